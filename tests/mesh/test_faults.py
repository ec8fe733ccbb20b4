"""Faults under concurrent greedy streams, with hand-started roles and a real Redis: a mixed, a
prefill or a decode worker SIGKILLed; a worker stopped past its heartbeat's TTL, then continued
(fenced off from the requests placed elsewhere meanwhile); the gateway killed and replaced; the
scheduler killed and replaced. Every stream either completes with the offline engine's greedy text
or ends with an explicit error; none hangs, none ends normally with text missing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from services.engine.llm import LLM
from shared.bus import Bus, RedisSettings, as_text, connect
from shared.keys import SCHEDULER_GROUP
from shared.protocol import PAYLOAD_FIELD, Finished, GenerateRequest, OutputBatch, Submit, decode
from shared.sampling_params import SamplingParams
from tests.mesh.harness import LocalMesh, Outcome, metric_value, stream_completion

WORKER_FLAGS = ("--device", "cpu", "--max-model-len", "512", "--no-suffix-cache")
PROMPTS = [f"def function_{i}(x, y):" for i in range(16)]
MAX_TOKENS = 32
STREAM_TIMEOUT_S = 90.0
"""Longer than any recovery should take, with room for a 2-core machine shared with other jobs: a
stream still open then has hung."""
TEST_GATEWAY = "fault-test-gateway"
"""The gateway id of requests the test submits on the bus itself (it reads their raw outputs)."""


@pytest.fixture(scope="module")
def expected(mesh_model: str) -> dict[str, str]:
    llm = LLM(mesh_model, device="cpu", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {prompt: output.text for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params))}


@contextlib.asynccontextmanager
async def bus_of(mesh: LocalMesh) -> AsyncIterator[Bus]:
    """A bus client of the mesh, closed however the test ends (an unclosed socket would fail a
    later test as an unraisable warning)."""
    settings = RedisSettings(port=mesh.redis_port, topic=mesh.topic)
    client = await connect(settings)
    try:
        yield Bus(client, settings.keys)
    finally:
        await client.aclose()


async def wait_for(
    condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = STREAM_TIMEOUT_S
) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        await asyncio.sleep(0.02)


async def stream(session: aiohttp.ClientSession, url: str, prompt: str, outcome: Outcome) -> None:
    """One greedy stream; a connection the gateway dropped is recorded as an error (a hang is not:
    the session's timeout raises)."""
    try:
        await stream_completion(session, url, prompt, MAX_TOKENS, outcome)
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        outcome.error = f"connection lost: {exc!r}"


def start_streams(
    session: aiohttp.ClientSession, url: str, prompts: list[str], stagger_s: float = 0.0
) -> tuple[list[Outcome], asyncio.Future[list[None]]]:
    """The streams (the n-th started `n * stagger_s` after the first) and one task that ends with
    all of them."""
    outcomes = [Outcome() for _ in prompts]

    async def one(index: int) -> None:
        await asyncio.sleep(index * stagger_s)
        await stream(session, url, prompts[index], outcomes[index])

    return outcomes, asyncio.gather(*(one(i) for i in range(len(prompts))))


def assert_whole_or_failed(
    prompts: list[str], outcomes: list[Outcome], expected: dict[str, str], all_whole: bool = True
) -> None:
    """The rule: each stream ended with `[DONE]` and the offline text, or with an error (never
    both); with `all_whole`, every one completed."""
    for prompt, outcome in zip(prompts, outcomes):
        assert outcome.done != (outcome.error is not None), f"{prompt!r}: {outcome}"
        if outcome.done:
            assert outcome.text == expected[prompt], f"{prompt!r} ended normally with other text"
        assert outcome.done or not all_whole, f"{prompt!r}: {outcome}"


# ---- a worker SIGKILLed ------------------------------------------------------------------------------------

DEPLOYMENTS = {
    "mixed": {"w1": "mixed", "w2": "mixed"},
    "prefill": {"p1": "prefill", "d1": "decode", "d2": "decode"},
    "decode": {"p1": "prefill", "d1": "decode", "d2": "decode"},
}


@pytest.mark.parametrize("victim_role", ["mixed", "prefill", "decode"])
def test_a_killed_worker_s_streams_complete_elsewhere_with_the_offline_text(
    mesh_factory: Any, mesh_model: str, expected: dict[str, str], victim_role: str
) -> None:
    """16 streams; a worker of `victim_role` is SIGKILLed while it runs some of them. A killed
    prefill worker is replaced (as `specmesh serve` would), else nobody could prefill again."""
    mesh: LocalMesh = mesh_factory(f"kill-{victim_role}")
    mesh.start_role("scheduler", "scheduler")
    workers = DEPLOYMENTS[victim_role]
    for name, role in workers.items():
        mesh.start_role(name, role, "--model", mesh_model, "--instance-id", name, *WORKER_FLAGS)
    url = f"http://127.0.0.1:{mesh.start_gateway(mesh_model)}"

    async def scenario() -> tuple[list[Outcome], int]:
        async with bus_of(mesh) as bus:
            candidates = [name for name, role in workers.items() if role == victim_role]

            async def busiest() -> tuple[str, int]:
                loads = {name: await bus.client.scard(bus.keys.assignments(name)) for name in candidates}
                return max(loads.items(), key=lambda item: item[1])

            timeout = aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                # a prefill is short: staggered arrivals keep the prefill worker busy for a while
                stagger_s = 0.1 if victim_role == "prefill" else 0.0
                outcomes, streams = start_streams(session, url, PROMPTS, stagger_s)

                async def struck_in_the_middle() -> bool:
                    started = victim_role == "prefill" or all(o.text or o.error for o in outcomes)
                    return started and (await busiest())[1] > 0

                await wait_for(struck_in_the_middle, f"a {victim_role} worker running streams")
                victim, num_running = await busiest()
                mesh.kill(victim)
                if victim_role == "prefill":
                    flags = ("--model", mesh_model, "--instance-id", "p2", *WORKER_FLAGS)
                    await asyncio.to_thread(mesh.start_role, "p2", "prefill", *flags)
                await streams
        return outcomes, num_running

    outcomes, num_running = asyncio.run(scenario())
    assert num_running > 0
    assert_whole_or_failed(PROMPTS, outcomes, expected)
    assert metric_value(mesh.metrics("scheduler"), "specmesh_scheduler_redispatched_total") >= 1


# ---- logprobs across a resume ---------------------------------------------------------------------------------

LOGPROB_PROMPTS = [f"class Stack_{i}:" for i in range(3)]
LOGPROB_MAX_TOKENS = 64


@dataclass
class LogprobStream:
    """What a client of a streamed completion with `logprobs` saw: per chunk, its text and its
    tokens' logprobs (the sampled token's, and the top alternatives')."""

    text: str = ""
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    done: bool = False
    error: str | None = None


async def stream_logprobs(
    session: aiohttp.ClientSession, url: str, prompt: str, record: LogprobStream
) -> None:
    body = {
        "prompt": prompt,
        "stream": True,
        "temperature": 0.0,
        "max_tokens": LOGPROB_MAX_TOKENS,
        "ignore_eos": True,
        "logprobs": 2,
    }
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            data = line.decode().removeprefix("data: ").strip()
            if not line.startswith(b"data: "):
                continue
            if data == "[DONE]":
                record.done = True
            elif "error" in (chunk := json.loads(data)):
                record.error = chunk["error"]["message"]
            elif chunk["choices"]:
                choice = chunk["choices"][0]
                record.text += choice["text"]
                if choice["logprobs"] is not None:
                    record.token_logprobs += choice["logprobs"]["token_logprobs"]
                    record.top_logprobs += choice["logprobs"]["top_logprobs"]


def test_logprobs_of_a_stream_resumed_on_another_decode_worker_are_whole_and_equal_the_offline_run(
    mesh_factory: Any, mesh_model: str
) -> None:
    """Greedy streams with `logprobs: 2` through 1 prefill + 2 decode workers; the decode worker
    running them is SIGKILLed mid-stream, and they resume on the other. Every streamed token has
    exactly one logprob entry (the sampled token's and its top 2), equal to the offline run's."""
    llm = LLM(mesh_model, device="cpu", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=LOGPROB_MAX_TOKENS, ignore_eos=True, logprobs=2)
    offline = {prompt: out for prompt, out in zip(LOGPROB_PROMPTS, llm.generate(LOGPROB_PROMPTS, params))}
    mesh: LocalMesh = mesh_factory("logprobs-resume")
    mesh.start_role("scheduler", "scheduler")
    for name, role in DEPLOYMENTS["decode"].items():
        mesh.start_role(name, role, "--model", mesh_model, "--instance-id", name, *WORKER_FLAGS)
    url = f"http://127.0.0.1:{mesh.start_gateway(mesh_model)}"

    async def scenario() -> tuple[list[LogprobStream], int]:
        async with bus_of(mesh) as bus:
            records = [LogprobStream() for _ in LOGPROB_PROMPTS]
            timeout = aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                streams = asyncio.gather(
                    *(stream_logprobs(session, url, p, r) for p, r in zip(LOGPROB_PROMPTS, records))
                )

                async def decoding() -> bool:
                    return all(len(r.token_logprobs) >= 4 for r in records)

                await wait_for(decoding, "every stream decoding")
                loads = {d: await bus.client.scard(bus.keys.assignments(d)) for d in ("d1", "d2")}
                victim = max(loads, key=lambda d: loads[d])
                mesh.kill(victim)
                await streams
        return records, loads[victim]

    records, num_stranded = asyncio.run(scenario())
    assert num_stranded > 0
    for prompt, record in zip(LOGPROB_PROMPTS, records):
        want = offline[prompt]
        assert record.done and record.error is None, f"{prompt!r}: {record.error}"
        assert record.text == want.text, prompt
        assert want.logprobs is not None
        assert len(record.token_logprobs) == len(record.top_logprobs) == LOGPROB_MAX_TOKENS, prompt
        assert record.token_logprobs == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-3), prompt
        got_top = [sorted(top.values()) for top in record.top_logprobs]
        want_top = [sorted(lp.top.values()) for lp in want.logprobs]
        assert got_top == [pytest.approx(values, abs=1e-3) for values in want_top], prompt


