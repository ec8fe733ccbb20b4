"""Offline benchmark: the serving metrics measured in-process on the engine (no mesh).

    python -m benchmarks.offline --workload code_editing agentic --concurrency 1 16 64 256 \\
        --methods naive ngram suffix mtp hybrid draft_model --hf-baseline

For every workload and concurrency, each method runs the same requests on a fresh engine (so no
method inherits another's prefix or suffix cache), `naive` first, one after the other in this
process: speedups are ratios of these side-by-side runs. *Concurrency* is the most requests inside
the engine at once (the engine's `max_num_seqs` too); `--request-rate` makes arrivals a Poisson
process instead of a closed loop. TTFT counts from a request's arrival to the end of the step that
produced its first token; TPOT and ITL come from the step timestamps. `--k-sweep` re-runs each
method with several k at the first concurrency (acceptance vs k); `--hf-baseline` adds Hugging Face
`generate()` (plain and prompt lookup) at concurrency 1 on the same model and device;
`--json-schema` constrains every output to a schema (structured output under speculation).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.client import Sampling, arrival_offsets
from benchmarks.compare import (
    Cell,
    add_output_identity,
    add_speedups,
    model_dirs,
    result_header,
    save_and_print,
    weights_fingerprints,
    write_result,
)
from benchmarks.dataset import (
    WARMUP_PROMPT,
    WORKLOAD_NAMES,
    BenchRequest,
    num_distinct,
    requests_for_cell,
    warmup_burst,
)
from benchmarks.hf_baseline import HFBaseline, unavailable_reason
from benchmarks.methods import BASELINE, max_k, resolve_methods, with_k
from benchmarks.metrics import SLO, RequestRecord, SpecCounts, run_duration_s, summarize, token_digest
from services.engine.args import add_engine_args, engine_config
from services.engine.engine import LLMEngine, StepCounts
from services.runtime import freeze_start_up
from shared.config import EngineConfig
from shared.reference import default_model
from shared.sampling_params import SamplingParams
from shared.speculative_config import SpeculativeConfig
from shared.structured_output import StructuredOutput, StructuredOutputError

DEFAULT_CONCURRENCY = (1, 16, 64, 256)


# ---- one engine, one set of requests ----------------------------------------------------------------


def sampling_params(request: BenchRequest, sampling: Sampling) -> SamplingParams:
    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=request.max_tokens,
        ignore_eos=sampling.ignore_eos,
        seed=sampling.seed,
        structured=sampling.structured,
    )


class Admission:
    """Which requests enter the engine when: due by the arrival schedule, at most `limit` inside.

    A request's arrival is when it was due, or, if the engine was full then, when a slot freed up
    (the closed-loop client would have sent it then)."""

    def __init__(self, requests: list[BenchRequest], limit: int, request_rate: float | None, seed: int):
        self.started = time.perf_counter()
        offsets = arrival_offsets(len(requests), request_rate, seed)
        self.pending = deque((r, self.started + o) for r, o in zip(requests, offsets))
        self.limit = limit
        self.num_running = 0
        self.slot_free_since = self.started

    def due(self, now: float) -> list[tuple[BenchRequest, float]]:
        """Requests to add now, with their arrival times."""
        admitted = []
        while self.pending and self.num_running < self.limit and self.pending[0][1] <= now:
            request, due_at = self.pending.popleft()
            admitted.append((request, max(due_at, self.slot_free_since)))
            self.num_running += 1
        return admitted

    def finished(self, now: float) -> None:
        if self.num_running == self.limit:
            self.slot_free_since = now
        self.num_running -= 1

    def next_due_in(self) -> float:
        return max(0.0, self.pending[0][1] - time.perf_counter()) if self.pending else 0.0


def run_requests(
    engine: LLMEngine,
    requests: list[BenchRequest],
    sampling: Sampling,
    concurrency: int | None,
    request_rate: float | None = None,
    seed: int = 0,
    progress: tqdm | None = None,
) -> list[RequestRecord]:
    """Drives the engine step by step; every output is stamped when its step returns."""
    admission = Admission(requests, concurrency or len(requests), request_rate, seed)
    records: dict[str, RequestRecord] = {}
    while admission.pending or engine.has_unfinished_requests():
        for request, arrived_at in admission.due(time.perf_counter()):
            request_id = f"{len(records)}-{request.id}"
            records[request_id] = RequestRecord(request.id, request.workload, arrived_at=arrived_at)
            engine.add_request(request_id, prompt=request.prompt, params=sampling_params(request, sampling))
        if not engine.has_unfinished_requests():
            time.sleep(admission.next_due_in())
            continue
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            record = records[output.request_id]
            if output.new_token_ids:
                record.token_times.append(now)
            if output.finished:
                _finish(record, output.token_ids, output.prompt_token_ids, output.spec_stats, now)
                admission.finished(now)
                if progress is not None:
                    progress.update(1)
    return list(records.values())


def _finish(
    record: RequestRecord, token_ids: list[int], prompt_ids: list[int], stats: dict[str, Any], now: float
) -> None:
    record.finished_at = now
    record.num_output_tokens = len(token_ids)
    record.num_prompt_tokens = len(prompt_ids)
    record.spec = SpecCounts.from_stats(stats)
    record.output_digest = token_digest(token_ids)


def warm_up(engine: LLMEngine) -> None:
    """One short request, so one-time costs (allocator, kernels, lazy init) stay out of the timing."""
    warmup = BenchRequest("warmup", "warmup", WARMUP_PROMPT, 8)
    run_requests(engine, [warmup, warmup], Sampling(ignore_eos=True), concurrency=2)


def build_engine(config: EngineConfig) -> LLMEngine:
    """The engine of a cell, warmed up, its start-up frozen out of garbage collection as the
    worker's engine core freezes it (`free_memory` thaws it once the cell is done)."""
    engine = LLMEngine(config)
    warm_up(engine)
    freeze_start_up()
    return engine


