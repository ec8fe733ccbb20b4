"""`specmesh serve` as a user runs it: a worker (under 4 and under 16 streams), the scheduler or
Redis (restarted at once, or kept down 5 s) SIGKILLed under concurrent greedy streams is restarted
and every stream still completes with the offline text (or, for Redis, ends with an explicit error),
none hangs; a 50 MB body does not hold up a small request; a SIGKILLed `serve` leaves no process; a
taken port is refused before anything starts; API keys given to serve reach the gateway, and each
role its own Redis user and password, without showing on a command line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import redis

from services.engine.llm import LLM
from services.runtime import KV_SECRET_ENV, PASSWORD_ENV
from services.serve import ACL_ROLE_OF, ADMIN_PASSWORD_FILE, free_port
from shared import acl
from shared.sampling_params import SamplingParams
from tests.mesh.harness import REPO, Outcome, pid_alive, stream_completion

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")

SERVE_FLAGS = ("--device", "cpu", "--max-model-len", "512", "--speculative-config", '{"method": "ngram"}')
PROMPTS = [f"def function_{i}(x, y):" for i in range(4)]
MAX_TOKENS = 160
LOAD_PROMPTS = [f"def function_{i}(x, y):" for i in range(16)]
"""The issue's load: 16 concurrent streams, shorter so that the test stays bounded on 2 cores."""
LOAD_MAX_TOKENS = 48
READY_TIMEOUT_S = 90.0
STREAM_TIMEOUT_S = 45.0
"""Longer than any recovery should take: a stream still open then has hung."""
REDIS_DOWN_S = 5.0
"""How long Redis stays down: the outage that once dropped tokens from streams that ended normally."""
BIG_BODY_BYTES = 50 * 2**20
SMALL_REQUESTS = 10
MAX_DELAY_S = 0.1
"""How much longer a small request may take while a big body arrives than with nothing else going on."""


@dataclass
class Served:
    popen: subprocess.Popen[bytes]
    log_dir: Path
    stdout: Path
    url: str

    def roles(self) -> dict[str, int]:
        """serve's children by role (redis, scheduler, suffix-cache, mixed, gateway)."""
        found = {}
        for pid in _children(self.popen.pid):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            name = "redis" if b"redis-server" in argv[0] else argv[argv.index(b"services.cli") + 1].decode()
            found[name] = pid
        return found

    def output(self) -> str:
        return self.stdout.read_text(errors="replace")

    def log_tails(self, num_lines: int = 25) -> str:
        """The last lines of serve's output and of each role's log: what a failed assertion shows."""
        tails = [f"== serve\n{_tail(self.output(), num_lines)}"]
        for log in sorted(self.log_dir.glob("*.log")):
            tails.append(f"== {log.name}\n{_tail(log.read_text(errors='replace'), num_lines)}")
        return "\n".join(tails)


def _tail(text: str, num_lines: int) -> str:
    return "\n".join(text.splitlines()[-num_lines:])


@pytest.fixture(scope="module")
def offline(mesh_model: str) -> Iterator[LLM]:
    with LLM(mesh_model, device="cpu", max_model_len=512) as llm:
        yield llm


