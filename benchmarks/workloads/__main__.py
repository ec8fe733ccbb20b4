"""`python -m benchmarks.workloads --out benchmarks/workloads`: rebuilds the workload files."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.workloads import WORKLOADS_DIR
from benchmarks.workloads.build import DEFAULT_SEED, build_workloads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the evaluation workloads from the held-out packages.")
    parser.add_argument("--out", type=Path, default=WORKLOADS_DIR, help="directory for the JSONL files")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    counts = build_workloads(args.out, args.seed)
    for workload, count in counts.items():
        print(f"{workload}: {count} records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
