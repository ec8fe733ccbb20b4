"""The mesh's own cost: the same requests in-process (the engine alone) and through gateway + Redis +
scheduler + worker, one after the other on this machine.

    python -m benchmarks.overhead --workload code_editing --num-requests 16 --concurrency 1 4 --pd

For each method and concurrency: a fresh in-process engine runs the requests (as
`benchmarks.offline` does), then a fresh local mesh with the same engine flags (and the same
`--max-num-seqs`: the concurrency, as in-process) serves them to the
streaming client (as `benchmarks.serving --launch` does): with one mixed worker, and with `--pd`
also with one prefill and one decode worker (the split mesh, a column beside mixed). The overhead
is the difference of the medians (TTFT, TPOT, e2e) and the ratio of output throughput; a second
table gives the cores each mesh process kept busy (`role/engine-core` is a worker's engine
process, `gateway/gateway-i` the gateway's workers). `naive` alone by default: the mesh adds the
same hops whatever the method. For hundreds of streams give the mesh `--gateway-workers N` and the
client `--client-processes N`, so that neither side's SSE is one process (the cores table shows
whether one was the limit). `--trace-hops`: where each request's milliseconds go between the
mesh's processes (`benchmarks/hops.py`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from benchmarks import hops
from benchmarks.compare import Cell, result_header, save_and_print, write_result
from benchmarks.offline import (
    add_common_args,
    cell_requests,
    engine_cell,
    finish_args,
    median_run,
    settings,
    use_torch_threads,
)
from benchmarks.serving import add_launch_args, online_cell
from services.engine.args import add_engine_args, engine_config
from shared import trace

MESHES = {"mesh": "", "mesh-pd": "_pd"}
"""Each mesh path and the suffix of its columns in a row (mixed worker; prefill + decode workers)."""


def path_cells(
    label: str,
    spec: dict[str, Any],
    workload: str,
    requests: list[Any],
    concurrency: int,
    args: argparse.Namespace,
) -> list[Cell]:
    """The paths on the same requests, in-process first; with repeats they interleave."""
    paths = ["in-process", "mesh", *(["mesh-pd"] if args.pd else [])]
    runs: dict[str, list[dict[str, Any]]] = {path: [] for path in paths}
    # the workers run as many requests at once as the in-process engine does (it sizes its KV
    # cache and graphs by them)
    mesh_args = argparse.Namespace(**{**vars(args), "max_num_seqs": min(concurrency, args.base.max_num_seqs)})
    for _ in range(args.repeats):
        runs["in-process"].append(engine_cell(args.base, label, spec, requests, concurrency, args))
        for path in paths[1:]:
            pd = path == "mesh-pd"
            runs[path].append(online_cell(label, spec, requests, concurrency, mesh_args, pd=pd))
            if args.trace_hops:
                trace_table(Path(args.log_dirs[-1]), f"{label} ({path}) c={concurrency}", args)
    return [
        {
            "method": label,
            "label": f"{label} ({path})",
            "backend": path,
            "speculative_config": spec,
            "workload": workload,
            "concurrency": concurrency,
            "request_rate": args.request_rate,
            **median_run(runs[path]),
        }
        for path in paths
    ]


def trace_table(log_dir: Path, title: str, args: argparse.Namespace) -> None:
    """The hop tables of one traced mesh run, printed now and kept for the result file."""
    summary = hops.summarize(log_dir)
    args.hop_tables.append({"cell": title, **summary})
    print(f"\nhops of {title} (log {log_dir})\n\n{hops.markdown(summary)}", flush=True)


def overhead_row(in_process: Cell, *meshes: Cell) -> dict[str, Any]:
    """Each mesh minus in-process, per latency median; throughput as a ratio. The mixed mesh's
    columns are `*_mesh_*`, the split mesh's `*_mesh_pd_*`."""
    a = in_process["summary"]
    row: dict[str, Any] = {k: in_process[k] for k in ("method", "workload", "concurrency", "request_rate")}
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        row[f"{metric}_in_process_p50"] = a[metric]["p50"]
    row["output_tok_per_s_in_process"] = a["output_tok_per_s"]
    for mesh in meshes:
        b, suffix = mesh["summary"], MESHES[mesh["backend"]]
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            row[f"{metric}_mesh{suffix}_p50"] = b[metric]["p50"]
            row[f"{metric}_overhead{suffix}_p50"] = b[metric]["p50"] - a[metric]["p50"]
        row[f"output_tok_per_s_mesh{suffix}"] = b["output_tok_per_s"]
        ratio = b["output_tok_per_s"] / a["output_tok_per_s"] if a["output_tok_per_s"] else None
        row[f"throughput_ratio{suffix}"] = ratio
        row[f"mesh{suffix}_cores_busy"] = b.get("cores_busy")
    return row


