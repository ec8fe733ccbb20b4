"""The engine-core process through its client: the same greedy tokens as the engine in-process,
refusals and aborts as rows, a crash reported (not a hang), and no core outliving its worker."""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services.engine.engine import LLMEngine
from services.engine.kv_export import KVStreamMessage, KVStreamStart
from services.engine.llm import LLM
from services.worker import engine_core
from services.worker.channel import BlockingChannel
from services.worker.core_client import EngineCoreClient, EngineCoreDied
from services.worker.core_messages import AddRequest, CoreOptions, RowEnd, Shutdown
from services.worker.cpus import bus_side_cpus, usable_cpus
from services.worker.engine_core import EngineCore, core_cpu_threads
from shared import trace
from shared.config import EngineConfig
from shared.protocol import GenerateRequest
from shared.sampling_params import SamplingParams
from tests.mesh.harness import pid_alive

REPO = Path(__file__).resolve().parents[3]
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14], [40, 41], [7] * 20]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def request(request_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, prompt_token_ids=prompt, params=params, gateway_id="g")


@pytest.fixture(scope="module")
def model(make_checkpoint: Any) -> str:
    return str(make_checkpoint("llama"))


@pytest.fixture
async def core(model: str) -> AsyncIterator[EngineCoreClient]:
    client = await EngineCoreClient.start(CoreOptions(EngineConfig(model=model, device="cpu")))
    yield client
    await client.shutdown()


async def run_to_end(
    core: EngineCoreClient, num_requests: int
) -> tuple[dict[str, list[int]], dict[str, RowEnd], dict[str, set[int]]]:
    tokens: dict[str, list[int]] = {}
    epochs: dict[str, set[int]] = {}
    ends: dict[str, RowEnd] = {}
    while len(ends) < num_requests:
        for batch in await asyncio.wait_for(core.next_batches(), 60):
            for row, request_id in enumerate(batch.request_ids):
                tokens.setdefault(request_id, []).extend(batch.row_tokens(row).tolist())
                epochs.setdefault(request_id, set()).add(batch.epochs[row])
            ends.update({batch.request_ids[end.row]: end for end in batch.ends})
    return tokens, ends, epochs


async def test_greedy_tokens_match_the_engine_in_process(core: EngineCoreClient, model: str) -> None:
    expected = LLM(model, device="cpu").generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    for i, prompt in enumerate(PROMPTS):
        await core.add_request(request(f"r{i}", prompt), epoch=i + 1)
    tokens, ends, epochs = await run_to_end(core, len(PROMPTS))
    assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == [o.token_ids for o in expected]
    assert epochs == {f"r{i}": {i + 1} for i in range(len(PROMPTS))}  # every row carries its placement's
    assert {e.finish_reason for e in ends.values()} == {"length"}
    assert core.load.num_running == 0 and core.load.free_kv_blocks == core.info.total_kv_blocks


