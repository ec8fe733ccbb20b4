"""Online benchmark: an OpenAI-style streaming client against the gateway, under load.

    python -m benchmarks.serving --launch --workload code_editing --num-requests 16 --concurrency 4
    python -m benchmarks.serving --url http://127.0.0.1:8000 --workload agentic --request-rate 4

With `--launch`, every cell (method x workload x concurrency) gets a fresh local mesh — Redis,
scheduler, suffix-cache, one mixed worker, gateway, each its own process, as `specmesh serve` starts
them, with the engine flags given here — so no method inherits another's caches; `naive` runs first
and the methods one after the other, so speedups are ratios of side-by-side runs. With `--url`, the
methods are asked for per request (the `speculative` request field; the server must have them), and
all of them meet the one server's caches, warmed by the methods before them: use `--launch` for
side-by-side figures.

Each request streams `/v1/completions`; the client stamps every chunk: TTFT, TPOT, ITL, e2e
(p50 / p90 / p99), output tokens/s, requests/s, goodput under `--slo-ttft-ms` / `--slo-tpot-ms`,
mean accepted length from `usage.speculative` (summed) and, with `--launch`, per-position acceptance
from the worker's counters. Writes a JSON result file and PNG plots next to it, prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from benchmarks.client import CompletionClient, Sampling, drive
from benchmarks.compare import Cell, add_speedups, result_header, save_and_print, write_result
from benchmarks.dataset import WARMUP_PROMPT, BenchRequest, num_distinct, warmup_burst
from benchmarks.launch import cores_busy, launch_mesh
from benchmarks.methods import request_override
from benchmarks.metrics import RequestRecord, SpecCounts, run_duration_s, summarize
from benchmarks.offline import add_common_args, cell_requests, finish_args, median_run, settings
from services.engine.args import add_engine_args

NUM_WARMUP = 2
"""Short requests each server gets before the measured ones."""
CLIENT_START_DELAY_S = 8.0
"""Client processes start sending this long after they are spawned (all at once; they import
torch on the way, through the benchmark modules)."""


# ---- one server, one set of requests ------------------------------------------------------------------


async def run_online(
    url: str,
    requests: list[BenchRequest],
    sampling: Sampling,
    concurrency: int | None,
    request_rate: float | None = None,
    seed: int = 0,
    speculative: dict[str, Any] | None = None,
    api_key: str | None = None,
    model: str | None = None,
    progress: tqdm | None = None,
    warmup: bool = True,
) -> list[RequestRecord]:
    """Warms the server up with two short requests (unless told not to), then measures `requests`."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        client = CompletionClient(session, url, sampling, model, speculative, api_key)
        if warmup:
            first = BenchRequest("warmup", "warmup", WARMUP_PROMPT, 8)
            await asyncio.gather(*(client.send(first) for _ in range(NUM_WARMUP)))
        return await drive(requests, client.send, concurrency, request_rate, seed, progress)


