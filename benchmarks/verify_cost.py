"""What verifying k drafts costs: a decode step over 1 + k tokens per request against a plain step.

    python -m benchmarks.verify_cost --model DIR --ks 1 3 5 --batch-sizes 1 16 64 --context 1024

For each k an engine is built (n-gram drafting, so its CUDA graphs cover queries of 1 and 1 + k
tokens), and a synthetic decode step — every request at `context` tokens, bringing 1 + k tokens —
is replayed from its graphs (forward, then the tail: verify, post-step update, n-gram drafting) and
timed with CUDA events against the same step with k = 0. The ratio is what speculation's ideal
speedup divides by: ideal = mean accepted length / (verify step / plain step).
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
from services.engine.verify_update import StepPlan
from shared.config import EngineConfig


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
        cu_num_rows=np.arange(0, num_tokens + 1, query_len, dtype=np.int32),
        seq_slots=np.full(batch, scratch, dtype=np.int64),
        seq_rows=np.arange(batch, dtype=np.int64),
        seq_methods=np.full(batch, -1, dtype=np.int32),
        num_wanted=np.zeros(batch, dtype=np.int32),
        max_seq_len=seq_len,
    )


def step_ms(graphs: DecodeGraphs, step: HostStep, reps: int = 50) -> float:
    """Median device time of the step's forward and tail replays."""
    key = graphs.lookup(step.num_tokens, int(step.query_lens.max()))
    assert key is not None, f"no graph for {step.num_tokens} tokens"
    plan = StepPlan([], [], 0)
    for _ in range(3):
        graphs.replay(step, key, plan)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.replay_forward(step, key)
        graphs.tails[(*key, 0)][0].replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for k in args.ks:
        spec = {"method": "ngram", "num_speculative_tokens": k, "adaptive": False}
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            max_num_seqs=max(args.batch_sizes),
            max_model_len=args.context + 2 * k + 16,
            cuda_graph_max_tokens=max(args.batch_sizes) * (1 + k),
            speculative_config=spec,
        )
        engine = LLMEngine(config)
        graphs = engine.runner.graphs
        assert graphs is not None, "CUDA graphs are needed (a GPU, no --enforce-eager)"
        for batch in args.batch_sizes:
            plain = step_ms(graphs, synthetic_step(graphs, batch, 1, args.context, config.block_size))
            verify = step_ms(graphs, synthetic_step(graphs, batch, 1 + k, args.context, config.block_size))
            row = dict(
                k=k, batch=batch, context=args.context, plain_ms=plain, verify_ms=verify, ratio=verify / plain
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
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
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = measure(args)
    if args.out:
        args.out.write_text(json.dumps({"card": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    print(f"{'k':>3} {'batch':>5} {'plain ms':>9} {'verify ms':>10} {'ratio':>6}")
    for row in rows:
        print(
            f"{row['k']:>3} {row['batch']:>5} {row['plain_ms']:>9.3f} {row['verify_ms']:>10.3f} {row['ratio']:>6.2f}"
        )


if __name__ == "__main__":
    main()