async def test_the_core_stamps_each_step_and_its_client_logs_the_core_s_hops(
    core: EngineCoreClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A step batch carries the wall clock of its step's start and of its send; traced, the
    worker's side logs every row's `core.step_start` and `core.sent` at those times (the core's
    loop logs nothing a step), then its own `worker.from_core`."""
    monkeypatch.setattr(trace, "ENABLED", True)
    caplog.set_level(logging.DEBUG, logger=trace.logger.name)
    before = time.time()
    await core.add_request(request("r0", PROMPTS[0]), epoch=1)
    batches = []
    while not any(batch.ends for batch in batches):
        batches += await asyncio.wait_for(core.next_batches(), 60)
    stepped = [batch for batch in batches if batch.num_rows]
    assert stepped
    for batch in stepped:  # sent during the step after the one that made its tokens
        assert before <= batch.started_at <= batch.sent_at <= time.time()
    num_steps = len({batch.started_at for batch in batches if batch.started_at})
    step_s = [seconds for batch in batches for seconds in batch.step_s]
    # each step's time goes out once, with the first batch after the step: every step's so far, but
    # the last read batch's own step's where that batch went out during it
    assert num_steps - 1 <= len(step_s) <= num_steps
    assert sum(step_s) <= batches[-1].sent_at - min(b.started_at for b in batches if b.started_at)
    logged = {
        (record.hop, record.pos): (record.t, record.pid, record.rtt)
        for record in caplog.records
        if record.name == trace.logger.name
    }
    for batch in stepped:  # the core's hops under its pid, their round trips not known here (None)
        [pos] = batch.num_output_tokens.tolist()
        assert logged[("core.step_start", pos)] == (batch.started_at, core.pid, None)
        assert logged[("core.sent", pos)] == (batch.sent_at, core.pid, None)
        t, pid, _ = logged[("worker.from_core", pos)]
        assert t >= batch.sent_at and pid == os.getpid()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_every_step_s_time_goes_out_once(
    model: str, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each engine step's time, as the core's clock measured it, goes out in exactly one entry of
    one batch, in step order, the last step's included (before the core waits idle): on a clock
    where step i takes i seconds, the batches' entries are 1, 2, ..., the number of steps."""
    engine = LLMEngine(EngineConfig(model=model, device="cpu", async_scheduling=async_scheduling))
    clock = SimpleNamespace(now=0.0, num_steps=0)
    monkeypatch.setattr(
        engine_core,
        "time",
        SimpleNamespace(time=time.time, monotonic=time.monotonic, perf_counter=lambda: clock.now),
    )
    step = engine.step

    def timed_step() -> list[Any]:
        outputs = step()
        clock.num_steps += 1
        clock.now += clock.num_steps
        return outputs

    engine.step = timed_step  # type: ignore[method-assign]
    ours, theirs = socket.socketpair()
    step_s: list[float] = []
    with ours, theirs:
        core = EngineCore(engine, BlockingChannel(ours))
        for i, prompt in enumerate(PROMPTS[:2]):
            core._add(AddRequest(f"r{i}", 1, prompt, GREEDY, []))
        while engine.has_unfinished_requests():
            core._step()
            while select.select([theirs], [], [], 0)[0]:
                step_s += BlockingChannel(theirs).recv().step_s
        engine.close()
    assert clock.num_steps > GREEDY.max_tokens
    assert step_s == [float(i) for i in range(1, clock.num_steps + 1)]


def test_a_step_s_outputs_leave_the_core_while_the_next_step_runs(model: str) -> None:
    """The core sends a step's rows as soon as the engine makes them, during the next step (on a
    GPU, while the device runs it), not after that step ends: by the time the next step reads its
    result back, the worker can already hold every earlier token."""
    engine = LLMEngine(EngineConfig(model=model, device="cpu"))
    ours, theirs = socket.socketpair()
    received: list[int] = []
    at_read_back: list[tuple[int, int]] = []  # (tokens the engine made before the step, tokens received)

    def traced(launch: Callable[..., Any]) -> Callable[..., Any]:
        def traced_launch(*args: Any) -> Any:
            launched = launch(*args)
            made_before = sum(seq.num_output_tokens for seq in engine.sequences.values())
            result = launched.result

            def traced_result() -> Any:
                while select.select([theirs], [], [], 0)[0]:
                    received.extend(BlockingChannel(theirs).recv().token_ids.tolist())
                at_read_back.append((made_before, len(received)))
                return result()

            launched.result = traced_result
            return launched

        return traced_launch

    engine.runner.launch = traced(engine.runner.launch)  # type: ignore[method-assign]
    engine.runner.launch_ahead = traced(engine.runner.launch_ahead)  # type: ignore[method-assign]
    with ours, theirs:
        core = EngineCore(engine, BlockingChannel(ours))
        core._add(AddRequest("r0", 1, PROMPTS[1], GREEDY, []))
        while engine.has_unfinished_requests():
            core._step()
        engine.close()
    # the prefill, then a decode step per later token (and, launched ahead, one past the last)
    assert GREEDY.max_tokens <= len(at_read_back) <= GREEDY.max_tokens + 1
    assert all(received >= made for made, received in at_read_back)
    assert max(made for made, _ in at_read_back) >= GREEDY.max_tokens - 2


def test_a_request_sent_while_the_core_steps_joins_its_next_step(model: str) -> None:
    """A request that arrives while a step runs is prefilled in the step after it (the loop reads
    its commands before every step, not only when idle): its first token goes out during the step
    after that."""
    engine = LLMEngine(EngineConfig(model=model, device="cpu"))
    ours, theirs = socket.socketpair()
    worker = BlockingChannel(theirs)
    core = EngineCore(engine, BlockingChannel(ours))
    loop = threading.Thread(target=core.run)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with ours, theirs:
        loop.start()
        worker.send(AddRequest("r0", 1, PROMPTS[1], long, []))
        starts: list[float] = []
        sent_at = None
        first_row_started_at = None
        while first_row_started_at is None:
            batch = worker.recv()
            if batch.started_at and batch.started_at not in starts:
                starts.append(batch.started_at)
            if sent_at is None and "r0" in batch.request_ids:  # r0 decodes: a step is under way
                worker.send(AddRequest("r1", 1, PROMPTS[0], GREEDY, []))
                sent_at = time.time()  # any step that starts later reads the command first
            if "r1" in batch.request_ids:
                first_row_started_at = batch.started_at
        worker.send(Shutdown())
        loop.join(timeout=60)
        engine.close()
    assert sent_at is not None
    # after the send, r1's prefill and at most one more step started before the one carrying its
    # first row: the core may read its commands just before the send and stamp that step's start
    # just after it (a race a loaded machine hits), so that step is counted without having seen r1
    assert len([t for t in starts if sent_at < t < first_row_started_at]) <= 2


async def test_kv_handed_between_two_cores_in_one_command_continues_the_same_tokens(
    core: EngineCoreClient, model: str
) -> None:
    """A prefill core's KV export, sent to a decode core as one `ImportKV` per request over the
    real channel, then `Activate`: the decode core's tokens continue the offline run exactly."""
    expected = LLM(model, device="cpu").generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    decode = await EngineCoreClient.start(CoreOptions(EngineConfig(model=model, device="cpu", block_size=4)))
    try:
        for i, prompt in enumerate(PROMPTS):
            assert (await (await decode.reserve(request(f"r{i}", prompt), epoch=1))).error is None
            await core.add_request(request(f"r{i}", prompt), epoch=1, handoff=True)
        num_handed = 0
        while num_handed < len(PROMPTS):
            for batch in await asyncio.wait_for(core.next_batches(), 60):
                for handoff in batch.handoffs:
                    await decode.import_kv(handoff.request_id, handoff.layers)
                    await decode.activate(handoff.request_id, handoff.first_token_id)
                num_handed += len(batch.handoffs)
        tokens, ends, _ = await run_to_end(decode, len(PROMPTS))
    finally:
        await decode.shutdown()
    for i, want in enumerate(expected):
        assert want.token_ids[:1] + tokens[f"r{i}"] == want.token_ids
    assert {e.finish_reason for e in ends.values()} == {"length"}


async def test_a_refused_request_and_an_abort_come_back_as_ended_rows(core: EngineCoreClient) -> None:
    await core.add_request(request("bad", [10**6]), epoch=1)
    await core.add_request(request("long", [5, 6], SamplingParams(max_tokens=400, ignore_eos=True)), epoch=1)
    await core.abort("long")
    await core.abort("unknown")
    _, ends, _ = await run_to_end(core, 2)
    assert ends["bad"].error is not None and ends["bad"].error.code == 400
    assert ends["long"].finish_reason == "abort" and ends["long"].outcome == "cancelled"


async def test_a_crashed_core_is_reported(core: EngineCoreClient) -> None:
    pending = await core.reserve(request("r", [5, 6, 7]), epoch=1)
    await pending  # answered: the core is alive
    os.kill(core.pid, signal.SIGKILL)
    await asyncio.wait_for(core.died.wait(), 30)
    assert core.exit_code == -signal.SIGKILL
    with pytest.raises(EngineCoreDied):
        await core.add_request(request("after", [5]), epoch=1)


PARENT = """
import asyncio, sys
from services.worker.core_client import EngineCoreClient
from services.worker.core_messages import CoreOptions
from shared.config import EngineConfig

async def main():
    core = await EngineCoreClient.start(CoreOptions(EngineConfig(model=sys.argv[1], device="cpu")))
    print(core.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_the_core_dies_with_its_worker(model: str) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, model], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        core_pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while pid_alive(core_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(core_pid)
    finally:
        if parent.poll() is None:
            parent.kill()
        assert parent.stdout is not None
        parent.stdout.close()


@pytest.mark.skipif(len(usable_cpus()) < 2, reason="a core is pinned only where there is a CPU to spare")
async def test_the_core_runs_on_its_cpus_alone(model: str) -> None:
    """Every thread of the core on the CPUs it reports (the bus side keeps off them)."""
    mine = str(usable_cpus()[-1])
    config = EngineConfig(model=model, device="cpu", core_cpus=mine)
    client = await EngineCoreClient.start(CoreOptions(config))
    try:
        assert client.info.cpus == [int(mine)]
        for task in os.listdir(f"/proc/{client.pid}/task"):
            assert os.sched_getaffinity(int(task)) == {int(mine)}, f"thread {task}"
        assert int(mine) not in bus_side_cpus(client.info.cpus)
    finally:
        await client.shutdown()


def test_the_core_leaves_cores_to_the_rest_of_the_mesh(model: str) -> None:
    """On CPU, half the cores by default (one of two: two threads of one op waiting on each other
    for a core another process holds stalled every step); one with a GPU; the flag wins."""
    cpu = EngineConfig(model=model, device="cpu")
    assert core_cpu_threads(cpu, num_cores=2) == 1
    assert core_cpu_threads(cpu, num_cores=1) == 1
    assert core_cpu_threads(cpu, num_cores=16) == 8
    assert core_cpu_threads(cpu.model_copy(update={"cpu_threads": 3}), num_cores=2) == 3
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(model=model, device="cpu", cpu_threads=0)


def test_step_batches_carry_the_suffix_cache_s_counters_about_once_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A snapshot of the suffix-cache client sorts its window of round trips: the core takes one
    per `SUFFIX_STATS_INTERVAL_S`, not one per step; the batches between carry none."""
    snapshots: list[int] = []

    class Index:
        def stats(self) -> dict[str, Any]:
            snapshots.append(1)
            return {"num_answered": len(snapshots)}

    scheduler = SimpleNamespace(running=[], waiting=[], num_waiting_tokens=0, num_preemptions=0)
    engine = SimpleNamespace(
        scheduler=scheduler, block_manager=SimpleNamespace(num_free_blocks=8, num_blocks=8)
    )
    now = [100.0]
    monkeypatch.setattr(engine_core.time, "monotonic", lambda: now[0])
    ours, theirs = socket.socketpair()
    with ours, theirs:
        core = EngineCore(engine, BlockingChannel(ours), suffix_index=Index())  # type: ignore[arg-type]
        loads = [core._load().suffix_cache for _ in range(50)]  # 50 steps within one instant
        now[0] += engine_core.SUFFIX_STATS_INTERVAL_S
        loads.append(core._load().suffix_cache)
    assert loads[0] == {"num_answered": 1} and loads[1:50] == [{}] * 49
    assert loads[50] == {"num_answered": 2}


async def test_kv_streamed_by_a_prefill_core_reaches_its_worker_before_the_hand_off(model: str) -> None:
    """A prefill core that streams KV: each request's `KVStreamStart`, then every target layer,
    reach the client before the step batch that hands the request off; fed to a decode core with
    the export's (here empty) rest, its tokens continue the offline run exactly."""
    expected = LLM(model, device="cpu").generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    options = CoreOptions(EngineConfig(model=model, device="cpu"), stream_kv=True)
    prefill = await EngineCoreClient.start(options)
    decode = await EngineCoreClient.start(CoreOptions(EngineConfig(model=model, device="cpu", block_size=4)))
    streamed: dict[str, list[tuple[str, int, Any, Any]]] = {}
    started: list[str] = []

    def on_kv_stream(message: KVStreamMessage) -> None:
        if isinstance(message, KVStreamStart):
            started.append(message.request_id)
            return
        assert set(message.first_blocks) == {0}  # whole layers: every prompt runs in one step
        for request_id, key, value in zip(message.request_ids, message.keys, message.values):
            streamed.setdefault(request_id, []).append(("target", message.index, key, value))

    prefill.on_kv_stream = on_kv_stream
    try:
        for i, prompt in enumerate(PROMPTS):
            assert (await (await decode.reserve(request(f"r{i}", prompt), epoch=1))).error is None
            await prefill.add_request(request(f"r{i}", prompt), epoch=1, handoff=True)
        num_handed = 0
        while num_handed < len(PROMPTS):
            for batch in await asyncio.wait_for(prefill.next_batches(), 60):
                for handoff in batch.handoffs:
                    assert handoff.streamed and handoff.layers == []
                    layers = streamed.pop(handoff.request_id)
                    assert [index for _, index, _, _ in layers] == list(range(len(layers)))
                    await decode.import_kv(handoff.request_id, layers)
                    await decode.activate(handoff.request_id, handoff.first_token_id)
                num_handed += len(batch.handoffs)
        tokens, _, _ = await run_to_end(decode, len(PROMPTS))
    finally:
        await decode.shutdown()
        await prefill.shutdown()
    assert sorted(started) == [f"r{i}" for i in range(len(PROMPTS))]
    for i, want in enumerate(expected):
        assert want.token_ids[:1] + tokens[f"r{i}"] == want.token_ids
