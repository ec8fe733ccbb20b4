"""Host time a step of suffix decoding costs, replayed on the CPU without the model.

The target's greedy outputs are generated once (naive, the shipped model); then the suffix
proposer is driven as the engine drives it under greedy verification: each step every running
request verifies its drafts against its true continuation (the accepted prefix plus one token are
appended), then the running requests draft their next step. Only the proposer's own calls are
timed, on the engine's thread: the step's tokens appended to each request and `propose` (the
per-request indexes' updates and look-ups; the global index's look-ups inside `propose` apart),
and `forget` (a finished output goes into the in-process global index; on a GPU the engine does
that while the device runs a step, in the mesh the suffix-cache service). Prompts are indexed at each request's first draft, as on the CPU; `--prepare` indexes
them before the steps instead, as the engine does on a GPU while the device runs a step.
`--warm-global` first replays the same requests untimed, so that the global index holds their
outputs: every request then finds long global matches (the costliest global look-ups).

`--device-ms D` replays the steps as the engine runs them on a GPU instead: each step the device
works for D ms (a sleep, which releases the interpreter lock) while the host indexes prompts and,
with `--feed window`, inserts finished outputs into the global tree (`DeferredGlobalIndex`, what
the engine does); `--feed thread` inserts them on a thread instead (the engine's way before), 16
tokens between releases of the lock. The step's proposer calls follow the device. Reported: the
time a step takes beyond D (its critical path: the proposer's calls, waits for the lock, work
that overran the device), per step. `--lock-releases N` has the host's work after the device
release the interpreter lock N times, as the engine's device calls (torch calls) do: a feeding
thread may take it for a chunk each time.

`--global-inserts N` instead inserts the outputs N times over into an in-process global tree, with
what the process holds so far frozen out of garbage collection as the engine freezes its start-up:
time a token, the garbage collections that ran (by generation: count, total, longest) and the
objects the collector tracks afterwards.

`--drafter` replays the drafter's whole host work of a decode step instead (`Drafter.plan`,
`choose_pending`, `prepare_on_host` with no window, `accepted` per request, `finish` for the
requests that end, `propose_on_host`, `record_step`), under naive and under suffix decoding left
at k = 0: paused (`AdaptiveSpeculation.pause`, what the audit does) and kept there by the
controller (acceptance never trusted: `adaptive_min_acceptance` 1, probes every
PROBE_EVERY_STEPS steps). The controller is fed a synthetic step time (1.5 ms + 15 us a request +
3 us a token) as a GPU would give it; the host time is the calls' CPU time on this thread.

python -m benchmarks.suffix_host_cost --concurrency 1 16 64
python -m benchmarks.suffix_host_cost --outputs /tmp/suffix_streams.json --drafter --concurrency 16 64 256
python -m benchmarks.suffix_host_cost --outputs /tmp/suffix_streams.json --global-inserts 2
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.dataset import load_requests
from services.engine.llm import LLM
from services.engine.scheduler import ScheduledBatch
from services.engine.sequence import FinishReason, Sequence
from services.engine.spec_decode.drafter import Drafter
from services.engine.spec_decode.proposer import DraftBatch
from services.engine.spec_decode.suffix import DeferredGlobalIndex, SuffixConfig, SuffixProposer
from services.engine.spec_decode.suffix_tree import GlobalSuffixIndex, SuffixDraft
from shared.reference import default_model
from shared.sampling_params import SamplingParams
from shared.speculative_config import SpeculativeConfig

Stream = tuple[list[int], list[int]]
"""A request's prompt ids and greedy output ids."""


@dataclass
class StepTimes:
    own_s: list[float] = field(default_factory=list)
    """Per step: the per-request indexes' updates and look-ups."""
    global_s: list[float] = field(default_factory=list)
    """Per step: the global index's look-ups."""
    insert_s: list[float] = field(default_factory=list)
    """Per step: finished outputs put into the global index."""
    num_accepted: int = 0
    num_drafted: int = 0

    @property
    def total_s(self) -> float:
        return sum(self.own_s) + sum(self.global_s)


class TimedIndex:
    """The global index, counting the time its look-ups take."""

    def __init__(self, index: GlobalSuffixIndex) -> None:
        self.index = index
        self.seconds = 0.0

    def add_sequence(self, seq_id: str, token_ids: list[int]) -> None:
        self.index.add_sequence(seq_id, token_ids)

    def speculate_batch(self, queries: list[tuple[list[int], int]]) -> list[SuffixDraft | None]:
        began = time.perf_counter()
        drafts = self.index.speculate_batch(queries)
        self.seconds += time.perf_counter() - began
        return list(drafts)


