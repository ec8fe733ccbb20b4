"""The engine's step loop in-process against the same engine inside a worker's engine core.

Issue 13: a mesh worker's decode steps take longer than the engine's own. This runs the same
requests (one workload, greedy, closed loop at `--concurrency`) along each *path*:

    in-process      benchmarks.offline's loop: engine.step() and its outputs, in this process
    in-process-1t   the same with torch on one CPU thread (what an engine core beside a GPU uses)
    core            an engine core started as a worker starts it, driven by a bare client (no bus)
    core-suffix     the same plus the shared suffix cache's client thread every mixed and decode
                    core runs (a redis-server started here, the service's heartbeat key set)
    core-pinned     the core on CPUs of its own (`--core-cpus auto`: hosts of four CPUs or more)
    core-batch      the core driven by a client under SCHED_BATCH (`--bus-side-policy batch`): a
                    step batch waking the client never preempts the core

and reports, per path, the medians of the engine's *step* (in-process: around `engine.step()`;
core: `StepBatch.step_s`), the loop's *period* (one step's start to the next one's, while the
same requests run) and their difference, the *gap* (what the loop does besides stepping), the
*delivery* (from a step's start to its tokens in the caller's hands: in-process, the next
`engine.step()` returning them; core, the batch carrying them read by its client), and the output
tok/s. A path that cannot run here (no redis-server) is skipped with the reason.
`--profile DIR`: the in-process path's `engine.step()` calls and the core path's whole loop after
its warm-up run under cProfile (DIR/in-process.prof, DIR/core.prof), and the functions the core calls more often
per step than the engine in-process does are listed (call counts are deterministic: differences
show even on a noisy machine).

    python -m benchmarks.core_step --device cpu --model models/specmesh-code-15m --cpu-threads 1 \\
        --workload code_editing --num-requests 6 --max-tokens 64 --concurrency 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import pstats
import statistics
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.compare import result_header, write_result
from benchmarks.dataset import WARMUP_PROMPT, load_requests
from benchmarks.offline import build_engine, free_memory
from services.engine.args import add_engine_args, engine_config
from services.serve import find_redis_server, free_port
from services.worker.core_client import EngineCoreClient
from services.worker.core_messages import CoreOptions, SuffixCacheOptions
from services.worker.cpus import set_thread_policy
from shared.bus import RedisSettings
from shared.config import EngineConfig
from shared.protocol import GenerateRequest
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

PATHS = ("in-process", "in-process-1t", "core", "core-suffix", "core-pinned", "core-batch")
TOPIC = "core-step"


@dataclass
class StepTimes:
    """One path's steps: each step's own time, the loop's periods, the tokens they made."""

    step_s: list[float] = field(default_factory=list)
    period_s: list[float] = field(default_factory=list)
    delivery_s: list[float] = field(default_factory=list)
    """Per step whose tokens came out: from its start to its tokens in the caller's hands."""
    num_steps: int = 0
    num_tokens: int = 0
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        step_ms = statistics.median(self.step_s) * 1000
        period_ms = statistics.median(self.period_s) * 1000 if self.period_s else float("nan")
        delivery_ms = statistics.median(self.delivery_s) * 1000 if self.delivery_s else float("nan")
        return {
            "num_steps": self.num_steps or len(self.step_s),
            "num_tokens": self.num_tokens,
            "step_p50_ms": step_ms,
            "period_p50_ms": period_ms,
            "gap_p50_ms": period_ms - step_ms,
            "delivery_p50_ms": delivery_ms,
            "output_tok_per_s": self.num_tokens / self.wall_s,
        }


@dataclass
class Closed:
    """A closed loop over the prompts: at most `limit` in flight; `fresh` after an admission."""

    prompts: list[list[int]]
    limit: int
    params: SamplingParams
    next_index: int = 0
    running: set[str] = field(default_factory=set)
    fresh: bool = True

    def due(self) -> Iterator[tuple[str, list[int]]]:
        while len(self.running) < self.limit and self.next_index < len(self.prompts):
            request_id = f"r{self.next_index}"
            self.running.add(request_id)
            self.fresh = True
            yield request_id, self.prompts[self.next_index]
            self.next_index += 1

    @property
    def done(self) -> bool:
        return not self.running and self.next_index == len(self.prompts)


