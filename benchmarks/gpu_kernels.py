"""GPU timings of the fused kernels and the decode step (one device visit; see scripts/gpu_check.sh).

    python -m benchmarks.gpu_kernels --out results.json

Measures, on the card it runs on (named in the output):
- device copy bandwidth (bytes read + written), the ceiling the memory-bound numbers are compared with;
- paged append-attention achieved bandwidth on long contexts (KV bytes read / kernel time);
- the n-gram kernel at batch 256 with 8k-token histories; the fused verify + sample kernel;
- the skinny decode matrix kernel against cuBLAS (`F.linear`) on every weight matrix of Llama-3.2-1B
  and Qwen2.5-7B at 1..16 rows (achieved weight-read bandwidth; weights cycled past the L2 cache);
- the quantized products (`kernels.quant_linear`: fp8 / int8 / int4 weights) on the same matrices
  at 1-256 rows (`--quant-rows`), time over the stored bytes' copy time (the floor) and over cuBLAS
  on the bf16 weights; int8 / int4 as the engine dispatches them (tile layout loaded; the kernel
  named), and on the same line each int kernel alone: quant_tiled (a split product both ways of
  adding its K splits), quant_mma, quant_gemv up to 16 rows / dequantize + cuBLAS past them; then the
  dispatch thresholds (`quant_thresholds`) and where the dispatched kernel was not the fastest;
  `--only quant_tiled_shapes`: quant_tiled per candidate block shape;
- the fused per-layer kernels (residual add + RMSNorm, SiLU-and-mul, rotary on fused-QKV views) at
  Llama-3.2-1B / Qwen2.5-7B widths, against the plain torch ops they replace, both graph-replayed;
- the target step (forward + LM head rows + verify/sample) of random-weight Llama-3.2-1B- and
  Qwen2.5-7B-shaped models at batch 1 / 16 / 64 with k = 0..5 drafts per sequence, eager (what the
  engine runs now, host overhead included) and replayed from a CUDA graph (device time), against the
  weight + KV read floor; the torch-reference path is rerun in the same process as the baseline;
  at batch 1 the step's device time per kernel (torch profiler), the map of where a step goes;
- `--only decode_paths`: the batch-1 decode paths of issue 12 against the ones they replace: the
  one-row skinny kernel vs cuBLAS on the qkv / o / down matrices of both shapes at one row (and
  which one `kernels.linear` picks); attention at batch 1, context 256 / 1024 / 4096 under a graph's
  bound per min_split_keys; greedy, temperature and top_p verify at batch 1 / 16 split vs one block
  per row per MIN_CHUNK (`--decode-parts verify` runs only these); the whole plain step (batch 1,
  k = 0, graph) with each switch off and all off.
Timings use CUDA events or synchronised host clocks, warm-up first, medians of repeats.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kernels
from benchmarks.random_model import SHAPES
from kernels import _cuda, quant_gemm, quant_tiled
from kernels.attention_ref import AttentionMetadata
from kernels.fused_layers_ref import fused_add_rms_norm_ref, rotary_embedding_ref, silu_and_mul_ref
from kernels.quant_gemm import MAX_ROWS, dequantize_weight_cuda, quant_gemv_cuda, quant_mma_cuda
from kernels.quant_ref import quantize_weight_ref
from kernels.quant_tiled import BlockShape, candidate_shapes, quant_tiled_cuda, tiled_config
from kernels.quant_tiled_ref import TiledWeight, repack_tiles
from shared.model.config import ModelConfig
from shared.model.llama import LlamaForCausalLM


def device_time_ms(fn: Callable[[], Any], reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_time_ms(fn: Callable[[], Any], reps: int = 20) -> float:
    """Device time of fn alone: captured once in a CUDA graph, replays timed (no launch gaps)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = device_time_ms(graph.replay, reps=reps)
    del graph
    return ms