class ThreadFedIndex:
    """The global index fed by a thread, 16 tokens between releases of the interpreter lock; a
    look-up while the thread is inside a chunk answers None (the engine's way before the deferred
    index)."""

    def __init__(self, index: GlobalSuffixIndex) -> None:
        self.index = index
        self._lock = threading.Lock()
        self._pending: list[tuple[str, list[int]]] = []
        self._wake = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def add_sequence(self, seq_id: str, token_ids: list[int]) -> None:
        with self._wake:
            self._pending.append((seq_id, list(token_ids)))
            self._wake.notify()

    def speculate_batch(self, queries: list[tuple[list[int], int]]) -> list[SuffixDraft | None]:
        if not self._lock.acquire(blocking=False):
            return [None] * len(queries)
        try:
            return list(self.index.speculate_batch(queries))
        finally:
            self._lock.release()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending:
                    self._wake.wait()
                seq_id, token_ids = self._pending.pop(0)
            done = False
            steps = self.index.add_sequence_steps(seq_id, token_ids, 16)
            while not done:
                with self._lock:
                    done = next(steps, True) is True
                time.sleep(0)


@dataclass
class DeviceStepTimes:
    """Per step of a replay with an emulated device, seconds."""

    after_s: list[float] = field(default_factory=list)
    """The proposer's calls after the device (verified tokens appended, finished requests
    forgotten, the next drafts), waits for the interpreter lock included."""
    overrun_s: list[float] = field(default_factory=list)
    """Window work (`prepare`) that went on past the device's end."""
    wake_s: list[float] = field(default_factory=list)
    """From the device's end (or the overrun's) to the host running again: the operating
    system's wake-up and, with a feeding thread, its hold on the interpreter lock."""
    num_accepted: int = 0
    num_drafted: int = 0

    @property
    def beyond_s(self) -> list[float]:
        return [sum(parts) for parts in zip(self.after_s, self.overrun_s, self.wake_s)]


def device_replay(
    streams: list[Stream], concurrency: int, k: int, device_s: float, feed: str, lock_releases: int
) -> DeviceStepTimes:
    """The replay with a device that works `device_s` a step (module docstring)."""
    config = SuffixConfig()
    index = config.global_index()
    global_index = DeferredGlobalIndex(index) if feed == "window" else ThreadFedIndex(index)
    proposer = SuffixProposer(config, global_index)
    params = SamplingParams(temperature=0.0, max_tokens=max(len(out) for _, out in streams))
    times = DeviceStepTimes()
    for start in range(0, len(streams), concurrency):
        group = streams[start : start + concurrency]
        running = [Sequence(f"r{start + i}", list(p), params, frozenset()) for i, (p, _) in enumerate(group)]
        outputs = {seq.request_id: out for seq, (_, out) in zip(running, group)}
        drafts: dict[str, list[int]] = {seq.request_id: [] for seq in running}
        for seq in running:
            proposer.start(seq)
        while running:
            device_done = time.perf_counter() + device_s
            proposer.prepare(until(device_done))
            window_done = max(time.perf_counter(), device_done)
            time.sleep(max(0.0, device_done - time.perf_counter()))
            woke = time.perf_counter()
            for _ in range(lock_releases):  # the engine's device calls, each letting a thread run
                time.sleep(0)
            running = device_step(proposer, running, outputs, drafts, k, times)
            times.after_s.append(time.perf_counter() - woke)
            times.overrun_s.append(window_done - device_done)
            times.wake_s.append(woke - window_done)
    return times


def until(deadline: float) -> Callable[[], bool]:
    """A device that is busy until `deadline` (perf_counter seconds)."""
    return lambda: time.perf_counter() < deadline


def device_step(
    proposer: SuffixProposer,
    running: list[Sequence],
    outputs: dict[str, list[int]],
    drafts: dict[str, list[int]],
    k: int,
    times: DeviceStepTimes,
) -> list[Sequence]:
    """What follows the device in a step: the verified tokens appended, finished requests
    forgotten, the next drafts; the requests still running."""
    for seq in running:
        new = accepted_tokens(drafts[seq.request_id], outputs[seq.request_id], seq.num_output_tokens)
        times.num_accepted += len(new) - 1
        times.num_drafted += len(drafts[seq.request_id])
        seq.token_ids += new
    for seq in [s for s in running if s.num_output_tokens >= len(outputs[s.request_id])]:
        proposer.forget(seq.request_id)
    running = [s for s in running if s.num_output_tokens < len(outputs[s.request_id])]
    ks = [max(0, min(k, len(outputs[s.request_id]) - s.num_output_tokens - 1)) for s in running]
    if running:
        proposed = proposer.propose(DraftBatch.on_host(None, running, ks))  # type: ignore[arg-type]
        for seq, row, n in zip(running, proposed.token_ids.tolist(), proposed.num_drafts.tolist()):
            drafts[seq.request_id] = row[:n]
    return running


