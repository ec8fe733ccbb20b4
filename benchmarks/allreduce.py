"""All-reduce time against its bytes over N ranks of one host, and what a decode step of a model
shape sends through its collectives under tensor parallelism.

    python -m benchmarks.allreduce --ranks 2 --shape qwen2.5-7b --dtype bfloat16 --out ar.json  # GPUs
    python -m benchmarks.allreduce --ranks 2 --device cpu                                      # gloo

Each size is all-reduced `--iters` times after a warm-up (timed by the slowest rank), by NCCL and,
on GPUs that reach each other's memory, by the one-shot peer all-reduce (kernels/all_reduce.py)
where it takes the size: back-to-back eager calls, and replays of a CUDA graph of GRAPH_CALLS calls
(how the engine's decode steps run them). *Bus bandwidth* is NCCL's figure of merit for a ring
all-reduce: bytes * 2 (N - 1) / N / time. A decode step of `batch` tokens runs 2 all-reduces per
layer (attention, MLP) of [batch, hidden_size] plus one for the vocab-parallel embedding, and one
all-gather of the float32 logits; the step's all-reduce time is estimated from the measured curves.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.random_model import SHAPES
from kernels.all_reduce import DEFAULT_BLOCKS, VECTOR_BYTES, PeerAllReduce, open_peer_all_reduce

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


STEP_ESTIMATES = {
    "est_all_reduce_ms": "us",
    "est_graph_all_reduce_ms": "graph_us",
    "est_peer_graph_all_reduce_ms": "peer_graph_us",
}
"""A decode step's all-reduce time, estimated from each curve."""
GRAPH_CALLS = 16
"""All-reduces captured in the timed CUDA graph."""


def _time_all_reduce(reduce: Callable[[], object], iters: int, cuda: bool) -> float:
    """Seconds per back-to-back `reduce()`, by the slowest rank."""
    for _ in range(3):
        reduce()
    return _slowest(lambda: [reduce() for _ in range(iters)], iters, cuda)