def greedy_texts(llm: LLM, prompts: list[str], max_tokens: int) -> dict[str, str]:
    """The offline engine's greedy text of each prompt (EOS ignored, as the streams ignore it)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return {prompt: output.text for prompt, output in zip(prompts, llm.generate(prompts, params))}


@pytest.fixture(scope="module")
def expected(offline: LLM) -> dict[str, str]:
    return greedy_texts(offline, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def expected_under_load(offline: LLM) -> dict[str, str]:
    return greedy_texts(offline, LOAD_PROMPTS, LOAD_MAX_TOKENS)


def serve_argv(port: int, log_dir: Path) -> list[str]:
    """`specmesh serve` on `port`, logging under `log_dir`."""
    return [sys.executable, "-m", "services.cli", "serve", "--port", str(port), "--log-dir", str(log_dir)]


@contextlib.contextmanager
def serve(tmp_path: Path, *flags: str) -> Iterator[Served]:
    """`specmesh serve` with SERVE_FLAGS and `flags`, once it says it is serving; stopped after."""
    port, stdout = free_port(), tmp_path / "serve.out"
    with open(stdout, "wb") as handle:
        popen = subprocess.Popen(
            [*serve_argv(port, tmp_path / "logs"), *SERVE_FLAGS, *flags],
            stdout=handle,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    mesh = Served(popen, tmp_path / "logs", stdout, f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "specmesh is serving" not in mesh.output():
            assert popen.poll() is None and time.monotonic() < deadline, mesh.output()
            time.sleep(0.1)
        yield mesh
    finally:
        if popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
            popen.wait(timeout=60)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with serve(tmp_path) as mesh:
        yield mesh


async def streams_through_a_kill(
    mesh: Served, role: str, prompts: list[str] = PROMPTS, max_tokens: int = MAX_TOKENS
) -> tuple[list[Outcome], int]:
    """A stream of each prompt, with `role` SIGKILLed once each has some text; their outcomes, and
    how many were still open at the kill."""
    outcomes = [Outcome() for _ in prompts]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)) as session:
        tasks = [
            asyncio.create_task(stream_completion(session, mesh.url, prompt, max_tokens, outcome))
            for prompt, outcome in zip(prompts, outcomes)
        ]
        deadline = time.monotonic() + STREAM_TIMEOUT_S
        while not all(o.text or o.error for o in outcomes) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        num_open = sum(not task.done() for task in tasks)
        os.kill(mesh.roles()[role], signal.SIGKILL)
        await asyncio.gather(*tasks)  # a hang raises aiohttp's timeout here
    return outcomes, num_open


def test_a_killed_worker_is_restarted_and_every_stream_completes_with_the_offline_text(
    served: Served, expected: dict[str, str]
) -> None:
    outcomes, num_open = asyncio.run(streams_through_a_kill(served, "mixed"))
    assert num_open > 0, "every stream ended before the worker died: the test tested nothing"
    for prompt, outcome in zip(PROMPTS, outcomes):
        assert outcome.done and outcome.error is None, f"{prompt!r}: {outcome}"
        assert outcome.text == expected[prompt], f"{prompt!r} ended with other text"
    assert "mixed exited with code -9; restarting it" in served.output()
    assert served.popen.poll() is None


def test_a_killed_worker_under_16_streams_is_restarted_and_every_stream_completes_with_the_offline_text(
    served: Served, expected_under_load: dict[str, str]
) -> None:
    outcomes, num_open = asyncio.run(streams_through_a_kill(served, "mixed", LOAD_PROMPTS, LOAD_MAX_TOKENS))
    assert num_open > 0, "every stream ended before the worker died: the test tested nothing"
    for prompt, outcome in zip(LOAD_PROMPTS, outcomes):
        assert outcome.done and outcome.error is None, f"{prompt!r}: {outcome}"
        assert outcome.text == expected_under_load[prompt], f"{prompt!r} ended with other text"
    assert "mixed exited with code -9; restarting it" in served.output()
    print(f"{num_open} of {len(LOAD_PROMPTS)} streams open at the kill")


def test_a_killed_scheduler_is_restarted_and_streams_old_and_new_complete(
    served: Served, expected: dict[str, str]
) -> None:
    """The running streams need no scheduler; the restarted one (a new consumer name, the dead
    one's lease dropped by serve) admits new requests."""
    outcomes, num_open = asyncio.run(streams_through_a_kill(served, "scheduler"))
    assert num_open > 0, "every stream ended before the scheduler died: the test tested nothing"
    for prompt, outcome in zip(PROMPTS, outcomes):
        assert outcome.done and outcome.text == expected[prompt], f"{prompt!r}: {outcome}"
    assert "scheduler exited with code -9; restarting it" in served.output()

    after = asyncio.run(one_stream(served, PROMPTS[0]))
    assert after.done and after.text == expected[PROMPTS[0]], after


def test_a_killed_redis_is_restarted_and_no_stream_ends_short_or_hangs(
    served: Served, expected: dict[str, str]
) -> None:
    outcomes, num_open = asyncio.run(streams_through_a_kill(served, "redis"))
    assert num_open > 0, "every stream ended before Redis died: the test tested nothing"
    for prompt, outcome in zip(PROMPTS, outcomes):
        assert outcome.done != (outcome.error is not None), f"{prompt!r}: {outcome}"
        if outcome.done:
            assert outcome.text == expected[prompt], f"{prompt!r} ended normally with other text"
    assert "redis exited with code -9; restarting it" in served.output()
    print(f"{sum(o.done for o in outcomes)} whole, errors {[o.error for o in outcomes if o.error]}")


def test_redis_killed_and_down_5_s_under_16_streams_ends_none_normally_with_other_text(
    tmp_path: Path, expected_under_load: dict[str, str]
) -> None:
    """Redis SIGKILLed under the streams and kept down 5 s (serve's restart delay) before serve
    starts it again: each stream completes with the offline text or ends with an error event, none
    hangs, and the mesh serves a new request afterwards."""
    with serve(tmp_path, "--restart-delay-s", str(REDIS_DOWN_S)) as mesh:
        outcomes, num_open = asyncio.run(streams_through_a_kill(mesh, "redis", LOAD_PROMPTS, LOAD_MAX_TOKENS))
        assert num_open > 0, "every stream ended before Redis died: the test tested nothing"
        for prompt, outcome in zip(LOAD_PROMPTS, outcomes):
            assert outcome.done != (outcome.error is not None), f"{prompt!r}: {outcome}"
            if outcome.done:
                assert outcome.text == expected_under_load[prompt], (
                    f"{prompt!r} ended normally with other text"
                )
        assert f"redis exited with code -9; restarting it in {REDIS_DOWN_S:g} s" in mesh.output()
        wait_until_healthy(mesh)  # 503 until the worker has registered again with the new Redis
        try:
            after = asyncio.run(one_stream(mesh, LOAD_PROMPTS[0], LOAD_MAX_TOKENS))
        except TimeoutError:
            pytest.fail(f"the request after the outage hung\n{mesh.log_tails()}")
        assert after.done and after.text == expected_under_load[LOAD_PROMPTS[0]], (
            f"{after}\n{mesh.log_tails()}"
        )
    errors = [o.error for o in outcomes if o.error]
    print(f"{num_open} open at the kill; {sum(o.done for o in outcomes)} whole, errors {errors}")


def wait_until_healthy(mesh: Served, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Returns once the gateway's /health says a worker can take requests."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{mesh.url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:  # 503 (HTTPError) or not answering yet
            pass
        assert time.monotonic() < deadline, f"the mesh did not become healthy in {timeout_s:g} s"
        time.sleep(0.1)


async def one_stream(mesh: Served, prompt: str, max_tokens: int = MAX_TOKENS) -> Outcome:
    outcome = Outcome()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)) as session:
        await stream_completion(session, mesh.url, prompt, max_tokens, outcome)
    return outcome


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_50_mb_body_does_not_delay_a_concurrent_small_request(served: Served, framing: str) -> None:
    """A one-token completion sent while a 50 MB body is on its way (declared up front, or chunked
    with no length) takes at most 100 ms longer than with nothing else going on."""
    host, port = served.url.removeprefix("http://").split(":")
    small_request_s(served.url)  # the first request warms the gateway and the worker
    unloaded = [small_request_s(served.url) for _ in range(SMALL_REQUESTS)]
    loaded, uploads = [], []
    for _ in range(SMALL_REQUESTS):
        upload = BodyUpload(host, int(port), framing)
        upload.start()
        assert upload.under_way.wait(timeout=10), "the 50 MB body never started"
        loaded.append(small_request_s(served.url))
        upload.join(timeout=60)
        uploads.append(upload)
    print(
        f"{framing}: unloaded median {statistics.median(unloaded) * 1e3:.0f} ms, max "
        f"{max(unloaded) * 1e3:.0f} ms; beside a 50 MB body median "
        f"{statistics.median(loaded) * 1e3:.0f} ms, max {max(loaded) * 1e3:.0f} ms; "
        f"each body sent in {max(u.took_s for u in uploads):.2f} s at most, answered {uploads[0].status!r}"
    )
    assert max(loaded) <= max(unloaded) + MAX_DELAY_S
    assert statistics.median(loaded) <= statistics.median(unloaded) + MAX_DELAY_S
    assert all(upload.status.startswith("HTTP/1.1 413") for upload in uploads), uploads[0].status


