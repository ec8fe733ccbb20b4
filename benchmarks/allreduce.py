"""All-reduce time against its bytes over N ranks of one host, and what a decode step of a model
shape sends through its collectives under tensor parallelism.

    python -m benchmarks.allreduce --ranks 2 --shape qwen2.5-7b --dtype bfloat16 --out ar.json  # GPUs: NCCL
    python -m benchmarks.allreduce --ranks 2 --device cpu                                      # gloo

Each size is all-reduced `--iters` times after a warm-up (timed by the slowest rank). *Bus
bandwidth* is NCCL's figure of merit for a ring all-reduce: bytes * 2 (N - 1) / N / time. A decode
step of `batch` tokens runs 2 all-reduces per layer (attention, MLP) of [batch, hidden_size] plus one
for the vocab-parallel embedding, and one all-gather of the float32 logits; the step's collective
time is estimated from the measured curve.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.random_model import SHAPES

DEFAULT_SIZES = [2**k for k in range(10, 28, 2)]  # 1 KiB .. 64 MiB


def step_collectives(shape: dict[str, Any], batch: int, element_size: int) -> dict[str, int]:
    """Bytes per rank of one decode step's collectives at `batch` tokens: the all-reduces, and the
    logits all-gather (each rank's share of the float32 vocabulary)."""
    hidden_bytes = batch * shape["hidden_size"] * element_size
    return {
        "num_all_reduces": 2 * shape["num_hidden_layers"] + 1,
        "all_reduce_bytes": hidden_bytes,
        "all_gather_bytes": batch * shape["vocab_size"] * 4,
    }


def _time_all_reduce(x: torch.Tensor, iters: int) -> float:
    """Seconds per all-reduce of `x`, by the slowest rank."""
    for _ in range(3):
        dist.all_reduce(x)
    if x.is_cuda:
        torch.cuda.synchronize()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    if x.is_cuda:
        torch.cuda.synchronize()
    seconds = torch.tensor([(time.perf_counter() - started) / iters], dtype=torch.float64, device=x.device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.item())


def _rank(rank: int, args: argparse.Namespace, port: int, curve_path: Path) -> None:
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    try:
        dtype = getattr(torch, args.dtype)
        rows = []
        for size in args.sizes:
            x = torch.ones(max(1, size // dtype.itemsize), dtype=dtype, device=device)
            seconds = _time_all_reduce(x, args.iters)
            nbytes = x.numel() * x.element_size()
            bus = nbytes * 2 * (args.ranks - 1) / args.ranks / seconds / 1e9
            rows.append({"bytes": nbytes, "us": seconds * 1e6, "bus_gbs": bus})
        if rank == 0:
            curve_path.write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="bytes per all-reduce")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="also estimate this shape's per-step time")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/allreduce.json"))
    args = parser.parse_args()
    if args.ranks < 2:
        parser.error("--ranks must be at least 2")
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        parser.error(f"--ranks {args.ranks} needs as many CUDA devices; {torch.cuda.device_count()} visible")

    from services.serve import free_port

    args.out.parent.mkdir(parents=True, exist_ok=True)
    curve_path = args.out.with_suffix(".curve.json")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(args, free_port(), curve_path), nprocs=args.ranks, join=True)
    curve = json.loads(curve_path.read_text())
    curve_path.unlink()
    result: dict[str, Any] = {
        "ranks": args.ranks,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (gloo)",
        "dtype": args.dtype,
        "curve": curve,
    }
    print(f"all-reduce over {args.ranks} ranks on {result['device']} ({args.dtype})")
    print("| bytes | us | bus GB/s |\n|---:|---:|---:|")
    for row in curve:
        print(f"| {row['bytes']} | {row['us']:.1f} | {row['bus_gbs']:.2f} |")
    if args.shape:
        element_size = getattr(torch, args.dtype).itemsize
        result["shape"] = args.shape
        result["steps"] = []
        print(f"\n{args.shape}: one decode step's all-reduces (estimated from the curve)")
        print("| batch | all-reduces | bytes each | est. ms per step |\n|---:|---:|---:|---:|")
        for batch in args.batch_sizes:
            step = step_collectives(SHAPES[args.shape], batch, element_size)
            each_us = _interpolate(curve, step["all_reduce_bytes"])
            step["est_all_reduce_ms"] = step["num_all_reduces"] * each_us / 1e3
            result["steps"].append({"batch": batch, **step})
            print(
                f"| {batch} | {step['num_all_reduces']} | {step['all_reduce_bytes']} | {step['est_all_reduce_ms']:.3f} |"
            )
    args.out.write_text(json.dumps(result, indent=2))


def _interpolate(curve: list[dict[str, float]], nbytes: int) -> float:
    """Microseconds for `nbytes` from the measured curve (linear between its points; the ends held)."""
    points = sorted((row["bytes"], row["us"]) for row in curve)
    if nbytes <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    return points[-1][1] * nbytes / points[-1][0]


if __name__ == "__main__":
    main()
