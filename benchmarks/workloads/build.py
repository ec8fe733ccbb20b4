"""Builds the evaluation workloads from the held-out files; the same seed gives the same bytes.

    python -m benchmarks.workloads --out benchmarks/workloads [--seed 0]

The held-out files are the ones `models/data_split.json.gz` lists (the packages of
`training.data.HELD_OUT_PACKAGES` as they were on the training machine), read from this
interpreter's stdlib: the packages are the same in every CPython 3.10 - 3.13, their text differs a
little. `sources.json` records the SHA-256 of every file read, so a rebuild elsewhere can tell
whether it saw the same text.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import platform
import random
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.workloads import MAX_PROMPT_TOKENS, WORKLOADS, WorkloadRecord, workload_path, write_workload
from shared.reference import MODELS_DIR, reference_dir
from shared.tokenizer import Tokenizer

DEFAULT_SEED = 0
SPLIT_FILE = "data_split.json.gz"
SOURCES_FILE = "sources.json"
NUM_RECORDS = {
    "code_continuation": 24,
    "code_editing": 24,
    "agentic": 48,
    "open_ended": 24,
    "json_editing": 24,
}

CONTINUATION_PROMPT_TOKENS = (256, 640)
"""A continuation prompt holds at least / at most this many tokens (trimmed from the front)."""
CONTINUATION_MAX_TOKENS = 128
EDIT_MAX_TOKENS = (32, 256)
AGENTIC_MAX_TOKENS = 96
OPEN_ENDED_MAX_TOKENS = 96

EDIT_MARKERS = (
    "# Revised version of the function above, with a bug fixed:",
    "# Revised version of the function above, with comments added:",
    "# Revised version of the function above, reformatted:",
    "# Revised version of the function above, with logging added:",
)
"""Each asks for a revised copy that keeps the signature, so the copy's first lines are verbatim."""

JSON_EDIT_CHANGES = (
    "with a bug in its code fixed",
    "with comments added to its code",
    "with its code reformatted",
    "with logging added to its code",
)
"""What a json_editing request asks to change in the record; every other field stays as it was."""

AGENT_PREAMBLE = """\
# === agent harness: tool-calling coding assistant ===
# You are a coding agent working on a Python code base. Call tools as Python functions,
# one call per line; their results come back as comments. Reply with Python code only.
#
# Tools:
#   read_file(path: str) -> str
#       Return the text of the file at `path`.
#   search_code(pattern: str) -> list[str]
#       Return "path:line: text" for every line that matches the regular expression.
#   write_file(path: str, text: str) -> None
#       Replace the file at `path` with `text`.
#   run_tests(module: str) -> str
#       Run the unit tests of `module` and return the report.
#
# Rules: keep the public behaviour; keep the code style of the file; add tests for changes.
# ======================================================
"""
AGENT_TASKS = (
    (
        "write a unit test for `{name}`",
        "import unittest\n\n\nclass Test{title}(unittest.TestCase):\n    def test_",
    ),
    ("add a docstring to `{name}` and return the whole function", '{header}    """'),
    ("find the callers of `{name}`, then read the first file", 'matches = search_code(r"\\b{name}\\(")\n'),
)
"""(instruction, start of the answer): `{name}`, `{title}` and `{header}` come from the function."""
AGENT_BLOCK = 4
"""Agentic requests come in blocks: this many first sessions, then the same tasks' second sessions."""

PLAIN_PROMPTS = (
    "# Read a CSV file and print the average of every numeric column.\n",
    "# Return the n-th Fibonacci number, computed iteratively.\n",
    "# A small command-line tool that counts the words in each file given as an argument.\n",
    "# Merge two sorted lists into one sorted list without using sort().\n",
    "# A class that keeps the last N values added to it and reports their mean.\n",
    "# Download nothing: parse a URL into scheme, host, port and path by hand.\n",
    "# Retry a function call up to three times, sleeping a little longer after each failure.\n",
    "# Flatten a nested list of any depth into a single list.\n",
)
"""Plain-English requests (hand-written: no held-out text) for `open_ended`."""


