"""Benchmark requests, read from the workload files.

A workload file is JSON Lines, one request a line: `{"id", "workload", "prompt", "max_tokens"}`.
`--workload NAME` reads the workload `benchmarks.workloads` built (`benchmarks/workloads/NAME.jsonl`);
anything ending in `.jsonl` is read as a path.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.workloads import WORKLOADS, load_workload

WORKLOAD_NAMES = WORKLOADS

WARMUP_PROMPT = (
    "def merge_sorted(left: list[int], right: list[int]) -> list[int]:\n"
    '    """Merges two sorted lists into one sorted list."""\n'
    "    merged = []\n"
    "    i = j = 0\n"
)
"""Warms each engine up before timing; unrelated to every workload, so it seeds no cache they use."""


@dataclass(frozen=True)
class BenchRequest:
    id: str
    workload: str
    prompt: str
    max_tokens: int


def load_requests(
    workload: str, num_requests: int | None = None, max_tokens: int | None = None
) -> list[BenchRequest]:
    """The first `num_requests` requests of a workload (all when None), in file order; `max_tokens`
    caps each request's own budget (short CPU runs). Asking for more requests than the file holds
    cycles through it again (ids get a `#n` suffix): a repeated prompt meets the prefix cache and the
    suffix cache again, which flatters suffix decoding, so results record how many prompts were
    distinct."""
    records = _records(workload)
    if not records:
        raise ValueError(f"workload {workload!r} has no requests")
    count = len(records) if num_requests is None else num_requests
    requests = [_request(records[i % len(records)], workload, i // len(records)) for i in range(count)]
    if max_tokens is not None:
        requests = [BenchRequest(r.id, r.workload, r.prompt, min(r.max_tokens, max_tokens)) for r in requests]
    return requests


def requests_for_cell(
    workload: str,
    num_requests: int | None,
    max_tokens: int | None,
    concurrency: int | None,
    requests_per_slot: int | None,
) -> list[BenchRequest]:
    """The requests of one cell: `num_requests` (default: the whole file), raised to
    `requests_per_slot` x `concurrency` when given, so a high concurrency keeps the engine full."""
    count = num_requests if num_requests is not None else len(_records(workload))
    if requests_per_slot and concurrency:
        count = max(count, requests_per_slot * concurrency)
    return load_requests(workload, count, max_tokens)


def warmup_burst(requests: list[BenchRequest], concurrency: int | None) -> list[BenchRequest]:
    """One request per concurrent slot (at most one per request of the cell), with the cell's own
    prompts and lengths, each led by a marker of its own: a first burst at the cell's concurrency
    pays the one-time costs of its batch's shapes, and seeds no prefix cache the measured requests
    use (a prompt's cached blocks chain from its first)."""
    count = min(concurrency or len(requests), len(requests))
    return [
        replace(request, id=f"warmup-{i}", workload="warmup", prompt=f"# warm-up {i}\n{request.prompt}")
        for i, request in enumerate(requests[:count])
    ]


def workload_label(workload: str) -> str:
    """A path's stem, or the name itself."""
    return Path(workload).stem if workload.endswith(".jsonl") else workload


def _records(workload: str) -> list[dict[str, object]]:
    if not workload.endswith(".jsonl"):
        return [asdict(record) for record in load_workload(workload)]
    with Path(workload).open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def num_distinct(requests: list[BenchRequest]) -> int:
    return len({r.prompt for r in requests})


def _request(record: dict[str, object], workload: str, cycle: int = 0) -> BenchRequest:
    missing = {"id", "prompt", "max_tokens"} - record.keys()
    if missing:
        raise ValueError(f"workload record {record.get('id')!r} lacks {sorted(missing)}")
    return BenchRequest(
        id=str(record["id"]) + (f"#{cycle}" if cycle else ""),
        workload=str(record.get("workload") or workload_label(workload)),
        prompt=str(record["prompt"]),
        max_tokens=int(record["max_tokens"]),  # type: ignore[call-overload]
    )
