"""The mesh's own cost: the same requests in-process (the engine alone) and through gateway + Redis +
scheduler + worker, one after the other on this machine.

    python -m benchmarks.overhead --workload code_editing --num-requests 16 --concurrency 1 4

For each method and concurrency: a fresh in-process engine runs the requests (as
`benchmarks.offline` does), then a fresh local mesh with the same engine flags serves them to the
streaming client (as `benchmarks.serving --launch` does). The overhead is the difference of the
medians (TTFT, TPOT, e2e) and the ratio of output throughput. `naive` alone by default: the mesh adds
the same hops whatever the method.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

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
from benchmarks.serving import online_cell
from services.engine.args import add_engine_args, engine_config

PATHS = ("in-process", "mesh")


def path_cells(
    label: str,
    spec: dict[str, Any],
    workload: str,
    requests: list[Any],
    concurrency: int,
    args: argparse.Namespace,
) -> list[Cell]:
    """The two paths on the same requests; with repeats they interleave."""
    runs: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
    for _ in range(args.repeats):
        runs["in-process"].append(engine_cell(args.base, label, spec, requests, concurrency, args))
        runs["mesh"].append(online_cell(label, spec, requests, concurrency, args))
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
        for path in PATHS
    ]


def overhead_row(in_process: Cell, mesh: Cell) -> dict[str, Any]:
    """Mesh minus in-process, per latency median; throughput as a ratio."""
    a, b = in_process["summary"], mesh["summary"]
    row: dict[str, Any] = {k: in_process[k] for k in ("method", "workload", "concurrency", "request_rate")}
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        row[f"{metric}_in_process_p50"] = a[metric]["p50"]
        row[f"{metric}_mesh_p50"] = b[metric]["p50"]
        row[f"{metric}_overhead_p50"] = b[metric]["p50"] - a[metric]["p50"]
    row["output_tok_per_s_in_process"] = a["output_tok_per_s"]
    row["output_tok_per_s_mesh"] = b["output_tok_per_s"]
    row["throughput_ratio"] = b["output_tok_per_s"] / a["output_tok_per_s"] if a["output_tok_per_s"] else None
    row["mesh_cores_busy"] = b.get("cores_busy")
    return row


def overhead_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| workload | concurrency | method | TTFT p50 in-process / mesh (+ms) | TPOT p50 in-process / mesh (+ms) "
        "| e2e p50 in-process / mesh (+ms) | out tok/s in-process / mesh (ratio) |\n"
        "|---|---:|---|---:|---:|---:|---:|"
    )
    lines = []
    for r in rows:
        cols = [
            f"{r[f'{m}_in_process_p50']:.1f} / {r[f'{m}_mesh_p50']:.1f} ({r[f'{m}_overhead_p50']:+.1f})"
            for m in ("ttft_ms", "tpot_ms", "e2e_ms")
        ]
        ratio = r["throughput_ratio"]
        throughput = (
            f"{r['output_tok_per_s_in_process']:.1f} / {r['output_tok_per_s_mesh']:.1f} ({ratio:.2f}x)"
        )
        lines.append(
            f"| {r['workload']} | {r['concurrency']} | {r['method']} | {' | '.join(cols)} | {throughput} |"
        )
    return "\n".join([head, *lines, "", cores_table(rows)])


def cores_table(rows: list[dict[str, Any]]) -> str:
    """Per mesh process, the cores it kept busy during the measured requests (1.0 = one core all
    the time): a process near 1.0 is single-threaded and saturated, the mesh's bottleneck."""
    names = sorted({name for r in rows for name in r.get("mesh_cores_busy") or {}})
    if not names:
        return ""
    head = f"| workload | concurrency | method | {' | '.join(f'{n} cores' for n in names)} |"
    lines = [head, "|---|---:|---|" + "---:|" * len(names)]
    for r in rows:
        busy = r.get("mesh_cores_busy") or {}
        cells = [f"{busy[n]:.2f}" if n in busy else "-" for n in names]
        lines.append(f"| {r['workload']} | {r['concurrency']} | {r['method']} | {' | '.join(cells)} |")
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
    group.add_argument("--log-dir", type=Path, help="keep each mesh's process logs here")
    return parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every pair; the result file is rewritten after each (a run cut short keeps what it measured)."""
    use_torch_threads(args.torch_threads)
    args.base = engine_config(args)
    args.launch, args.url, args.api_key, args.served_model_name, args.log_dirs = True, None, None, None, []
    cells: list[Cell] = []
    rows: list[dict[str, Any]] = []
    extra = {
        "concurrency": args.concurrency,
        "engine": args.base.model_dump(mode="json"),
        "log_dirs": args.log_dirs,
    }

    def result(complete: bool) -> dict[str, Any]:
        header = result_header("overhead", args.model, settings(args, extra))
        return {**header, "complete": complete, "skipped": args.skipped, "cells": cells, "overhead": rows}

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