# ---- a worker stopped past its TTL, then continued -----------------------------------------------------------


def submit(request_id: str, prompt: list[int], params: SamplingParams) -> Submit:
    request = GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, params=params, gateway_id=TEST_GATEWAY
    )
    return Submit(request=request)


async def rows_of(bus: Bus) -> dict[str, list[tuple[int, list[int], bool]]]:
    """Every row the test gateway's output stream holds, per request: (start position, tokens,
    finished), in stream order."""
    rows: dict[str, list[tuple[int, list[int], bool]]] = {}
    for _, fields in await bus.client.xrange(bus.keys.outputs(TEST_GATEWAY)):
        batch = decode(fields[PAYLOAD_FIELD])
        assert isinstance(batch, OutputBatch)
        for event in batch.events():
            start = event.num_output_tokens - len(event.token_ids)
            rows.setdefault(event.request_id, []).append((start, event.token_ids, event.finished))
    return rows


def assert_published_once(request_id: str, rows: list[tuple[int, list[int], bool]]) -> None:
    """Each row starts where the one before ended: no output position was published twice."""
    position = 0
    for start, new, _ in rows:
        assert start == position, f"{request_id}: a row at {start} after {position} tokens (published twice)"
        position += len(new)


def test_a_worker_stopped_past_its_ttl_publishes_nothing_into_requests_placed_elsewhere(
    mesh_factory: Any, mesh_model: str
) -> None:
    """SIGSTOP a worker for longer than the heartbeat TTL (2 s here): its requests are placed on
    the other worker and complete with the offline tokens. After SIGCONT its engine core's steps
    (stepped on while it was stopped) reach the bus, which fences them off: every output position
    of every request is published exactly once, and the stale worker reports nothing for them."""
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = {f"r{i}": list(range(10 + 3 * i, 40 + 3 * i)) for i in range(3)}
    llm = LLM(mesh_model, device="cpu", max_model_len=512)
    outputs = llm.generate(prompt_token_ids=list(prompts.values()), sampling_params=params)
    expected = {request_id: output.token_ids for request_id, output in zip(prompts, outputs)}
    mesh: LocalMesh = mesh_factory("stopped-worker")
    mesh.start_role("scheduler", "scheduler")
    for name in ("w1", "w2"):
        mesh.start_role(name, "mixed", "--model", mesh_model, "--instance-id", name, *WORKER_FLAGS)

    async def scenario() -> tuple[
        dict[str, list[tuple[int, list[int], bool]]], list[Finished], str, set[str]
    ]:
        async with bus_of(mesh) as bus:

            async def both_registered() -> bool:
                return await bus.client.exists(bus.keys.heartbeat("w1"), bus.keys.heartbeat("w2")) == 2

            await wait_for(both_registered, "both workers registered")
            for request_id, prompt in prompts.items():
                await bus.publish(bus.keys.requests, submit(request_id, prompt, params))

            async def some_tokens_out() -> bool:
                return len((await bus.delivered_tokens("r0"))[0]) >= 8

            await wait_for(some_tokens_out, "r0 under way")
            placement = await bus.placement("r0")
            assert placement is not None
            victim = placement.instance_ids[0]
            stranded = {as_text(r) for r in await bus.client.smembers(bus.keys.assignments(victim))}
            pid = mesh.processes[victim].popen.pid
            os.kill(pid, signal.SIGSTOP)
            try:

                async def placed_elsewhere() -> bool:
                    placements = [await bus.placement(request_id) for request_id in stranded]
                    return all(p is None or victim not in p.instance_ids for p in placements)

                await wait_for(placed_elsewhere, f"{victim}'s requests placed elsewhere")
            finally:
                os.kill(pid, signal.SIGCONT)

            async def all_ended() -> bool:
                rows = await rows_of(bus)
                for request_id in prompts:
                    assert_published_once(request_id, rows.get(request_id, []))
                return all(any(finished for _, _, finished in rows.get(r, [])) for r in prompts)

            await wait_for(all_ended, "every request ended")

            async def fenced() -> bool:
                return metric_value(mesh.metrics(victim), "specmesh_worker_requests_fenced_total", 0.0) >= 1

            await wait_for(fenced, f"{victim} found itself fenced off", timeout_s=20.0)
            rows = await rows_of(bus)
            replies = [
                decode(f[PAYLOAD_FIELD]) for _, f in await bus.client.xrange(bus.keys.scheduler_replies)
            ]
        return rows, [r for r in replies if isinstance(r, Finished)], victim, stranded

    rows, reports, victim, stranded = asyncio.run(scenario())
    assert stranded, "the stopped worker ran nothing: the test tested nothing"
    for request_id, want in expected.items():
        assert_published_once(request_id, rows[request_id])
        assert [t for _, new, _ in rows[request_id] for t in new] == want, request_id
        assert [finished for _, _, finished in rows[request_id]].count(True) == 1, request_id
    assert not [r for r in reports if r.request_id in stranded and r.instance_id == victim], "stale reports"
    assert mesh.processes[victim].alive()