def free_memory() -> None:
    """Returns a dropped engine's memory (the next cell's engine sizes its KV cache from what is free)."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- cells ----------------------------------------------------------------------------------------------


def measure(
    run: Callable[[tqdm | None], list[RequestRecord]], total: int, slo: SLO, desc: str, show: bool
) -> dict[str, Any]:
    """Runs once under a progress bar; the summary and the per-request records."""
    with tqdm(desc=desc, unit="req", disable=not show, leave=False, total=total) as progress:
        records = run(progress)
    return {
        "summary": summarize(records, run_duration_s(records), slo),
        "records": [r.compact() for r in records],
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Of repeated runs, the one with the median output tok/s; all throughputs kept."""
    throughputs = [r["summary"]["output_tok_per_s"] for r in runs]
    median = statistics.median_low(throughputs)
    chosen = runs[throughputs.index(median)]
    return {**chosen, "runs_output_tok_per_s": throughputs}


def engine_cell(
    base: EngineConfig,
    label: str,
    spec: dict[str, Any],
    requests: list[BenchRequest],
    concurrency: int,
    opts: argparse.Namespace,
) -> dict[str, Any]:
    config = base.model_copy(
        update={
            "speculative_config": SpeculativeConfig.model_validate(spec),
            "max_num_seqs": min(concurrency, base.max_num_seqs) if concurrency else base.max_num_seqs,
        }
    )
    engines = [build_engine(config)]  # a list, so the engine can be dropped before memory is freed
    try:
        if opts.warmup_burst:
            run_requests(engines[0], warmup_burst(requests, concurrency), opts.sampling, concurrency)
        engines[0].step_counts = StepCounts()
        measured = measure(
            lambda p: run_requests(
                engines[0], requests, opts.sampling, concurrency, opts.request_rate, opts.seed, p
            ),
            len(requests),
            opts.slo,
            f"{label} c={concurrency}",
            opts.progress,
        )
        measured["steps"] = steps = engines[0].step_counts.summary()
        print(
            f"steps {label} c={concurrency}: {steps['num_steps']}, "
            f"{100 * steps['ahead_share']:.1f}% launched ahead, "
            f"{100 * steps['waited_share']:.1f}% waited for the host (mean gap "
            f"{steps['mean_host_gap_ms']:.2f} ms, step {steps['mean_waited_step_ms']:.2f} ms; "
            f"others {steps['mean_other_step_ms']:.2f} ms)"
        )
        return measured
    finally:
        engines.pop().close()  # stops its other tensor-parallel ranks, if any
        free_memory()


