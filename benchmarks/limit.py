"""How close each drafting method comes to its ideal speedup at concurrency 1.

    python -m benchmarks.verify_cost --model DIR --ks 1 2 3 4 5 8 --batch-sizes 1 --context 512 --out VC.json
    python -m benchmarks.offline --model DIR --concurrency 1 --methods naive ngram ... --out OFFLINE.json
    python -m benchmarks.limit --offline OFFLINE.json --verify-cost VC.json

A method that accepts L tokens a verify step (its mean accepted length, bonus token included) with
k drafts, on a target whose verify step over 1 + k tokens costs r times a plain step, can at best
speed decoding up by L / r: its ideal. What it reaches (TPOT over naive's, measured in the offline
run) falls short of that by whatever the drafting and the host cost, and by steps run without
drafts. k is the mean number of drafts a verify step carried (adaptive speculation and short
n-gram / suffix matches draft fewer than the configured k), and r at that k is interpolated between
the verify steps measured (the n-gram engine's, whose tail drafts nothing of cost: the target's
verify step alone). Both files should come from the same device call.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np


def read_json(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def verify_ratios(verify_cost: dict[str, Any], batch: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """k and the verify step's cost over a plain step at `batch`, k = 0 (ratio 1) included."""
    rows = sorted((row["k"], row["ratio"]) for row in verify_cost["rows"] if row["batch"] == batch)
    if not rows:
        raise ValueError(f"the verify-cost file has no rows at batch {batch}")
    ks, ratios = zip(*[(0, 1.0), *rows])
    return np.array(ks, dtype=float), np.array(ratios, dtype=float)


def limit_rows(offline: dict[str, Any], verify_cost: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per drafting method of the offline run at concurrency 1."""
    ks, ratios = verify_ratios(verify_cost)
    rows = []
    for cell in offline["cells"]:
        spec = cell["summary"].get("speculative")
        if cell["concurrency"] != 1 or not spec or not spec["num_verify_steps"]:
            continue
        mean_k = spec["num_draft_tokens"] / spec["num_verify_steps"]
        if mean_k > ks[-1]:
            raise ValueError(
                f"{cell['method']} drafts {mean_k:.2f} a step; the verify costs stop at k = {ks[-1]:.0f}"
            )
        ratio = float(np.interp(mean_k, ks, ratios))
        length = spec["mean_accepted_length"]
        summary = cell["summary"]
        # every request's first token comes from its prefill; a decode step keeps 1 + its accepted drafts
        decode_steps = summary["output_tokens"] - summary["num_completed"] - spec["num_accepted_tokens"]
        drafted = min(1.0, spec["num_verify_steps"] / decode_steps) if decode_steps > 0 else 1.0
        measured = cell.get("tpot_speedup")
        rows.append(
            dict(
                method=cell["method"],
                mean_accepted_length=length,
                mean_drafts=mean_k,
                verify_ratio=ratio,
                ideal=length / ratio,
                drafted_share=drafted,
                ideal_at_share=(drafted * length + 1 - drafted) / (drafted * ratio + 1 - drafted),
                tpot_speedup=measured,
                share_of_ideal=None if measured is None else measured * ratio / length,
            )
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| method | mean acc. len | drafts / verify step | verify step / plain | ideal | steps drafted "
        "| ideal at that share | TPOT speedup | of ideal | of ideal at that share |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        measured = "-" if r["tpot_speedup"] is None else f"{r['tpot_speedup']:.2f}x"
        share = "-" if r["share_of_ideal"] is None else f"{r['share_of_ideal']:.0%}"
        at_share = "-" if r["tpot_speedup"] is None else f"{r['tpot_speedup'] / r['ideal_at_share']:.0%}"
        lines.append(
            f"| {r['method']} | {r['mean_accepted_length']:.2f} | {r['mean_drafts']:.2f} | "
            f"{r['verify_ratio']:.3f} | {r['ideal']:.2f}x | {r['drafted_share']:.0%} | "
            f"{r['ideal_at_share']:.2f}x | {measured} | {share} | {at_share} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.limit", description=__doc__)
    parser.add_argument(
        "--offline", type=Path, required=True, help="benchmarks.offline result (.json / .json.gz)"
    )
    parser.add_argument("--verify-cost", type=Path, required=True, help="benchmarks.verify_cost --out file")
    parser.add_argument("--out", type=Path, help="the rows as JSON")
    args = parser.parse_args(argv)
    verify_cost = read_json(args.verify_cost)
    rows = limit_rows(read_json(args.offline), verify_cost)
    if args.out:
        args.out.write_text(json.dumps({"card": verify_cost.get("card"), "rows": rows}, indent=2))
    print(f"card: {verify_cost.get('card')}")
    print(table(rows))


if __name__ == "__main__":
    main()
