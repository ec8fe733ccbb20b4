"""`specmesh gateway`: its flags, and the real process: serving, then draining a stream on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gateway_fake_backend import ClientFactory, sse_data

from services.gateway.main import (
    add_gateway_parser,
    cmd_gateway,
    gateway_settings,
    load_api_keys,
)
from services.gateway.prepare import ServedModel
from services.runtime import API_KEY_ENV
from services.serve import free_port
from shared.bus import Bus, RedisSettings, connect
from shared.protocol import OutputBatch, Submit, TokenEvent, encode

REPO_ROOT = Path(__file__).resolve().parents[3]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specmesh")
    add_gateway_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(list(argv))


def test_flags_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECMESH_SCHEDULER_PASSWORD", raising=False)
    args = parse("gateway", "--model", "m")
    assert args.handler is cmd_gateway
    assert (args.host, args.port, args.api_keys, args.request_timeout_s) == ("127.0.0.1", 8000, [], 600.0)
    assert (args.scheduler_host, args.scheduler_port, args.scheduler_password, args.scheduler_topic) == (
        "127.0.0.1",
        6379,
        None,
        "default",
    )
    assert args.gateway_log_level == "INFO"
    args = parse("gateway", "--model", "m", "--api-key", "a", "--api-key", "b", "--log-level", "DEBUG")
    assert args.api_keys == ["a", "b"] and args.gateway_log_level == "DEBUG"
    assert parse("gateway", "--model", "m", "--scheduler-ttl", "2").scheduler_ttl == 2.0  # accepted, unused


def test_api_keys_from_env_file_and_flags(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# one key a line\nsk-file-1\n\n  sk-file-2  \n")
    args = parse("gateway", "--api-key-file", str(key_file), "--api-key", "sk-flag")
    keys = load_api_keys(args, {API_KEY_ENV: "sk-env-1, sk-env-2"})
    assert keys == {"sk-file-1", "sk-file-2", "sk-flag", "sk-env-1", "sk-env-2"}
    assert load_api_keys(parse("gateway"), {API_KEY_ENV: "sk-env"}) == {"sk-env"}
    assert load_api_keys(parse("gateway"), {}) == frozenset()  # no key anywhere: no auth
    key_file.write_text("# nothing but a comment\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_api_keys(parse("gateway", "--api-key-file", str(key_file)), {})


async def test_keys_from_env_and_file_guard_the_api(make_client: ClientFactory, tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("sk-file\n")
    keys = load_api_keys(parse("gateway", "--api-key-file", str(key_file)), {API_KEY_ENV: "sk-env"})
    client = await make_client(api_keys=keys)
    for key, status in (("sk-env", 200), ("sk-file", 200), ("sk-wrong", 401)):
        response = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert response.status == status, key
    assert (await client.get("/v1/models")).status == 401


def test_limit_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse("gateway")
    assert (args.max_body_bytes, args.body_timeout_s, args.keepalive_timeout_s) == (0, 30.0, 30.0)
    assert args.max_concurrent_per_key == 0
    args = parse(
        "gateway", "--max-body-bytes", "1000", "--body-timeout-s", "5", "--max-concurrent-per-key", "4"
    )
    settings = gateway_settings(args)
    assert (settings.max_body_bytes, settings.body_timeout_s, settings.max_concurrent_per_key) == (
        1000,
        5.0,
        4,
    )
    monkeypatch.setattr("services.gateway.main.serve", lambda args: 0)
    monkeypatch.setattr("services.gateway.main.setup_logging", lambda *args: None)
    with pytest.raises(ValueError, match="--body-timeout-s must be positive"):
        cmd_gateway(parse("gateway", "--body-timeout-s", "0"))
    with pytest.raises(ValueError, match="--max-body-bytes must not be negative"):
        cmd_gateway(parse("gateway", "--max-body-bytes", "-1"))


def test_served_model_name_and_context(make_checkpoint: Any) -> None:
    model_dir = make_checkpoint("llama")
    served = ServedModel.load(model_dir)
    assert (served.name, served.max_model_len, served.vocab_size) == (model_dir.name, 512, 384)
    assert ServedModel.load(model_dir, "x", max_model_len=128).max_model_len == 128


@pytest.fixture
async def bus(redis_port: int) -> AsyncIterator[Bus]:
    settings = RedisSettings(port=redis_port, topic=f"main{os.getpid()}{time.monotonic_ns()}")
    client = await connect(settings)
    yield Bus(client, settings.keys)
    await client.aclose()


async def test_process_serves_and_drains_a_stream_on_sigterm(
    make_checkpoint: Any, redis_port: int, bus: Bus
) -> None:
    port = free_port()
    command = [sys.executable, "-m", "services.gateway.main", "--model", str(make_checkpoint("llama"))]
    command += ["--port", str(port), "--scheduler-port", str(redis_port), "--scheduler-topic", bus.keys.topic]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            await _wait_until_serving(session, f"{url}/v1/models", process)
            assert (await session.get(f"{url}/health")).status == 503  # no worker yet
            await bus.client.sadd(bus.keys.instances, "w1")
            await bus.client.set(bus.keys.heartbeat("w1"), b"x", ex=30)
            await _wait_until_serving(session, f"{url}/health", process)  # probed in the background
            stream = asyncio.create_task(
                session.post(f"{url}/v1/completions", json={"prompt": "hi", "stream": True, "max_tokens": 2})
            )
            submit = await _first_submit(bus)
            process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)  # the listener closes; the open stream keeps going
            request, gateway = submit.request.request_id, submit.request.gateway_id
            assert gateway is not None
            for i, text in enumerate(["Hé", "llo"]):
                event = TokenEvent(
                    request_id=request,
                    token_ids=[i],
                    text=text,
                    finished=i == 1,
                    finish_reason="length",
                    num_output_tokens=i + 1,
                )
                await bus.publish_step([(gateway, encode(OutputBatch.of([event])))])
            response = await asyncio.wait_for(stream, 10)
            chunks = sse_data(await response.text())
            assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "Héllo" and chunks[-1] == "[DONE]"
        assert process.wait(timeout=15) == 0
        assert process.stderr is not None
        logged = [
            json.loads(line) for line in process.stderr.read().decode().splitlines() if line.startswith("{")
        ]
        [start] = [entry for entry in logged if entry["msg"].startswith("gateway serving")]
        assert start["level"] == "info"  # a normal start is no warning
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        assert process.stderr is not None
        process.stderr.close()


async def _wait_until_serving(
    session: aiohttp.ClientSession, url: str, process: subprocess.Popen[bytes]
) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else "gateway exited"
        try:
            if (await session.get(url)).status == 200:
                return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.1)
    pytest.fail("the gateway did not start serving in 30 s")


async def _first_submit(bus: Bus) -> Submit:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        deliveries, _ = await bus.read_stream(bus.keys.requests, "0-0", block_ms=50)
        for delivery in deliveries:
            if isinstance(delivery.message, Submit):
                return delivery.message
    pytest.fail("no Submit on the requests stream")


async def test_workers_share_the_port_and_stop_together(
    make_checkpoint: Any, redis_port: int, bus: Bus
) -> None:
    """`--workers 2`: two gateway processes accept on one port, each answered on its own output
    stream; SIGTERM to the supervisor stops both."""
    from tests.mesh.harness import child_pid, pid_alive

    port = free_port()
    command = [sys.executable, "-m", "services.gateway.main", "--model", str(make_checkpoint("llama"))]
    command += ["--port", str(port), "--workers", "2"]
    command += ["--scheduler-port", str(redis_port), "--scheduler-topic", bus.keys.topic]
    await bus.client.sadd(bus.keys.instances, "w1")  # before the gateways' first health probe
    await bus.client.set(bus.keys.heartbeat("w1"), b"x", ex=30)
    process = subprocess.Popen(command, cwd=REPO_ROOT, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    answering = asyncio.create_task(_answer_every_submit(bus))
    try:
        workers = [child_pid(process.pid, f"gateway-{i}") for i in range(2)]
        gateways: set[str | None] = set()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            await _wait_until_serving(session, f"{url}/v1/models", process)
            body = {"prompt": "hi", "max_tokens": 1}
            deadline = time.monotonic() + 20  # the second process may start listening after the first
            while len(gateways) < 2 and time.monotonic() < deadline:
                responses = await asyncio.gather(
                    *(session.post(f"{url}/v1/completions", json=body) for _ in range(24))
                )
                assert [r.status for r in responses] == [200] * 24
                assert {(await r.json())["choices"][0]["text"] for r in responses} == {"ok"}
                gateways = {m.request.gateway_id for m in await _submits(bus)}
        assert len(gateways) == 2  # bursts of 24 connections: both processes took some
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert not any(pid_alive(pid) for pid in workers)
    finally:
        answering.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()
        assert process.stderr is not None
        process.stderr.close()


async def _answer_every_submit(bus: Bus) -> None:
    """A stand-in worker: one finished event per submitted request, to its gateway's stream."""
    last_id = "0-0"
    while True:
        deliveries, last_id = await bus.read_stream(bus.keys.requests, last_id, block_ms=50)
        for delivery in deliveries:
            if isinstance(delivery.message, Submit) and delivery.message.request.gateway_id:
                request = delivery.message.request
                event = TokenEvent(
                    request_id=request.request_id,
                    token_ids=[1],
                    text="ok",
                    finished=True,
                    finish_reason="length",
                    num_output_tokens=1,
                )
                await bus.publish_step([(request.gateway_id, encode(OutputBatch.of([event])))])


async def _submits(bus: Bus) -> list[Submit]:
    deliveries, _ = await bus.read_stream(bus.keys.requests, "0-0", block_ms=50, count=10_000)
    return [d.message for d in deliveries if isinstance(d.message, Submit)]


def test_a_worker_that_fails_to_start_says_why(tmp_path: Path) -> None:
    """`--workers 2` with a model directory that cannot be read: the supervisor exits non-zero and
    the log names the cause (a forked worker leaves through os._exit, which prints nothing itself)."""
    missing = tmp_path / "no-model"
    command = [sys.executable, "-m", "services.gateway.main", "--model", str(missing), "--workers", "2"]
    command += ["--port", str(free_port())]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"cannot read {missing / 'config.json'}" in done.stderr + done.stdout
