"""The committed workload files: rebuilt byte for byte from the held-out files, valid records,
and each workload is what its name says (code_editing outputs repeat their prompt)."""

from __future__ import annotations

import gzip
import hashlib
import json
import sysconfig
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.acceptance import AcceptanceBench, MethodConfig, Options, engine_speculative_config
from benchmarks.workloads import MAX_PROMPT_TOKENS, WORKLOADS, WORKLOADS_DIR, load_workload, workload_path
from benchmarks.workloads.build import AGENT_PREAMBLE, AGENT_TASKS, SOURCES_FILE, SPLIT_FILE, build_workloads
from shared.reference import MODELS_DIR, reference_dir
from shared.tokenizer import Tokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def local_sources_match_committed() -> bool:
    """Whether this interpreter's held-out files are the ones the committed workloads came from."""
    committed = json.loads((WORKLOADS_DIR / SOURCES_FILE).read_text())["files"]
    for relpath, digest in committed.items():
        path = STDLIB / relpath
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            return False
    return True


def test_rebuild_gives_the_committed_bytes(tmp_path: Path) -> None:
    if not local_sources_match_committed():
        pytest.skip("this interpreter's stdlib differs from the one the workloads were built from")
    build_workloads(tmp_path)
    for name in [*(workload_path(w).name for w in WORKLOADS), SOURCES_FILE]:
        assert (tmp_path / name).read_bytes() == (WORKLOADS_DIR / name).read_bytes(), name


def test_records_are_valid() -> None:
    tokenizer = Tokenizer(reference_dir())
    with gzip.open(MODELS_DIR / SPLIT_FILE, "rt", encoding="utf-8") as f:
        held_out = {entry.split(":", 1)[1] for entry in json.load(f)["held_out"]}
    ids = []
    for workload in WORKLOADS:
        records = load_workload(workload)
        assert len(records) >= 16
        for record in records:
            assert record.workload == workload and record.prompt.strip() and record.max_tokens > 0
            assert record.num_prompt_tokens == len(tokenizer.encode(record.prompt)) <= MAX_PROMPT_TOKENS
            assert record.source in held_out or (workload == "open_ended" and record.source == "")
            ids.append(record.id)
    assert len(ids) == len(set(ids))


def test_continuation_prompts_end_inside_code_at_a_line_end() -> None:
    for record in load_workload("code_continuation"):
        assert not record.prompt.endswith("\n") and "\n" in record.prompt
        source = (STDLIB / record.source).read_text(encoding="utf-8")
        assert record.prompt + "\n" in source  # a contiguous run of whole lines of the file


def test_agentic_requests_share_one_preamble_and_recur() -> None:
    records = load_workload("agentic")
    assert all(r.prompt.startswith(AGENT_PREAMBLE) for r in records)
    openings = [task.split("`")[0] for task, _ in AGENT_TASKS]
    assert all(any(f"# task: {opening}" in r.prompt for r in records) for opening in openings)
    # every prompt recurs in a second session, differing only in the session line
    without_session = Counter(_drop_session_line(r.prompt) for r in records)
    assert set(without_session.values()) == {2}


def _drop_session_line(prompt: str) -> str:
    return "\n".join(line for line in prompt.split("\n") if not line.startswith("# session:"))


def test_json_editing_prompts_hold_a_record_their_schema_writes() -> None:
    """Each prompt's record is valid under json_edit_schema.json and written as the grammar engine
    writes JSON (fields in the schema's order, its separators), so a constrained answer can copy it."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((WORKLOADS_DIR / "json_edit_schema.json").read_text())
    for record in load_workload("json_editing"):
        line = record.prompt.split("\n")[1]
        fields = json.loads(line)
        jsonschema.validate(fields, schema)
        assert list(fields) == list(schema["properties"]) and json.dumps(fields) == line
        assert fields["file"] == record.source and fields["num_lines"] == fields["code"].count("\n")


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """As `benchmarks.acceptance` runs: two OpenMP threads on a shared 2-core box wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_torch_thread")
def test_code_editing_outputs_repeat_the_prompt() -> None:
    """The greedy output of a code_editing request copies its prompt: most of its 4-grams occur in
    the prompt (open-ended outputs: almost none), and n-gram drafts, which come only from the
    request's own tokens, are accepted for more than 1.5 tokens per verify step."""
    options = Options(
        ["code_editing", "open_ended"], 8, 32, 4, "cpu", "float32", WORKLOADS_DIR, progress=False
    )
    bench = AcceptanceBench(options)
    ngram = MethodConfig("ngram", 3)
    engine, _ = bench.make_engine(engine_speculative_config(ngram.engine_key, [ngram]))
    copied = {}
    for workload, records in bench.records.items():
        result = bench.run_one(engine, ngram, workload, records)
        if workload == "code_editing":
            assert result.num_verify_steps > 0 and result.mean_accepted_length > 1.5
        shares = [
            copied_share(engine.tokenizer.encode(r.prompt), bench.reference_outputs[f"{workload}/{r.id}"])
            for r in records
        ]
        copied[workload] = sum(shares) / len(shares)
    assert copied["code_editing"] > 0.3
    assert copied["code_editing"] > 3 * copied["open_ended"]


def copied_share(prompt_ids: list[int], output_ids: list[int], n: int = 4) -> float:
    """Share of the n-grams that end in the output which also occur in the prompt."""
    in_prompt = {tuple(prompt_ids[i : i + n]) for i in range(len(prompt_ids) - n + 1)}
    token_ids = prompt_ids + output_ids
    ends = range(len(prompt_ids), len(token_ids))
    grams = [tuple(token_ids[end - n + 1 : end + 1]) for end in ends if end >= n - 1]
    return sum(gram in in_prompt for gram in grams) / max(len(grams), 1)