def in_process(
    config: EngineConfig, loop: Closed, threads: int | None, profile: Path | None = None
) -> StepTimes:
    """The steps of benchmarks.offline's loop; `profile`: engine.step() under cProfile, saved there."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    engine = build_engine(config)
    times, last_start = StepTimes(), None
    profiler = cProfile.Profile() if profile is not None else None
    try:
        started = time.perf_counter()
        while not loop.done:
            for request_id, prompt in loop.due():
                engine.add_request(request_id, prompt_token_ids=prompt, params=loop.params)
            step_start = time.perf_counter()
            outputs = engine.step() if profiler is None else profiler.runcall(engine.step)
            returned = time.perf_counter()
            times.step_s.append(returned - step_start)
            if last_start is not None and any(output.new_token_ids for output in outputs):
                times.delivery_s.append(returned - last_start)  # a call returns the last step's tokens
            if last_start is not None and not loop.fresh:
                times.period_s.append(step_start - last_start)
            last_start, loop.fresh = step_start, False
            for output in outputs:
                times.num_tokens += len(output.new_token_ids)
                if output.finished:
                    loop.running.discard(output.request_id)
        times.wall_s = time.perf_counter() - started
        if profiler is not None and profile is not None:
            profiler.dump_stats(profile)
    finally:
        engine.close()
        free_memory()
        torch.set_num_threads(previous)
    return times


async def in_core(
    options: CoreOptions, warmup: list[int], loop: Closed, profile: Path | None = None
) -> tuple[StepTimes, list[int]]:
    """The steps of a core started as a worker starts it, after a warm-up as the in-process
    engine's; also the CPUs it was pinned to. `profile`: its loop under cProfile after the warm-up.
    The client's thread takes `bus_side_policy` once the core runs, as a worker's does."""
    core = await EngineCoreClient.start(options)
    set_thread_policy(options.config.bus_side_policy)
    try:
        await drive(core, Closed([warmup, warmup], 2, SamplingParams(max_tokens=8, ignore_eos=True)))
        if profile is not None:
            await core.profile(str(profile))
        return await drive(core, loop), core.info.cpus
    finally:
        set_thread_policy("normal")
        await core.shutdown()


async def drive(core: EngineCoreClient, loop: Closed) -> StepTimes:
    """Steps the core's requests to their ends; a batch sent during (or after) step k carries the
    tokens of step k - 1, whose start is the one before k's."""
    times, starts = StepTimes(), [0.0, 0.0]
    started = time.perf_counter()
    while not loop.done:
        for request_id, prompt in loop.due():
            request = GenerateRequest(request_id=request_id, prompt_token_ids=prompt, params=loop.params)
            await core.add_request(request, epoch=1)
        batches = await core.next_batches()
        received = time.time()
        for batch in batches:
            times.num_tokens += len(batch.token_ids)
            loop.running.difference_update(batch.request_ids[end.row] for end in batch.ends)
            times.step_s += batch.step_s
            if not batch.started_at:
                continue  # no step: a command's effects only
            if batch.started_at != starts[-1]:  # the first batch of a step
                times.num_steps += 1
                if starts[-1] and not loop.fresh:
                    times.period_s.append(batch.started_at - starts[-1])
                starts = [starts[-1], batch.started_at]
                loop.fresh = False
            if len(batch.token_ids) and starts[0]:
                times.delivery_s.append(received - starts[0])
    times.wall_s = time.perf_counter() - started
    return times