def run_clients(
    url: str,
    requests: list[BenchRequest],
    sampling: Sampling,
    concurrency: int | None,
    request_rate: float | None,
    seed: int,
    num_processes: int,
    on_start: Callable[[], None] = lambda: None,
    start_delay_s: float = CLIENT_START_DELAY_S,
) -> tuple[list[RequestRecord], float]:
    """`run_online` (no warm-up) split over `num_processes` client processes, so that hundreds of
    streams are not one process's SSE parsing: request i goes to process i % n, with its share of
    the concurrency and of the rate; all start at one instant (their clocks are the same monotonic
    clock), `start_delay_s` after they are spawned. `on_start` is called here at that instant, as
    the first request goes out (where a measurement of the run's window begins: not while the
    client processes start). Returns the records in request order and the CPU seconds the clients
    used."""
    num_processes = min(num_processes, concurrency or num_processes, len(requests))
    if num_processes <= 1:
        on_start()
        started = time.process_time()
        records = asyncio.run(
            run_online(url, requests, sampling, concurrency, request_rate, seed, warmup=False)
        )
        return records, time.process_time() - started
    start_at = time.monotonic() + start_delay_s
    jobs = []
    for i in range(num_processes):
        share = (
            None if concurrency is None else concurrency // num_processes + (i < concurrency % num_processes)
        )
        rate = None if request_rate is None else request_rate / num_processes
        jobs.append((url, requests[i::num_processes], sampling, share, rate, seed + i, start_at))
    with concurrent.futures.ProcessPoolExecutor(
        num_processes, mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        futures = [pool.submit(_client_process, job) for job in jobs]
        time.sleep(max(0.0, start_at - time.monotonic()))
        on_start()
        results = [future.result() for future in futures]
    ordered: list[RequestRecord | None] = [None] * len(requests)
    for i, (records, _) in enumerate(results):
        ordered[i::num_processes] = records
    return ordered, sum(cpu_s for _, cpu_s in results)  # type: ignore[return-value]


def _client_process(job: tuple[Any, ...]) -> tuple[list[RequestRecord], float]:
    url, requests, sampling, concurrency, request_rate, seed, start_at = job
    if time.monotonic() > start_at:
        print("warning: a client process started late; arrivals are staggered", file=sys.stderr)
    time.sleep(max(0.0, start_at - time.monotonic()))
    started = time.process_time()
    records = asyncio.run(run_online(url, requests, sampling, concurrency, request_rate, seed, warmup=False))
    return records, time.process_time() - started


def with_worker_positions(records: list[RequestRecord], positions: dict[str, list[int]]) -> SpecCounts:
    """Totals from the gateway's usage, per-position counts from the worker."""
    total = SpecCounts()
    for record in records:
        total.add(record.spec)
    total.drafted_per_position = positions["drafted_per_position"]
    total.accepted_per_position = positions["accepted_per_position"]
    return total


def _minus(after: dict[str, list[int]], before: dict[str, list[int]]) -> dict[str, list[int]]:
    return {
        key: [x - (before[key][i] if i < len(before[key]) else 0) for i, x in enumerate(values)]
        for key, values in after.items()
    }


# ---- cells ----------------------------------------------------------------------------------------------


def online_cell(
    label: str,
    spec: dict[str, Any],
    requests: list[BenchRequest],
    concurrency: int | None,
    args: argparse.Namespace,
    pd: bool = False,
) -> dict[str, Any]:
    """`pd`: with `--launch`, one prefill and one decode worker instead of one mixed worker."""
    desc = f"{label} c={concurrency or '-'}" + (f" rate={args.request_rate}" if args.request_rate else "")
    with tqdm(desc=desc, total=len(requests), unit="req", disable=not args.progress, leave=False) as progress:
        cpu: dict[str, float] | None = None
        if args.launch:
            records, spec_counts, cpu = launched_cell(spec, requests, concurrency, args, progress, pd)
        else:
            records = asyncio.run(
                run_online(
                    args.url,
                    requests,
                    args.sampling,
                    concurrency,
                    args.request_rate,
                    args.seed,
                    request_override(spec),
                    args.api_key,
                    args.served_model_name,
                    progress,
                )
            )
            spec_counts = None
    summary = summarize(records, run_duration_s(records), args.slo)
    if spec_counts is not None:
        summary["speculative"] = {**spec_counts.summary(), "per_position_source": "worker metrics"}
    if cpu is not None:
        summary["cores_busy"] = cpu
    return {"summary": summary, "records": [r.compact() for r in records]}


def launched_cell(
    spec: dict[str, Any],
    requests: list[BenchRequest],
    concurrency: int | None,
    args: argparse.Namespace,
    progress: tqdm,
    pd: bool = False,
) -> tuple[list[RequestRecord], SpecCounts, dict[str, float]]:
    """The cell's records, the decoding worker's per-position counts, and the cores each process
    kept busy during the measured requests."""
    log_dir = args.log_dir / f"cell-{len(args.log_dirs)}" if args.log_dir else None
    with launch_mesh(args, args.model, spec, log_dir, args.torch_threads, pd, args.gateway_workers) as mesh:
        args.log_dirs.append(str(mesh.log_dir))
        burst = warmup_burst(requests, concurrency) if args.warmup_burst else []
        asyncio.run(run_online(mesh.url, burst, args.sampling, concurrency))
        num_warmup = NUM_WARMUP + len(burst)
        before = mesh.worker_spec_counts(num_finished=num_warmup)
        cpu_at_start: dict[str, float] = {}
        records, client_cpu_s = run_clients(
            mesh.url,
            requests,
            args.sampling,
            concurrency,
            args.request_rate,
            args.seed,
            args.client_processes,
            on_start=lambda: cpu_at_start.update(mesh.cpu_seconds()),
        )
        cpu_before = cpu_at_start  # from the first request on: the run's window, not the clients' start-up
        progress.update(len(records))
        cpu_after = {**mesh.cpu_seconds(), "client": cpu_before["client"] + client_cpu_s}
        busy = cores_busy(cpu_before, cpu_after, run_duration_s(records))
        after = mesh.worker_spec_counts(num_finished=num_warmup + sum(r.ok for r in records))
    return records, with_worker_positions(records, _minus(after, before)), busy


def method_cells(
    workload: str, requests: list[BenchRequest], concurrency: int | None, args: argparse.Namespace
) -> list[Cell]:
    """Every method on the same requests, naive first; repeats interleave the methods."""
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in args.method_configs}
    for _ in range(args.repeats):
        for label, spec in args.method_configs.items():
            runs[label].append(online_cell(label, spec, requests, concurrency, args))
    return [
        {
            "method": label,
            "backend": "mesh" if args.launch else "server",
            "speculative_config": spec,
            "workload": workload,
            "concurrency": concurrency,
            "effective_concurrency": min(concurrency or len(requests), len(requests)),
            "num_distinct_prompts": num_distinct(requests),
            "request_rate": args.request_rate,
            **median_run(runs[label]),
        }
        for label, spec in args.method_configs.items()
    ]


