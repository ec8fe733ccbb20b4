"""How many kernels a drafting model's chain launches, counted on CPU.

    python -m benchmarks.chain_launches --ks 1 2 3

A GPU step's tail runs the drafting model's catch-up and then a chain of drafts, each a kernel
launch or twenty (services/engine/spec_decode/). This counts them on CPU without a GPU: an engine
over a small random bfloat16 target (and a random MTP head; the target itself as draft model)
decodes one request with k drafts a step, and each `propose` call's ops are counted (the torch
profiler records them): each outermost aten op that runs a kernel counts once (views, allocations
and wrappers such as `to` run none themselves: what they call is counted); a fused kernel of
`kernels` counts once (its torch twin's ops are not counted), the attention kernel once, a matrix
product once as a GEMM plus once as a cast where it casts its output. What a GPU adds by shape
(cuBLAS's split-K reductions, the attention's split merge) is not counted. A chain of n drafts
costs count(n); one chained draft costs count(n) - count(n - 1), n >= 2.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import kernels
from benchmarks.random_model import write_random_checkpoint
from services.engine.llm import LLM
from services.engine.spec_decode.proposer import DraftBatch, Drafts
from shared.model import load_model
from shared.model.mtp import MTPHead, save_mtp_head
from shared.sampling_params import SamplingParams

FUSED = (
    "embed_norm_concat",
    "fused_add_rms_norm",
    "silu_and_mul",
    "rotary_embedding",
    "rotary_write_kv",
    "write_kv",
    "verify_sample",
    "ngram_match",
    "post_step_update",
    "post_step_update_slots",
)
"""Entry points of `kernels` that are one CUDA kernel each."""
ATTENTION, GEMM, CAST = "attention", "gemm", "cast of a GEMM's output"
GEMMS = {"linear", "matmul", "mm", "addmm", "bmm"}
WRAPPERS = {"to", "contiguous", "reshape", "flatten", "type_as", "chunk", "split", "unbind"}
"""Ops that launch nothing themselves: what they call is counted instead (`to` copies through
`_to_copy` when it must)."""
NO_LAUNCH = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach"}
LAUNCH_PREFIX = "launch::"


class LaunchCounter:
    """Counts, per name, the kernels the ops run inside it would launch on a GPU (the torch
    profiler records the ops; each outermost op that launches counts once)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        with fused_kernels_recorded(), profile(activities=[ProfilerActivity.CPU]) as prof:
            yield
        for event in prof.events():
            if event.cpu_parent is None:
                self._count(event)

    def _count(self, event: Any) -> None:
        name = event.name
        if name.startswith(LAUNCH_PREFIX):
            self.counts[name.removeprefix(LAUNCH_PREFIX)] += 1
            return
        op = name.removeprefix("aten::")
        if name.startswith("aten::") and launches(op):
            self.counts[GEMM if op in GEMMS else op] += 1
            return
        for child in event.cpu_children:
            self._count(child)


@functools.cache
def launches(op: str) -> bool:
    """Whether aten op `op` runs a kernel itself (not a view, an allocation or a wrapper)."""
    if op in WRAPPERS or op in NO_LAUNCH:
        return False
    packet = getattr(torch.ops.aten, op, None)
    if packet is None:
        return True
    return not any(getattr(packet, overload).is_view for overload in packet.overloads())