@contextlib.contextmanager
def suffix_cache_bus() -> Iterator[RedisSettings]:
    """A bare redis-server holding the suffix-cache service's heartbeat key (so the core's client
    takes the service for up, as in a mesh), stopped on exit."""
    import redis

    settings = RedisSettings(port=free_port(), topic=TOPIC)
    server = subprocess.Popen(
        [find_redis_server(), "--port", str(settings.port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=settings.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.set(settings.keys.suffix_cache_heartbeat, b"up")
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield settings
    finally:
        server.terminate()
        server.wait(timeout=10)


def run_path(
    path: str, config: EngineConfig, prompts: list[list[int]], warmup: list[int], args: Any
) -> dict[str, Any]:
    loop = Closed(prompts, args.concurrency, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    if path.startswith("in-process"):
        threads = 1 if path == "in-process-1t" else config.cpu_threads
        profile = args.profile / "in-process.prof" if args.profile and path == "in-process" else None
        return {"path": path, **in_process(config, loop, threads, profile).summary()}
    cpus: list[int] = []
    if path == "core-suffix":
        with suffix_cache_bus() as settings:
            options = CoreOptions(config, SuffixCacheOptions(settings, f"{TOPIC}-core", 0.002))
            times, cpus = asyncio.run(in_core(options, warmup, loop))
    elif path in ("core-pinned", "core-batch"):
        update = {"core_cpus": "auto"} if path == "core-pinned" else {"bus_side_policy": "batch"}
        times, cpus = asyncio.run(in_core(CoreOptions(config.model_copy(update=update)), warmup, loop))
    else:
        profile = args.profile / "core.prof" if args.profile else None
        times, cpus = asyncio.run(in_core(CoreOptions(config), warmup, loop, profile))
    return {"path": path, "core_cpus": cpus, **times.summary()}


def calls_per_step(profile: Path) -> dict[str, float]:
    """Calls per engine step of every function in a profile (steps: the calls of `LLMEngine.step`)."""
    stats: dict[Any, Any] = pstats.Stats(str(profile)).stats  # type: ignore[attr-defined]
    steps = max(
        n for (file, _, name), (_, n, *_) in stats.items() if name == "step" and file.endswith("engine.py")
    )
    return {
        f"{Path(file).name}:{line}({name})": n / steps for (file, line, name), (_, n, *_) in stats.items()
    }


def calls_table(in_process_prof: Path, core_prof: Path, min_difference: float = 0.5) -> str:
    """Total calls per step on each path, and each function the core calls more often per step."""
    engine, core = calls_per_step(in_process_prof), calls_per_step(core_prof)
    lines = [
        f"calls per step: in-process {sum(engine.values()):.1f}, core {sum(core.values()):.1f}",
        "",
        "| function | in-process | core | more in the core |",
        "|---|---:|---:|---:|",
    ]
    more = [(core[f] - engine.get(f, 0.0), f) for f in core if core[f] - engine.get(f, 0.0) >= min_difference]
    for difference, function in sorted(more, reverse=True):
        lines.append(
            f"| {function} | {engine.get(function, 0.0):.2f} | {core[function]:.2f} | {difference:+.2f} |"
        )
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| path | steps | step p50 ms | period p50 ms | gap p50 ms | delivery p50 ms | out tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['path']} | skipped: {r['skipped']} | | | | | |")
            continue
        lines.append(
            f"| {r['path']} | {r['num_steps']} | {r['step_p50_ms']:.3f} | {r['period_p50_ms']:.3f} "
            f"| {r['gap_p50_ms']:.3f} | {r['delivery_p50_ms']:.3f} | {r['output_tok_per_s']:.1f} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.core_step", description=__doc__.splitlines()[0]
    )
    add_engine_args(parser)
    parser.add_argument("--workload", default="code_editing")
    parser.add_argument("--num-requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128, help="each request's output tokens")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the paths, interleaved")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/core-step.json"))
    parser.add_argument("--profile", type=Path, help="directory for the in-process and core paths' profiles")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.concurrency < 1 or args.num_requests < 1 or args.max_tokens < 1:
        raise SystemExit("--concurrency, --num-requests and --max-tokens must be at least 1")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    config = engine_config(args)
    config = config.model_copy(update={"max_num_seqs": min(args.concurrency, config.max_num_seqs)})
    tokenizer = Tokenizer(config.model)
    requests = load_requests(args.workload, args.num_requests)
    prompts = [tokenizer.encode(r.prompt) for r in requests]
    warmup = tokenizer.encode(WARMUP_PROMPT)
    header = result_header(
        "core_step", args.model, {"args": vars(args) | {"out": str(args.out), "profile": str(args.profile)}}
    )
    rows: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        for path in args.paths:
            try:
                rows.append(run_path(path, config, prompts, warmup, args))
            except SystemExit as exc:  # find_redis_server: none here
                rows.append({"path": path, "skipped": str(exc)})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            # rewritten after each path: a run cut short (a device call's time limit) keeps what it measured
            result = {**header, "engine": config.model_dump(mode="json"), "rows": rows}
            write_result(result, args.out, plot=False)
    print(f"\nstep loop, in-process and in an engine core (c={args.concurrency})\n\n{table(rows)}")
    if args.profile and {"in-process", "core"} <= set(args.paths):
        print(f"\n{calls_table(args.profile / 'in-process.prof', args.profile / 'core.prof')}")


if __name__ == "__main__":
    main()