class NoRunner:
    """What `Drafter` reads of a model runner, for host-drafted methods only (no drafting model)."""

    device = torch.device("cpu")
    inputs = None
    block_size = 16
    mtp_head = eagle3_head = draft_model = None


@dataclass
class DrafterTimes:
    """Per step of a drafter replay, CPU seconds on this thread."""

    host_s: list[float] = field(default_factory=list)
    """The drafter's calls, `finish` included."""
    finish_s: list[float] = field(default_factory=list)
    """`finish` alone: on the CPU a finished output goes into the global tree there (on a GPU
    `DeferredGlobalIndex` only queues it)."""
    num_drafted_steps: int = 0
    """Request-steps that drafted (probes)."""
    idle_s: list[float] = field(default_factory=list)
    """The host time of the steps that drafted nothing for the next step, less `finish`."""


def drafter_replay(streams: list[Stream], concurrency: int, mode: str) -> DrafterTimes:
    """The drafter's host work, step by step, under `mode`: naive, suffix-paused or suffix-kept
    (module docstring)."""
    config = {"method": "naive"} if mode == "naive" else {"method": "suffix", "num_speculative_tokens": 8}
    if mode == "suffix-kept":
        config["adaptive_min_acceptance"] = 1.0
    drafter = Drafter(SpeculativeConfig.model_validate(config), NoRunner(), None)  # type: ignore[arg-type]
    if mode == "suffix-paused":
        drafter.adaptive.pause(num_steps=2**62, batch=None)
    params = SamplingParams(temperature=0.0, max_tokens=max(len(out) for _, out in streams) + 2)
    times = DrafterTimes()
    clock = time.thread_time
    for start in range(0, len(streams), concurrency):
        group = streams[start : start + concurrency]
        running = [Sequence(f"r{start + i}", list(p), params, frozenset()) for i, (p, _) in enumerate(group)]
        outputs = {seq.request_id: out for seq, (_, out) in zip(running, group)}
        for seq in running:
            drafter.configure(seq)
        while running:
            batch = ScheduledBatch()
            for seq in running:
                seq.num_computed_tokens = seq.num_tokens - 1
                batch.add(seq, 1 + len(seq.spec.draft_token_ids))
            began = clock()
            plan = drafter.plan(batch, num_running=len(running))
            drafter.choose_pending()
            drafter.prepare_on_host(lambda: False)
            num_emitted = 0
            for seq in running:
                drafts = seq.spec.draft_token_ids
                new = accepted_tokens(drafts, outputs[seq.request_id], seq.num_output_tokens)
                seq.append_tokens(new)
                drafter.accepted(seq, len(drafts), len(new) - 1)
                seq.spec.draft_token_ids, seq.spec.k = [], 0  # the step's device drafts: none
                times.num_drafted_steps += bool(drafts)
                num_emitted += len(new)
            finishing = clock()
            for seq in [s for s in running if s.num_output_tokens >= len(outputs[s.request_id])]:
                seq.finish_reason = FinishReason.LENGTH
                drafter.finish(seq)
            finished = clock()
            drafter.propose_on_host(plan)
            num_tokens = sum(batch.num_new_tokens)
            step_s = 1.5e-3 + 15e-6 * len(running) + 3e-6 * num_tokens
            drafter.record_step(
                plan, len(running), num_tokens, num_emitted, step_s, mixed=False, host_gap_s=None
            )
            times.host_s.append(clock() - began)
            times.finish_s.append(finished - finishing)
            if not any(plan.num_wanted):
                times.idle_s.append(times.host_s[-1] - times.finish_s[-1])
            running = [s for s in running if s.finish_reason is None]
    return times


