"""Offline engine throughput: output tokens per second at several batch sizes.

    python -m benchmarks.bench_engine --shape llama-tiny --batch-sizes 1 32

Each batch size runs `batch` requests of `--prompt-len` random tokens generating `--output-len`
tokens each (greedy, EOS ignored), after one warm-up run. Results are printed as a table and
written as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.random_model import SHAPES, write_random_checkpoint
from services.engine.llm import LLM
from shared.sampling_params import SamplingParams


def run(llm: LLM, batch: int, prompt_len: int, output_len: int, vocab_size: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(batch)
    prompts = [
        torch.randint(1, vocab_size, (prompt_len,), generator=generator).tolist() for _ in range(batch)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=params.model_copy(update={"max_tokens": 4}))
    started = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - started
    num_out = sum(len(o.token_ids) for o in outputs)
    return {
        "batch": batch,
        "output_tokens": num_out,
        "seconds": elapsed,
        "output_tok_per_s": num_out / elapsed,
    }


def profile_decode(llm: LLM, batch: int, prompt_len: int, vocab_size: int) -> None:
    """Prints where 8 decode steps of a full batch spend their time (CPU and device)."""
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
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(write_random_checkpoint(args.shape, Path(tmp) / args.shape))
        llm = LLM(
            model_dir,
            dtype=args.dtype,
            max_model_len=args.prompt_len + args.output_len + 8,
            max_num_seqs=max(args.batch_sizes),
        )
        vocab = llm.engine.model_config.vocab_size
        rows = [run(llm, b, args.prompt_len, args.output_len, vocab) for b in args.batch_sizes]
        if args.profile:
            profile_decode(llm, max(args.batch_sizes), args.prompt_len, vocab)
    result = {
        "model": args.model or args.shape,
        "device": str(llm.engine.runner.device),
        "dtype": str(llm.engine.runner.dtype),
        "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(
        f"{result['model']} on {result['device']} ({result['dtype']}), prompt {args.prompt_len}, output {args.output_len}"
    )
    print("| batch | output tokens | seconds | output tok/s |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['output_tokens']} | {r['seconds']:.2f} | {r['output_tok_per_s']:.1f} |")


if __name__ == "__main__":
    main()