@contextlib.contextmanager
def fused_kernels_recorded() -> Iterator[None]:
    """Patches the `kernels` entry points so each call is recorded as the one launch it is on a
    GPU (what its torch twin runs inside is not counted)."""
    originals = {name: getattr(kernels, name) for name in (*FUSED, "append_attention", "linear")}

    def once(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with record_function(LAUNCH_PREFIX + name):
                return function(*args, **kwargs)

        return wrapper

    def linear(x: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        with record_function(LAUNCH_PREFIX + GEMM):
            out = originals["linear"](x, weight, *args, **kwargs)
        if out.dtype != x.dtype:
            with record_function(LAUNCH_PREFIX + CAST):
                pass
        return out

    for name in FUSED:
        setattr(kernels, name, once(name, originals[name]))
    kernels.append_attention = once(ATTENTION, originals["append_attention"])
    kernels.linear = linear
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(kernels, name, function)


def chain_launches(target: Path, spec: dict[str, Any], k: int) -> collections.Counter[str]:
    """The launches of one `propose` call (catch-up and a chain of k drafts) of the device proposer
    `spec` asks for, in an engine over `target` decoding one request with k drafts a step."""
    config = {**spec, "num_speculative_tokens": k, "adaptive": False}
    if spec["method"] == "mtp":
        config["num_model_steps"] = k
    llm = LLM(str(target), device="cpu", dtype="bfloat16", max_model_len=128, speculative_config=config)
    proposer = llm.engine.drafter.proposers[spec["method"]]
    original = proposer.propose
    counts: collections.Counter[str] | None = None

    def propose(batch: DraftBatch) -> Drafts:
        nonlocal counts
        if batch.num_steps != k:
            return original(batch)
        counter = LaunchCounter()
        with counter.counting():
            drafts = original(batch)
        counts = counter.counts
        return drafts

    proposer.propose = propose  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    llm.generate(prompt_token_ids=[list(range(3, 40))], sampling_params=params)
    assert counts is not None, f"{spec['method']}: no step ran a chain of {k} drafts"
    return counts


def per_chained_draft(longer: collections.Counter[str], shorter: collections.Counter[str]) -> dict[str, int]:
    """What one more chained draft launches: a chain of n + 1 drafts' counts less a chain of n's
    (n >= 2, so that both compute the chain's inputs)."""
    extra = longer.copy()
    extra.subtract(shorter)
    return {name: count for name, count in extra.items() if count}


def others(launches: dict[str, int]) -> int:
    """Launches other than GEMMs and attention."""
    return sum(count for name, count in launches.items() if name not in (GEMM, ATTENTION))


def write_models(workdir: Path) -> tuple[Path, dict[str, dict[str, Any]]]:
    """A small random bfloat16 target and the drafting methods over it: a random MTP head, the
    target as its own draft model."""
    target = write_random_checkpoint("llama-tiny", workdir / "target", overrides={"num_hidden_layers": 2})
    model = load_model(target, torch.bfloat16, torch.device("cpu"), 64)
    torch.manual_seed(0)
    head = MTPHead(model).to(torch.bfloat16)
    for param in head.parameters():
        torch.nn.init.normal_(param, std=0.05)
    save_mtp_head(head, workdir / "mtp")
    return target, {
        "mtp": {"method": "mtp", "model": str(workdir / "mtp")},
        "draft_model": {"method": "draft_model", "model": str(target)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chain_launches", description=__doc__)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3], help="chain lengths (>= 1)")
    args = parser.parse_args()
    if min(args.ks) < 1:
        parser.error("--ks: chain lengths are at least 1")
    ks = sorted(set(args.ks))
    print(f"{'method':>11} {'chain':>5} {'launches':>8} {'gemm':>5} {'attn':>5} {'other':>5}")
    with tempfile.TemporaryDirectory() as workdir:
        target, methods = write_models(Path(workdir))
        for method, spec in methods.items():
            by_length = {k: chain_launches(target, spec, k) for k in ks}
            for k, counts in by_length.items():
                row = (
                    f"{method:>11} {k:>5} {sum(counts.values()):>8} {counts[GEMM]:>5} {counts[ATTENTION]:>5}"
                )
                print(f"{row} {others(counts):>5}")
            if len(ks) >= 2 and ks[-2] >= 2 and ks[-1] == ks[-2] + 1:
                extra = per_chained_draft(by_length[ks[-1]], by_length[ks[-2]])
                listed = ", ".join(f"{name} {count}" for name, count in sorted(extra.items()))
                print(
                    f"  one chained draft: {sum(extra.values())} launches, {others(extra)} beyond GEMMs and attention ({listed})"
                )


if __name__ == "__main__":
    main()
