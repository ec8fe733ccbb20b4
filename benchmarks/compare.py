"""Side-by-side comparison of one run's cells: speedup over `naive`, markdown tables, plots.

A *cell* is one measured (method, workload, concurrency or rate) combination. Speedup is always the
ratio of two cells of the same run, same requests, same machine: `output tok/s of the method /
output tok/s of naive` (and `tpot_speedup`: naive's median TPOT / the method's). Absolute times from
a shared machine are noise; these ratios are what a CPU run reports.

    python -m benchmarks.compare benchmarks/results/serving.json   # re-print the tables, redraw plots
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.methods import BASELINE

Cell = dict[str, Any]
RUN_DATE = os.environ.get("SPECMESH_BENCH_DATE") or datetime.date.today().isoformat()


def cell_key(cell: Cell) -> tuple[Any, ...]:
    return (cell["workload"], cell.get("concurrency"), cell.get("request_rate"))


def add_speedups(cells: list[Cell]) -> list[Cell]:
    """Sets `speedup` and `tpot_speedup` on every cell against the naive cell of the same key (None
    where that cell is missing or measured nothing)."""
    baselines = {cell_key(c): c for c in cells if c["method"] == BASELINE and c.get("backend") != "hf"}
    for cell in cells:
        base = baselines.get(cell_key(cell))
        cell["speedup"] = _ratio(cell, base, "output_tok_per_s", higher_is_better=True)
        cell["tpot_speedup"] = _ratio(cell, base, "tpot_p50", higher_is_better=False)
    return cells


def same_outputs(cell: Cell, reference: Cell) -> tuple[int, int]:
    """(requests whose outputs equal the reference cell's, requests compared): the two cells ran the
    same requests in the same order, and each finished request keeps a hash of its tokens."""
    pairs = [
        (mine.get("output_digest"), theirs.get("output_digest"))
        for mine, theirs in zip(cell.get("records", []), reference.get("records", []))
    ]
    compared = [(a, b) for a, b in pairs if a is not None and b is not None]
    return sum(a == b for a, b in compared), len(compared)


def add_output_identity(cells: list[Cell]) -> list[str]:
    """Sets `same_outputs_as_naive` ([identical, compared]) on every specmesh cell of a greedy run
    against the naive cell of its key, and returns a line for each: speculation must not change a
    greedy output, so anything short of all of them is a bug (or a near-tie in the logits that
    another kernel path rounds the other way)."""
    baselines = {cell_key(c): c for c in cells if c["method"] == BASELINE and c.get("backend") != "hf"}
    lines = []
    for cell in cells:
        base = baselines.get(cell_key(cell))
        if base is None or cell is base or cell.get("backend") == "hf":
            continue
        identical, compared = cell["same_outputs_as_naive"] = list(same_outputs(cell, base))
        lines.append(
            f"outputs {cell['method']} {cell['workload']} c={cell.get('concurrency')}: "
            f"identical to naive for {identical} of {compared} requests"
        )
    return lines


def compare_outputs(result: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """A line per cell of `result` with a cell of the same method and key in `other` (e.g. the same
    greedy run under another tensor-parallel size): how many outputs are identical."""
    theirs = {(c["method"], *cell_key(c)): c for c in other["cells"]}
    lines = []
    for cell in result["cells"]:
        match = theirs.get((cell["method"], *cell_key(cell)))
        if match is not None:
            identical, compared = same_outputs(cell, match)
            lines.append(
                f"outputs {cell['method']} {cell['workload']} c={cell.get('concurrency')}: "
                f"identical in both runs for {identical} of {compared} requests"
            )
    return lines


def _ratio(cell: Cell, base: Cell | None, metric: str, higher_is_better: bool) -> float | None:
    if base is None:
        return None
    mine, theirs = _metric(cell["summary"], metric), _metric(base["summary"], metric)
    if not mine or not theirs:
        return None
    return mine / theirs if higher_is_better else theirs / mine


def _metric(summary: dict[str, Any], metric: str) -> float:
    if metric == "tpot_p50":
        return float(summary["tpot_ms"]["p50"])
    return float(summary[metric])


def machine() -> dict[str, Any]:
    """What the numbers were measured on (a GPU's name when there is one)."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": _cpu_model() or platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def result_header(kind: str, model: str, settings: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": kind,
        "command": " ".join(["python -m", f"benchmarks.{kind}", *map(shlex.quote, sys.argv[1:])]),
        "date": RUN_DATE,
        "machine": machine(),
        "model": model,
        "weights_sha256": weights_fingerprints(model_dirs(model, settings.get("methods") or {})),
        "settings": settings,
    }


def model_dirs(model: str, methods: dict[str, Any]) -> tuple[str, ...]:
    """The target's directory and every draft model / MTP head a method loads."""
    heads = [str(c["model"]) for c in methods.values() if isinstance(c, dict) and c.get("model")]
    return tuple(dict.fromkeys([model, *heads]))


@functools.cache
def weights_fingerprints(model_dirs: tuple[str, ...]) -> dict[str, str]:
    """The first 16 hex digits of the SHA-256 of each directory's safetensors files, as they were
    when the run began, so a result says which weights it measured (checkpoints get retrained)."""
    prints = {}
    for model_dir in model_dirs:
        digest = hashlib.sha256()
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            digest.update(path.read_bytes())
        prints[model_dir] = digest.hexdigest()[:16]
    return prints


def markdown_table(cells: list[Cell]) -> str:
    """One row per cell: throughput, speedup over naive, latency percentiles, goodput, acceptance;
    with repeats, every run's output tok/s too (the row shows the median run)."""
    repeated = any(len(c.get("runs_output_tok_per_s") or []) > 1 for c in cells)
    head = (
        "| workload | concurrency | rate | method | req/s | out tok/s | speedup | TPOT speedup "
        "| TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | ITL p50/p99 ms | goodput req/s "
        "| mean acc. len | acc. rate | acc. per position |"
        + (" runs: out tok/s |" if repeated else "")
        + "\n"
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
        + ("---|" if repeated else "")
    )
    rows = [_row(c) + (_runs(c) if repeated else "") for c in cells]
    return "\n".join([head, *rows])


def _runs(cell: Cell) -> str:
    return " " + " ".join(f"{t:.0f}" for t in cell.get("runs_output_tok_per_s") or []) + " |"


def _row(cell: Cell) -> str:
    s, spec = cell["summary"], cell["summary"]["speculative"]
    rate = cell.get("request_rate")
    per_position = " ".join(f"{a:.2f}" for a in spec["acceptance_per_position"][:8]) or "-"
    accepted = spec["num_verify_steps"] > 0
    failed = f" ({s['num_failed']} failed)" if s["num_failed"] else ""
    return (
        f"| {cell['workload']} | {cell.get('concurrency') or '-'} | {rate if rate is not None else '-'} "
        f"| {cell.get('label') or cell['method']}{failed} | {s['requests_per_s']:.2f} | {s['output_tok_per_s']:.1f} "
        f"| {_x(cell.get('speedup'))} | {_x(cell.get('tpot_speedup'))} | {_pcts(s['ttft_ms'])} "
        f"| {_pcts(s['tpot_ms'])} | {s['itl_ms']['p50']:.1f} / {s['itl_ms']['p99']:.1f} "
        f"| {s['goodput_requests_per_s']:.2f} | {spec['mean_accepted_length']:.2f} "
        f"| {spec['acceptance_rate']:.2f} | {per_position if accepted else '-'} |"
    )


def k_sweep_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| workload | method | k | out tok/s | speedup | mean acc. len | acc. rate | acc. per position |\n"
        "|---|---|---:|---:|---:|---:|---:|---|"
    )
    lines = [
        f"| {r['workload']} | {r['method']} | {r['k']} | {r['output_tok_per_s']:.1f} | {_x(r.get('speedup'))} "
        f"| {r['mean_accepted_length']:.2f} | {r['acceptance_rate']:.2f} "
        f"| {' '.join(f'{a:.2f}' for a in r['acceptance_per_position'][:8]) or '-'} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def describe(result: dict[str, Any]) -> str:
    m = result["machine"]
    device = m.get("gpu") or f"{m['processor']} CPU, {m['cpu_count']} cores"
    return f"{result['kind']} benchmark of {Path(result['model']).name} on {device}, {result['date']}"


def _pcts(d: dict[str, float]) -> str:
    return f"{d['p50']:.1f} / {d['p90']:.1f} / {d['p99']:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def write_result(result: dict[str, Any], out: Path, plot: bool = True) -> list[Path]:
    """Writes the JSON and, when matplotlib is installed, the PNGs next to it; returns the PNGs."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if not plot:
        return []
    from benchmarks.plots import plot_result

    return plot_result(result, out)


def save_and_print(result: dict[str, Any], out: Path, plot: bool = True) -> None:
    """What a benchmark command ends with: the JSON (and PNGs) written, the tables printed."""
    pngs = write_result(result, out, plot)
    print_result(result)
    print(f"\nwrote {out}" + "".join(f", {p}" for p in pngs))


def print_result(result: dict[str, Any]) -> None:
    print(f"\n{describe(result)}\n`{result['command']}`\n")
    if result.get("cells"):
        print(markdown_table(result["cells"]))
        for cell in result["cells"]:
            for error in cell["summary"]["errors"]:
                print(f"{cell.get('label') or cell['method']}: {error}")
    if result.get("k_sweep"):
        print("\nacceptance vs k\n")
        print(k_sweep_table(result["k_sweep"]))
    if result.get("overhead"):
        from benchmarks.overhead import overhead_table

        print("\nmesh overhead\n")
        print(overhead_table(result["overhead"]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "results", type=Path, nargs="+", help="result JSON files of benchmarks.serving / offline"
    )
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--outputs-against",
        type=Path,
        help="another offline result of the same requests (greedy): print, per cell, how many outputs "
        "the two runs share instead of the tables",
    )
    args = parser.parse_args()
    for path in args.results:
        result = json.loads(path.read_text())
        if args.outputs_against is not None:
            print("\n".join(compare_outputs(result, json.loads(args.outputs_against.read_text()))))
            continue
        print_result(result)
        if not args.no_plots:
            from benchmarks.plots import plot_result

            for png in plot_result(result, path):
                print(f"wrote {png}")


if __name__ == "__main__":
    main()