@dataclass(frozen=True)
class HeldOutFile:
    relpath: str
    """Path under the stdlib, e.g. `json/encoder.py`."""
    text: str


@dataclass(frozen=True)
class Function:
    """One function (or method) of a held-out file, moved to column 0, decorators included."""

    relpath: str
    name: str
    lines: list[str]
    """Its source lines, each ending in a newline."""
    num_header_lines: int
    """Decorators and signature: the lines before the first statement of the body."""
    num_docstring_lines: int
    """Lines up to the end of the docstring (0: it has none)."""

    @property
    def text(self) -> str:
        return "".join(self.lines)

    @property
    def header(self) -> str:
        return "".join(self.lines[: self.num_header_lines])


def held_out_files(stdlib: Path | None = None, split_path: Path | None = None) -> list[HeldOutFile]:
    """The held-out files this interpreter has, sorted by path (a file it lacks is skipped)."""
    stdlib = stdlib or Path(sysconfig.get_paths()["stdlib"])
    split_path = split_path or MODELS_DIR / SPLIT_FILE
    with gzip.open(split_path, "rt", encoding="utf-8") as f:
        entries: list[str] = json.load(f)["held_out"]
    relpaths = sorted(entry.split(":", 1)[1] for entry in entries)
    return [
        HeldOutFile(relpath, (stdlib / relpath).read_text(encoding="utf-8"))
        for relpath in relpaths
        if (stdlib / relpath).is_file()
    ]


