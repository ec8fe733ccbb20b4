"""Host time a step of suffix decoding costs, replayed on the CPU without the model.

The target's greedy outputs are generated once (naive, the shipped model); then the suffix
proposer is driven exactly as the engine drives it under greedy verification: each step every
running request verifies its drafts against its true continuation (the accepted prefix plus one
token are appended), then the running requests draft their next step. Only the proposer's own
calls are timed: `append` (the per-request index updates), `propose` (the look-ups) and `forget`
(a finished output goes into the global index).

python -m benchmarks.suffix_host_cost --concurrency 1 16 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.dataset import load_requests
from services.engine.llm import LLM
from services.engine.sequence import Sequence
from services.engine.spec_decode.proposer import DraftBatch
from services.engine.spec_decode.suffix import SuffixConfig, SuffixProposer
from shared.reference import default_model
from shared.sampling_params import SamplingParams


@dataclass
class StepTimes:
    append_s: list[float] = field(default_factory=list)
    propose_s: list[float] = field(default_factory=list)
    forget_s: list[float] = field(default_factory=list)
    num_tokens: int = 0
    num_accepted: int = 0
    num_drafted: int = 0


def greedy_outputs(
    model: str, workload: str, num_requests: int, max_tokens: int
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy output ids) of each request, from the plain engine on the CPU."""
    llm = LLM(model, device="cpu")
    requests = load_requests(workload, num_requests)
    prompts = [llm.tokenizer.encode(r.prompt) for r in requests]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [(prompt, out.token_ids) for prompt, out in zip(prompts, outputs)]


def replay(streams: list[tuple[list[int], list[int]]], concurrency: int, k: int) -> StepTimes:
    """Runs the requests `concurrency` at a time through one proposer, timing its calls per step."""
    proposer = SuffixProposer(SuffixConfig())
    times = StepTimes()
    params = SamplingParams(temperature=0.0, max_tokens=max(len(out) for _, out in streams))
    for start in range(0, len(streams), concurrency):
        group = streams[start : start + concurrency]
        seqs = [
            Sequence(f"r{start + i}", list(prompt), params, frozenset())
            for i, (prompt, _) in enumerate(group)
        ]
        for seq in seqs:
            proposer.start(seq)
        outputs = {seq.request_id: out for seq, (_, out) in zip(seqs, group)}
        drafts: dict[str, list[int]] = {seq.request_id: [] for seq in seqs}
        running = list(seqs)
        while running:
            append_s = 0.0
            for seq in running:
                out = outputs[seq.request_id]
                done = seq.num_output_tokens
                draft = drafts[seq.request_id]
                accepted = 0
                while (
                    accepted < len(draft)
                    and done + accepted < len(out)
                    and draft[accepted] == out[done + accepted]
                ):
                    accepted += 1
                new = out[done : done + accepted + 1]
                times.num_accepted += accepted
                times.num_drafted += len(draft)
                seq.token_ids += new
                times.num_tokens += len(new)
                began = time.perf_counter()
                proposer.append(seq, new)
                append_s += time.perf_counter() - began
            forget_s = 0.0
            for seq in [s for s in running if s.num_output_tokens >= len(outputs[s.request_id])]:
                began = time.perf_counter()
                proposer.forget(seq.request_id)
                forget_s += time.perf_counter() - began
            running = [s for s in running if s.num_output_tokens < len(outputs[s.request_id])]
            ks = [max(0, min(k, len(outputs[s.request_id]) - s.num_output_tokens - 1)) for s in running]
            began = time.perf_counter()
            proposed = proposer.propose(DraftBatch.on_host(None, running, ks)) if running else None  # type: ignore[arg-type]
            propose_s = time.perf_counter() - began
            if proposed is not None:
                for seq, row, n in zip(running, proposed.token_ids.tolist(), proposed.num_drafts.tolist()):
                    drafts[seq.request_id] = row[:n]
            times.append_s.append(append_s)
            times.propose_s.append(propose_s)
            times.forget_s.append(forget_s)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--workload", default="agentic")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--k", type=int, default=8, help="drafts asked for per request and step")
    parser.add_argument(
        "--repeats", type=int, default=3, help="replays per concurrency; the fastest is reported"
    )
    parser.add_argument("--outputs", type=Path, help="cache of the greedy outputs (JSON), written if absent")
    args = parser.parse_args()
    if args.outputs is not None and args.outputs.exists():
        streams = [tuple(s) for s in json.loads(args.outputs.read_text())]
    else:
        streams = greedy_outputs(
            args.model or default_model(), args.workload, args.num_requests, args.max_tokens
        )
        if args.outputs is not None:
            args.outputs.write_text(json.dumps(streams))
    print(
        "| requests | steps | index updates ms/step | look-ups ms/step | finish ms/step | total ms/step | accepted/drafted |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for concurrency in args.concurrency:
        runs = [replay(streams, concurrency, args.k) for _ in range(args.repeats)]  # type: ignore[arg-type]
        best = min(runs, key=lambda t: sum(t.append_s) + sum(t.propose_s) + sum(t.forget_s))
        steps = len(best.append_s)
        append_ms, propose_ms = 1e3 * statistics.fmean(best.append_s), 1e3 * statistics.fmean(best.propose_s)
        forget_ms = 1e3 * statistics.fmean(best.forget_s)
        print(
            f"| {concurrency} | {steps} | {append_ms:.3f} | {propose_ms:.3f} | {forget_ms:.3f} | "
            f"{append_ms + propose_ms + forget_ms:.3f} | {best.num_accepted}/{best.num_drafted} |"
        )


if __name__ == "__main__":
    main()
