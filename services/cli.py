"""The `specmesh` command: one subcommand per job."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable

from pydantic import ValidationError

from shared.config import EngineConfig
from shared.errors import describe_validation_error
from shared.model import ModelConfigError
from shared.sampling_params import SamplingParams
from shared.speculative_config import SpeculativeConfig
from training.train_mtp import add_train_mtp_parser

Command = Callable[[argparse.Namespace], int]


def add_engine_args(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    """Flags that size and shape a worker's engine; names follow vLLM / FastDeploy."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", required=model_required, help="Hugging Face model directory")
    group.add_argument(
        "--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16"
    )
    group.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    group.add_argument("--max-model-len", type=int, help="longest prompt + output in tokens")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    group.add_argument("--num-kv-blocks", type=int, help="fixed KV-cache size in blocks")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--cpu-kv-cache-space-gib", type=float, default=2.0)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int)
    group.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    group.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--speculative-config",
        help='draft method and verification as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'',
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_cache_space_gib=args.cpu_kv_cache_space_gib,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        speculative_config=SpeculativeConfig.from_json(args.speculative_config),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from services.engine.engine import LLMEngine

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        seed=args.request_seed,
        stop=args.stop or [],
    )
    started = time.perf_counter()
    engine = LLMEngine(engine_config(args))
    loaded = time.perf_counter()
    engine.add_request("cli", prompt=args.prompt, params=params)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            sys.stdout.write(output.new_text)
            sys.stdout.flush()
            final = output
    finished = time.perf_counter()
    sys.stdout.write("\n")
    assert final is not None
    num_generated = len(final.token_ids)
    decode_s = finished - loaded
    stats = final.spec_stats
    spec = ""
    if stats.get("num_verify_steps"):
        spec = (
            f" | {stats['method']}: {stats['num_accepted_tokens']}/{stats['num_draft_tokens']} drafts accepted, "
            f"mean accepted length {stats['mean_accepted_length']:.2f}"
        )
    print(
        f"load {loaded - started:.2f} s | prompt {len(final.prompt_token_ids)} tokens | "
        f"generated {num_generated} tokens in {decode_s:.2f} s ({num_generated / decode_s:.1f} tok/s) | "
        f"TTFT {final.metrics.get('ttft_s', 0.0) * 1000:.0f} ms | finish {final.finish_reason}{spec}",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh", description="Speculative-decoding LLM serving mesh")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    generate = sub.add_parser("generate", help="generate text for one prompt, offline")
    add_engine_args(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--stop", action="append", help="stop string (repeatable)")
    generate.add_argument("--request-seed", type=int, help="per-request sampling seed")
    generate.add_argument("--ignore-eos", action="store_true")
    generate.set_defaults(handler=cmd_generate)
    add_train_mtp_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    handler: Command = args.handler
    try:
        return handler(args)
    except ValidationError as exc:
        print(f"specmesh {args.command}: error: {describe_validation_error(exc)}", file=sys.stderr)
        return 2
    except (ModelConfigError, ValueError) as exc:
        print(f"specmesh {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
