"""Time to first token for prompts of many distinct lengths: the first time each length is seen
and again, in one engine. A gap between the two is a per-shape cost (kernel compiles, attention
plans) that a server pays on every new prompt length.

    python -m benchmarks.prefill_latency --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from services.engine.llm import LLM
from shared.reference import default_model
from shared.sampling_params import SamplingParams


def time_to_first_token(llm: LLM, prompt: list[int]) -> float:
    engine = llm.engine
    started = time.perf_counter()
    engine.add_request(f"ttft-{started}", prompt_token_ids=prompt, params=SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="model directory (default: the shipped reference model)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 257, 300, 333, 517, 700, 901, 1200])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    llm = LLM(args.model or default_model(), device=args.device, enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in args.lengths]
    first = [time_to_first_token(llm, p) for p in prompts]
    again = [time_to_first_token(llm, p) for p in prompts]
    print(f"device {llm.engine.runner.device}, model {args.model or default_model()}")
    print("| prompt tokens | first TTFT ms | repeated TTFT ms |\n|---:|---:|---:|")
    for n, a, b in zip(args.lengths, first, again):
        print(f"| {n} | {a:.1f} | {b:.1f} |")
    print(f"median first {statistics.median(first):.1f} ms, repeated {statistics.median(again):.1f} ms")
    if args.out:
        args.out.write_text(
            json.dumps({"lengths": args.lengths, "first_ms": first, "again_ms": again}, indent=2)
        )


if __name__ == "__main__":
    main()
