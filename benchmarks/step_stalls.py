"""The slow steps of a burst and what happened in them: kernels compiled, garbage collections.

    python -m benchmarks.step_stalls --model DIR --concurrency 256 --methods naive \\
        'mtp1={"method":"mtp","model":"HEAD","num_speculative_tokens":1}'

For each method (one engine each, built and warmed up as `benchmarks.offline` builds them) the same
burst runs `--runs` times: its wall time, steps and output tokens per second, then every step slower
than `--threshold-ms` with the CUDA kernel variants compiled during it and the garbage collections
that ran in it (generation, ms). A step that pauses every request shows up here, where a table of
percentiles only shows a long tail.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import kernels
from benchmarks.burst_trace import add_burst_arguments, burst_prompts, method_engines
from services.engine.engine import LLMEngine


@dataclass
class SlowStep:
    index: int
    wall_ms: float
    kernels_compiled: int
    collections: list[tuple[int, float]]
    """(generation, ms) of each garbage collection during the step."""


@dataclass
class Collections:
    """Every garbage collection while installed: (generation, ms)."""

    done: list[tuple[int, float]] = field(default_factory=list)
    _started: float = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.done.append((info["generation"], (time.perf_counter() - self._started) * 1e3))


def run_burst(
    engine: LLMEngine, prompts: list[tuple[str, Any]], tag: str, threshold_ms: float, collections: Collections
) -> tuple[float, int, int, list[SlowStep]]:
    """(wall ms, steps, output tokens, the slow steps) of one burst run to its end."""
    for i, (prompt, params) in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt=prompt, params=params)
    slow, steps, tokens = [], 0, 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        compiled, collected, t = kernels.compiled_variants(), len(collections.done), time.perf_counter()
        tokens += sum(len(output.new_token_ids) for output in engine.step())
        wall_ms = (time.perf_counter() - t) * 1e3
        if wall_ms > threshold_ms:
            new = kernels.compiled_variants() - compiled
            slow.append(SlowStep(steps, wall_ms, new, collections.done[collected:]))
        steps += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3, steps, tokens, slow


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_burst_arguments(parser, concurrency=256, methods=["naive"])
    parser.add_argument("--runs", type=int, default=2, help="bursts per method, on the same engine")
    parser.add_argument("--threshold-ms", type=float, default=15.0, help="steps slower than this are listed")
    args = parser.parse_args(argv)
    prompts = burst_prompts(args)
    collections = Collections()
    gc.callbacks.append(collections)
    try:
        for label, engine in method_engines(args):
            for run in range(args.runs):
                wall, steps, tokens, slow = run_burst(
                    engine, prompts, f"{label}-{run}", args.threshold_ms, collections
                )
                print(
                    f"== {label} run {run + 1}: {wall:.0f} ms, {steps} steps, {tokens / wall * 1e3:.0f} "
                    f"output tok/s, {len(slow)} steps over {args.threshold_ms:g} ms"
                )
                for s in slow:
                    gcs = " ".join(f"gen{g}:{ms:.1f}ms" for g, ms in s.collections if ms >= 1.0)
                    print(f"step {s.index}: {s.wall_ms:.1f} ms, kernels compiled {s.kernels_compiled} {gcs}")
    finally:
        gc.callbacks.remove(collections)


if __name__ == "__main__":
    main()