def wall_time_ms(fn: Callable[[], Any], reps: int = 10, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    src = torch.randn(512 * 2**20, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = device_time_ms(functools.partial(dst.copy_, src), reps=10)
    return 2 * 512 * 2**20 * 4 / ms / 1e6


def paged_batch(
    batch: int,
    ctx: int,
    q_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    seq_len = ctx + q_len
    blocks = -(-seq_len // block_size)
    num_blocks = batch * blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, device="cuda", dtype=dtype)
    value_cache = torch.randn(shape, device="cuda", dtype=dtype)
    tables = torch.randperm(num_blocks, device="cuda").int().view(batch, blocks)
    query = torch.randn(batch * q_len, num_heads, head_dim, device="cuda", dtype=dtype)
    positions = torch.arange(ctx, seq_len, device="cuda").repeat(batch)
    rows = torch.arange(batch, device="cuda").repeat_interleave(q_len)
    slots = tables[rows, positions // block_size].long() * block_size + positions % block_size
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(0, batch * q_len + 1, q_len, device="cuda", dtype=torch.int32),
        seq_lens=torch.full((batch,), seq_len, device="cuda", dtype=torch.int32),
        block_tables=tables,
        query_lens_cpu=[q_len] * batch,
        seq_lens_cpu=[seq_len] * batch,
    )
    return query, key_cache, value_cache, meta


def attention_rows(copy_gbs: float) -> list[dict[str, Any]]:
    """Per shape, batch, context and query length: the kernel's device time with its own choice of
    context splits, and with 1..32 splits forced (`split_us`: what the choice leaves on the table).
    Context 256 rows are the verify regime of the step benchmarks (their KV sits in L2)."""
    from kernels.attention import append_attention_cuda

    rows = []
    for name, heads, kv_heads, head_dim in [("llama-3.2-1b", 32, 8, 64), ("qwen2.5-7b", 28, 4, 128)]:
        for batch, ctx in [(1, 256), (16, 256), (1, 8192), (1, 32768), (16, 8192), (64, 4096), (64, 8192)]:
            for q_len in (1, 6):
                query, key_cache, value_cache, meta = paged_batch(
                    batch, ctx, q_len, heads, kv_heads, head_dim, torch.bfloat16
                )
                call = functools.partial(
                    append_attention_cuda, query, key_cache, value_cache, meta, head_dim**-0.5
                )
                call_ms = device_time_ms(call)
                ms = graph_time_ms(call)
                kv_bytes = 2 * batch * (ctx + q_len) * kv_heads * head_dim * 2
                gbs = kv_bytes / ms / 1e6
                cuda_cores_us = 1e3 * graph_time_ms(functools.partial(call, tensor_cores=False))
                split_us = {
                    splits: 1e3 * graph_time_ms(functools.partial(call, num_splits=splits))
                    for splits in (1, 2, 4, 8, 16, 32)
                }
                rows.append(
                    dict(
                        shape=name,
                        batch=batch,
                        context=ctx,
                        query_len=q_len,
                        us=1e3 * ms,
                        call_us=1e3 * call_ms,
                        gb_per_s=gbs,
                        fraction_of_copy=gbs / copy_gbs,
                        split_us=split_us,
                        cuda_cores_us=cuda_cores_us,
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def ngram_row() -> dict[str, Any]:
    from kernels.ngram import ngram_match_cuda

    batch, length = 256, 8192
    history = torch.randint(0, 50, (batch, length), device="cuda", dtype=torch.int32)
    lengths = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    ks = torch.full((batch,), 5, device="cuda", dtype=torch.int32)
    out = {}
    for min_n, max_n in [(1, 3), (3, 8)]:
        call = functools.partial(ngram_match_cuda, history, lengths, min_n, max_n, ks, budget=512, max_k=5)
        out[f"n{min_n}-{max_n}_us"] = 1e3 * graph_time_ms(call, reps=50)
        out[f"n{min_n}-{max_n}_call_us"] = 1e3 * device_time_ms(call, reps=50)
    return dict(batch=batch, history_len=length, **out)


def _verify_rows(
    batch: int, k: int, vocab: int, temp: float, top_k: int, top_p: float
) -> dict[str, torch.Tensor]:
    """`verify_sample_cuda`'s row arguments for `batch` requests of 1 + k rows each, every row
    sampled alike, random drafts."""
    num_rows = batch * (k + 1)
    return dict(
        temperature=torch.full((num_rows,), temp, device="cuda"),
        top_k=torch.full((num_rows,), top_k, device="cuda", dtype=torch.int32),
        top_p=torch.full((num_rows,), top_p, device="cuda"),
        min_p=torch.zeros(num_rows, device="cuda"),
        seeds=torch.arange(num_rows, device="cuda"),
        positions=torch.arange(num_rows, device="cuda"),
        draft_ids=torch.randint(0, vocab, (num_rows,), device="cuda", dtype=torch.int32),
        cu_num_rows=torch.arange(0, num_rows + 1, k + 1, device="cuda", dtype=torch.int32),
        request_of_row=torch.arange(batch, device="cuda", dtype=torch.int32).repeat_interleave(k + 1),
    )


def verify_rows() -> list[dict[str, Any]]:
    from kernels.verify import verify_sample_cuda

    rows = []
    vocab = 128_256
    for batch, k in [(1, 0), (1, 5), (16, 5), (64, 0), (64, 5)]:
        num_rows = batch * (k + 1)
        logits = torch.randn(num_rows, vocab, device="cuda") * 3
        for label, temp, top_k, top_p in [
            ("greedy", 0.0, 0, 1.0),
            ("temperature", 0.8, 0, 1.0),
            ("top_k_top_p", 0.8, 50, 0.9),
        ]:
            args = _verify_rows(batch, k, vocab, temp, top_k, top_p)
            call = functools.partial(verify_sample_cuda, logits, **args, strategy=1, max_rows=k + 1)
            rows.append(
                dict(
                    batch=batch,
                    k=k,
                    mode=label,
                    vocab=vocab,
                    us=1e3 * graph_time_ms(call),
                    call_us=1e3 * device_time_ms(call),
                )
            )
    return rows


FUSED_LAYER_SHAPES = {
    # name: (hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim)
    "llama-3.2-1b": (2048, 8192, 32, 8, 64),
    "qwen2.5-7b": (3584, 18944, 28, 4, 128),
}


def per_call_us(fn: Callable[[], Any], calls: int = 20) -> float:
    """Device time of one call among `calls` back to back in one CUDA graph, as inside a captured
    model step (a graph of one small kernel would time the graph launch instead)."""
    return 1e3 * graph_time_ms(lambda: [fn() for _ in range(calls)], reps=20) / calls


def fused_layer_rows() -> list[dict[str, Any]]:
    """Each fused kernel vs its torch twin (the plain ops the model ran before, bit for bit), bf16,
    device time per call from CUDA-graph replays."""
    from kernels.fused_layers import fused_add_rms_norm_cuda, rotary_embedding_cuda, silu_and_mul_cuda

    rows = []
    dtype, eps = torch.bfloat16, 1e-5
    for name, (hidden, inter, heads, kv_heads, head_dim) in FUSED_LAYER_SHAPES.items():
        cos = torch.randn(4096, head_dim // 2, device="cuda")
        sin = torch.randn(4096, head_dim // 2, device="cuda")
        weight = torch.rand(hidden, device="cuda", dtype=dtype)
        for num_tokens in (1, 16, 64, 384):
            x = torch.randn(num_tokens, hidden, device="cuda", dtype=dtype)
            residual = torch.randn(num_tokens, hidden, device="cuda", dtype=dtype)
            gate_up = torch.randn(num_tokens, 2 * inter, device="cuda", dtype=dtype)
            qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=dtype)
            query = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
            key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(
                num_tokens, kv_heads, head_dim
            )
            positions = torch.randint(0, 4096, (num_tokens,), device="cuda")

            pairs: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
                (
                    "add_rms_norm",
                    functools.partial(fused_add_rms_norm_cuda, x, residual, weight, eps),
                    functools.partial(fused_add_rms_norm_ref, x, residual, weight, eps),
                ),
                (
                    "silu_and_mul",
                    functools.partial(silu_and_mul_cuda, gate_up),
                    functools.partial(silu_and_mul_ref, gate_up),
                ),
                (
                    "rotary",
                    functools.partial(rotary_embedding_cuda, positions, query, key, cos, sin),
                    functools.partial(rotary_embedding_ref, positions, query, key, cos, sin),
                ),
            ]
            for op, fused, plain in pairs:
                fused_us, torch_us = per_call_us(fused), per_call_us(plain)
                rows.append(
                    dict(
                        shape=name,
                        op=op,
                        tokens=num_tokens,
                        us=fused_us,
                        torch_us=torch_us,
                        speedup=torch_us / fused_us,
                    )
                )
    return rows


LINEAR_SHAPES = {  # (out_features, in_features) of each weight matrix
    "llama-3.2-1b": {
        "qkv": (3072, 2048),
        "o": (2048, 2048),
        "gate_up": (16384, 2048),
        "down": (2048, 8192),
        "lm_head": (128256, 2048),
    },
    "qwen2.5-7b": {
        "qkv": (4608, 3584),
        "o": (3584, 3584),
        "gate_up": (37888, 3584),
        "down": (3584, 18944),
        "lm_head": (152064, 3584),
    },
}


def linear_rows(
    copy_gbs: float, row_counts: tuple[int, ...] = (1, 2, 4, 6, 8, 12, 16)
) -> list[dict[str, Any]]:
    """Weight bytes / device time of cuBLAS and the skinny kernel (one and two outputs per warp).
    Each timing runs the product over enough copies of the weight (>= 256 MiB) that it streams from
    HBM as in a model's step, not from the L2 cache."""
    from kernels.skinny_gemm import skinny_linear_cuda

    products: dict[str, Callable[..., torch.Tensor]] = {
        "cublas": torch.nn.functional.linear,
        "skinny1": functools.partial(skinny_linear_cuda, rows_per_warp=1),
        "skinny2": functools.partial(skinny_linear_cuda, rows_per_warp=2),
    }
    rows = []
    for model, matrices in LINEAR_SHAPES.items():
        for name, (n, k) in matrices.items():
            copies = min(32, -(-256 * 2**20 // (2 * n * k)))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            for num_rows in row_counts:
                x = torch.randn(num_rows, k, device="cuda", dtype=torch.bfloat16)
                row: dict[str, Any] = dict(model=model, matrix=name, n=n, k=k, rows=num_rows)
                for label, product in products.items():
                    us = 1e3 * graph_time_ms(functools.partial(_each_weight, product, x, weights)) / copies
                    row[f"{label}_us"] = us
                    row[f"{label}_fraction_of_copy"] = 2 * n * k / us / 1e3 / copy_gbs
                rows.append(row)
                print(json.dumps(row), flush=True)
            weights.clear()
            torch.cuda.empty_cache()
    return rows


QUANT_ROWS = (1, 4, 8, 16, 32, 64, 128, 256)
"""Row counts of the quant_linear section: either side of each dispatch threshold (`quant_thresholds`)."""


def quant_thresholds() -> dict[str, int]:
    """The constants `kernels.quant_linear`'s dispatch (quant_gemm `choose_path`) and quant_tiled's K
    split follow, by kernel: what a quant_linear run's timings set."""
    return dict(
        INT_GEMV_MAX_ROWS=quant_gemm.INT_GEMV_MAX_ROWS,
        FP8_GEMV_MAX_ROWS=quant_gemm.FP8_GEMV_MAX_ROWS,
        MMA_MAX_ROWS=quant_gemm.MMA_MAX_ROWS,
        TILED_MIN_ROWS=quant_gemm.TILED_MIN_ROWS,
        TILED_MAX_ROWS=quant_gemm.TILED_MAX_ROWS,
        TILED_MIN_WIDTH=quant_gemm.TILED_MIN_WIDTH,
        LAST_BLOCK_MAX_SPLITS=quant_tiled.LAST_BLOCK_MAX_SPLITS,
        WAVES=quant_tiled.WAVES,
    )


def quant_linear_rows(copy_gbs: float, row_counts: tuple[int, ...] = QUANT_ROWS) -> list[dict[str, Any]]:
    """Stored bytes (quantized weight + scales) / device time of `kernels.quant_linear` per scheme
    (fp8 and int8 per channel, int4 groups of 128), beside cuBLAS on the bf16 weight, over enough
    weight copies (>= 256 MiB of bf16) to stream from HBM. int8 / int4 weights have their tile
    layout, so the dispatch is the engine's (`{scheme}_path`); each int kernel is also timed alone on
    the same line: `quant_tiled` (a split product also with each way of adding its splits forced),
    `quant_mma`, and `quant_gemv` up to 16 rows or dequantize + cuBLAS past them."""
    rows = []
    for model, matrices in LINEAR_SHAPES.items():
        for name, (n, k) in matrices.items():
            if name == "lm_head":  # stays in the model dtype
                continue
            copies = min(32, -(-256 * 2**20 // (2 * n * k)))
            weights = [
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)
            ]
            stored = {
                scheme: [quantize_weight_ref(w, scheme, 128 if scheme == "int4" else None) for w in weights]
                for scheme in ("fp8", "int8", "int4")
            }
            tiled = {
                scheme: [repack_tiles(q, s, scheme) for q, s in stored[scheme]] for scheme in ("int8", "int4")
            }
            for num_rows in row_counts:
                x = torch.randn(num_rows, k, device="cuda", dtype=torch.bfloat16)
                row: dict[str, Any] = dict(model=model, matrix=name, n=n, k=k, rows=num_rows)
                us = 1e3 * graph_time_ms(
                    functools.partial(_each_weight, torch.nn.functional.linear, x, weights)
                )
                row["bf16_us"] = us / copies
                for scheme, quantized in stored.items():
                    product = functools.partial(_each_quantized, scheme, x, quantized, tiled.get(scheme))
                    row[f"{scheme}_us"] = 1e3 * graph_time_ms(product) / copies
                    num_bytes = sum(t.numel() * t.element_size() for t in quantized[0])
                    row[f"{scheme}_fraction_of_copy"] = num_bytes / row[f"{scheme}_us"] / 1e3 / copy_gbs
                    first_tiled = tiled[scheme][0] if scheme in tiled else None
                    row[f"{scheme}_path"] = kernels.quant_path(x, *quantized[0], scheme, first_tiled)
                    if scheme != "fp8":
                        row.update(_int_kernel_times(scheme, x, quantized, tiled[scheme], copies))
                rows.append(row)
                print(json.dumps(row), flush=True)
            del weights, stored, tiled
            torch.cuda.empty_cache()
    return rows


def _int_kernel_times(
    scheme: str,
    x: torch.Tensor,
    stored: list[tuple[torch.Tensor, torch.Tensor]],
    tiled: list[TiledWeight],
    copies: int,
) -> dict[str, Any]:
    """us per matrix of each int8 / int4 kernel alone: quant_tiled (`{scheme}_tiled_splits` K splits
    added as `{scheme}_tiled_reduce` says; a split product also with each way forced:
    `tiled_last_block`, `tiled_reduce_kernel`), quant_mma, and quant_gemv (up to its MAX_ROWS rows)
    or dequantize + cuBLAS (past them)."""
    config = tiled_config(x.shape[0], tiled[0], _cuda.num_sms(x.device.index or 0))
    products: dict[str, Callable[[torch.Tensor, torch.Tensor, TiledWeight], Any]] = {
        "tiled": lambda q, s, t: quant_tiled_cuda(x, t),
        "mma": lambda q, s, t: quant_mma_cuda(x, q, s, scheme),
    }
    if config.splits > 1:
        products["tiled_last_block"] = lambda q, s, t: quant_tiled_cuda(x, t, reduce="last_block")
        products["tiled_reduce_kernel"] = lambda q, s, t: quant_tiled_cuda(x, t, reduce="reduce_kernel")
    if x.shape[0] <= MAX_ROWS:
        products["gemv"] = lambda q, s, t: quant_gemv_cuda(x, q, s, scheme)
    else:
        products["dequantize"] = lambda q, s, t: torch.nn.functional.linear(
            x, dequantize_weight_cuda(q, s, scheme, x.dtype)
        )
    times: dict[str, Any] = {f"{scheme}_tiled_splits": config.splits, f"{scheme}_tiled_reduce": config.reduce}
    for label, product in products.items():
        each = functools.partial(_each_int, product, stored, tiled)
        times[f"{scheme}_{label}_us"] = 1e3 * graph_time_ms(each) / copies
    return times


def _each_int(
    product: Callable[[torch.Tensor, torch.Tensor, TiledWeight], Any],
    stored: list[tuple[torch.Tensor, torch.Tensor]],
    tiled: list[TiledWeight],
) -> None:
    for (qweight, scale), weight in zip(stored, tiled):
        product(qweight, scale, weight)


TILED_SHAPE_MATRICES = (("llama-3.2-1b", "gate_up"), ("qwen2.5-7b", "gate_up"), ("qwen2.5-7b", "down"))


def quant_tiled_shape_rows(
    copy_gbs: float, row_counts: tuple[int, ...] = (1, 16, 64, 256)
) -> list[dict[str, Any]]:
    """`quant_tiled`'s time per block shape (`candidate_shapes`, the default first) on a few
    matrices, int4 in groups of 128 and int8 per channel: which shape `block_shape` should pick."""
    rows = []
    for model, name in TILED_SHAPE_MATRICES:
        n, k = LINEAR_SHAPES[model][name]
        copies = min(32, -(-256 * 2**20 // (2 * n * k)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        for scheme in ("int4", "int8"):
            stored = [quantize_weight_ref(w, scheme, 128 if scheme == "int4" else None) for w in weights]
            tiled = [repack_tiles(q, s, scheme) for q, s in stored]
            num_bytes = sum(t.numel() * t.element_size() for t in stored[0])
            for num_rows in row_counts:
                x = torch.randn(num_rows, k, device="cuda", dtype=torch.bfloat16)
                row: dict[str, Any] = dict(model=model, matrix=name, scheme=scheme, rows=num_rows, shapes={})
                for shape in candidate_shapes(num_rows):
                    product = functools.partial(_each_tiled, x, tiled, shape)
                    us = 1e3 * graph_time_ms(product) / copies
                    row["shapes"]["x".join(map(str, shape))] = dict(
                        us=us, floor=us * 1e3 * copy_gbs / num_bytes
                    )
                rows.append(row)
                print(json.dumps(row), flush=True)
            del stored, tiled
        del weights
        torch.cuda.empty_cache()
    return rows


def _each_tiled(x: torch.Tensor, tiled: list[TiledWeight], shape: BlockShape) -> None:
    for weight in tiled:
        quant_tiled_cuda(x, weight, shape=shape)


def _each_quantized(
    scheme: str,
    x: torch.Tensor,
    stored: list[tuple[torch.Tensor, torch.Tensor]],
    tiled: list[TiledWeight] | None,
) -> None:
    for index, (qweight, scale) in enumerate(stored):
        kernels.quant_linear(x, qweight, scale, scheme, tiled=tiled[index] if tiled else None)


def _each_weight(product: Callable[..., torch.Tensor], x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    for weight in weights:
        product(x, weight)


def kernel_table(fn: Callable[[], Any], calls: int = 5, top: int = 25) -> list[dict[str, Any]]:
    """Device time per call of each kernel `fn` launches (torch profiler), largest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            entry = totals.setdefault(event.name[:90], [0.0, 0])
            entry[0] += event.device_time / calls
            entry[1] += 1 / calls
    table = [dict(kernel=name, us=us, launches=count) for name, (us, count) in totals.items()]
    table.sort(key=lambda r: -r["us"])
    total = dict(kernel="(all)", us=sum(r["us"] for r in table), launches=sum(r["launches"] for r in table))
    return [total] + table[:top]


def random_model(shape: str, max_positions: int) -> LlamaForCausalLM:
    raw = {**SHAPES[shape], "hidden_act": "silu", "rms_norm_eps": 1e-5}
    config = ModelConfig.from_dict(raw)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    model.tie_weights()
    model.rotary.build(torch.device("cuda"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()


def step_rows(
    shape: str, copy_gbs: float, batches: list[int], ks: list[int], ref_batches: list[int]
) -> list[dict[str, Any]]:
    """Target step (forward over B x (1 + k) tokens at context 256, LM head rows, verify) per batch."""
    ctx, block_size = 256, 16
    model = random_model(shape, ctx + 32)
    c = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for batch in batches:
        blocks = -(-(ctx + 16) // block_size)
        num_blocks = batch * blocks
        kv_shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        caches = [
            (
                torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16),
                torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16),
            )
            for _ in range(c.num_hidden_layers)
        ]
        tables = torch.arange(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
        for k in ks:
            q_len = 1 + k
            seq_len = ctx + q_len
            positions = torch.arange(ctx, seq_len, device="cuda").repeat(batch)
            seq_rows = torch.arange(batch, device="cuda").repeat_interleave(q_len)
            meta = AttentionMetadata(
                slot_mapping=tables[seq_rows, positions // block_size].long() * block_size
                + positions % block_size,
                query_start_loc=torch.arange(0, batch * q_len + 1, q_len, device="cuda", dtype=torch.int32),
                seq_lens=torch.full((batch,), seq_len, device="cuda", dtype=torch.int32),
                block_tables=tables,
                query_lens_cpu=[q_len] * batch,
                seq_lens_cpu=[seq_len] * batch,
            )
            input_ids = torch.randint(0, c.vocab_size, (batch * q_len,), device="cuda")
            num_rows = batch * q_len
            verify_args = dict(
                temperature=torch.zeros(num_rows, device="cuda"),
                top_k=torch.zeros(num_rows, device="cuda", dtype=torch.int32),
                top_p=torch.ones(num_rows, device="cuda"),
                min_p=torch.zeros(num_rows, device="cuda"),
                seeds=torch.zeros(num_rows, device="cuda", dtype=torch.long),
                positions=torch.zeros(num_rows, device="cuda", dtype=torch.long),
                draft_ids=torch.randint(0, c.vocab_size, (num_rows,), device="cuda", dtype=torch.int32),
                cu_num_rows=torch.arange(0, num_rows + 1, q_len, device="cuda", dtype=torch.int32),
                request_of_row=torch.arange(batch, device="cuda", dtype=torch.int32).repeat_interleave(q_len),
            )

            step = functools.partial(
                _target_step, model, input_ids, positions, caches, meta, verify_args, q_len
            )

            kv_bytes = 2 * c.num_hidden_layers * batch * seq_len * c.num_key_value_heads * c.head_dim * 2
            floor_ms = (weight_bytes + kv_bytes) / copy_gbs / 1e6
            row: dict[str, Any] = dict(shape=shape, batch=batch, k=k, floor_ms=floor_ms)
            row["eager_ms"] = wall_time_ms(step)
            try:
                graph = torch.cuda.CUDAGraph()
                step()
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    step()
                row["graph_ms"] = device_time_ms(graph.replay)
                del graph
                row["graph_cublas_ms"] = _graph_ms_with(step, "SPECMESH_SKINNY_GEMM")
                row["graph_cuda_core_attention_ms"] = _graph_ms_with(step, "SPECMESH_TENSOR_CORE_ATTENTION")
                if batch == 1 and k in (0, 5):
                    row["kernels"] = kernel_table(step)
            except Exception as exc:  # noqa: BLE001 - report, keep timing the rest
                row["graph_error"] = repr(exc)[:200]
            if batch in ref_batches and k in (0, 5):
                real = _cuda.available
                _cuda.available = lambda *t: False  # type: ignore[assignment]
                try:
                    row["ref_eager_ms"] = wall_time_ms(
                        functools.partial(_forward, model, input_ids, positions, caches, meta), reps=5
                    )
                finally:
                    _cuda.available = real  # type: ignore[assignment]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del caches
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    return rows


DECODE_MATRICES = {
    name: {m: LINEAR_SHAPES[name][m] for m in ("qkv", "o", "down")} for name in ("llama-3.2-1b", "qwen2.5-7b")
}
SPLIT_KEYS = (64, 128, 256, 512, 1024, 1 << 20)
"""min_split_keys swept by `decode_attention_rows` (1 << 20: never split)."""


def decode_linear_rows(copy_gbs: float) -> list[dict[str, Any]]:
    """qkv / o / down at one row: cuBLAS and the one-row kernel, and which one `kernels.linear`
    dispatches to (weights cycled past the L2 cache)."""
    from kernels import skinny_gemm

    products: dict[str, Callable[..., torch.Tensor]] = {
        "cublas": torch.nn.functional.linear,
        "skinny1": functools.partial(skinny_gemm.skinny_linear_cuda, rows_per_warp=1),
    }
    rows = []
    for model, matrices in DECODE_MATRICES.items():
        for name, (n, k) in matrices.items():
            copies = min(32, -(-256 * 2**20 // (2 * n * k)))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            row: dict[str, Any] = dict(model=model, matrix=name, n=n, k=k, rows=1)
            for label, product in products.items():
                us = 1e3 * graph_time_ms(functools.partial(_each_weight, product, x, weights)) / copies
                row[f"{label}_us"] = us
                row[f"{label}_fraction_of_copy"] = 2 * n * k / us / 1e3 / copy_gbs
            row["dispatch"] = "skinny1" if skinny_gemm.preferred(x, weights[0]) else "cublas"
            rows.append(row)
            print(json.dumps(row), flush=True)
            weights.clear()
            torch.cuda.empty_cache()
    return rows


def decode_attention_rows() -> list[dict[str, Any]]:
    """Batch-1 decode attention (q = 1) at context 256 / 1024 / 4096, 16 layers' caches called back
    to back in one graph (per-call device time), with the graph's bound (max_seq_len 8192, as the
    engine's decode graphs launch) per min_split_keys, and with the exact length (eager's choice)."""
    from kernels.attention import MIN_SPLIT_KEYS_ENV, append_attention_cuda

    rows = []
    for name, heads, kv_heads, head_dim in [("llama-3.2-1b", 32, 8, 64), ("qwen2.5-7b", 28, 4, 128)]:
        for ctx in (256, 1024, 4096):
            layers = [paged_batch(1, ctx, 1, heads, kv_heads, head_dim, torch.bfloat16) for _ in range(16)]
            row: dict[str, Any] = dict(shape=name, batch=1, context=ctx)
            for bound in ("graph", "exact"):
                for keys in SPLIT_KEYS:
                    os.environ[MIN_SPLIT_KEYS_ENV] = str(keys)
                    try:
                        calls = [
                            functools.partial(
                                append_attention_cuda,
                                q,
                                kc,
                                vc,
                                dataclasses.replace(meta, max_query_len=1, max_seq_len=8192)
                                if bound == "graph"
                                else meta,
                                head_dim**-0.5,
                            )
                            for q, kc, vc, meta in layers
                        ]
                        row[f"{bound}_keys{keys}_us"] = (
                            per_call_us(functools.partial(_call_each, calls), calls=1) / 16
                        )
                    finally:
                        del os.environ[MIN_SPLIT_KEYS_ENV]
            rows.append(row)
            print(json.dumps(row), flush=True)
            del layers
    return rows


def _call_each(calls: list[Callable[[], Any]]) -> None:
    for call in calls:
        call()


VERIFY_MODES = {"greedy": (0.0, 1.0), "temperature": (0.8, 1.0), "top_p": (0.8, 0.9)}
"""Decode verify rows per mode: (temperature, top_p)."""


def decode_verify_rows() -> list[dict[str, Any]]:
    """Verify at batch 1 / 16 (k = 0 and 5), vocabulary 128256, greedy, temperature 0.8 and
    temperature 0.8 with top_p 0.9: one block per row (SPECMESH_VERIFY_SPLIT=off), sampled rows in
    one block and greedy rows split (`greedy`: the kernel before sampled rows split), and every row
    split per MIN_CHUNK."""
    from kernels.verify import MIN_CHUNK_ENV, SPLIT_ENV, verify_sample_cuda

    rows = []
    vocab = 128_256
    for batch, k in [(1, 0), (1, 5), (16, 0), (16, 5)]:
        num_rows = batch * (k + 1)
        logits = torch.randn(num_rows, vocab, device="cuda") * 3
        for mode, (temp, top_p) in VERIFY_MODES.items():
            args = _verify_rows(batch, k, vocab, temp, 0, top_p)
            call = functools.partial(verify_sample_cuda, logits, **args, strategy=0, max_rows=k + 1)
            row: dict[str, Any] = dict(batch=batch, k=k, mode=mode, vocab=vocab)
            for label, env in [
                ("off", {SPLIT_ENV: "off"}),
                ("greedy_split", {SPLIT_ENV: "greedy"}),
                ("chunk4096", {MIN_CHUNK_ENV: "4096"}),
                ("chunk8192", {MIN_CHUNK_ENV: "8192"}),
                ("chunk16384", {MIN_CHUNK_ENV: "16384"}),
                ("chunk32768", {MIN_CHUNK_ENV: "32768"}),
            ]:
                os.environ.update(env)
                try:
                    row[f"{label}_us"] = per_call_us(call, calls=4)
                finally:
                    for key in env:
                        del os.environ[key]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


PLAIN_STEP_SWITCHES: dict[str, dict[str, str]] = {
    "all_new": {},
    "attn_keys64": {"SPECMESH_ATTN_MIN_SPLIT_KEYS": "64"},
    "attn_keys256": {"SPECMESH_ATTN_MIN_SPLIT_KEYS": "256"},
    "attn_keys1024": {"SPECMESH_ATTN_MIN_SPLIT_KEYS": "1024"},
    "attn_nosplit": {"SPECMESH_ATTN_MIN_SPLIT_KEYS": str(1 << 20)},
    "verify_split_off": {"SPECMESH_VERIFY_SPLIT": "off"},
    "all_off": {
        "SPECMESH_VERIFY_SPLIT": "off",
        "SPECMESH_ATTN_MIN_SPLIT_KEYS": "64",
    },
}
"""The plain step's environment per variant (`all_off`: the kernels as before issue 12, but for the
attention's empty split blocks returning at once and the one-row kernel on the small wide matrices,
which no switch turns off alone)."""


def plain_step_rows(copy_gbs: float) -> list[dict[str, Any]]:
    """The plain decode step (batch 1, k = 0, context 256; forward + LM head + greedy verify) from a
    CUDA graph whose attention has the engine's bound (max_seq_len 8192), per PLAIN_STEP_SWITCHES,
    with the floor; the kernel table of `all_new` and `all_off`."""
    rows = []
    for shape in ("llama-3.2-1b", "qwen2.5-7b"):
        step, floor_ms = _plain_step(shape, copy_gbs)
        row: dict[str, Any] = dict(shape=shape, batch=1, k=0, context=256, floor_ms=floor_ms)
        for label, env in PLAIN_STEP_SWITCHES.items():
            os.environ.update(env)
            try:
                row[f"{label}_ms"] = graph_time_ms(step, reps=50)
                if label in ("all_new", "all_off"):
                    row[f"{label}_kernels"] = kernel_table(step)
            finally:
                for key in env:
                    del os.environ[key]
        row["all_new_over_floor"] = row["all_new_ms"] / floor_ms
        row["all_off_over_floor"] = row["all_off_ms"] / floor_ms
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("kernels")}), flush=True)
        del step
        torch.cuda.empty_cache()
    return rows


def _plain_step(shape: str, copy_gbs: float) -> tuple[Callable[[], Any], float]:
    ctx, block_size = 256, 16
    model = random_model(shape, ctx + 32)
    c = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    blocks = -(-(ctx + 16) // block_size)
    kv_shape = (blocks, block_size, c.num_key_value_heads, c.head_dim)
    caches = [
        (
            torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16),
            torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(c.num_hidden_layers)
    ]
    tables = torch.arange(blocks, device="cuda", dtype=torch.int32).view(1, blocks)
    seq_len = ctx + 1
    positions = torch.tensor([ctx], device="cuda")
    meta = AttentionMetadata(
        slot_mapping=tables[0, ctx // block_size].long().view(1) * block_size + ctx % block_size,
        query_start_loc=torch.tensor([0, 1], device="cuda", dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], device="cuda", dtype=torch.int32),
        block_tables=tables,
        query_lens_cpu=[1],
        seq_lens_cpu=[seq_len],
        max_query_len=1,
        max_seq_len=8192,
    )
    input_ids = torch.randint(0, c.vocab_size, (1,), device="cuda")
    verify_args = dict(
        temperature=torch.zeros(1, device="cuda"),
        top_k=torch.zeros(1, device="cuda", dtype=torch.int32),
        top_p=torch.ones(1, device="cuda"),
        min_p=torch.zeros(1, device="cuda"),
        seeds=torch.zeros(1, device="cuda", dtype=torch.long),
        positions=torch.zeros(1, device="cuda", dtype=torch.long),
        draft_ids=torch.randint(0, c.vocab_size, (1,), device="cuda", dtype=torch.int32),
        cu_num_rows=torch.tensor([0, 1], device="cuda", dtype=torch.int32),
        request_of_row=torch.zeros(1, device="cuda", dtype=torch.int32),
    )
    kv_bytes = 2 * c.num_hidden_layers * seq_len * c.num_key_value_heads * c.head_dim * 2
    floor_ms = (weight_bytes + kv_bytes) / copy_gbs / 1e6
    step = functools.partial(_target_step, model, input_ids, positions, caches, meta, verify_args, 1)
    return step, floor_ms


DECODE_PARTS = ("linear", "attention", "verify", "plain_step")


def decode_path_rows(copy_gbs: float, parts: list[str] | None = None) -> dict[str, Any]:
    """Issue 12's batch-1 decode paths, new against old (see the module docstring); `parts`: a
    subset of DECODE_PARTS (default all)."""
    out: dict[str, Any] = {}
    runs: dict[str, Callable[[], Any]] = {
        "linear": lambda: decode_linear_rows(copy_gbs),
        "attention": decode_attention_rows,
        "verify": decode_verify_rows,
        "plain_step": lambda: plain_step_rows(copy_gbs),
    }
    for name, run in runs.items():
        if parts and name not in parts:
            continue
        try:
            out[name] = run()
        except Exception as exc:  # noqa: BLE001 - one broken part must not hide the others
            out[name] = {"error": repr(exc)[:500]}
            print(name, "error", repr(exc)[:500], flush=True)
    return out


def _graph_ms_with(step: Callable[[], Any], switch: str) -> float:
    """The step's graph time with one kernel switched off (`switch=off`: SPECMESH_SKINNY_GEMM puts
    every matrix product on cuBLAS, SPECMESH_TENSOR_CORE_ATTENTION the attention on CUDA cores)."""
    os.environ[switch] = "off"
    try:
        return graph_time_ms(step)
    finally:
        del os.environ[switch]


@torch.inference_mode()
def _forward(
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    caches: list,
    meta: AttentionMetadata,
) -> torch.Tensor:
    return model.compute_logits(model(input_ids, positions, caches, meta))


def _target_step(
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    caches: list,
    meta: AttentionMetadata,
    verify_args: dict[str, torch.Tensor],
    q_len: int,
) -> torch.Tensor:
    """Target forward, LM head over every row, fused greedy verification."""
    from kernels.verify import verify_sample_cuda

    logits = _forward(model, input_ids, positions, caches, meta)
    return verify_sample_cuda(logits, **verify_args, strategy=0, max_rows=q_len)[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_kernels.json"))
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--only", nargs="+", metavar="SECTION", help="run only these sections")
    parser.add_argument(
        "--decode-parts", nargs="+", choices=DECODE_PARTS, help="decode_paths: run only these parts"
    )
    parser.add_argument(
        "--quant-rows", nargs="+", type=int, default=list(QUANT_ROWS), help="quant_linear: these row counts"
    )
    args = parser.parse_args()
    result: dict[str, Any] = {"card": torch.cuda.get_device_name(), "torch": torch.__version__}
    result["quant_thresholds"] = quant_thresholds()
    result["copy_gb_per_s"] = copy_bandwidth_gbs()
    print("card", result["card"], "copy GB/s", round(result["copy_gb_per_s"]), flush=True)
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("attention", lambda: attention_rows(result["copy_gb_per_s"])),
        ("ngram", ngram_row),
        ("verify", verify_rows),
        ("fused_layers", fused_layer_rows),
        ("linear", lambda: linear_rows(result["copy_gb_per_s"])),
        ("quant_linear", lambda: quant_linear_rows(result["copy_gb_per_s"], tuple(args.quant_rows))),
        ("quant_tiled_shapes", lambda: quant_tiled_shape_rows(result["copy_gb_per_s"])),
    ]
    if not args.skip_steps:
        sections += [
            ("decode_paths", lambda: decode_path_rows(result["copy_gb_per_s"], args.decode_parts)),
            (
                "step_llama",
                lambda: step_rows(
                    "llama-3.2-1b", result["copy_gb_per_s"], [1, 16, 64], [0, 1, 2, 3, 4, 5], [1, 16, 64]
                ),
            ),
            ("step_qwen", lambda: step_rows("qwen2.5-7b", result["copy_gb_per_s"], [1, 16, 64], [0, 5], [1])),
        ]
    if args.only:
        sections = [(name, run) for name, run in sections if name in args.only]
    for name, run in sections:
        try:
            result[name] = run()
        except Exception as exc:  # noqa: BLE001 - one broken section must not hide the others
            result[name] = {"error": repr(exc)[:500]}
        print(name, json.dumps(result[name])[:3000], flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    summarize(result)


def summarize(result: dict[str, Any]) -> None:
    print(f"\n== {result['card']}: copy {result['copy_gb_per_s']:.0f} GB/s")
    for row in result.get("attention", []) if isinstance(result.get("attention"), list) else []:
        print(
            f"attention {row['shape']:13s} B={row['batch']:3d} ctx={row['context']:6d} q={row['query_len']} "
            f"{row['us']:8.1f} us {row['gb_per_s']:7.0f} GB/s ({100 * row['fraction_of_copy']:.0f}% of copy)"
            f" call {row['call_us']:.1f} us; CUDA cores {row.get('cuda_cores_us', float('nan')):.1f} us; splits "
            + " ".join(f"{k}:{v:.1f}" for k, v in row.get("split_us", {}).items())
        )
    print("ngram", result.get("ngram"))
    for row in result.get("verify", []) if isinstance(result.get("verify"), list) else []:
        print(
            f"verify B={row['batch']:3d} k={row['k']} {row['mode']:12s} {row['us']:8.1f} us (call {row['call_us']:.1f} us)"
        )
    for row in result.get("fused_layers", []) if isinstance(result.get("fused_layers"), list) else []:
        print(
            f"fused {row['shape']:13s} {row['op']:13s} tokens={row['tokens']:4d} {row['us']:7.1f} us "
            f"(torch ops {row['torch_us']:7.1f} us, {row['speedup']:.1f}x)"
        )
    for row in result.get("linear", []) if isinstance(result.get("linear"), list) else []:
        print(
            f"linear {row['model']:13s} {row['matrix']:8s} rows={row['rows']:2d} "
            + " ".join(
                f"{label} {row[label + '_us']:7.1f} us ({100 * row[label + '_fraction_of_copy']:3.0f}%)"
                for label in ("cublas", "skinny1", "skinny2")
            )
        )
    quant_rows = result.get("quant_linear", []) if isinstance(result.get("quant_linear"), list) else []
    for row in quant_rows:
        print(
            f"quant {row['model']:13s} {row['matrix']:8s} rows={row['rows']:3d} bf16 {row['bf16_us']:7.1f} us "
            + " ".join(
                f"{s} {row.get(s + '_path', '?')} {row[s + '_us']:7.1f} us ({row[s + '_us'] / row['bf16_us']:4.2f} "
                f"of bf16, {1 / row[s + '_fraction_of_copy']:4.2f}x the floor)"
                for s in ("fp8", "int8", "int4")
            )
            + "".join(f" | {s} {_int_kernel_summary(row, s)}" for s in ("int8", "int4"))
        )
    if quant_rows:
        summarize_quant_dispatch(quant_rows, result.get("quant_thresholds", {}))
    for row in (
        result.get("quant_tiled_shapes", []) if isinstance(result.get("quant_tiled_shapes"), list) else []
    ):
        print(
            f"quant_tiled {row['model']:13s} {row['matrix']:8s} {row['scheme']} rows={row['rows']:3d} MTxKWxNWxTW: "
            + " ".join(
                f"{shape} {v['us']:7.1f} us ({v['floor']:4.2f}x)" for shape, v in row["shapes"].items()
            )
        )
    summarize_decode_paths(result.get("decode_paths"))
    for key in ("step_llama", "step_qwen"):
        for row in result.get(key, []) if isinstance(result.get(key), list) else []:
            print(
                f"step {row['shape']:13s} B={row['batch']:3d} k={row['k']} floor {row['floor_ms']:.3f} ms "
                f"eager {row['eager_ms']:.2f} ms graph {row.get('graph_ms', float('nan')):.3f} ms "
                f"(cuBLAS {row.get('graph_cublas_ms', float('nan')):.3f} ms, "
                f"CUDA-core attention {row.get('graph_cuda_core_attention_ms', float('nan')):.3f} ms) "
                f"ref-eager {row.get('ref_eager_ms', float('nan')):.2f} ms"
            )
            for kernel in row.get("kernels", []):
                print(f"    {kernel['us']:8.1f} us {kernel['launches']:6.1f}x  {kernel['kernel']}")


INT_KERNELS = (
    ("tiled", "quant_tiled"),
    ("mma", "quant_mma"),
    ("dequantize", "dequantize + cuBLAS"),
    ("gemv", "quant_gemv"),
)
"""The int8 / int4 kernels a quant_linear row times alone: (`choose_path`'s name, the kernel's)."""


def _int_kernel_summary(row: dict[str, Any], scheme: str) -> str:
    """Each int kernel's time alone on one quant line; quant_tiled's K split and, where it splits,
    both ways of adding it."""
    parts = []
    for key, name in INT_KERNELS:
        if f"{scheme}_{key}_us" not in row:
            continue
        part = f"{name} {row[f'{scheme}_{key}_us']:7.1f} us"
        if key == "tiled" and row.get(f"{scheme}_tiled_splits", 1) > 1:
            part += (
                f" ({row[f'{scheme}_tiled_splits']} splits, {row[f'{scheme}_tiled_reduce']}: last block "
                f"{row[f'{scheme}_tiled_last_block_us']:.1f} / reduce kernel {row[f'{scheme}_tiled_reduce_kernel_us']:.1f})"
            )
        parts.append(part)
    return " ".join(parts)


def quant_dispatch_findings(rows: list[dict[str, Any]]) -> list[str]:
    """Where the quant_linear rows disagree with the dispatch: per int scheme and row count, the
    matrices whose dispatched kernel was slower alone than another int kernel, then the split
    products whose K split added by the last block beat the reduce kernel (LAST_BLOCK_MAX_SPLITS)."""
    findings = []
    for scheme in ("int8", "int4"):
        for num_rows in sorted({row["rows"] for row in rows}):
            at_rows = [row for row in rows if row["rows"] == num_rows and f"{scheme}_mma_us" in row]
            slower = []
            for row in at_rows:
                times = {
                    key: row[f"{scheme}_{key}_us"] for key, _ in INT_KERNELS if f"{scheme}_{key}_us" in row
                }
                fastest = min(times, key=times.__getitem__)
                path = row.get(f"{scheme}_path")
                if path in times and times[path] > times[fastest]:
                    slower.append(
                        f"{row['model']} {row['matrix']} {path} {times[path]:.1f} us vs {fastest} {times[fastest]:.1f}"
                    )
            if at_rows:
                findings.append(
                    f"quant dispatch {scheme} rows={num_rows:3d}: fastest on {len(at_rows) - len(slower)}/{len(at_rows)}"
                    + (": slower: " + "; ".join(slower) if slower else "")
                )
        wins: dict[int, list[str]] = {}
        split_products: dict[int, int] = {}
        for row in rows:
            splits = row.get(f"{scheme}_tiled_splits", 1)
            if splits > 1:
                split_products[splits] = split_products.get(splits, 0) + 1
                last_block, reduced = (
                    row[f"{scheme}_tiled_last_block_us"],
                    row[f"{scheme}_tiled_reduce_kernel_us"],
                )
                if last_block < reduced:
                    wins.setdefault(splits, []).append(
                        f"{row['model']} {row['matrix']} rows={row['rows']} {last_block:.1f} vs {reduced:.1f} us"
                    )
        if split_products:
            findings.append(
                f"quant split {scheme}: last block faster / split products, by K splits: "
                + " ".join(f"{k}: {len(wins.get(k, []))}/{n}" for k, n in sorted(split_products.items()))
                + "".join(f"; {k} splits: " + ", ".join(wins[k]) for k in sorted(wins))
            )
    return findings


def summarize_quant_dispatch(rows: list[dict[str, Any]], thresholds: dict[str, int]) -> None:
    """The dispatch thresholds by kernel, then where this run's timings disagree with them."""
    by_kernel = {
        "quant_gemv": ("INT_GEMV_MAX_ROWS", "FP8_GEMV_MAX_ROWS"),
        "quant_mma": ("MMA_MAX_ROWS",),
        "quant_tiled": (
            "TILED_MIN_ROWS",
            "TILED_MAX_ROWS",
            "TILED_MIN_WIDTH",
            "LAST_BLOCK_MAX_SPLITS",
            "WAVES",
        ),
    }
    print(
        "quant thresholds: "
        + " | ".join(
            f"{kernel} " + " ".join(f"{name}={thresholds.get(name, '?')}" for name in names)
            for kernel, names in by_kernel.items()
        )
    )
    for line in quant_dispatch_findings(rows):
        print(line)


def summarize_decode_paths(paths: Any) -> None:
    """The decode-path section, one line per shape: new against old."""
    if not isinstance(paths, dict):
        return
    for row in paths.get("linear", []) if isinstance(paths.get("linear"), list) else []:
        labels = [k[:-3] for k in row if k.endswith("_us")]
        print(
            f"decode linear {row['model']:13s} {row['matrix']:5s} rows={row['rows']} "
            + " ".join(f"{label} {row[label + '_us']:6.1f}" for label in labels)
            + f" us ({row['dispatch']})"
        )
    for row in paths.get("attention", []) if isinstance(paths.get("attention"), list) else []:
        print(
            f"decode attention {row['shape']:13s} ctx={row['context']:5d} us per layer: "
            + " ".join(f"{k[:-3]} {v:.2f}" for k, v in row.items() if k.endswith("_us"))
        )
    for row in paths.get("verify", []) if isinstance(paths.get("verify"), list) else []:
        print(
            f"decode verify B={row['batch']:2d} k={row['k']} {row['mode']:11s} us: "
            + " ".join(f"{k[:-3]} {v:.1f}" for k, v in row.items() if k.endswith("_us"))
        )
    for row in paths.get("plain_step", []) if isinstance(paths.get("plain_step"), list) else []:
        print(
            f"plain step {row['shape']:13s} floor {row['floor_ms']:.3f} ms: "
            + " ".join(f"{k[:-3]} {v:.3f}" for k, v in row.items() if k.endswith("_ms") and k != "floor_ms")
            + f" ms; all_new {row['all_new_over_floor']:.2f}x the floor, all_off {row['all_off_over_floor']:.2f}x"
        )
        for key in ("all_new_kernels", "all_off_kernels"):
            print(f"  {key}:")
            for kernel in row.get(key, [])[:16]:
                print(f"    {kernel['us']:8.1f} us {kernel['launches']:6.1f}x  {kernel['kernel']}")
    for part, value in paths.items():
        if isinstance(value, dict) and "error" in value:
            print(f"decode {part} error: {value['error']}")


if __name__ == "__main__":
    main()