def small_request_s(url: str) -> float:
    """Seconds for one non-streamed, one-token completion."""
    body = json.dumps({"prompt": "def f(x):", "max_tokens": 1, "temperature": 0.0}).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()
        assert response.status == 200
    return time.monotonic() - started


class BodyUpload(threading.Thread):
    """Sends one BIG_BODY_BYTES completion body as fast as the gateway takes it, and records how
    it was answered (the gateway may answer before the body is whole, and then drop the rest)."""

    def __init__(self, host: str, port: int, framing: str) -> None:
        super().__init__(daemon=True)
        self.address, self.framing = (host, port), framing
        self.under_way = threading.Event()
        """Set once the head and the first MiB of the body are sent."""
        self.took_s, self.status = 0.0, ""

    def run(self) -> None:
        prompt_mib = (BIG_BODY_BYTES - len(b'{"prompt": "", "max_tokens": 1}')) // 2**20
        chunks = [b'{"prompt": "', *([b"a" * 2**20] * prompt_mib), b'", "max_tokens": 1}']
        if self.framing == "content-length":
            framing = f"Content-Length: {sum(map(len, chunks))}"
        else:
            framing, chunks = "Transfer-Encoding: chunked", [*map(_chunk, chunks), b"0\r\n\r\n"]
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{framing}\r\n\r\n"
        )
        started = time.monotonic()
        with socket.create_connection(self.address, timeout=30) as sock:
            try:
                sock.sendall(head.encode() + chunks[0] + chunks[1])
                self.under_way.set()
                for chunk in chunks[2:]:
                    sock.sendall(chunk)
            except OSError:  # answered early: the gateway closed the connection mid-body
                pass
            finally:
                self.under_way.set()
            self.status = sock.recv(64).decode(errors="replace").split("\r\n")[0]
        self.took_s = time.monotonic() - started


