"""The `specmesh` command: one subcommand per job."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable

from pydantic import ValidationError

from services.engine.args import add_engine_args, engine_config
from services.gateway.main import add_gateway_parser
from services.scheduler.main import add_scheduler_parser
from services.serve import add_serve_parser
from services.suffix_cache.service import add_suffix_cache_parser
from services.worker.main import add_worker_parsers
from shared.errors import describe_validation_error
from shared.model import ModelConfigError
from shared.sampling_params import SamplingParams
from training.train_mtp import add_train_mtp_parser

Command = Callable[[argparse.Namespace], int]


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
    add_serve_parser(sub)
    add_scheduler_parser(sub)
    add_gateway_parser(sub)
    add_suffix_cache_parser(sub)
    add_worker_parsers(sub)
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
    except (ModelConfigError, ValueError, FileNotFoundError, ConnectionError) as exc:
        print(f"specmesh {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
