"""What verifying k drafts costs: a decode step over 1 + k tokens per request against a plain step,
and what a drafting model's work in the step's tail costs.

    python -m benchmarks.verify_cost --model DIR --ks 1 3 5 --batch-sizes 1 16 64 --context 1024
    python -m benchmarks.verify_cost --model DIR --ks 3 --method '{"method": "mtp", "model": "HEAD"}'

For each k an engine is built (by default n-gram drafting, so its CUDA graphs cover queries of 1
and 1 + k tokens), and a synthetic decode step — every request at `context` tokens, bringing 1 + k
tokens — is replayed from its graphs and timed with CUDA events: the forward alone, and the tail
(verify, post-step update, drafting) for each chain length a drafting model may run. `ratio` is
the whole step over 1 + k tokens against the plain step (k = 0, no chain): what speculation's ideal
speedup divides by, ideal = mean accepted length / ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.engine.cuda_graph import DecodeGraphs, HostStep
from services.engine.engine import LLMEngine
from shared.config import EngineConfig
from shared.speculative_config import SpeculativeConfig


def synthetic_step(
    graphs: DecodeGraphs, batch: int, query_len: int, context: int, block_size: int
) -> HostStep:
    """`batch` requests at `context` tokens, each bringing `query_len` tokens, in blocks of their own
    (the KV they read is whatever the cache holds: timing only), every request on the scratch slot."""
    seq_len = context + query_len
    blocks = -(-seq_len // block_size)
    tables = np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks) + 1
    positions = np.tile(np.arange(context, seq_len, dtype=np.int64), batch)
    seq_of_token = np.repeat(np.arange(batch), query_len)
    slots = (
        tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    )
    num_tokens = batch * query_len
    scratch = graphs.inputs.scratch_slot
    rng = np.random.default_rng(0)
    return HostStep(
        input_ids=rng.integers(0, graphs.logits.shape[1], num_tokens),
        positions=positions,
        slot_mapping=slots,
        token_slots=np.full(num_tokens, scratch, dtype=np.int64),
        query_lens=np.full(batch, query_len, dtype=np.int32),
        seq_lens=np.full(batch, seq_len, dtype=np.int32),
        block_tables=tables,
        logits_indices=np.arange(num_tokens, dtype=np.int64),
        row_slots=np.full(num_tokens, scratch, dtype=np.int64),
        row_positions=np.zeros(num_tokens, dtype=np.int64),
        draft_ids=rng.integers(0, graphs.logits.shape[1], num_tokens).astype(np.int32),
        request_of_row=seq_of_token.astype(np.int32),
        masked_rows=np.zeros(num_tokens, dtype=np.int32),
        cu_num_rows=np.arange(0, num_tokens + 1, query_len, dtype=np.int32),
        seq_slots=np.full(batch, scratch, dtype=np.int64),
        seq_rows=np.arange(batch, dtype=np.int64),
        num_output=np.zeros(batch, dtype=np.int64),
        seq_methods=np.full(batch, -1, dtype=np.int32),
        num_wanted=np.zeros(batch, dtype=np.int32),
        max_seq_len=seq_len,
    )


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 50) -> float:
    """Median device time of one graph's replays."""
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def own_tail(graphs: DecodeGraphs) -> int | None:
    """The tails a step of the server's own method replays: its proposer alone where it has them."""
    return graphs.onlys[-1]


def step_times(graphs: DecodeGraphs, step: HostStep) -> dict[str, float]:
    """The forward's and each tail's device time for `step` (its inputs copied in once)."""
    key = graphs.lookup(step.num_tokens, int(step.query_lens.max()))
    assert key is not None, f"no graph for {step.num_tokens} tokens"
    graphs.replay_forward(step, key)
    times = {"forward_ms": replay_ms(graphs.graphs[key])}
    for chain in graphs.chain_lengths:
        times[f"tail_L{chain}_ms"] = replay_ms(graphs.tails[(*key, chain, own_tail(graphs))][0])
    return times


def kernel_table(graph: torch.cuda.CUDAGraph, reps: int = 10) -> list[dict[str, Any]]:
    """The kernels one replay of `graph` runs: per kernel name, launches and device microseconds
    per replay, most expensive first (torch.profiler over `reps` replays)."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    table = [
        {"kernel": row.key[:90], "launches": row.count / reps, "us": row.device_time_total / reps}
        for row in prof.key_averages()
        if row.device_time_total > 0
    ]
    return sorted(table, key=lambda row: -row["us"])


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    method = json.loads(args.method)
    for k in args.ks:
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            max_num_seqs=max(args.batch_sizes),
            max_model_len=args.context + 2 * k + 16,
            cuda_graph_max_tokens=max(args.batch_sizes) * (1 + k),
            speculative_config=SpeculativeConfig.model_validate(
                {**method, "num_speculative_tokens": k, "adaptive": False}
            ),
        )
        engine = LLMEngine(config)
        graphs = engine.runner.graphs
        assert graphs is not None, "CUDA graphs are needed (a GPU, no --enforce-eager)"
        for batch in args.batch_sizes:
            plain = step_times(graphs, synthetic_step(graphs, batch, 1, args.context, config.block_size))
            verify = step_times(graphs, synthetic_step(graphs, batch, 1 + k, args.context, config.block_size))
            plain_ms = plain["forward_ms"] + plain["tail_L0_ms"]
            verify_ms = verify["forward_ms"] + verify[f"tail_L{max(graphs.chain_lengths)}_ms"]
            row = dict(
                method=method["method"],
                k=k,
                batch=batch,
                context=args.context,
                plain=plain,
                verify=verify,
                plain_ms=plain_ms,
                verify_ms=verify_ms,
                ratio=verify_ms / plain_ms,
            )
            if args.kernels:
                key = graphs.lookup(batch * (1 + k), 1 + k)
                assert key is not None
                graphs.replay_forward(
                    synthetic_step(graphs, batch, 1 + k, args.context, config.block_size), key
                )
                row["kernels"] = {
                    "forward": kernel_table(graphs.graphs[key]),
                    "tail": kernel_table(
                        graphs.tails[(*key, max(graphs.chain_lengths), own_tail(graphs))][0]
                    ),
                }
            rows.append(row)
            print(json.dumps({name: value for name, value in row.items() if name != "kernels"}), flush=True)
            for part, table in row.get("kernels", {}).items():
                launches = sum(r["launches"] for r in table)
                print(f"  {part}: {launches:.0f} launches, {sum(r['us'] for r in table):.0f} us")
                for r in table[:25]:
                    print(f"    {r['us']:8.1f} us {r['launches']:5.1f}x  {r['kernel']}")
        del engine, graphs
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.verify_cost", description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--method", default='{"method": "ngram"}', help="speculative config JSON (k aside)")
    parser.add_argument(
        "--kernels", action="store_true", help="list the verify step's kernels (torch.profiler)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = measure(args)
    if args.out:
        args.out.write_text(json.dumps({"card": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    print(f"{'method':>11} {'k':>3} {'batch':>5} {'plain ms':>9} {'verify ms':>10} {'ratio':>6}")
    for row in rows:
        print(
            f"{row['method']:>11} {row['k']:>3} {row['batch']:>5} {row['plain_ms']:>9.3f} {row['verify_ms']:>10.3f} {row['ratio']:>6.2f}"
        )


if __name__ == "__main__":
    main()