def method_cells(
    base: EngineConfig,
    methods: dict[str, dict[str, Any]],
    workload: str,
    requests: list[BenchRequest],
    concurrency: int,
    opts: argparse.Namespace,
) -> list[Cell]:
    """Every method on the same requests, naive first, then (at concurrency 1, when asked) the HF
    baselines; with repeats the runs interleave (naive, a, b, hf, naive, a, b, hf, ...) so drift
    on a shared machine hits them alike."""
    hf_variants = hf_baselines(opts) if opts.hf_device_resolved and concurrency == 1 else {}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in [*methods, *hf_variants]}
    for _ in range(opts.repeats):
        for label, spec in methods.items():
            runs[label].append(engine_cell(base, label, spec, requests, concurrency, opts))
        for label, measured in hf_runs(base, hf_variants, requests, opts).items():
            runs[label].append(measured)
    configs = {**methods, **hf_variants}
    return [
        {
            "method": label,
            "backend": "hf" if label in hf_variants else "specmesh",
            "speculative_config": configs[label],
            "workload": workload,
            "concurrency": concurrency,
            "effective_concurrency": min(concurrency or len(requests), len(requests)),
            "num_distinct_prompts": num_distinct(requests),
            "request_rate": opts.request_rate,
            **median_run(runs[label]),
        }
        for label in runs
    ]