def wait_until_healthy(url: str, timeout_s: float) -> None:
    """Polls `/health` until the server says 200 (a gateway answers 503 until a worker registers)."""
    deadline = time.monotonic() + timeout_s
    reason = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            reason = exc.read().decode(errors="replace")[:200]
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            reason = str(exc)
        time.sleep(0.5)
    raise SystemExit(f"{url} is not healthy after {timeout_s:.0f} s: {reason}")


# ---- command ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(parser)
    add_common_args(parser)
    group = parser.add_argument_group("online")
    where = group.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running gateway, e.g. http://127.0.0.1:8000")
    where.add_argument(
        "--launch", action="store_true", help="start a local mesh per cell (needs redis-server)"
    )
    group.add_argument(
        "--concurrency", type=int, nargs="+", default=[None], help="most requests in flight (default: no cap)"
    )
    group.add_argument("--api-key", help="bearer key for --url")
    group.add_argument(
        "--ready-timeout-s", type=float, default=300.0, help="--url: how long to wait for /health to say 200"
    )
    group.add_argument(
        "--served-model-name", help="the `model` field to send (default: none, the served model)"
    )
    group.add_argument("--log-dir", type=Path, help="--launch: keep each cell's process logs here")
    add_launch_args(group)
    return parser


def add_launch_args(group: argparse._ArgumentGroup) -> None:
    """Flags of a launched mesh beyond the engine's."""
    group.add_argument(
        "--gateway-workers", type=int, default=1, help="launched gateway processes (`gateway --workers`)"
    )
    group.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="--launch: split the measured requests over this many client processes (hundreds of "
        "streams would otherwise be one process's SSE parsing)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every cell; the result file is rewritten after each group of cells (a run cut short keeps
    what it measured)."""
    args.log_dirs = []
    cells: list[Cell] = []
    extra = {
        "concurrency": args.concurrency,
        "target": "launched mesh (mixed worker)" if args.launch else args.url,
        "log_dirs": args.log_dirs,
    }

    def result(complete: bool) -> dict[str, Any]:
        header = result_header("serving", args.model, settings(args, extra))
        return {**header, "complete": complete, "skipped": args.skipped, "cells": add_speedups(cells)}

    for workload in args.workload:
        for concurrency in args.concurrency:
            requests = cell_requests(workload, concurrency, args)
            cells += method_cells(requests[0].workload, requests, concurrency, args)
            write_result(result(complete=False), args.out, plot=False)
    return result(complete=True)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    finish_args(args)
    if args.request_rate is None and args.concurrency == [None]:
        args.concurrency = [1]  # no rate and no cap would send everything at once; say what we do
    args.out = args.out or Path("benchmarks/results/serving.json")
    if args.url:
        wait_until_healthy(args.url, args.ready_timeout_s)
    result = run(args)
    save_and_print(result, args.out, plot=not args.no_plots)


if __name__ == "__main__":
    main()
