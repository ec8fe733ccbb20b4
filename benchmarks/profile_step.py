"""Where an engine step's host time goes, for any method: a cProfile over the decode of a few
requests, or (`--phases`) the wall time of each phase of `LLMEngine.step` per step.

python -m benchmarks.profile_step --device cuda --speculative-config '{"method": "ngram"}'
python -m benchmarks.profile_step --device cuda --model DIR --dtype bfloat16 --phases \\
    --methods naive ngram 'mtp1={"method": "mtp", "model": "DIR/mtp", "num_speculative_tokens": 1}'

With `--phases`, `result(wait)` is the host waiting for the device after launching a step; the rest
is host work. With `--no-async-scheduling` (and in steps that need the host) most of it is on the
step's critical path at concurrency 1 (the device idles meanwhile except while `launch` and `_emit`
run); otherwise a decode step launched ahead (`_launch_ahead`) runs while the host lands the last. `--cpu-time` counts each phase's CPU time on the engine's
thread instead, which a shared machine's other work does not inflate (the wait then counts nothing).
Each run's first line after the summary, `engine.step less runner._run`, is the step's host work
on the CPU (where `runner._run` is the forward itself): what a suffix batch at k = 0
(`--pause-host-drafting`) costs beside naive's.

With `--kernels` (a GPU), the device's side instead: the kernels the steps ran (those replayed from
CUDA graphs included), each with its device time and launches per step, heaviest first, and the
device's busy time per step against the step's wall time.

With `--timeline PATH`, the steps one by one instead (JSON lines, one file per method: PATH with the
method's label before the suffix): each `step()` call's start and wall time, its wait for the device,
and the steps it launched (prefill tokens, decode rows, drafts, launched ahead or not); then each
request's arrival and first token. The summary splits the run at the last step with prefill tokens:
where a burst's time to first token goes, step by step, against naive's.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import json
import pstats
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.dataset import load_requests
from benchmarks.methods import resolve_methods
from benchmarks.offline import free_memory
from services.engine import model_runner
from services.engine.llm import LLM
from shared.reference import default_model
from shared.sampling_params import SamplingParams
from shared.speculative_config import SpeculativeConfig

PHASES = {
    "engine": ("step", "_launch_ahead", "_land", "_update_slots", "_emit", "_apply", "_free_stopped"),
    "scheduler": ("schedule", "schedule_ahead"),
    "drafter": ("plan", "choose_pending", "prepare_on_host", "propose_on_host", "record_step", "accepted"),
    "runner": ("launch", "launch_ahead", "prepare", "_run", "_read_back"),
    "graphs": ("lookup", "replay_forward", "_copy_in", "replay_tail"),
}
"""The timed methods of each part of the engine (`graphs`: the runner's CUDA graphs, when captured)."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--workload", default="code_editing")
    parser.add_argument("--speculative-config")
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=1, help="requests generated together")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--rows", type=int, default=35)
    parser.add_argument("--phases", action="store_true", help="time each phase of a step instead")
    parser.add_argument(
        "--kernels", action="store_true", help="the device time of each kernel per step instead (a GPU)"
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="with --phases: each phase's CPU time on this thread instead of its wall time (on a shared "
        "machine what it would take alone; a wait for the device is then not counted)",
    )
    parser.add_argument(
        "--timeline",
        type=Path,
        metavar="PATH",
        help="each step's times and launches as JSON lines instead (PATH gets each method's label)",
    )
    parser.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="launch each step once the last one's result is read",
    )
    parser.add_argument(
        "--pause-host-drafting",
        action="store_true",
        help="host drafting paused for the whole run (the controller's audit forced): a paused suffix "
        "batch's host cost beside naive's",
    )
    parser.add_argument(
        "--no-drafts",
        action="store_true",
        help="every request drafts nothing (k = 0) after the warm-up: what a drafting method's step "
        "costs beside naive's where the controller has stopped it",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        help="methods to run one after another, naive first (benchmarks.offline's names or label={json})",
    )
    args = parser.parse_args(argv)
    if args.kernels and (args.device == "cpu" or not torch.cuda.is_available()):
        parser.error("--kernels profiles a GPU's kernels: it needs a CUDA device (--device cuda)")
    requests = load_requests(args.workload, args.num_requests + 1)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        seed=0 if args.temperature > 0 else None,
        max_tokens=args.max_tokens,
    )
    prompts = [r.prompt for r in requests[1:]]
    model = args.model or default_model()
    if args.methods:  # naive first, as the baseline
        methods = resolve_methods(args.methods, model)
    else:
        methods = {"": SpeculativeConfig.from_json(args.speculative_config).model_dump()}
    for label, config in methods.items():
        llm = LLM(
            model,
            device=args.device,
            dtype=args.dtype,
            speculative_config=config,
            async_scheduling=args.async_scheduling,
        )
        llm.generate(prompts=[requests[0].prompt], sampling_params=params)  # warm-up
        if args.pause_host_drafting:
            llm.engine.drafter.adaptive.pause(num_steps=2**62, batch=None)
        if args.no_drafts:
            llm.engine.drafter.adaptive.choose = lambda seqs, *_, **__: [0] * len(seqs)  # type: ignore[method-assign]
        if args.phases:
            clock = time.thread_time if args.cpu_time else time.perf_counter
            print_phases(label, llm, prompts, params, args.concurrency, clock)
        elif args.kernels:
            print_kernels(label, llm, prompts, params, args.concurrency, args.rows)
        elif args.timeline:
            path = args.timeline.with_name(f"{args.timeline.stem}-{label or 'method'}{args.timeline.suffix}")
            write_timeline(label, llm, prompts, params, args.concurrency, path)
        else:
            profile(llm, prompts, params, args.concurrency, args.rows)
        llm.close()
        del llm
        free_memory()


