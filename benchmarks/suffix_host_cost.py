"""Host time a step of suffix decoding costs, replayed on the CPU without the model.

The target's greedy outputs are generated once (naive, the shipped model); then the suffix
proposer is driven as the engine drives it under greedy verification: each step every running
request verifies its drafts against its true continuation (the accepted prefix plus one token are
appended), then the running requests draft their next step. Only the proposer's own calls are
timed, on the engine's thread: `append` and `propose` (the per-request indexes' updates and
look-ups; the global index's look-ups inside `propose` apart), and `forget` (a finished output
goes into the in-process global index; on a GPU a thread does that, in the mesh the suffix-cache
service). Prompts are indexed at each request's first draft, as on the CPU; `--prepare` indexes
them before the steps instead, as the engine does on a GPU while the device runs a step.
`--warm-global` first replays the same requests untimed, so that the global index holds their
outputs: every request then finds long global matches (the costliest global look-ups).

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
from services.engine.spec_decode.suffix_tree import GlobalSuffixIndex, SuffixDraft
from shared.reference import default_model
from shared.sampling_params import SamplingParams

Stream = tuple[list[int], list[int]]
"""A request's prompt ids and greedy output ids."""


@dataclass
class StepTimes:
    own_s: list[float] = field(default_factory=list)
    """Per step: the per-request indexes' updates and look-ups."""
    global_s: list[float] = field(default_factory=list)
    """Per step: the global index's look-ups."""
    insert_s: list[float] = field(default_factory=list)
    """Per step: finished outputs put into the global index."""
    num_accepted: int = 0
    num_drafted: int = 0

    @property
    def total_s(self) -> float:
        return sum(self.own_s) + sum(self.global_s)


class TimedIndex:
    """The global index, counting the time its look-ups take."""

    def __init__(self, index: GlobalSuffixIndex) -> None:
        self.index = index
        self.seconds = 0.0

    def add_sequence(self, seq_id: str, token_ids: list[int]) -> None:
        self.index.add_sequence(seq_id, token_ids)

    def speculate_batch(self, queries: list[tuple[list[int], int]]) -> list[SuffixDraft | None]:
        began = time.perf_counter()
        drafts = self.index.speculate_batch(queries)
        self.seconds += time.perf_counter() - began
        return list(drafts)


def greedy_outputs(model: str, workload: str, num_requests: int, max_tokens: int) -> list[Stream]:
    """(prompt ids, greedy output ids) of each request, from the plain engine on the CPU."""
    llm = LLM(model, device="cpu")
    requests = load_requests(workload, num_requests)
    prompts = [llm.tokenizer.encode(r.prompt) for r in requests]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [(prompt, out.token_ids) for prompt, out in zip(prompts, outputs)]


def accepted_tokens(draft: list[int], output: list[int], done: int) -> list[int]:
    """What greedy verification keeps: the drafts that match the output, then the output's next token."""
    num_accepted = 0
    while num_accepted < len(draft) and done + num_accepted < len(output):
        if draft[num_accepted] != output[done + num_accepted]:
            break
        num_accepted += 1
    return output[done : done + num_accepted + 1]


def replay(streams: list[Stream], concurrency: int, k: int, prepare: bool, warm_global: bool) -> StepTimes:
    """Runs the requests `concurrency` at a time through one proposer, timing its calls per step
    (after an untimed first pass with `warm_global`)."""
    config = SuffixConfig()
    global_index = TimedIndex(config.global_index())
    proposer = SuffixProposer(config, global_index)
    if warm_global:
        replay_pass(proposer, global_index, streams, concurrency, k, prepare, "warm-")
    return replay_pass(proposer, global_index, streams, concurrency, k, prepare, "")


def replay_pass(
    proposer: SuffixProposer,
    global_index: TimedIndex,
    streams: list[Stream],
    concurrency: int,
    k: int,
    prepare: bool,
    id_prefix: str,
) -> StepTimes:
    times = StepTimes()
    params = SamplingParams(temperature=0.0, max_tokens=max(len(out) for _, out in streams))
    for start in range(0, len(streams), concurrency):
        group = streams[start : start + concurrency]
        running = [
            Sequence(f"{id_prefix}r{start + i}", list(p), params, frozenset())
            for i, (p, _) in enumerate(group)
        ]
        outputs = {seq.request_id: out for seq, (_, out) in zip(running, group)}
        drafts: dict[str, list[int]] = {seq.request_id: [] for seq in running}
        for seq in running:
            proposer.start(seq)
        if prepare:
            proposer.prepare(lambda: True)
        while running:
            began = time.perf_counter()
            for seq in running:
                new = accepted_tokens(drafts[seq.request_id], outputs[seq.request_id], seq.num_output_tokens)
                times.num_accepted += len(new) - 1
                times.num_drafted += len(drafts[seq.request_id])
                seq.token_ids += new
                proposer.append(seq, new)
            own_s = time.perf_counter() - began
            finished = [s for s in running if s.num_output_tokens >= len(outputs[s.request_id])]
            running = [s for s in running if s not in finished]
            began = time.perf_counter()
            for seq in finished:
                proposer.forget(seq.request_id)
            times.insert_s.append(time.perf_counter() - began)
            ks = [max(0, min(k, len(outputs[s.request_id]) - s.num_output_tokens - 1)) for s in running]
            global_index.seconds, began = 0.0, time.perf_counter()
            if running:
                proposed = proposer.propose(DraftBatch.on_host(None, running, ks))  # type: ignore[arg-type]
                counts = proposed.num_drafts.tolist()
                for seq, row, n in zip(running, proposed.token_ids.tolist(), counts):
                    drafts[seq.request_id] = row[:n]
            times.own_s.append(own_s + time.perf_counter() - began - global_index.seconds)
            times.global_s.append(global_index.seconds)
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
        "--repeats", type=int, default=3, help="replays per concurrency; the fastest is shown"
    )
    parser.add_argument("--outputs", type=Path, help="cache of the greedy outputs (JSON), written if absent")
    parser.add_argument("--prepare", action="store_true", help="index prompts before the steps, as on a GPU")
    parser.add_argument(
        "--warm-global", action="store_true", help="time a second pass over the same requests"
    )
    args = parser.parse_args()
    if args.outputs is not None and args.outputs.exists():
        streams = [(p, o) for p, o in json.loads(args.outputs.read_text())]
    else:
        model = args.model or default_model()
        streams = greedy_outputs(model, args.workload, args.num_requests, args.max_tokens)
        if args.outputs is not None:
            args.outputs.write_text(json.dumps(streams))
    print(
        "| requests | steps | own indexes ms/step (p90) | global look-ups ms/step | global inserts ms/step |"
    )
    print("|---:|---:|---:|---:|---:|")
    for concurrency in args.concurrency:
        runs = [
            replay(streams, concurrency, args.k, args.prepare, args.warm_global) for _ in range(args.repeats)
        ]
        best = min(runs, key=lambda t: t.total_s)
        p90_ms = 1e3 * statistics.quantiles(best.own_s, n=10)[-1]
        print(
            f"| {concurrency} | {len(best.own_s)} | {1e3 * statistics.fmean(best.own_s):.3f} ({p90_ms:.3f}) | "
            f"{1e3 * statistics.fmean(best.global_s):.3f} | {1e3 * statistics.fmean(best.insert_s):.3f} |"
        )
    print(f"accepted / drafted tokens: {best.num_accepted} / {best.num_drafted}")


if __name__ == "__main__":
    main()
