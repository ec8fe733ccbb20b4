"""Evaluation workloads built from the reference family's held-out packages, stored as JSONL.

Each record is one request: `id`, `workload`, `prompt` (text), `max_tokens`, plus `source` (the
held-out file it came from, or "" for a hand-written prompt) and `num_prompt_tokens` (with the
reference tokenizer). The files sit next to this module; `python -m benchmarks.workloads` rebuilds
them (see `benchmarks.workloads.build`).

- `code_continuation`: a file prefix cut at a line boundary -> continue the file.
- `code_editing`: a function, a marker comment asking for a revised copy, and the copy's first
  line(s) -> the output mostly repeats the input (what n-gram and suffix drafting exist for).
- `agentic`: one fixed tool-calling preamble, a function and an instruction from a small set, each
  issued in two sessions: requests share templates and their outputs recur across requests
  (what the global suffix cache exists for).
- `open_ended`: a signature and docstring, or a one-line comment in plain English -> write the code.
- `json_editing`: a function as a JSON record and a change to make -> the same record as JSON, to
  be run under `json_edit_schema.json` (structured output whose answer copies its prompt, so drafts
  can match under the schema).

A prompt followed by indented code ends at the end of a line, before its newline: with this
tokenizer the newline and the next line's indentation are one token (see `build._without_newline`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

WORKLOADS_DIR = Path(__file__).resolve().parent
WORKLOADS = ("code_continuation", "code_editing", "agentic", "open_ended", "json_editing")
MAX_PROMPT_TOKENS = 1500
"""No prompt is longer than this with the reference tokenizer."""


@dataclass(frozen=True)
class WorkloadRecord:
    id: str
    workload: str
    prompt: str
    max_tokens: int
    source: str
    """Held-out file under the stdlib (`json/encoder.py`), or "" for a hand-written prompt."""
    num_prompt_tokens: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


def workload_path(workload: str, directory: Path = WORKLOADS_DIR) -> Path:
    return directory / f"{workload}.jsonl"


def load_workload(workload: str, directory: Path = WORKLOADS_DIR) -> list[WorkloadRecord]:
    """The records of one workload, in file order (the order benchmarks submit them)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)}")
    path = workload_path(workload, directory)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; run `python -m benchmarks.workloads --out {directory}`")
    lines = path.read_text(encoding="utf-8").splitlines()
    return [WorkloadRecord(**json.loads(line)) for line in lines if line]


def write_workload(records: list[WorkloadRecord], path: Path) -> None:
    path.write_text("".join(record.to_json() + "\n" for record in records), encoding="utf-8")
