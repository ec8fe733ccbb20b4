"""PNG plots of a result file, written next to it: speedup vs concurrency per method, acceptance per
draft position and vs k, latency CDFs (TTFT, TPOT, ITL). One panel per workload; a method keeps its
colour in every panel. matplotlib is optional (`pip install -e ".[bench]"`); without it no plot is
drawn and the run says so."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.compare import Cell, cell_key
from benchmarks.methods import BASELINE

MAX_CDF_ROWS = 6
Points = dict[str, list[tuple[float, float]]]


def plot_result(result: dict[str, Any], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -e '.[bench]')", file=sys.stderr)
        return []
    cells: list[Cell] = result.get("cells") or []
    if not cells:
        return []
    colors = _colors([label(c) for c in cells] + [r["method"] for r in result.get("k_sweep") or []])
    written = []
    if result["kind"] != "overhead":
        written.append(_speedup(cells, colors, out.with_name(f"{out.stem}_speedup.png")))
        sweep = result.get("k_sweep") or []
        written.append(_acceptance(cells, sweep, colors, out.with_name(f"{out.stem}_acceptance.png")))
    written.append(_latency_cdfs(cells, colors, out.with_name(f"{out.stem}_latency_cdf.png")))
    return written


def label(cell: Cell) -> str:
    return str(cell.get("label") or cell["method"])


def _speedup(cells: list[Cell], colors: dict[str, Any], path: Path) -> Path:
    """Output tok/s over naive's, per method, against concurrency (HF baselines: one point at 1)."""
    import matplotlib.pyplot as plt

    workloads = _workloads(cells)
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.2), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        lines: Points = defaultdict(list)
        for cell in cells:
            if cell["workload"] == workload and cell.get("speedup") is not None:
                x = cell.get("concurrency") or cell.get("request_rate") or 1
                lines[label(cell)].append((float(x), float(cell["speedup"])))
        for name, points in lines.items():
            xs, ys = zip(*sorted(points))
            style = "--" if name == BASELINE else "-"
            ax.plot(xs, ys, marker="o", linestyle=style, color=colors[name], label=name)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ticks = sorted({x for points in lines.values() for x, _ in points})
        _log_axis(ax, base=2, ticks=ticks)
        ax.set(title=workload, xlabel="concurrency", ylabel="speedup over naive (output tok/s)")
        ax.legend(fontsize=7)
    return _save(fig, path)


def _acceptance(cells: list[Cell], k_sweep: list[dict[str, Any]], colors: dict[str, Any], path: Path) -> Path:
    """Left: acceptance at each draft position (lowest concurrency measured); right: mean accepted
    length against k (the k sweep, or each method at its own k)."""
    import matplotlib.pyplot as plt

    workloads = _workloads(cells)
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.8 * len(workloads)), squeeze=False)
    lowest = min(c.get("concurrency") or 0 for c in cells)
    for (by_position, by_k), workload in zip(axes, workloads):
        mine = [c for c in cells if c["workload"] == workload and c["method"] != BASELINE]
        for cell in (c for c in mine if (c.get("concurrency") or 0) == lowest):
            rates = cell["summary"]["speculative"]["acceptance_per_position"]
            if rates:
                name = label(cell)
                by_position.plot(range(1, len(rates) + 1), rates, marker="o", color=colors[name], label=name)
        by_position.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05))
        by_position.set_title(
            f"{workload}: per-position acceptance (concurrency {lowest or '-'})", fontsize=9
        )
        for name, points in _length_vs_k(mine, [r for r in k_sweep if r["workload"] == workload]).items():
            ks, lengths = zip(*sorted(points))
            by_k.plot(ks, lengths, marker="o", color=colors[name], label=name)
        by_k.axhline(1.0, color="grey", linewidth=0.8)
        by_k.set(xlabel="k (num_speculative_tokens)", ylabel="mean accepted length (bonus included)")
        by_k.set_title(f"{workload}: acceptance vs k", fontsize=9)
        for ax in (by_position, by_k):
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    return _save(fig, path)


def _length_vs_k(cells: list[Cell], k_sweep: list[dict[str, Any]]) -> Points:
    points: Points = defaultdict(list)
    for row in k_sweep:
        points[row["method"]].append((float(row["k"]), float(row["mean_accepted_length"])))
    if points:
        return points
    lowest = min((c.get("concurrency") or 0 for c in cells), default=0)
    for cell in cells:
        spec = cell["summary"]["speculative"]
        if spec["num_verify_steps"] and (cell.get("concurrency") or 0) == lowest:
            k = float((cell.get("speculative_config") or {}).get("num_speculative_tokens") or 0)
            points[label(cell)].append((k, float(spec["mean_accepted_length"])))
    return points


def _latency_cdfs(cells: list[Cell], colors: dict[str, Any], path: Path) -> Path:
    """One row per (workload, concurrency): the CDFs of TTFT, TPOT and ITL, a line per method."""
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(cell_key(c) for c in cells))[:MAX_CDF_ROWS]
    fig, axes = plt.subplots(len(keys), 3, figsize=(15, 3.6 * len(keys)), squeeze=False)
    for row, key in zip(axes, keys):
        for cell in (c for c in cells if cell_key(c) == key):
            records = [r for r in cell.get("records") or [] if r["ok"]]
            series = (
                [r["ttft_ms"] for r in records],
                [r["tpot_ms"] for r in records if r["tpot_ms"] is not None],
                [g for r in records for g in r["itl_ms"]],
            )
            for ax, values in zip(row, series):
                if values:
                    xs = np.sort(np.asarray(values))
                    fractions = np.arange(1, len(xs) + 1) / len(xs)
                    name = label(cell)
                    ax.step(
                        np.r_[xs[0], xs], np.r_[0.0, fractions], where="post", color=colors[name], label=name
                    )
        workload, concurrency, rate = key
        where = f"{workload}, concurrency {concurrency or '-'}" + (f", rate {rate}/s" if rate else "")
        for ax, name in zip(row, ("TTFT", "TPOT", "ITL")):
            ax.set(
                xlabel=f"{name} (ms)", ylabel="fraction of gaps" if name == "ITL" else "fraction of requests"
            )
            _log_axis(ax, base=10)
            ax.set_ylim(0, 1.02)
            ax.set_title(f"{name} CDF: {where}", fontsize=9)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    return _save(fig, path)


def _workloads(cells: list[Cell]) -> list[str]:
    return list(dict.fromkeys(c["workload"] for c in cells))


def _colors(names: list[str]) -> dict[str, Any]:
    """A fixed colour per method name, in order of first appearance."""
    import matplotlib.pyplot as plt

    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    unique = list(dict.fromkeys(names))
    return {name: cycle[i % len(cycle)] for i, name in enumerate(unique)}


def _log_axis(ax: Any, base: int, ticks: list[float] | None = None) -> None:
    """A log x axis labelled with plain numbers (1, 16, 256; 20, 100, 500), no minor labels."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    ax.set_xscale("log", base=base)
    if ticks:
        ax.set_xticks(ticks)
    elif base == 10:
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
