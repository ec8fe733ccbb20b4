"""Offline engine throughput and decode step time at several batch sizes.

    python -m benchmarks.bench_engine --shape llama-tiny --batch-sizes 1 32
    python -m benchmarks.bench_engine --shape llama-3.2-1b --dtype bfloat16 --batch-sizes 1 16 64  # GPU
    python -m benchmarks.bench_engine ... --enforce-eager   # the same without CUDA graphs
    python -m benchmarks.bench_engine ... --no-async-scheduling   # each step waits for the last
    python -m benchmarks.bench_engine ... --tensor-parallel-size 2   # split over cuda:0 and cuda:1
    python -m benchmarks.bench_engine ... --tensor-parallel-size 2 --no-peer-all-reduce   # NCCL only
    python -m benchmarks.bench_engine ... --quantization int4   # fp8 / int8 / int4 weights, quantized at load

Each batch size runs `batch` requests of `--prompt-len` random tokens generating `--output-len`
tokens each (greedy, EOS ignored), after a warm-up run of the same batch. The decode step time is
the mean of the engine steps after every prompt is in (the whole step: scheduling, inputs, forward,
sampling, outputs), with their median beside it (a mean above the median: a few slow steps). On a GPU it is set against the weight-read floor: (the weight bytes a step reads + the KV
bytes it reads) / device-to-device copy bandwidth, the least time any engine needs to read them once
(per rank under tensor parallelism: its shards and its KV heads). The weight bytes are those stored:
quantized weights and their scales, the embedding rows of the batch's tokens only (unless tied to
the LM head, which reads the whole table).
Results are printed as a table and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.random_model import SHAPES, write_random_checkpoint
from services.engine.llm import LLM
from shared.model.parallel import num_local_kv_heads
from shared.sampling_params import SamplingParams
from shared.speculative_config import SpeculativeConfig


def random_prompt_ids(batch: int, prompt_len: int, vocab_size: int) -> torch.Tensor:
    """The prompts of one batch size ([batch, prompt_len]): random ids in [1, vocab_size), one draw
    per prompt from a generator seeded with the batch size (benchmarks.hf_baseline uses the same)."""
    generator = torch.Generator().manual_seed(batch)
    return torch.stack(
        [torch.randint(1, vocab_size, (prompt_len,), generator=generator) for _ in range(batch)]
    )


def run(llm: LLM, batch: int, prompt_len: int, output_len: int, vocab_size: int) -> dict[str, float]:
    prompts = random_prompt_ids(batch, prompt_len, vocab_size).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    # A warm-up at the full batch: every kernel variant and graph bucket the timed run uses is built.
    llm.generate(prompt_token_ids=prompts, sampling_params=params.model_copy(update={"max_tokens": 8}))
    engine = llm.engine
    ahead_before = engine.runner.num_steps_ahead
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{batch}-{i}", prompt_token_ids=prompt, params=params)
    started = time.perf_counter()
    num_out = 0
    step_times: list[float] = []
    while engine.has_unfinished_requests():
        prefilling = any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.sequences.values())
        step_started = time.perf_counter()
        outputs = engine.step()
        if not prefilling:
            step_times.append(time.perf_counter() - step_started)
        num_out += sum(len(o.new_token_ids) for o in outputs)
    elapsed = time.perf_counter() - started
    return {
        "batch": batch,
        "output_tokens": num_out,
        "seconds": elapsed,
        "output_tok_per_s": num_out / elapsed,
        "decode_step_ms": 1e3 * sum(step_times) / max(1, len(step_times)),
        "decode_step_p50_ms": 1e3 * statistics.median(step_times) if step_times else 0.0,
        "decode_steps": len(step_times),
        "steps_ahead": engine.runner.num_steps_ahead - ahead_before,
    }


def weight_bytes_read(model: torch.nn.Module, batch: int) -> int:
    """Bytes of parameters one decode step of `batch` single-token rows reads, as stored (quantized
    weights, their scales): all of them but an untied embedding table, of which only `batch` rows."""
    embedding = model.get_submodule("embed_tokens").weight
    tied = model.get_submodule("lm_head").weight is embedding
    total = 0
    for param in model.parameters():
        if param is embedding and not tied:
            total += min(batch, param.shape[0]) * param.shape[1] * param.element_size()
        else:
            total += param.numel() * param.element_size()
    return total


def floor_ms(llm: LLM, batch: int, context: int, copy_gbs: float) -> float:
    """(weights + KV read by one decode step at this context) / copy bandwidth, in ms (rank 0's)."""
    runner = llm.engine.runner
    weight_bytes = weight_bytes_read(runner.model, batch)
    c = runner.model_config
    kv_heads = num_local_kv_heads(c, runner.tp)
    kv_bytes = batch * context * 2 * c.num_hidden_layers * kv_heads * c.head_dim
    kv_bytes *= torch.tensor([], dtype=runner.dtype).element_size()
    return (weight_bytes + kv_bytes) / (copy_gbs * 1e9) * 1e3


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), in GB/s."""
    src = torch.empty(256 * 2**20, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 10 * 2 * src.numel() * 4 / (start.elapsed_time(end) / 1e3) / 1e9


def profile_decode(llm: LLM, batch: int, prompt_len: int, vocab_size: int) -> None:
    """Prints where 8 decode steps of a full batch spend their time (torch profiler: ops and
    kernels), then the Python functions of 32 more (cProfile: the host work between replays)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len - prompt_len, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"profile-{i}", prompt_token_ids=[1 + i % (vocab_size - 1)] * prompt_len, params=params
        )
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.sequences.values()):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(8):
            engine.step()
    sort_by = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_by, row_limit=25))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(32):
        engine.step()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
    while engine.has_unfinished_requests():
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="llama-tiny", choices=sorted(SHAPES))
    parser.add_argument("--model", help="an existing model directory instead of a random --shape")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/engine.json"))
    parser.add_argument(
        "--profile", action="store_true", help="print a torch.profiler table of 8 decode steps"
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="launch each step once the last one's result is read",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks the model is split over")
    parser.add_argument(
        "--no-peer-all-reduce",
        dest="peer_all_reduce",
        action="store_false",
        help="every all-reduce through NCCL (default: small ones over peer memory where the GPUs allow)",
    )
    parser.add_argument("--speculative-config", help="JSON, as for `specmesh serve` (default: naive)")
    parser.add_argument(
        "--quantization", choices=["fp8", "int8", "int4"], help="quantize the linear layers at load"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(write_random_checkpoint(args.shape, Path(tmp) / args.shape))
        llm = LLM(
            model_dir,
            dtype=args.dtype,
            max_model_len=args.prompt_len + args.output_len + 8,
            max_num_seqs=max(args.batch_sizes),
            enforce_eager=args.enforce_eager,
            async_scheduling=args.async_scheduling,
            tensor_parallel_size=args.tensor_parallel_size,
            peer_all_reduce=args.peer_all_reduce,
            speculative_config=SpeculativeConfig.from_json(args.speculative_config),
            quantization=args.quantization,
        )
        vocab = llm.engine.model_config.vocab_size
        rows = [run(llm, b, args.prompt_len, args.output_len, vocab) for b in args.batch_sizes]
        if llm.engine.runner.device.type == "cuda":
            copy_gbs = copy_bandwidth_gbs()
            for row in rows:  # mean context over the decode: prompt + half the output
                row["floor_ms"] = floor_ms(
                    llm, row["batch"], args.prompt_len + args.output_len // 2, copy_gbs
                )
                row["step_over_floor"] = row["decode_step_ms"] / row["floor_ms"]
        if args.profile:
            profile_decode(llm, max(args.batch_sizes), args.prompt_len, vocab)
        cuda_graphs = llm.engine.runner.graphs is not None  # closing destroys them
        llm.close()
    result = {
        "model": args.model or args.shape,
        "device": str(llm.engine.runner.device),
        "dtype": str(llm.engine.runner.dtype),
        "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "cuda_graphs": cuda_graphs,
        "async_scheduling": llm.engine.config.async_scheduling,
        "tensor_parallel_size": args.tensor_parallel_size,
        "peer_all_reduce": llm.engine.runner.tp.peer is not None,
        "quantization": str(llm.engine.runner.quantization or "none"),
        "weight_bytes_batch_1": weight_bytes_read(llm.engine.runner.model, 1),
        "speculative_config": args.speculative_config,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(
        f"{result['model']} on {result['device']} ({result['dtype']}), prompt {args.prompt_len}, output {args.output_len}"
    )
    print(
        f"CUDA graphs: {result['cuda_graphs']}, async scheduling: {result['async_scheduling']} "
        f"({sum(r['steps_ahead'] for r in rows)} of {sum(r['decode_steps'] for r in rows)} decode steps "
        "launched ahead), "
        f"tensor parallel: {args.tensor_parallel_size} (peer all-reduce: {result['peer_all_reduce']}), "
        f"speculative config: {args.speculative_config or 'naive'}, weights: {result['quantization']} "
        f"({result['weight_bytes_batch_1'] / 2**20:.1f} MiB read a step at batch 1)"
    )
    print(
        "| batch | output tokens | seconds | output tok/s | decode step ms (p50) | floor ms | step / floor |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        floor = f"{r['floor_ms']:.3f} | {r['step_over_floor']:.2f}x" if "floor_ms" in r else "- | -"
        print(
            f"| {r['batch']} | {r['output_tokens']} | {r['seconds']:.2f} | {r['output_tok_per_s']:.1f} "
            f"| {r['decode_step_ms']:.3f} ({r['decode_step_p50_ms']:.3f}) | {floor} |"
        )


if __name__ == "__main__":
    main()