def _chunk(data: bytes) -> bytes:
    """`data` as one chunk of a chunked transfer encoding."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def test_a_sigkilled_serve_leaves_no_process(served: Served) -> None:
    descendants = _descendants(served.popen.pid)
    assert len(descendants) >= 6, descendants  # five roles and the worker's engine core
    served.popen.kill()
    served.popen.wait()
    deadline = time.monotonic() + 10.0
    while (alive := [pid for pid in descendants if pid_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive:  # the test's own leftovers go, whatever it finds
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"still running after serve was SIGKILLed: {alive}"


def test_secrets_reach_each_role_off_its_command_line(tmp_path: Path) -> None:
    """API keys reach the gateway, and each role runs as its own Redis user with its own password,
    through its environment; Redis refuses anyone else, and each user what is not its role's."""
    key_file = tmp_path / "keys"
    key_file.write_text("sk-from-file\n")
    key_file.chmod(0o600)
    with serve(tmp_path, "--api-key", "sk-from-flag", "--api-key-file", str(key_file)) as mesh:
        gateway = Path(f"/proc/{mesh.roles()['gateway']}/cmdline").read_bytes()
        assert b"sk-from-flag" not in gateway

        async def status(key: str | None) -> int:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"{mesh.url}/v1/models", headers=headers) as response,
            ):
                return response.status

        assert asyncio.run(status(None)) == 401
        assert asyncio.run(status("sk-wrong")) == 401
        assert asyncio.run(status("sk-from-flag")) == 200
        assert asyncio.run(status("sk-from-file")) == 200
        assert_each_role_is_its_own_redis_user(mesh)

        async def models() -> dict:
            headers = {"Authorization": "Bearer sk-from-file"}
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"{mesh.url}/v1/models", headers=headers) as response,
            ):
                return await response.json()

        assert asyncio.run(models())["data"][0]["max_model_len"] == 512  # serve's, not the model's


def test_engine_flags_given_to_serve_reach_the_workers_command_line(tmp_path: Path) -> None:
    flags = ("--enforce-eager", "--cuda-graph-max-tokens", "64", "--max-num-batched-tokens", "384")
    with serve(tmp_path, *flags) as mesh:
        argv = [
            arg.decode() for arg in Path(f"/proc/{mesh.roles()['mixed']}/cmdline").read_bytes().split(b"\0")
        ]
    assert "--enforce-eager" in argv
    assert argv[argv.index("--cuda-graph-max-tokens") + 1] == "64"
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "384"
    assert argv[argv.index("--max-model-len") + 1] == "512"  # SERVE_FLAGS'


def assert_each_role_is_its_own_redis_user(mesh: Served) -> None:
    passwords = {}
    for role, pid in mesh.roles().items():
        if role == "redis":
            continue
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environ = dict(
            line.split(b"=", 1)
            for line in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if b"=" in line
        )
        acl_role = ACL_ROLE_OF.get(role, "worker")
        assert argv[argv.index(b"--redis-user") + 1].decode() == acl.user_name(acl_role)
        password = environ[PASSWORD_ENV.encode()]
        assert not any(password in arg for arg in argv)
        assert (KV_SECRET_ENV.encode() in environ) == (acl_role == "worker")
        passwords[acl_role] = password.decode()
    assert sorted(passwords) == sorted(acl.ROLES) and len(set(passwords.values())) == len(acl.ROLES)
    for name in ("redis.conf", "users.acl", ADMIN_PASSWORD_FILE):
        assert (mesh.log_dir / name).stat().st_mode & 0o077 == 0, name
    assert not any(password in (mesh.log_dir / "users.acl").read_text() for password in passwords.values())

    conf = (mesh.log_dir / "redis.conf").read_text()
    port = int(re.search(r"^port (\d+)$", conf, re.MULTILINE)[1])  # type: ignore[index]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port).ping()
    gateway = redis.Redis(port=port, username=acl.user_name("gateway"), password=passwords["gateway"])
    with pytest.raises(redis.exceptions.NoPermissionError):
        gateway.flushall()
    gateway.close()
    admin_password = (mesh.log_dir / ADMIN_PASSWORD_FILE).read_text().strip()
    admin = redis.Redis(port=port, username=acl.user_name(acl.ADMIN), password=admin_password)
    assert admin.ping()
    admin.close()


def test_a_taken_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = serve_argv(port, tmp_path / "logs")
        result = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 1
    assert (
        f"port 127.0.0.1:{port} is already in use" in result.stderr and "nothing was started" in result.stderr
    )
    assert not (tmp_path / "logs").exists()


def _children(pid: int) -> list[int]:
    from benchmarks.launch import child_processes

    return list(child_processes(pid).values())


def _descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        children = _children(frontier.pop())
        found += children
        frontier += children
    return found