def functions_of(source: HeldOutFile) -> list[Function]:
    """Every function and method of a file (outer ones first, in `ast.walk` order)."""
    lines = source.text.splitlines(keepends=True)
    found = []
    for node in ast.walk(ast.parse(source.text)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.end_lineno is None:
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
        body = [_dedent(line, node.col_offset) for line in lines[first : node.end_lineno]]
        body[-1] = body[-1] if body[-1].endswith("\n") else body[-1] + "\n"
        docstring = ast.get_docstring(node, clean=False) is not None
        num_docstring = (node.body[0].end_lineno or 0) - first if docstring else 0
        found.append(
            Function(source.relpath, node.name, body, node.body[0].lineno - 1 - first, num_docstring)
        )
    return found


def _without_newline(text: str) -> str:
    """`text` without its final newline, for a prompt the model continues with indented code.

    The reference tokenizer (GPT-2 pre-tokenization) makes a newline and the next line's
    indentation one token, so a prompt ending in a bare newline before an indented line is unlike
    any training text: the model reads it as "the block ends here" and closes it or the file.
    Ending the prompt at the end of the line leaves that token to the model."""
    return text.removesuffix("\n")


def _inside_block(previous: str, line: str) -> bool:
    """Whether a cut between `previous` and `line` falls inside an indented block of code."""
    indented = line[:1] in (" ", "\t") and bool(line.strip())
    return indented and bool(previous.strip()) and not line.lstrip().startswith("#")


def _dedent(line: str, columns: int) -> str:
    """Removes up to `columns` leading spaces (a docstring line may have fewer)."""
    stripped = line[:columns].lstrip(" ")
    return stripped + line[columns:] if stripped else line[columns:]


class WorkloadBuilder:
    """Draws every workload from one seeded random stream per workload (so each is reproducible
    alone) and counts tokens with the reference tokenizer."""

    def __init__(self, files: list[HeldOutFile], tokenizer: Tokenizer, seed: int = DEFAULT_SEED):
        self.files = files
        self.tokenizer = tokenizer
        self.seed = seed
        self.functions = [fn for source in files for fn in functions_of(source)]

    def build(self, workload: str) -> list[WorkloadRecord]:
        builders: dict[str, Callable[[random.Random], list[tuple[str, str, int]]]] = {
            "code_continuation": self.code_continuation,
            "code_editing": self.code_editing,
            "agentic": self.agentic,
            "open_ended": self.open_ended,
            "json_editing": self.json_editing,
        }
        rng = random.Random(f"{self.seed}:{workload}")
        records = []
        for i, (prompt, source, max_tokens) in enumerate(builders[workload](rng)):
            num_tokens = self.num_tokens(prompt)
            assert num_tokens <= MAX_PROMPT_TOKENS, (workload, source, num_tokens)
            records.append(
                WorkloadRecord(f"{workload}-{i:03d}", workload, prompt, max_tokens, source, num_tokens)
            )
        return records

    def num_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    # ---- the workloads: each returns (prompt, source, max_tokens) ------------------------------------

    def code_continuation(self, rng: random.Random) -> list[tuple[str, str, int]]:
        """A prefix of a file cut at a line boundary inside an indented block (the cursor in the
        middle of a function, not between top-level statements, where there is nothing to
        continue but a new idea), trimmed from the front at a line boundary to at most 640
        tokens; one request per file."""
        min_tokens, max_tokens = CONTINUATION_PROMPT_TOKENS
        out = []
        for source in rng.sample(self.files, len(self.files)):
            lines = source.text.splitlines(keepends=True)
            cumulative = [0]
            for count in (len(e.ids) for e in self.tokenizer.backend.encode_batch(lines)):
                cumulative.append(cumulative[-1] + count)
            cuts = [
                cut
                for cut in range(1, len(lines) - 16)
                if cumulative[cut] >= min_tokens and _inside_block(lines[cut - 1], lines[cut])
            ]
            if not cuts:
                continue
            cut = rng.choice(cuts)
            start = next(s for s in range(cut) if cumulative[cut] - cumulative[s] <= max_tokens)
            while self.num_tokens("".join(lines[start:cut])) > max_tokens:
                start += 1
            out.append((_without_newline("".join(lines[start:cut])), source.relpath, CONTINUATION_MAX_TOKENS))
            if len(out) == NUM_RECORDS["code_continuation"]:
                break
        return out

    def code_editing(self, rng: random.Random) -> list[tuple[str, str, int]]:
        """A function, a marker asking for a revised copy, and the copy's signature; at most one
        function per file. The output budget is the body's length (what a faithful copy needs)."""
        lo, hi = EDIT_MAX_TOKENS
        out = []
        for fn in self._one_per_file(rng, lambda f: 8 <= len(f.lines) <= 40 and 1 <= f.num_header_lines <= 4):
            num_fn_tokens = self.num_tokens(fn.text)
            if not 96 <= num_fn_tokens <= 700:
                continue
            marker = rng.choice(EDIT_MARKERS)
            prompt = f"{fn.text}\n{marker}\n{_without_newline(fn.header)}"
            body_tokens = num_fn_tokens - self.num_tokens(fn.header)
            out.append((prompt, fn.relpath, max(lo, min(hi, body_tokens + 16))))
            if len(out) == NUM_RECORDS["code_editing"]:
                break
        return out

    def agentic(self, rng: random.Random) -> list[tuple[str, str, int]]:
        """Preamble + session line + file + function + task + start of the answer. Every
        (function, task) pair runs in two sessions that differ only in the session line; requests
        come in blocks of 4 first sessions followed by their 4 second sessions."""
        num_functions = NUM_RECORDS["agentic"] // (2 * len(AGENT_TASKS))
        picked = []
        for fn in self._one_per_file(rng, lambda f: 6 <= len(f.lines) <= 30 and 1 <= f.num_header_lines <= 3):
            if 64 <= self.num_tokens(fn.text) <= 400 and not fn.name.startswith("__"):
                picked.append(fn)
            if len(picked) == num_functions:
                break
        pairs = [(fn, task) for fn in picked for task in AGENT_TASKS]
        rng.shuffle(pairs)
        out = []
        for block_start in range(0, len(pairs), AGENT_BLOCK):
            block = pairs[block_start : block_start + AGENT_BLOCK]
            for _session in range(2):
                for fn, (instruction, answer) in block:
                    session_id = f"{rng.getrandbits(32):08x}"
                    out.append(
                        (
                            self._agent_prompt(fn, instruction, answer, session_id),
                            fn.relpath,
                            AGENTIC_MAX_TOKENS,
                        )
                    )
        return out

    @staticmethod
    def _agent_prompt(fn: Function, instruction: str, answer: str, session_id: str) -> str:
        title = "".join(part.capitalize() for part in fn.name.split("_")) or "Function"
        fields = {"name": fn.name, "title": title, "header": fn.header}
        return (
            f"{AGENT_PREAMBLE}# session: {session_id}\n# file: {fn.relpath}\n\n{fn.text}\n"
            f"# task: {instruction.format(**fields)}\n{answer.format(**fields)}"
        )

    def open_ended(self, rng: random.Random) -> list[tuple[str, str, int]]:
        """A documented function's signature and docstring (write the body), or a plain-English
        comment; shuffled together."""
        num_docstrings = NUM_RECORDS["open_ended"] - len(PLAIN_PROMPTS)
        out = []
        for fn in self._one_per_file(rng, lambda f: f.num_docstring_lines > 0 and len(f.lines) >= 6):
            prompt = _without_newline("".join(fn.lines[: fn.num_docstring_lines]))
            if 24 <= self.num_tokens(prompt) <= 400:
                out.append((prompt, fn.relpath, OPEN_ENDED_MAX_TOKENS))
            if len(out) == num_docstrings:
                break
        out += [(prompt, "", OPEN_ENDED_MAX_TOKENS) for prompt in PLAIN_PROMPTS]
        rng.shuffle(out)
        return out

    def json_editing(self, rng: random.Random) -> list[tuple[str, str, int]]:
        """A function as a JSON record (name, file, line count, code: the fields of
        `benchmarks/workloads/json_edit_schema.json`, in its order, as the grammar engine writes
        JSON) and a request for the same record with its code changed; at most one function per
        file. The answer under that schema copies most of the record, escapes included."""
        lo, hi = EDIT_MAX_TOKENS
        out = []
        for fn in self._one_per_file(rng, lambda f: 8 <= len(f.lines) <= 40):
            record = json.dumps(
                {"name": fn.name, "file": fn.relpath, "num_lines": len(fn.lines), "code": fn.text}
            )
            num_record_tokens = self.num_tokens(record)
            if not 96 <= num_record_tokens <= 700:
                continue
            change = rng.choice(JSON_EDIT_CHANGES)
            prompt = f"# A function of the code base as a JSON record:\n{record}\n# The same record as JSON, {change}:\n"
            out.append((prompt, fn.relpath, max(lo, min(hi, num_record_tokens + 16))))
            if len(out) == NUM_RECORDS["json_editing"]:
                break
        return out

    def _one_per_file(self, rng: random.Random, keep: Callable[[Function], bool]) -> list[Function]:
        """One random function per file (among those `keep` accepts), files in random order."""
        by_file: dict[str, list[Function]] = {}
        for fn in self.functions:
            if keep(fn):
                by_file.setdefault(fn.relpath, []).append(fn)
        relpaths = sorted(by_file)
        rng.shuffle(relpaths)
        return [rng.choice(by_file[relpath]) for relpath in relpaths]


def build_workloads(out: Path, seed: int = DEFAULT_SEED, stdlib: Path | None = None) -> dict[str, int]:
    """Writes every workload's JSONL and `sources.json` under `out`; returns the record counts."""
    files = held_out_files(stdlib)
    builder = WorkloadBuilder(files, Tokenizer(reference_dir()), seed)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for workload in WORKLOADS:
        records = builder.build(workload)
        write_workload(records, workload_path(workload, out))
        counts[workload] = len(records)
    write_sources(files, out / SOURCES_FILE, seed)
    return counts


def write_sources(files: list[HeldOutFile], path: Path, seed: int) -> None:
    sources = {
        "python": platform.python_version(),
        "seed": seed,
        "files": {f.relpath: hashlib.sha256(f.text.encode("utf-8")).hexdigest() for f in files},
    }
    path.write_text(json.dumps(sources, indent=1) + "\n", encoding="utf-8")