def print_drafter_replay(streams: list[Stream], args: argparse.Namespace) -> None:
    modes = ("naive", "suffix-paused", "suffix-kept")
    print(
        "| requests | steps | "
        + " | ".join(f"{m} ms/step (finish)" for m in modes)
        + " | kept: drafted request-steps | k = 0 steps less finish: naive, paused, kept |"
    )
    print("|---:|---:|" + "---:|" * (len(modes) + 2))
    for concurrency in args.concurrency:
        best = {}
        for _ in range(args.repeats):  # the modes alternated, the fastest replay of each kept
            for mode in modes:
                run = drafter_replay(streams, concurrency, mode)
                if mode not in best or sum(run.host_s) < sum(best[mode].host_s):
                    best[mode] = run
        cells = " | ".join(
            f"{1e3 * statistics.fmean(best[m].host_s):.3f} ({1e3 * statistics.fmean(best[m].finish_s):.3f})"
            for m in modes
        )
        steps = len(best["naive"].host_s)
        idle = ", ".join(f"{1e3 * statistics.fmean(best[m].idle_s or [0.0]):.3f}" for m in modes)
        print(f"| {concurrency} | {steps} | {cells} | {best['suffix-kept'].num_drafted_steps} | {idle} |")


def global_inserts(streams: list[Stream], rounds: int) -> None:
    """Times inserting every output `rounds` times into an in-process global tree (module docstring)."""
    outputs = [output for _, output in streams] * rounds
    gc.collect()
    gc.freeze()
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    began = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - began[0])

    index = GlobalSuffixIndex(max_cached_requests=len(outputs))
    gc.callbacks.append(timed)
    try:
        started = time.perf_counter()
        for i, output in enumerate(outputs):
            index.add_sequence(f"r{i}", output)
        seconds = time.perf_counter() - started
    finally:
        gc.callbacks.remove(timed)
    num_tokens = sum(map(len, outputs))
    print(f"{len(outputs)} outputs, {num_tokens} tokens: {1e6 * seconds / num_tokens:.1f} us a token")
    for generation, times in pauses.items():
        longest = 1e3 * max(times, default=0.0)
        print(
            f"generation {generation}: {len(times)} collections, {1e3 * sum(times):.1f} ms, longest {longest:.1f} ms"
        )
    print(f"tracked objects after: {len(gc.get_objects())}; tree nodes: {index.tree.num_nodes}")
    gc.unfreeze()


def greedy_outputs(model: str, workload: str, num_requests: int, max_tokens: int) -> list[Stream]:
    """(prompt ids, greedy output ids) of each request, from the plain engine on the CPU."""
    llm = LLM(model, device="cpu")
    requests = load_requests(workload, num_requests)
    prompts = [llm.tokenizer.encode(r.prompt) for r in requests]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [(prompt, out.token_ids) for prompt, out in zip(prompts, outputs)]


def accepted_tokens(draft: list[int], output: list[int], done: int) -> list[int]:
    """What greedy verification keeps: the drafts that match the output, then the output's next token."""
    num_accepted = 0
    while num_accepted < len(draft) and done + num_accepted < len(output):
        if draft[num_accepted] != output[done + num_accepted]:
            break
        num_accepted += 1
    return output[done : done + num_accepted + 1]


def replay(streams: list[Stream], concurrency: int, k: int, prepare: bool, warm_global: bool) -> StepTimes:
    """Runs the requests `concurrency` at a time through one proposer, timing its calls per step
    (after an untimed first pass with `warm_global`)."""
    config = SuffixConfig()
    global_index = TimedIndex(config.global_index())
    proposer = SuffixProposer(config, global_index)
    if warm_global:
        replay_pass(proposer, global_index, streams, concurrency, k, prepare, "warm-")
    return replay_pass(proposer, global_index, streams, concurrency, k, prepare, "")


