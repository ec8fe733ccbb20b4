"""Where an engine step's host time goes: cProfile over one request's decode (any method).

python -m benchmarks.profile_step --device cuda --speculative-config '{"method": "ngram"}'
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

from benchmarks.dataset import load_requests
from services.engine.llm import LLM
from shared.reference import default_model
from shared.sampling_params import SamplingParams
from shared.speculative_config import SpeculativeConfig


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--workload", default="code_editing")
    parser.add_argument("--speculative-config")
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=1, help="requests generated together")
    parser.add_argument("--rows", type=int, default=35)
    args = parser.parse_args()
    llm = LLM(
        args.model or default_model(),
        device=args.device,
        speculative_config=SpeculativeConfig.from_json(args.speculative_config),
    )
    requests = load_requests(args.workload, args.num_requests)
    params = SamplingParams(temperature=0.0, max_tokens=128)
    llm.generate(prompts=[requests[0].prompt], sampling_params=params)  # warm-up
    profiler = cProfile.Profile()
    profiler.enable()
    for start in range(0, len(requests), args.concurrency):
        batch = requests[start : start + args.concurrency]
        llm.generate(prompts=[r.prompt for r in batch], sampling_params=params)
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(args.rows)
    stats.sort_stats("cumulative").print_stats(args.rows)


if __name__ == "__main__":
    main()