# ---- the gateway killed and replaced -------------------------------------------------------------------------


def test_a_killed_gateway_s_clients_see_a_clean_error_and_a_new_gateway_serves(
    mesh_factory: Any, mesh_model: str, expected: dict[str, str]
) -> None:
    """The dead gateway's clients lose their connections (nothing can keep those); its requests
    are aborted once its liveness lapses, or have run out, and are cleaned up (queue slot,
    assignment, KV blocks); a new gateway serves new requests with the offline text."""
    mesh: LocalMesh = mesh_factory("gateway-restart")
    mesh.start_role("scheduler", "scheduler")
    mesh.start_role("w1", "mixed", "--model", mesh_model, "--instance-id", "w1", *WORKER_FLAGS)
    first_url = f"http://127.0.0.1:{mesh.start_gateway(mesh_model)}"

    async def scenario() -> tuple[list[Outcome], list[Outcome]]:
        async with bus_of(mesh) as bus:
            timeout = aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                cut, streams = start_streams(session, first_url, PROMPTS[:8])

                async def all_under_way() -> bool:
                    return all(o.text or o.error for o in cut)

                await wait_for(all_under_way, "every stream under way")
                mesh.kill("gateway")
                await streams
                port = await asyncio.to_thread(mesh.start_gateway, mesh_model, name="gateway2")
                served, streams = start_streams(session, f"http://127.0.0.1:{port}", PROMPTS[8:12])
                await streams

            left: dict[str, float] = {}

            async def cleaned_up() -> bool:
                left["queue depth"] = int(await bus.client.get(bus.keys.queue_depth) or 0)
                left["assigned"] = await bus.client.scard(bus.keys.assignments("w1"))
                metrics = mesh.metrics("w1")  # updated with every step: the streams ran there
                left["running"] = metric_value(metrics, "specmesh_worker_running_requests")
                left["KV in use"] = metric_value(metrics, "specmesh_worker_kv_usage_ratio")
                return not any(left.values())

            try:
                await wait_for(cleaned_up, "the dead gateway's requests cleaned up")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; left: {left}") from None
        return cut, served

    cut, served = asyncio.run(scenario())
    assert_whole_or_failed(PROMPTS[:8], cut, expected, all_whole=False)
    assert any(o.error is not None and o.error.startswith("connection lost") for o in cut)
    assert_whole_or_failed(PROMPTS[8:12], served, expected)
    assert all(p.alive() for name, p in mesh.processes.items() if name != "gateway")


