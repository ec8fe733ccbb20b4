"""Hugging Face transformers `generate()` on the same model and device, as an outside baseline.

Two variants: `hf` (plain greedy or sampled decoding) and `hf_prompt_lookup`
(`prompt_lookup_num_tokens`, HF's n-gram drafting, Saxena 2023), which HF runs at batch 1 only.
`benchmarks.offline --hf-baseline` sends the workload prompts one request at a time, tokenized with
specmesh's tokenizer so both engines see the same ids. Run alone, this module times
`benchmarks.bench_engine`'s workload (random prompts, greedy, EOS ignored), so its table and
bench_engine's can be set side by side:

    python -m benchmarks.hf_baseline --model DIR --dtype bfloat16 --batch-sizes 1 16 64 \\
        --prompt-len 128 --output-len 128 --out hf.json

Plain `generate()` runs every batch size (prompts of equal length, so no padding), prompt lookup
batch 1. Each row is one timed call after a warm-up call on the same prompts. A streamer stamps each
step's tokens as they reach the host; on CUDA `generate()` already waits for the device every step
(it reads its stop flag on the host), so the stamps cost a copy of the step's token ids and no extra
wait. The first stamp ends the prefill (TTFT); *decode step ms* is the mean gap between later stamps,
as bench_engine's decode step time; *ms per decode token* divides the time after the first stamp by
the tokens each sequence got after it (a prompt-lookup step delivers several). Two calls with 1 and N
new tokens would also separate the prefill, but by a difference of two noisy totals, and say nothing
of lookup's multi-token steps. Output tok/s counts the whole call, prefill included, as bench_engine's
does. On random weights lookup's acceptance means nothing; its row times the method's overhead.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.bench_engine import random_prompt_ids
from benchmarks.client import Sampling
from benchmarks.dataset import WARMUP_PROMPT, BenchRequest
from benchmarks.metrics import RequestRecord
from shared.tokenizer import Tokenizer

VARIANTS = ("hf", "hf_prompt_lookup")
WARMUP_TOKENS = 4


def unavailable_reason(device: str) -> str | None:
    """Why the HF baseline cannot run on `device`, or None when it can."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed (pip install -e '.[bench]')"
    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"device {device} requested but CUDA is not available"
    return None


class StampStreamer:
    """A `generate()` streamer that records when each step's new tokens arrive and how many each
    sequence got (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.num_tokens: list[int] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        # [batch] after a plain step, [1, num_new_tokens] after an assisted (prompt lookup) step
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        if value.device.type == "cuda":
            torch.cuda.synchronize(value.device)
        self.times.append(time.perf_counter())
        self.num_tokens.append(value.shape[-1] if value.dim() > 1 else 1)

    def end(self) -> None:
        pass


class HFBaseline:
    def __init__(self, model_dir: str, device: str, dtype: torch.dtype):
        import transformers

        self.device = torch.device(device)
        # `dtype` since transformers 4.56; older releases call it `torch_dtype`
        old = tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (4, 56)
        model: Any = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, attn_implementation="sdpa", **{"torch_dtype" if old else "dtype": dtype}
        )
        self.model = model.to(self.device).eval()
        self.tokenizer = Tokenizer(model_dir)

    def close(self) -> None:
        """Frees the model's memory (the engine runs next on the same device)."""
        del self.model

    def run(
        self,
        requests: list[BenchRequest],
        sampling: Sampling,
        prompt_lookup_num_tokens: int | None,
        progress: tqdm | None = None,
    ) -> list[RequestRecord]:
        self.generate(BenchRequest("warmup", "warmup", WARMUP_PROMPT, 8), sampling, prompt_lookup_num_tokens)
        records = []
        for request in requests:
            records.append(self.generate(request, sampling, prompt_lookup_num_tokens))
            if progress is not None:
                progress.update(1)
        return records

    def generate(
        self, request: BenchRequest, sampling: Sampling, prompt_lookup_num_tokens: int | None
    ) -> RequestRecord:
        ids = self.tokenizer.encode(request.prompt)
        record = RequestRecord(request.id, request.workload, arrived_at=time.perf_counter())
        output, streamer = self.generate_ids(
            torch.tensor([ids]), request.max_tokens, sampling, prompt_lookup_num_tokens
        )
        record.finished_at = time.perf_counter()
        record.token_times = streamer.times
        record.num_prompt_tokens = len(ids)
        record.num_output_tokens = int(output.shape[1]) - len(ids)
        return record

    @torch.inference_mode()
    def generate_ids(
        self,
        prompt_ids: torch.Tensor,  # [batch, prompt_len], no padding
        max_tokens: int,
        sampling: Sampling,
        prompt_lookup_num_tokens: int | None,
    ) -> tuple[torch.Tensor, StampStreamer]:
        """The prompts and their continuations ([batch, prompt_len + new]), and the step stamps."""
        input_ids = prompt_ids.to(self.device)
        streamer = StampStreamer()
        output = self.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            streamer=streamer,
            **self._generate_kwargs(max_tokens, sampling, prompt_lookup_num_tokens),
        )
        return output, streamer

    def _generate_kwargs(
        self, max_tokens: int, sampling: Sampling, prompt_lookup_num_tokens: int | None
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "pad_token_id": self.model.config.pad_token_id or 0,
        }
        if sampling.temperature > 0:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=1.0, top_k=0)
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if sampling.ignore_eos:
            kwargs["min_new_tokens"] = max_tokens
        if prompt_lookup_num_tokens:
            kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
        return kwargs