def overhead_table(rows: list[dict[str, Any]]) -> str:
    """One column per metric: in-process / mesh (/ split mesh), and what each mesh adds."""
    split = any("output_tok_per_s_mesh_pd" in r for r in rows)
    paths = "in-process / mesh / pd" if split else "in-process / mesh"
    head = (
        f"| workload | concurrency | method | TTFT p50 {paths} (+ms) | TPOT p50 {paths} (+ms) "
        f"| e2e p50 {paths} (+ms) | out tok/s {paths} (ratio) |\n"
        "|---|---:|---|---:|---:|---:|---:|"
    )
    suffixes = [s for s in MESHES.values() if not s or split]
    lines = []
    for r in rows:
        cols = []
        for m in ("ttft_ms", "tpot_ms", "e2e_ms"):
            values = " / ".join(f"{r.get(f'{m}_mesh{s}_p50', float('nan')):.1f}" for s in suffixes)
            added = ", ".join(f"{r.get(f'{m}_overhead{s}_p50', float('nan')):+.1f}" for s in suffixes)
            cols.append(f"{r[f'{m}_in_process_p50']:.1f} / {values} ({added})")
        values = " / ".join(f"{r.get(f'output_tok_per_s_mesh{s}', float('nan')):.1f}" for s in suffixes)
        ratios = ", ".join(f"{r.get(f'throughput_ratio{s}') or float('nan'):.2f}x" for s in suffixes)
        cols.append(f"{r['output_tok_per_s_in_process']:.1f} / {values} ({ratios})")
        lines.append(f"| {r['workload']} | {r['concurrency']} | {r['method']} | {' | '.join(cols)} |")
    return "\n".join([head, *lines, "", cores_table(rows)])


def cores_table(rows: list[dict[str, Any]]) -> str:
    """Per mesh process, the cores it kept busy during the measured requests (1.0 = one core all
    the time): a process near 1.0 is single-threaded and saturated, the mesh's bottleneck."""
    measured = [
        (r, mesh, r[f"mesh{suffix}_cores_busy"])
        for r in rows
        for mesh, suffix in MESHES.items()
        if r.get(f"mesh{suffix}_cores_busy")
    ]
    names = sorted({name for _, _, busy in measured for name in busy})
    if not names:
        return ""
    head = f"| workload | concurrency | method | mesh | {' | '.join(f'{n} cores' for n in names)} |"
    lines = [head, "|---|---:|---|---|" + "---:|" * len(names)]
    for r, mesh, busy in measured:
        cells = [f"{busy[n]:.2f}" if n in busy else "-" for n in names]
        lines.append(
            f"| {r['workload']} | {r['concurrency']} | {r['method']} | {mesh} | {' | '.join(cells)} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(parser)
    add_common_args(parser)
    parser.set_defaults(methods=["naive"])
    group = parser.add_argument_group("overhead")
    group.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    group.add_argument(
        "--pd", action="store_true", help="also the split mesh: one prefill and one decode worker"
    )
    group.add_argument("--log-dir", type=Path, help="keep each mesh's process logs here")
    group.add_argument(
        "--trace-hops",
        action="store_true",
        help=f"the meshes log every hop of every request ({trace.TRACE_ENV}=1; slows them a little): "
        "a table per mesh run of the time and Redis round trips between hops (benchmarks/hops.py)",
    )
    add_launch_args(group)
    return parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every pair; the result file is rewritten after each (a run cut short keeps what it measured)."""
    use_torch_threads(args.torch_threads)
    args.base = engine_config(args)
    args.launch, args.url, args.api_key, args.served_model_name, args.log_dirs = True, None, None, None, []
    args.hop_tables = []
    if args.trace_hops:
        os.environ[trace.TRACE_ENV] = "1"  # the launched processes inherit it
    cells: list[Cell] = []
    rows: list[dict[str, Any]] = []
    extra = {
        "concurrency": args.concurrency,
        "pd": args.pd,
        "gateway_workers": args.gateway_workers,
        "engine": args.base.model_dump(mode="json"),
        "log_dirs": args.log_dirs,
    }

    def result(complete: bool) -> dict[str, Any]:
        header = result_header("overhead", args.model, settings(args, extra))
        return {
            **header,
            "complete": complete,
            "skipped": args.skipped,
            "cells": cells,
            "overhead": rows,
            "hops": args.hop_tables,
        }

    for workload in args.workload:
        for concurrency in args.concurrency:
            requests = cell_requests(workload, concurrency, args)
            for label, spec in args.method_configs.items():
                pair = path_cells(label, spec, requests[0].workload, requests, concurrency, args)
                cells += pair
                rows.append(overhead_row(*pair))
                write_result(result(complete=False), args.out, plot=False)
    return result(complete=True)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    finish_args(args)
    args.out = args.out or Path("benchmarks/results/overhead.json")
    result = run(args)
    save_and_print(result, args.out, plot=not args.no_plots)


if __name__ == "__main__":
    main()