# ---- a gateway SIGKILLed: its requests aborted once its liveness lapses ---------------------------------------

ORPHAN_MAX_TOKENS = 448
"""The dead gateway's requests: far longer than the TTL, so only the abort can end them early."""
SURVIVOR_MAX_TOKENS = 128
SURVIVOR_PROMPTS = [f"def survivor_{i}(items):" for i in range(6)]
LIVENESS_TTL_S = 2.0
"""`LocalMesh.bus_flags`' --scheduler-ttl: the gateways' liveness TTL too."""


async def long_stream(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, outcome: Outcome
) -> None:
    try:
        await stream_completion(session, url, prompt, max_tokens, outcome)
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        outcome.error = f"connection lost: {exc!r}"


def test_a_killed_gateway_s_requests_stop_within_its_liveness_ttl_and_no_others(
    mesh_factory: Any, mesh_model: str
) -> None:
    """Gateways ga and gb stream on one worker. ga is SIGKILLed mid-stream and restarted under the
    same id at once: the dead incarnation's 4 requests are aborted by the scheduler within about
    the TTL (2 s here) of the kill, long before their max_tokens, and the worker frees them;
    gb's streams, and those of ga's new incarnation, complete with the offline text."""
    llm = LLM(mesh_model, device="cpu", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=SURVIVOR_MAX_TOKENS, ignore_eos=True)
    expected = {p: o.text for p, o in zip(SURVIVOR_PROMPTS, llm.generate(SURVIVOR_PROMPTS, params))}
    mesh: LocalMesh = mesh_factory("gateway-liveness")
    mesh.start_role("scheduler", "scheduler")
    mesh.start_role("w1", "mixed", "--model", mesh_model, "--instance-id", "w1", *WORKER_FLAGS)
    ga = f"http://127.0.0.1:{mesh.start_gateway(mesh_model, '--gateway-id', 'ga', name='ga')}"
    gb = f"http://127.0.0.1:{mesh.start_gateway(mesh_model, '--gateway-id', 'gb', name='gb')}"

    async def scenario() -> tuple[list[Outcome], list[Outcome], float, dict[str, int]]:
        async with bus_of(mesh) as bus:
            timeout = aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                cut = [Outcome() for _ in range(4)]
                survivors = [Outcome() for _ in SURVIVOR_PROMPTS]
                streams = [
                    long_stream(session, ga, prompt, ORPHAN_MAX_TOKENS, outcome)
                    for prompt, outcome in zip(PROMPTS[:4], cut)
                ]
                streams += [
                    long_stream(session, gb, prompt, SURVIVOR_MAX_TOKENS, outcome)
                    for prompt, outcome in zip(SURVIVOR_PROMPTS[:4], survivors)
                ]
                running = asyncio.gather(*streams)

                async def all_under_way() -> bool:
                    return all(o.text or o.error for o in cut + survivors[:4])

                await wait_for(all_under_way, "every stream under way")
                orphans = await bus.gateway_requests("ga")
                assert len(orphans) == 4, orphans
                mesh.kill("ga")
                killed_at = time.monotonic()
                lengths: dict[str, int] = {}

                async def orphans_ended() -> bool:
                    for request_id in orphans:
                        if await bus.placement(request_id) is not None:
                            tokens, _ = await bus.delivered_tokens(request_id)
                            lengths[request_id] = len(tokens)
                    return all([await bus.placement(r) is None for r in orphans])

                await wait_for(orphans_ended, "the dead gateway's requests aborted")
                stopped_after_s = time.monotonic() - killed_at
                port = await asyncio.to_thread(
                    mesh.start_gateway, mesh_model, "--gateway-id", "ga", name="ga-restarted"
                )
                url = f"http://127.0.0.1:{port}"
                streams = [
                    long_stream(session, url, prompt, SURVIVOR_MAX_TOKENS, outcome)
                    for prompt, outcome in zip(SURVIVOR_PROMPTS[4:], survivors[4:])
                ]
                await asyncio.gather(running, *streams)

            left: dict[str, float] = {}

            async def cleaned_up() -> bool:
                left["queue depth"] = int(await bus.client.get(bus.keys.queue_depth) or 0)
                metrics = mesh.metrics("w1")
                left["running"] = metric_value(metrics, "specmesh_worker_running_requests")
                left["KV in use"] = metric_value(metrics, "specmesh_worker_kv_usage_ratio")
                return not any(left.values())

            try:
                await wait_for(cleaned_up, "everything freed")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; left: {left}") from None
        return cut, survivors, stopped_after_s, lengths

    cut, survivors, stopped_after_s, lengths = asyncio.run(scenario())
    assert all(o.error is not None and not o.done for o in cut)
    assert_whole_or_failed(SURVIVOR_PROMPTS, survivors, expected)
    # the TTL, a sweep and a loaded 2-core machine's slack: not the minutes max_tokens would take
    assert stopped_after_s < LIVENESS_TTL_S + 10.0, stopped_after_s
    assert all(n < ORPHAN_MAX_TOKENS for n in lengths.values()), lengths
    scheduler = mesh.metrics("scheduler")
    assert metric_value(scheduler, "specmesh_scheduler_orphans_aborted_total") == 4