# ---- bench_engine's workload: batched random prompts --------------------------------------------------


def time_generate(
    hf: HFBaseline, prompt_ids: torch.Tensor, output_len: int, prompt_lookup_num_tokens: int | None
) -> dict[str, Any]:
    """One row: a warm-up call, then one timed greedy `generate()` of `prompt_ids`, EOS ignored."""
    sampling = Sampling(ignore_eos=True)
    hf.generate_ids(prompt_ids, WARMUP_TOKENS, sampling, prompt_lookup_num_tokens)
    started = time.perf_counter()
    output, streamer = hf.generate_ids(prompt_ids, output_len, sampling, prompt_lookup_num_tokens)
    seconds = time.perf_counter() - started
    batch, prompt_len = prompt_ids.shape
    num_new = int(output.shape[1]) - prompt_len  # per sequence
    decode_s = streamer.times[-1] - streamer.times[0]
    return {
        "variant": VARIANTS[1] if prompt_lookup_num_tokens else VARIANTS[0],
        "batch": batch,
        "output_tokens": batch * num_new,
        "seconds": seconds,
        "output_tok_per_s": batch * num_new / seconds,
        "ttft_ms": 1e3 * (streamer.times[0] - started),
        "decode_step_ms": 1e3 * decode_s / max(1, len(streamer.times) - 1),
        "decode_ms_per_token": 1e3 * decode_s / max(1, sum(streamer.num_tokens[1:])),
        "tokens_per_step": sum(streamer.num_tokens) / len(streamer.times),
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"HF generate() on {result['model']}, {result['device']} ({result['dtype']}, "
        f"{result['attn_implementation']}), prompt {result['prompt_len']}, output {result['output_len']}"
    )
    print(
        "| variant | batch | output tokens | seconds | output tok/s | TTFT ms | decode step ms "
        "| ms / decode token | tokens / step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in result["rows"]:
        print(
            f"| {r['variant']} | {r['batch']} | {r['output_tokens']} | {r['seconds']:.2f} "
            f"| {r['output_tok_per_s']:.1f} | {r['ttft_ms']:.1f} | {r['decode_step_ms']:.3f} "
            f"| {r['decode_ms_per_token']:.3f} | {r['tokens_per_step']:.2f} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=10, help="0: no prompt-lookup row")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/hf_baseline.json"))
    args = parser.parse_args(argv)
    reason = unavailable_reason(args.device)
    if reason:
        print(f"HF baseline skipped: {reason}", file=sys.stderr)
        return 2

    import transformers

    hf = HFBaseline(args.model, args.device, getattr(torch, args.dtype))
    vocab_size = hf.model.config.vocab_size
    runs = [(b, None) for b in args.batch_sizes]
    runs += [(1, args.prompt_lookup_num_tokens)] if args.prompt_lookup_num_tokens else []
    rows = [
        time_generate(hf, random_prompt_ids(batch, args.prompt_len, vocab_size), args.output_len, lookup)
        for batch, lookup in runs
    ]
    result = {
        "model": args.model,
        "device": str(hf.device),
        "dtype": args.dtype,
        "attn_implementation": hf.model.config._attn_implementation,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "prompt_lookup_num_tokens": args.prompt_lookup_num_tokens,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
