"""`specmesh generate`: one prompt through an in-process engine, offline, streamed to stdout.

    specmesh generate --prompt "..." --max-tokens 128 --speculative-config '{"method": "ngram"}'
    specmesh generate --prompt "..." --guided-json '{"type": "object", ...}'   # or --guided-regex / --guided-choice

Load time, TTFT, decode throughput and, with drafts, the acceptance go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from services.engine.args import add_engine_args, engine_config
from shared.sampling_params import SamplingParams
from shared.structured_output import StructuredOutput


def add_generate_parser(subparsers: Any) -> None:
    generate = subparsers.add_parser("generate", help="generate text for one prompt, offline")
    add_engine_args(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--stop", action="append", help="stop string (repeatable)")
    generate.add_argument("--request-seed", type=int, help="per-request sampling seed")
    generate.add_argument("--ignore-eos", action="store_true")
    grammar = generate.add_mutually_exclusive_group()
    grammar.add_argument(
        "--guided-json", metavar="SCHEMA", help="constrain the output to this JSON Schema (JSON text)"
    )
    grammar.add_argument("--guided-regex", metavar="REGEX", help="constrain the output to match this regex")
    grammar.add_argument(
        "--guided-choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)"
    )
    generate.set_defaults(handler=cmd_generate)


def structured_output(args: argparse.Namespace) -> StructuredOutput | None:
    """The grammar the flags ask for; a bad schema or regex fails here, with the engine's reason."""
    if args.guided_json is not None:
        structured = StructuredOutput.json_schema(args.guided_json)
    elif args.guided_regex is not None:
        structured = StructuredOutput(kind="regex", spec=args.guided_regex)
    elif args.guided_choice:
        structured = StructuredOutput.choice(args.guided_choice)
    else:
        return None
    structured.check()
    return structured


def cmd_generate(args: argparse.Namespace) -> int:
    from services.engine.engine import LLMEngine  # torch: not needed to parse the flags

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        seed=args.request_seed,
        stop=args.stop or [],
        structured=structured_output(args),
    )
    started = time.perf_counter()
    engine = LLMEngine(engine_config(args))
    loaded = time.perf_counter()
    engine.add_request("cli", prompt=args.prompt, params=params)
    final = None
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                sys.stdout.write(output.new_text)
                sys.stdout.flush()
                final = output
    finally:
        engine.close()
    finished = time.perf_counter()
    sys.stdout.write("\n")
    assert final is not None
    num_generated = len(final.token_ids)
    decode_s = finished - loaded
    stats = final.spec_stats
    quantization = engine.runner.quantization
    weights = f" | weights {quantization}" if quantization else ""
    spec = ""
    if stats.get("num_verify_steps"):
        spec = (
            f" | {stats['method']}: {stats['num_accepted_tokens']}/{stats['num_draft_tokens']} drafts accepted, "
            f"mean accepted length {stats['mean_accepted_length']:.2f}"
        )
    print(
        f"load {loaded - started:.2f} s{weights} | prompt {len(final.prompt_token_ids)} tokens | "
        f"generated {num_generated} tokens in {decode_s:.2f} s ({num_generated / decode_s:.1f} tok/s) | "
        f"TTFT {final.metrics.get('ttft_s', 0.0) * 1000:.0f} ms | finish {final.finish_reason}{spec}",
        file=sys.stderr,
    )
    return 0
