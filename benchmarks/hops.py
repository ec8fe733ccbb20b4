"""Where a request's time goes in the mesh: the hop lines of a traced mesh's logs, joined.

    python -m benchmarks.hops LOG_DIR

The mesh must have run with `SPECMESH_TRACE_HOPS=1` (`benchmarks.overhead --trace-hops` does that;
`shared/trace.py` says what a hop line holds). Two tables: the first token's path (HTTP request
to its first SSE chunk, every hop between) and a later token's (the engine core's step to the
chunk), each hop with the median and p90 of the time from the hop before, and the median Redis
round trips the process made between the two (where both are in one process and that process
logged both itself: a worker logs its engine core's step hops without the core's count; with
several requests in flight at once, those of the others are counted too).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

FIRST_TOKEN_PATH = [
    "gateway.http",
    "gateway.prepared",
    "gateway.submitted",
    "scheduler.read",
    "scheduler.admitted",
    "scheduler.claimed",
    "scheduler.dispatched",
    "worker.read",
    "worker.to_core",
    "core.added",
    "core.step_start",
    "core.sent",
    "worker.from_core",
    "worker.published",
    "gateway.read",
    "gateway.sent",
]
"""The hops of a request's first token, in order; before `core.step_start` they carry pos 0."""
STEP_PATH = ["core.sent (previous)", *FIRST_TOKEN_PATH[FIRST_TOKEN_PATH.index("core.step_start") :]]
"""A later token: from the step before it left the core (the gap is the core's time between steps)."""

Hop = tuple[float, int | None, int]
"""(wall-clock time, the process's Redis round trips so far or None where another process logged
the hop for it, its pid)."""


def read_hops(log_dir: Path) -> dict[str, dict[int, dict[str, Hop]]]:
    """request id -> pos -> hop name -> its time, round trips and pid, from every log under `log_dir`."""
    hops: dict[str, dict[int, dict[str, Hop]]] = defaultdict(lambda: defaultdict(dict))
    for path in sorted(log_dir.rglob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if '"hop"' not in line:
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            hops[entry["request_id"]][int(entry["pos"])][entry["hop"]] = (
                entry["t"],
                entry["rtt"],
                entry["pid"],
            )
    return hops


def paths(
    hops: dict[str, dict[int, dict[str, Hop]]],
) -> tuple[list[list[Hop | None]], list[list[Hop | None]]]:
    """Each request's first-token path and each later token's path, as hops in path order (None: missing)."""
    first_paths, step_paths = [], []
    for by_pos in hops.values():
        rows = sorted(pos for pos in by_pos if pos > 0)
        if not rows or 0 not in by_pos:
            continue
        first = {**by_pos[0], **by_pos[rows[0]]}
        first_paths.append([first.get(name) for name in FIRST_TOKEN_PATH])
        for before, pos in zip(rows, rows[1:]):
            previous = by_pos[before].get("core.sent")
            step_paths.append([previous, *(by_pos[pos].get(name) for name in STEP_PATH[1:])])
    return first_paths, step_paths


def hop_table(names: list[str], runs: list[list[Hop | None]]) -> list[dict[str, Any]]:
    """Per pair of hops, each from the last one before it on its path that was logged (a path
    may skip some: an admission that dispatched at once): median / p90 ms between the two, and
    the median Redis round trips between them where both are in one process."""
    gaps_ms: dict[str, list[float]] = {}
    trips: dict[str, list[int]] = {}
    for run in runs:
        before: tuple[str, Hop] | None = None
        for name, after in zip(names, run):
            if after is None:
                continue
            if before is not None:
                pair = f"{before[0]} -> {name}"
                gaps_ms.setdefault(pair, []).append((after[0] - before[1][0]) * 1000)
                if (trips_after := _trips_between(before[1], after)) is not None:
                    trips.setdefault(pair, []).append(trips_after)
            before = (name, after)
    return [
        {
            "hop": pair,
            "n": len(gaps),
            "p50_ms": statistics.median(gaps),
            "p90_ms": _quantile(gaps, 0.9),
            "round_trips_p50": statistics.median(trips[pair]) if pair in trips else None,
        }
        for pair, gaps in sorted(gaps_ms.items(), key=lambda item: _path_order(names, item[0]))
    ]


def _trips_between(before: Hop, after: Hop) -> int | None:
    """The Redis round trips a process made between two of its hops; None where the hops are of two
    processes, or one was logged by another process (which does not know the count)."""
    if before[2] != after[2] or before[1] is None or after[1] is None:
        return None
    return after[1] - before[1]


def _path_order(names: list[str], pair: str) -> tuple[int, int]:
    first, _, second = pair.partition(" -> ")
    return names.index(second), names.index(first)


def summarize(log_dir: Path) -> dict[str, list[dict[str, Any]]]:
    first_paths, step_paths = paths(read_hops(log_dir))
    return {
        "first_token": hop_table(FIRST_TOKEN_PATH, first_paths),
        "later_token": hop_table(STEP_PATH, step_paths),
    }


def markdown(summary: dict[str, list[dict[str, Any]]]) -> str:
    lines = []
    for path, rows in summary.items():
        lines += [
            f"| {path} hop | n | p50 ms | p90 ms | Redis round trips p50 |",
            "|---|---:|---:|---:|---:|",
        ]
        for row in rows:
            trips = "-" if row["round_trips_p50"] is None else f"{row['round_trips_p50']:g}"
            lines.append(
                f"| {row['hop']} | {row['n']} | {row['p50_ms']:.2f} | {row['p90_ms']:.2f} | {trips} |"
            )
        total = sum(row["p50_ms"] for row in rows)
        lines += [f"| (sum of medians) | | {total:.2f} | | |", ""]
    return "\n".join(lines)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hops", description=__doc__)
    parser.add_argument("log_dir", type=Path, help="a traced mesh's log directory (searched recursively)")
    args = parser.parse_args(argv)
    print(markdown(summarize(args.log_dir)))


if __name__ == "__main__":
    main()
