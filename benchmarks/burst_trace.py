"""Per-step trace of a burst: every request arrives at once; where the time to first token goes.

    python -m benchmarks.burst_trace --model DIR --concurrency 64 \\
        --methods naive ngram 'draft3={"method":"draft_model","model":"models/specmesh-code-draft","num_speculative_tokens":3}'

For each method (one engine each, `benchmarks.offline`'s warm-up first): the time until every request
has its first token, then the first steps of the burst: start time, wall time, the host time of
`ModelRunner.launch`, sequences / tokens / prefill chunks scheduled, the drafting chain and the drafts
wanted, whether the step replayed from CUDA graphs, and how many requests have their first token.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.dataset import requests_for_cell
from benchmarks.methods import resolve_methods
from benchmarks.offline import Sampling, build_engine, free_memory, sampling_params
from services.engine.engine import LLMEngine
from services.engine.model_runner import LaunchedStep
from services.engine.scheduler import ScheduledBatch
from services.engine.verify_update import StepPlan
from shared.config import EngineConfig
from shared.speculative_config import SpeculativeConfig


@dataclass
class StepRow:
    start_ms: float
    wall_ms: float
    launch_ms: float
    num_seqs: int
    num_tokens: int
    num_prefill: int
    chain: int
    drafts_wanted: int
    replayed: bool
    num_first_tokens: int


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def trace(engine: LLMEngine, prompts: list[tuple[str, Any]]) -> tuple[list[StepRow], list[float]]:
    """Runs the burst to the end; the steps and each request's time to first token (ms)."""
    scheduler, runner = engine.scheduler, engine.runner
    schedule, launch = scheduler.schedule, runner.launch
    seen: dict[str, Any] = {}

    def traced_schedule() -> ScheduledBatch:
        batch = schedule()
        prefill = sum(seq.num_uncomputed_tokens > 1 for seq in batch.seqs)
        seen["batch"] = (len(batch.seqs), sum(batch.num_new_tokens), prefill)
        return batch

    def traced_launch(batch: ScheduledBatch, plan: StepPlan) -> LaunchedStep:
        started = time.perf_counter()
        launched = launch(batch, plan)
        seen["launch_ms"] = (time.perf_counter() - started) * 1e3
        seen["plan"] = plan
        return launched

    scheduler.schedule, runner.launch = traced_schedule, traced_launch  # type: ignore[method-assign]
    try:
        synchronize()
        t0 = time.perf_counter()
        for i, (prompt, params) in enumerate(prompts):
            engine.add_request(str(i), prompt=prompt, params=params)
        first: dict[str, float] = {}
        rows = []
        while engine.has_unfinished_requests():
            graphs = runner.graphs
            replays = graphs.num_replays if graphs else 0
            seen.clear()
            started = time.perf_counter()
            outputs = engine.step()
            synchronize()
            ended = time.perf_counter()
            for output in outputs:
                if output.new_token_ids and output.request_id not in first:
                    first[output.request_id] = (ended - t0) * 1e3
            num_seqs, num_tokens, num_prefill = seen.get("batch", (0, 0, 0))
            plan = seen.get("plan")
            rows.append(
                StepRow(
                    start_ms=(started - t0) * 1e3,
                    wall_ms=(ended - started) * 1e3,
                    launch_ms=seen.get("launch_ms", 0.0),
                    num_seqs=num_seqs,
                    num_tokens=num_tokens,
                    num_prefill=num_prefill,
                    chain=plan.num_steps if plan else 0,
                    drafts_wanted=sum(plan.num_wanted) if plan else 0,
                    replayed=bool(graphs and graphs.num_replays > replays),
                    num_first_tokens=len(first),
                )
            )
        return rows, sorted(first.values())
    finally:
        scheduler.schedule, runner.launch = schedule, launch  # type: ignore[method-assign]


def add_burst_arguments(parser: argparse.ArgumentParser, concurrency: int, methods: list[str]) -> None:
    """The flags of a burst benchmark: the model, the burst and the methods."""
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--workload", default="code_editing")
    parser.add_argument("--concurrency", type=int, default=concurrency, help="requests in the burst")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--methods", nargs="+", default=methods, help="as benchmarks.offline")


def burst_prompts(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(prompt, sampling params) of every request of the burst `args` describe."""
    requests = requests_for_cell(args.workload, args.concurrency, args.max_tokens, args.concurrency, 1)
    return [(r.prompt, sampling_params(r, Sampling())) for r in requests]


def method_engines(args: argparse.Namespace) -> Iterator[tuple[str, LLMEngine]]:
    """(label, engine) per method of `args`, one engine at a time, built as `benchmarks.offline`
    builds them; each is closed and its memory freed once the caller moves on."""
    for label, spec in resolve_methods(args.methods, args.model).items():
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            max_num_seqs=args.concurrency,
            speculative_config=SpeculativeConfig.model_validate(spec),
        )
        engines = [build_engine(config)]
        try:
            yield label, engines[0]
        finally:
            engines.pop().close()
            free_memory()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_burst_arguments(parser, concurrency=64, methods=["naive", "ngram"])
    parser.add_argument("--steps", type=int, default=8, help="steps of each burst to print")
    args = parser.parse_args(argv)
    prompts = burst_prompts(args)
    for label, engine in method_engines(args):
        rows, firsts = trace(engine, prompts)
        print(
            f"== {label}, {len(prompts)} requests: every first token after {firsts[-1]:.1f} ms "
            f"(p50 {firsts[len(firsts) // 2]:.1f} ms), {len(rows)} steps, {rows[-1].start_ms:.0f} ms in all"
        )
        print("start_ms wall_ms launch_ms seqs tokens prefill chain drafts replayed firsts")
        for r in rows[: args.steps]:
            print(
                f"{r.start_ms:.1f} {r.wall_ms:.2f} {r.launch_ms:.2f} {r.num_seqs} {r.num_tokens} "
                f"{r.num_prefill} {r.chain} {r.drafts_wanted} {int(r.replayed)} {r.num_first_tokens}"
            )


if __name__ == "__main__":
    main()