def generate(llm: LLM, prompts: list[str], params: SamplingParams, concurrency: int) -> int:
    """Output tokens of `prompts` run `concurrency` at a time."""
    num_tokens = 0
    for start in range(0, len(prompts), concurrency):
        outputs = llm.generate(prompts=prompts[start : start + concurrency], sampling_params=params)
        num_tokens += sum(len(o.token_ids) for o in outputs)
    return num_tokens


def profile(llm: LLM, prompts: list[str], params: SamplingParams, concurrency: int, rows: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    generate(llm, prompts, params, concurrency)
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)


def print_phases(
    label: str,
    llm: LLM,
    prompts: list[str],
    params: SamplingParams,
    concurrency: int,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """Mean time per step of each phase by `clock` (wall time unless told)."""
    engine = llm.engine
    totals: dict[str, float] = collections.defaultdict(float)
    parts: dict[str, Any] = {
        "engine": engine,
        "scheduler": engine.scheduler,
        "drafter": engine.drafter,
        "runner": engine.runner,
        "graphs": engine.runner.graphs,
    }
    originals = [(model_runner.LaunchedStep, "result", model_runner.LaunchedStep.result)]
    model_runner.LaunchedStep.result = timed(model_runner.LaunchedStep.result, "result(wait)", totals, clock)  # type: ignore[method-assign]
    for part, names in PHASES.items():
        if parts[part] is None:
            continue
        for name in names:
            originals.append((parts[part], name, getattr(parts[part], name)))
            setattr(parts[part], name, timed(getattr(parts[part], name), f"{part}.{name}", totals, clock))
    synchronize = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    synchronize()
    started = time.perf_counter()
    num_tokens = generate(llm, prompts, params, concurrency)
    synchronize()
    seconds = time.perf_counter() - started
    for owner, name, original in originals:
        if owner is model_runner.LaunchedStep:
            setattr(owner, name, original)
        else:
            delattr(owner, name)  # the instance attribute shadowed the class's method
    num_steps = max(int(totals.pop("#engine.step")), 1)
    print(
        f"{label or 'method'}: {num_steps} steps, {num_tokens} tokens, "
        f"{seconds / num_steps * 1e3:.3f} ms a step, {num_tokens / num_steps:.2f} tokens a step, "
        f"TPOT {seconds / max(num_tokens, 1) * 1e3:.3f} ms"
    )
    beyond_run_s = totals["engine.step"] - totals["runner._run"]
    print(f"  {'engine.step less runner._run':28s} {beyond_run_s / num_steps * 1e6:9.1f} us a step")
    for name, total in sorted(totals.items(), key=lambda item: -item[1]):
        if not name.startswith("#"):
            print(f"  {name:28s} {total / num_steps * 1e6:9.1f} us a step")


def print_kernels(
    label: str, llm: LLM, prompts: list[str], params: SamplingParams, concurrency: int, rows: int
) -> None:
    """Device time and launches per step of the `rows` heaviest kernels, by the CUDA profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as device_profile

    engine = llm.engine
    counts: dict[str, float] = collections.defaultdict(float)
    engine.step = timed(engine.step, "engine.step", counts)  # type: ignore[method-assign]
    torch.cuda.synchronize()
    started = time.perf_counter()
    with device_profile(activities=[ProfilerActivity.CUDA]) as prof:
        num_tokens = generate(llm, prompts, params, concurrency)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    del engine.step
    num_steps = max(int(counts["#engine.step"]), 1)
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name][0] += event.device_time_total
            kernels[event.name][1] += 1
    busy_us = sum(total for total, _ in kernels.values())
    print(
        f"{label or 'method'}: {num_steps} steps, {num_tokens / num_steps:.2f} tokens a step, "
        f"{seconds / num_steps * 1e3:.3f} ms a step (profiled), device busy "
        f"{busy_us / num_steps:.1f} us a step in {sum(n for _, n in kernels.values()) / num_steps:.0f} kernels"
    )
    heaviest = sorted(kernels.items(), key=lambda item: -item[1][0])[:rows]
    for name, (total_us, launches) in heaviest:
        print(f"  {total_us / num_steps:9.1f} us {launches / num_steps:6.1f}x  {name[:110]}")


def write_timeline(
    label: str, llm: LLM, prompts: list[str], params: SamplingParams, concurrency: int, path: Path
) -> None:
    """Each `step()` call of the run as a JSON line in `path` (its start and wall time from the run's
    start, its wait for the device, the steps it launched), then each request's first token; prints
    the time before and after the last step with prefill tokens, and the steps' mean times. A burst
    of the same shapes runs first, untimed."""
    engine, runner = llm.engine, llm.engine.runner
    steps: list[dict[str, Any]] = []
    current: dict[str, Any] = {}

    def launched(function: Callable[..., Any], ahead: bool) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(batch: Any, plan: Any) -> Any:
            prefill = sum(
                n for seq, n in zip(batch.seqs, batch.num_new_tokens) if seq.num_uncomputed_tokens > 1
            )
            current.setdefault("launched", []).append(
                {
                    "ahead": ahead,
                    "seqs": len(batch.seqs),
                    "tokens": sum(batch.num_new_tokens),
                    "prefill_tokens": prefill,
                    "drafts": sum(plan.num_wanted),
                }
            )
            return function(batch, plan)

        return wrapper

    original_result = model_runner.LaunchedStep.result

    def result(self: model_runner.LaunchedStep) -> Any:
        started = time.perf_counter()
        if self.done is not None:
            self.done.synchronize()
        current["wait_ms"] = current.get("wait_ms", 0.0) + (time.perf_counter() - started) * 1e3
        return original_result(self)

    original_step = engine.step

    def step() -> Any:
        current.clear()
        started = time.perf_counter()
        try:
            return original_step()
        finally:
            ended = time.perf_counter()
            steps.append({"start_ms": (started - t0) * 1e3, "wall_ms": (ended - started) * 1e3, **current})

    runner.launch = launched(runner.launch, ahead=False)  # type: ignore[method-assign]
    runner.launch_ahead = launched(runner.launch_ahead, ahead=True)  # type: ignore[method-assign]
    model_runner.LaunchedStep.result = result  # type: ignore[method-assign]
    # the burst's shapes' one-time costs first, on prompts that seed no prefix cache the run uses
    llm.generate(
        prompts=[f"# warm-up {i}\n{p}" for i, p in enumerate(prompts[:concurrency])], sampling_params=params
    )
    t0 = time.perf_counter()
    engine.step = step  # type: ignore[method-assign]
    try:
        outputs = llm.generate(prompts=prompts[:concurrency], sampling_params=params)
    finally:
        model_runner.LaunchedStep.result = original_result  # type: ignore[method-assign]
        for name in ("launch", "launch_ahead"):
            delattr(runner, name)
        del engine.step
    ttfts = sorted(o.metrics.get("ttft_s", 0.0) * 1e3 for o in outputs)
    with path.open("w") as handle:
        for record in steps:
            handle.write(json.dumps(record) + "\n")
        handle.write(json.dumps({"ttft_ms": ttfts}) + "\n")
    last_prefill = max(
        (i for i, s in enumerate(steps) if any(x["prefill_tokens"] for x in s.get("launched", []))),
        default=-1,
    )
    before, after = steps[: last_prefill + 1], steps[last_prefill + 1 :]
    end_ms = steps[-1]["start_ms"] + steps[-1]["wall_ms"] if steps else 0.0
    prefill_end_ms = before[-1]["start_ms"] + before[-1]["wall_ms"] if before else 0.0
    print(
        f"{label or 'method'}: {len(steps)} steps in {end_ms:.1f} ms; TTFT p50 {ttfts[len(ttfts) // 2]:.1f} ms, "
        f"max {ttfts[-1]:.1f} ms; {len(before)} steps to the last prefill ({prefill_end_ms:.1f} ms, "
        f"{sum(s.get('wait_ms', 0.0) for s in before):.1f} ms of it waiting), then {len(after)} steps of "
        f"{(end_ms - prefill_end_ms) / max(len(after), 1):.3f} ms ({path})"
    )


def timed(
    function: Callable[..., Any],
    name: str,
    totals: dict[str, float],
    clock: Callable[[], float] = time.perf_counter,
) -> Callable[..., Any]:
    """`function`, adding its time by `clock` to totals[name] and its calls to totals["#" + name]."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = clock()
        try:
            return function(*args, **kwargs)
        finally:
            totals[name] += clock() - started
            totals["#" + name] += 1

    return wrapper


if __name__ == "__main__":
    main()