def replay_pass(
    proposer: SuffixProposer,
    global_index: TimedIndex,
    streams: list[Stream],
    concurrency: int,
    k: int,
    prepare: bool,
    id_prefix: str,
) -> StepTimes:
    times = StepTimes()
    params = SamplingParams(temperature=0.0, max_tokens=max(len(out) for _, out in streams))
    for start in range(0, len(streams), concurrency):
        group = streams[start : start + concurrency]
        running = [
            Sequence(f"{id_prefix}r{start + i}", list(p), params, frozenset())
            for i, (p, _) in enumerate(group)
        ]
        outputs = {seq.request_id: out for seq, (_, out) in zip(running, group)}
        drafts: dict[str, list[int]] = {seq.request_id: [] for seq in running}
        for seq in running:
            proposer.start(seq)
        if prepare:
            proposer.prepare(lambda: True)
        while running:
            began = time.perf_counter()
            for seq in running:
                new = accepted_tokens(drafts[seq.request_id], outputs[seq.request_id], seq.num_output_tokens)
                times.num_accepted += len(new) - 1
                times.num_drafted += len(drafts[seq.request_id])
                seq.token_ids += new
            own_s = time.perf_counter() - began
            finished = [s for s in running if s.num_output_tokens >= len(outputs[s.request_id])]
            running = [s for s in running if s not in finished]
            began = time.perf_counter()
            for seq in finished:
                proposer.forget(seq.request_id)
            times.insert_s.append(time.perf_counter() - began)
            ks = [max(0, min(k, len(outputs[s.request_id]) - s.num_output_tokens - 1)) for s in running]
            global_index.seconds, began = 0.0, time.perf_counter()
            if running:
                proposed = proposer.propose(DraftBatch.on_host(None, running, ks))  # type: ignore[arg-type]
                counts = proposed.num_drafts.tolist()
                for seq, row, n in zip(running, proposed.token_ids.tolist(), counts):
                    drafts[seq.request_id] = row[:n]
            times.own_s.append(own_s + time.perf_counter() - began - global_index.seconds)
            times.global_s.append(global_index.seconds)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--workload", default="agentic")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--k", type=int, default=8, help="drafts asked for per request and step")
    parser.add_argument(
        "--repeats", type=int, default=3, help="replays per concurrency; the fastest is shown"
    )
    parser.add_argument("--outputs", type=Path, help="cache of the greedy outputs (JSON), written if absent")
    parser.add_argument("--prepare", action="store_true", help="index prompts before the steps, as on a GPU")
    parser.add_argument(
        "--warm-global", action="store_true", help="time a second pass over the same requests"
    )
    parser.add_argument("--device-ms", type=float, help="replay with a device step of this many ms")
    parser.add_argument("--feed", choices=["window", "thread"], default="window")
    parser.add_argument("--global-inserts", type=int, help="time inserting the outputs this many times over")
    parser.add_argument(
        "--replicate", type=int, default=1, help="replay the requests this many times over (c > their number)"
    )
    parser.add_argument(
        "--drafter", action="store_true", help="the drafter's host work a step: naive, suffix at k = 0"
    )
    parser.add_argument(
        "--lock-releases",
        type=int,
        default=0,
        help="with --device-ms: times the host's work after the device releases the interpreter lock",
    )
    args = parser.parse_args()
    if args.outputs is not None and args.outputs.exists():
        streams = [(p, o) for p, o in json.loads(args.outputs.read_text())]
    else:
        model = args.model or default_model()
        streams = greedy_outputs(model, args.workload, args.num_requests, args.max_tokens)
        if args.outputs is not None:
            args.outputs.write_text(json.dumps(streams))
    streams *= args.replicate
    if args.global_inserts is not None:
        global_inserts(streams, args.global_inserts)
        return
    if args.device_ms is not None:
        print_device_replay(streams, args)
        return
    if args.drafter:
        print_drafter_replay(streams, args)
        return
    print(
        "| requests | steps | own indexes ms/step (p90) | global look-ups ms/step | global inserts ms/step |"
    )
    print("|---:|---:|---:|---:|---:|")
    for concurrency in args.concurrency:
        runs = [
            replay(streams, concurrency, args.k, args.prepare, args.warm_global) for _ in range(args.repeats)
        ]
        best = min(runs, key=lambda t: t.total_s)
        p90_ms = 1e3 * statistics.quantiles(best.own_s, n=10)[-1]
        print(
            f"| {concurrency} | {len(best.own_s)} | {1e3 * statistics.fmean(best.own_s):.3f} ({p90_ms:.3f}) | "
            f"{1e3 * statistics.fmean(best.global_s):.3f} | {1e3 * statistics.fmean(best.insert_s):.3f} |"
        )
    print(f"accepted / drafted tokens: {best.num_accepted} / {best.num_drafted}")


def print_device_replay(streams: list[Stream], args: argparse.Namespace) -> None:
    print(
        f"| requests | steps | ms/step beyond the device ({args.device_ms} ms), --feed {args.feed}, "
        f"{args.lock_releases} lock releases "
        "| after the device | window overrun | wake-up | accepted / drafted |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for concurrency in args.concurrency:
        runs = [
            device_replay(streams, concurrency, args.k, args.device_ms / 1e3, args.feed, args.lock_releases)
            for _ in range(args.repeats)
        ]
        best = min(runs, key=lambda t: sum(t.beyond_s))
        columns = [best.beyond_s, best.after_s, best.overrun_s, best.wake_s]
        cells = " | ".join(f"{1e3 * statistics.fmean(c):.3f}" for c in columns)
        print(f"| {concurrency} | {len(best.after_s)} | {cells} | {best.num_accepted} / {best.num_drafted} |")


if __name__ == "__main__":
    main()