def hf_baselines(opts: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """label -> generate() options: plain, and prompt lookup."""
    return {"hf": {}, "hf_prompt_lookup": {"prompt_lookup_num_tokens": opts.hf_prompt_lookup_num_tokens}}


def resolve_hf_device(base: EngineConfig, opts: argparse.Namespace) -> str | None:
    """Where the HF baseline runs (the engine's device unless told), or None with the reason noted."""
    if not opts.hf_baseline:
        return None
    device = str(base.torch_device) if opts.hf_device == "auto" else opts.hf_device
    reason = unavailable_reason(device)
    if reason:
        print(f"HF baseline skipped: {reason}")
        opts.skipped.append(f"hf baseline: {reason}")
        return None
    return device


def hf_runs(
    base: EngineConfig,
    variants: dict[str, dict[str, Any]],
    requests: list[BenchRequest],
    opts: argparse.Namespace,
) -> dict[str, dict[str, Any]]:
    """Each HF variant once on the requests, the model loaded for the occasion and freed after."""
    if not variants:
        return {}
    hf = HFBaseline(opts.model, opts.hf_device_resolved, base.torch_dtype)
    try:
        return {
            label: hf_run(hf, label, options.get("prompt_lookup_num_tokens"), requests, opts)
            for label, options in variants.items()
        }
    finally:
        hf.close()
        free_memory()


def hf_run(
    hf: HFBaseline, label: str, lookup: int | None, requests: list[BenchRequest], opts: argparse.Namespace
) -> dict[str, Any]:
    return measure(
        lambda p: hf.run(requests, opts.sampling, lookup, p), len(requests), opts.slo, label, opts.progress
    )


def k_sweep(
    base: EngineConfig,
    methods: dict[str, dict[str, Any]],
    workload: str,
    requests: list[BenchRequest],
    concurrency: int,
    cells: list[Cell],
    opts: argparse.Namespace,
) -> list[dict[str, Any]]:
    """Acceptance and speedup of each method at each k of `--k-sweep` (naive from `cells`)."""
    naive = next(
        c
        for c in cells
        if c["method"] == BASELINE and c["workload"] == workload and c["concurrency"] == concurrency
    )
    rows = []
    for label, spec in methods.items():
        if label == BASELINE:
            continue
        for k in (k for k in opts.k_sweep if k <= max_k(spec)):
            cell = engine_cell(base, f"{label} k={k}", with_k(spec, k), requests, concurrency, opts)
            summary = cell["summary"]
            spec_summary = summary["speculative"]
            rows.append(
                {
                    "workload": workload,
                    "method": label,
                    "k": k,
                    "concurrency": concurrency,
                    "output_tok_per_s": summary["output_tok_per_s"],
                    "speedup": summary["output_tok_per_s"] / naive["summary"]["output_tok_per_s"],
                    "mean_accepted_length": spec_summary["mean_accepted_length"],
                    "acceptance_rate": spec_summary["acceptance_rate"],
                    "acceptance_per_position": spec_summary["acceptance_per_position"],
                }
            )
    return rows


# ---- command ---------------------------------------------------------------------------------------------


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Flags the offline and online benchmarks share."""
    group = parser.add_argument_group("benchmark")
    group.add_argument("--workload", nargs="+", default=list(WORKLOAD_NAMES), help="names or .jsonl paths")
    group.add_argument("--num-requests", type=int, help="first N requests of each workload (default: all)")
    group.add_argument(
        "--requests-per-slot",
        type=int,
        help="at least this many requests per unit of concurrency (cycling the workload past its end)",
    )
    group.add_argument("--max-tokens", type=int, help="cap every request's max_tokens (short CPU runs)")
    group.add_argument(
        "--methods", nargs="+", help="method names or label={json} (default: every method the model has)"
    )
    group.add_argument("--request-rate", type=float, help="Poisson arrivals at this rate (req/s)")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--ignore-eos", action="store_true", help="every request generates max_tokens")
    group.add_argument("--request-seed", type=int, help="sampling seed for every request")
    group.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT objective")
    group.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT objective")
    group.add_argument(
        "--repeats", type=int, default=1, help="run each cell N times, interleaved; keep the median"
    )
    group.add_argument(
        "--torch-threads",
        type=int,
        help="torch CPU threads, here and in launched workers (1 on a shared CPU box: spinning threads "
        "on busy cores slow every step)",
    )
    group.add_argument(
        "--warmup-burst",
        action="store_true",
        help="before each cell's timed run, serve one untimed burst at its concurrency (its own prompts, "
        "each led by a marker: no prefix cache carries over), so one-time costs of the batch's shapes "
        "stay out of the timing (default: two short requests only)",
    )
    group.add_argument("--out", type=Path, help="result JSON (PNGs are written next to it)")
    group.add_argument("--no-plots", action="store_true")
    group.add_argument("--no-progress", dest="progress", action="store_false")
    group.add_argument(
        "--log",
        metavar="LOGGER",
        nargs="*",
        default=[],
        help="loggers whose INFO lines to show on stderr (e.g. services.engine.spec_decode.adaptive)",
    )


def finish_args(args: argparse.Namespace) -> None:
    args.model = args.model or default_model()
    args.sampling = Sampling(args.temperature, args.ignore_eos, args.request_seed, args.top_p)
    args.slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    args.skipped = []
    names = list(args.methods or [])
    if getattr(args, "speculative_config", None):
        names.append(f"custom={args.speculative_config}")
    args.method_configs = resolve_methods(names or None, args.model)
    weights_fingerprints(model_dirs(args.model, args.method_configs))  # as the weights are now


def settings(args: argparse.Namespace, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "workloads": args.workload,
        "num_requests": args.num_requests,
        "requests_per_slot": args.requests_per_slot,
        "max_tokens_cap": args.max_tokens,
        "methods": args.method_configs,
        "request_rate": args.request_rate,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "ignore_eos": args.ignore_eos,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "repeats": args.repeats,
        "torch_threads": args.torch_threads,
        **extra,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.offline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(parser)
    add_common_args(parser)
    group = parser.add_argument_group("offline")
    group.add_argument("--concurrency", type=int, nargs="+", default=list(DEFAULT_CONCURRENCY))
    group.add_argument("--k-sweep", type=int, nargs="*", default=[], help="acceptance vs k: these k")
    group.add_argument(
        "--hf-baseline", action="store_true", help="add HF generate() (plain, prompt lookup) at concurrency 1"
    )
    group.add_argument("--hf-device", default="auto", help="auto: the engine's device")
    group.add_argument("--hf-prompt-lookup-num-tokens", type=int, default=10)
    group.add_argument(
        "--json-schema",
        metavar="SCHEMA",
        help="constrain every output to this JSON schema (JSON text, or the path of a .json file), as "
        "the API's response_format json_schema does",
    )
    return parser


def json_schema_grammar(schema: str) -> StructuredOutput:
    """The grammar of `--json-schema`: a file's schema or the text itself; checked by the engine's
    grammar library, so a bad schema fails here with its reason."""
    path = Path(schema)
    text = path.read_text() if schema.endswith(".json") and path.is_file() else schema
    try:
        structured = StructuredOutput.json_schema(text)
        structured.check()
    except StructuredOutputError as exc:
        raise SystemExit(f"--json-schema: {exc}") from None
    return structured


def cell_requests(workload: str, concurrency: int | None, args: argparse.Namespace) -> list[BenchRequest]:
    return requests_for_cell(
        workload, args.num_requests, args.max_tokens, concurrency, args.requests_per_slot
    )


def use_torch_threads(threads: int | None) -> None:
    """This process's torch CPU threads (launched workers get theirs through OMP_NUM_THREADS)."""
    if threads:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every cell; the result file is rewritten after each group of cells, so a run cut short (a
    device call's time limit) still leaves what it measured."""
    use_torch_threads(args.torch_threads)
    base = engine_config(args)
    args.hf_device_resolved = resolve_hf_device(base, args)
    cells: list[Cell] = []
    sweep: list[dict[str, Any]] = []
    extra = {
        "concurrency": args.concurrency,
        "k_sweep": args.k_sweep,
        "engine": base.model_dump(mode="json"),
        "json_schema": args.json_schema,
    }

    def result(complete: bool) -> dict[str, Any]:
        header = result_header("offline", args.model, settings(args, extra))
        cells_so_far = add_speedups(cells)
        return {
            **header,
            "complete": complete,
            "skipped": args.skipped,
            "cells": cells_so_far,
            "k_sweep": sweep,
        }

    for workload in args.workload:
        for concurrency in args.concurrency:
            requests = cell_requests(workload, concurrency, args)
            new_cells = method_cells(
                base, args.method_configs, requests[0].workload, requests, concurrency, args
            )
            if args.sampling.temperature == 0:  # greedy: every method's outputs are naive's
                for line in add_output_identity(new_cells):
                    print(line)
            cells += new_cells
            write_result(result(complete=False), args.out, plot=False)
        if args.k_sweep:
            first = args.concurrency[0]
            requests = cell_requests(workload, first, args)
            sweep += k_sweep(base, args.method_configs, requests[0].workload, requests, first, cells, args)
            write_result(result(complete=False), args.out, plot=False)
    return result(complete=True)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    finish_args(args)
    if args.log:
        logging.basicConfig(format="%(name)s: %(message)s")
        for name in args.log:
            logging.getLogger(name).setLevel(logging.INFO)
    if args.json_schema:
        args.sampling = dataclasses.replace(args.sampling, structured=json_schema_grammar(args.json_schema))
    args.out = args.out or Path("benchmarks/results/offline.json")
    result = run(args)
    save_and_print(result, args.out, plot=not args.no_plots)


if __name__ == "__main__":
    main()