def _time_in_graph(reduce: Callable[[], object], iters: int) -> float:
    """Seconds per `reduce()` replayed from a CUDA graph of GRAPH_CALLS of them, by the slowest rank."""
    reduce()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            reduce()
    graph.replay()
    replays = max(1, iters // GRAPH_CALLS)
    return _slowest(lambda: [graph.replay() for _ in range(replays)], replays * GRAPH_CALLS, True)


def _slowest(run: Callable[[], object], calls: int, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    started = time.perf_counter()
    run()
    if cuda:
        torch.cuda.synchronize()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    seconds = torch.tensor([(time.perf_counter() - started) / calls], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.item())


def _measure(x: torch.Tensor, peers: list[PeerAllReduce], iters: int, num_ranks: int) -> dict[str, Any]:
    """One size's row: NCCL (or gloo) eager and in a graph; where the peer all-reduce takes `x`,
    its own choice of kernel eager and in a graph on the first grid of `peers` (the default), each
    kernel forced (where it can run) in a graph, and its own choice in a graph on every grid."""
    cuda = x.is_cuda
    seconds = _time_all_reduce(lambda: dist.all_reduce(x), iters, cuda)
    num_bytes = x.numel() * x.element_size()
    row: dict[str, Any] = {
        "bytes": num_bytes,
        "us": seconds * 1e6,
        "bus_gbs": num_bytes * 2 * (num_ranks - 1) / num_ranks / seconds / 1e9,
        "graph_us": _time_in_graph(lambda: dist.all_reduce(x), iters) * 1e6 if cuda else None,
        "peer_us": None,
        "peer_graph_us": None,
        "one_shot_graph_us": None,
        "two_shot_graph_us": None,
        "peer_graph_us_by_blocks": {},
    }
    if not peers or not peers[0].fits(x):
        return row
    out = torch.empty_like(x)

    def in_graph(peer: PeerAllReduce, shots: int | None = None) -> float:
        return _time_in_graph(lambda: peer.all_reduce(x, out=out, shots=shots), iters) * 1e6

    row["peer_us"] = _time_all_reduce(lambda: peers[0].all_reduce(x, out=out), iters, True) * 1e6
    row["peer_graph_us"] = in_graph(peers[0])
    row["one_shot_graph_us"] = in_graph(peers[0], shots=1)
    if (num_bytes // VECTOR_BYTES) % num_ranks == 0:
        row["two_shot_graph_us"] = in_graph(peers[0], shots=2)
    row["peer_graph_us_by_blocks"] = {peer.num_blocks: in_graph(peer) for peer in peers}
    return row


def _rank(rank: int, args: argparse.Namespace, port: int, curve_path: Path) -> None:
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    peers = [open_peer_all_reduce(dist.group.WORLD, device, blocks) for blocks in args.peer_blocks]
    opened = [peer for peer in peers if peer is not None]
    try:
        dtype = getattr(torch, args.dtype)
        rows = []
        for size in args.sizes:
            x = torch.ones(max(1, size // dtype.itemsize), dtype=dtype, device=device)
            rows.append(_measure(x, opened, args.iters, args.ranks))
        if rank == 0:
            curve_path.write_text(json.dumps(rows))
    finally:
        for peer in opened:
            peer.close()
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
    parser.add_argument("--iters", type=int, default=64)
    parser.add_argument(
        "--peer-blocks",
        type=int,
        nargs="*",
        default=[DEFAULT_BLOCKS],
        help="grids of the peer all-reduce to time, the first for the step estimate (none: NCCL only)",
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), help="also estimate this shape's per-step time")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/allreduce.json"))
    args = parser.parse_args()
    if args.ranks < 2:
        parser.error("--ranks must be at least 2")
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        parser.error(f"--ranks {args.ranks} needs as many CUDA devices; {torch.cuda.device_count()} visible")

    from services.serve import free_port

    if args.shape:  # measure the decode step's own message sizes too
        element_size = getattr(torch, args.dtype).itemsize
        steps = [step_collectives(SHAPES[args.shape], b, element_size) for b in args.batch_sizes]
        args.sizes = sorted({*args.sizes, *(step["all_reduce_bytes"] for step in steps)})

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
    group = "NCCL" if args.device == "cuda" else "gloo"
    print(f"all-reduce over {args.ranks} ranks on {result['device']} ({args.dtype}), us per call")
    grids = "".join(f" peer graph {n} |" for n in args.peer_blocks[1:])
    print(
        f"(peer: the peer all-reduce's own choice of kernel over {args.peer_blocks[0] if args.peer_blocks else '-'} "
        "blocks; 1-shot / 2-shot: each kernel forced; peer graph N: over N blocks)"
    )
    print(
        f"| bytes | {group} | {group} graph | peer | peer graph | 1-shot graph | 2-shot graph |{grids} {group} bus GB/s |"
    )
    print("|" + "---:|" * (8 + len(args.peer_blocks[1:])))
    for row in curve:
        keys = ("us", "graph_us", "peer_us", "peer_graph_us", "one_shot_graph_us", "two_shot_graph_us")
        times = [_us(row[key]) for key in keys]
        times += [_us(row["peer_graph_us_by_blocks"].get(str(n))) for n in args.peer_blocks[1:]]
        print(f"| {row['bytes']} | {' | '.join(times)} | {row['bus_gbs']:.2f} |")
    if args.shape:
        element_size = getattr(torch, args.dtype).itemsize
        result["shape"] = args.shape
        result["steps"] = []
        print(
            f"\n{args.shape}: one decode step's all-reduces, ms (estimated from the curves; peer: NCCL past its limit)"
        )
        print(
            "| batch | all-reduces | bytes each | NCCL | NCCL graph | peer graph |\n|---:|---:|---:|---:|---:|---:|"
        )
        for batch in args.batch_sizes:
            step = step_collectives(SHAPES[args.shape], batch, element_size)
            for name, key in STEP_ESTIMATES.items():
                each_us = _estimate_us(curve, step["all_reduce_bytes"], key)
                step[name] = None if each_us is None else step["num_all_reduces"] * each_us / 1e3
            result["steps"].append({"batch": batch, **step})
            estimates = " | ".join(_ms(step[name]) for name in STEP_ESTIMATES)
            print(f"| {batch} | {step['num_all_reduces']} | {step['all_reduce_bytes']} | {estimates} |")
    args.out.write_text(json.dumps(result, indent=2))


def _estimate_us(curve: list[dict[str, Any]], nbytes: int, key: str) -> float | None:
    """Microseconds of one all-reduce of `nbytes` on the curve's `key`: the peer all-reduce's
    (`peer_graph_us`) where it takes the size, NCCL's graph replay past its limit."""
    if key == "peer_graph_us":
        fits = any(row["bytes"] >= nbytes and row[key] is not None for row in curve)
        key = key if fits else "graph_us"
    return _interpolate([row for row in curve if row[key] is not None], nbytes, key)


def _interpolate(curve: list[dict[str, Any]], nbytes: int, key: str) -> float | None:
    """Microseconds for `nbytes` from the curve's `key` (linear between its points; the ends held)."""
    points = sorted((row["bytes"], row[key]) for row in curve)
    if not points:
        return None
    if nbytes <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    return points[-1][1] * nbytes / points[-1][0]


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