# ---- the scheduler killed and replaced -----------------------------------------------------------------------


def test_a_replaced_scheduler_takes_over_its_predecessor_s_messages_at_once(
    mesh_factory: Any, mesh_model: str, expected: dict[str, str]
) -> None:
    """Streams run on w1; w1 is told to drain (it finishes them, takes nothing new), so the next
    requests wait in the scheduler, read but not placed. The scheduler is SIGKILLed; a new worker
    and a new scheduler (another consumer name) start. The running streams complete, the waiting
    requests are taken over as soon as the dead scheduler's lease lapses (not after the idle time
    of `claim_idle_ms`) and complete, and new requests are admitted."""
    mesh: LocalMesh = mesh_factory("scheduler-restart")
    mesh.start_role("s1", "scheduler")
    mesh.start_role("w1", "mixed", "--model", mesh_model, "--instance-id", "w1", *WORKER_FLAGS)
    url = f"http://127.0.0.1:{mesh.start_gateway(mesh_model)}"

    async def scenario() -> tuple[list[Outcome], list[Outcome], list[Outcome]]:
        async with bus_of(mesh) as bus:
            timeout = aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                running, running_done = start_streams(session, url, PROMPTS[:8])

                async def all_under_way() -> bool:
                    return all(o.text or o.error for o in running)

                await wait_for(all_under_way, "every stream under way")
                mesh.processes["w1"].killed = True  # it exits once drained
                mesh.processes["w1"].popen.send_signal(signal.SIGTERM)  # drains: finishes, takes nothing new

                async def draining() -> bool:  # as the scheduler sees it: it places nothing there
                    metrics = mesh.metrics("s1")
                    return metric_value(metrics, "specmesh_scheduler_live_instances", role="mixed") == 0

                await wait_for(draining, "w1 draining")
                waiting, waiting_done = start_streams(session, url, PROMPTS[8:12])

                async def read_by_s1() -> bool:
                    pending: Any = await bus.client.xpending(bus.keys.requests, SCHEDULER_GROUP)
                    return int(pending["pending"]) >= len(waiting)

                await wait_for(read_by_s1, "the waiting requests read by s1")
                mesh.kill("s1")
                await asyncio.to_thread(
                    mesh.start_role,
                    "w2",
                    "mixed",
                    "--model",
                    mesh_model,
                    "--instance-id",
                    "w2",
                    *WORKER_FLAGS,
                )
                await asyncio.to_thread(mesh.start_role, "s2", "scheduler")
                await running_done
                await waiting_done
                new, new_done = start_streams(session, url, PROMPTS[12:16])
                await new_done
        return running, waiting, new

    running, waiting, new = asyncio.run(scenario())
    assert_whole_or_failed(PROMPTS[:8], running, expected)
    assert_whole_or_failed(PROMPTS[8:12], waiting, expected)
    assert_whole_or_failed(PROMPTS[12:16], new, expected)
    assert "message(s) pending with consumers gone" in mesh.processes["s2"].tail(100_000)
