"""Speculative acceptance of the reference family on the held-out workloads (greedy).

    python -m benchmarks.acceptance [--num-requests 16] [--max-tokens 64] [--markdown PATH] [--update-docs]

Every method runs on the shipped base model (the *target*) over the requests of each workload
(`benchmarks/workloads/*.jsonl`), at temperature 0 with adaptive speculation off, so every verify
step of a request carries exactly the k drafts asked for (fewer only where a model-free method
finds fewer, or where max_tokens is near). Terms, as in vLLM's spec-decode metrics:

- *accepted*: a draft equal to the target's greedy token, all drafts before it accepted too.
- *mean accepted length*: accepted drafts + 1 per verify step (the target's own recovered or
  *bonus* token included), averaged over verify steps, i.e. steps that carried at least one draft.
- *acceptance at position j*: of the verify steps with at least j drafts, the fraction whose
  first j drafts were all accepted (so position 1 is the first-draft acceptance rate).
- *tokens per step*: output tokens after the first, per decode step of the target, counting
  steps where a model-free method had no draft (1 token) too; *drafted* is the share of decode
  steps that carried drafts.

Methods: `ngram`, `suffix` (with a global suffix tree that starts empty for each workload),
`mtp` (num_model_steps = k, k <= 3), `mtp_ngram` (mtp_strategy with_ngram: m MTP drafts then
n-gram drafts up to k, m = 1 or 2 < k), `eagle3` (a chain of k EAGLE-3 drafts), `draft_model`, and
`mtp_tree` / `eagle3_tree` (each shape of `--trees`, e.g. 3,2,1: the head's top-3 at depth 1, top-2
under each, top-1 under each; k is the tree's depth, --ks does not apply), and `mtp_tree_ngram` /
`eagle3_tree_ngram` (the same trees with an n-gram branch from the root, with_ngram, sharing
`--tree-budget` tokens). Runs that share models share one engine
(each request asks for its method and k by a per-request override), so a workload's prompts are
prefilled once per engine and then served from the prefix cache. Speculation is lossless at
temperature 0: every method must produce the same output tokens, and the JSON counts requests
whose output differs from the first run's (float rounding under a different batch can flip a
near-tie; anything more is a bug).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from tqdm import tqdm

from benchmarks.workloads import WORKLOADS, WORKLOADS_DIR, WorkloadRecord, load_workload
from services.engine.engine import LLMEngine, RequestOutput
from services.engine.spec_decode.suffix import SuffixConfig
from services.engine.spec_decode.suffix_tree import GlobalSuffixIndex, SuffixDraft
from shared.config import EngineConfig
from shared.model import ModelConfig
from shared.reference import BASE_MODEL, DRAFT_MODEL, EAGLE3_HEAD, MTP_HEAD, reference_dir
from shared.sampling_params import SamplingParams
from shared.speculative_config import SpeculativeConfig, SpeculativeOverride

Dtype = Literal["float32", "bfloat16", "float16"]
METHODS = (
    "ngram",
    "suffix",
    "mtp",
    "mtp_ngram",
    "eagle3",
    "draft_model",
    "mtp_tree",
    "eagle3_tree",
    "mtp_tree_ngram",
    "eagle3_tree_ngram",
)
TREE_METHODS = {
    "mtp_tree": "mtp",
    "eagle3_tree": "eagle3",
    "mtp_tree_ngram": "mtp",
    "eagle3_tree_ngram": "eagle3",
}
"""Methods that draft a static tree (`--trees`), and the head each one uses."""
HYBRID_TREE_METHODS = ("mtp_tree_ngram", "eagle3_tree_ngram")
"""Tree methods with an n-gram branch (with_ngram; `--tree-budget`)."""
DEFAULT_TREES = ("3,2,1",)
MAX_MTP_STEPS = 3
"""The MTP head is chained at most this many times (k = num_model_steps <= 3)."""
MTP_NGRAM_STEPS = (1, 2)
"""with_ngram: MTP drafts per step; n-gram drafts fill the rest of k."""
GOAL_FIRST_POSITION = 0.6
"""The issue's goal for MTP first-draft acceptance on held-out code continuation."""
DEFAULT_OUT = Path("benchmarks/results/acceptance.json")
BLOCK_SIZE = 16


@dataclass(frozen=True)
class MethodConfig:
    """One row family of the table: a draft method at one k."""

    method: str
    k: int
    num_model_steps: int | None = None
    """mtp / mtp_ngram: times the MTP head is chained per step."""
    tree: tuple[int, ...] | None = None
    """Tree methods: children per node at each depth."""
    tree_budget: int | None = None
    """*_tree_ngram: tokens of the tree query shared with the n-gram branch (None: the config's default)."""

    @property
    def label(self) -> str:
        if self.tree is not None:
            label = f"{TREE_METHODS[self.method]} tree [{', '.join(map(str, self.tree))}]"
            if self.method in HYBRID_TREE_METHODS:
                label += f" + ngram ({self.spec_fields()['tree_budget']} tokens)"
            return label
        if self.method == "mtp_ngram":
            return f"mtp+ngram (m={self.num_model_steps})"
        return self.method

    @property
    def engine_key(self) -> str:
        """Runs with the same key share one engine: model-free methods all share one; an MTP
        chain length is fixed per engine only with with_ngram (plain mtp chains min(k, 3))."""
        if self.method in ("ngram", "suffix"):
            return "model_free"
        if self.method == "mtp_ngram":
            return f"mtp_ngram_{self.num_model_steps}"
        if self.tree is not None:
            key = f"{self.method}_{'_'.join(map(str, self.tree))}"
            return key if self.tree_budget is None else f"{key}_{self.tree_budget}"
        return self.method

    def spec_fields(self) -> dict[str, Any]:
        """A tree method's fields of the engine's SpeculativeConfig (its head's too)."""
        assert self.tree is not None
        fields: dict[str, Any] = {"method": TREE_METHODS[self.method], "tree": self.tree}
        fields["model"] = str(reference_dir(MTP_HEAD if fields["method"] == "mtp" else EAGLE3_HEAD))
        if self.method in HYBRID_TREE_METHODS:
            fields["with_ngram"] = True
            fields["tree_budget"] = SpeculativeConfig(**fields, tree_budget=self.tree_budget).tree_budget
        return fields

    def override(self) -> SpeculativeOverride:
        method = self.method if self.engine_key == "model_free" else None  # else: the engine's own
        return SpeculativeOverride.model_validate({"method": method, "num_speculative_tokens": self.k})


def method_matrix(
    methods: list[str],
    ks: list[int],
    trees: list[tuple[int, ...]] | None = None,
    tree_budget: int | None = None,
) -> list[MethodConfig]:
    """Every (method, k) the issue asks for, restricted to `methods` and `ks`; tree methods at
    each of `trees` (those with an n-gram branch sharing `tree_budget` tokens with it)."""
    configs = []
    for method in methods:
        if method in TREE_METHODS:
            budget = tree_budget if method in HYBRID_TREE_METHODS else None
            configs += [
                MethodConfig(method, len(tree), tree=tree, tree_budget=budget) for tree in trees or []
            ]
        elif method == "mtp":
            configs += [MethodConfig("mtp", k, k) for k in ks if k <= MAX_MTP_STEPS]
        elif method == "mtp_ngram":
            configs += [MethodConfig("mtp_ngram", k, m) for m in MTP_NGRAM_STEPS for k in ks if m < k]
        else:
            configs += [MethodConfig(method, k) for k in ks]
    return configs


def engine_speculative_config(key: str, configs: list[MethodConfig]) -> SpeculativeConfig:
    """The server-side config of one shared engine: the largest k its runs ask for."""
    max_k = max(c.k for c in configs)
    common: dict[str, Any] = {"num_speculative_tokens": max_k, "adaptive": False}
    if key == "model_free":
        return SpeculativeConfig(method="ngram", **common)
    if key == "draft_model":
        return SpeculativeConfig(method="draft_model", model=str(reference_dir(DRAFT_MODEL)), **common)
    if key == "eagle3":
        return SpeculativeConfig(method="eagle3", model=str(reference_dir(EAGLE3_HEAD)), **common)
    mtp_dir = str(reference_dir(MTP_HEAD))
    if configs[0].tree is not None:
        return SpeculativeConfig(**configs[0].spec_fields(), **common)
    if key == "mtp":
        return SpeculativeConfig(method="mtp", model=mtp_dir, num_model_steps=max_k, **common)
    steps = configs[0].num_model_steps
    return SpeculativeConfig(
        method="mtp", model=mtp_dir, mtp_strategy="with_ngram", num_model_steps=steps, **common
    )


class FreshGlobalIndex:
    """The in-process global suffix tree, emptied before each run so that one workload's outputs
    (or the same workload's at another k) never draft for another."""

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.spec = spec
        self.index = self._empty()

    def reset(self) -> None:
        self.index = self._empty()

    def _empty(self) -> GlobalSuffixIndex:
        return SuffixConfig.from_speculative_config(self.spec).global_index()

    def add_sequence(self, seq_id: str, token_ids: list[int]) -> None:
        self.index.add_sequence(seq_id, token_ids)

    def speculate_batch(self, queries: list[tuple[list[int], int]]) -> list[SuffixDraft | None]:
        return list(self.index.speculate_batch(queries))


@dataclass
class RunResult:
    """One (method, k, workload) run, summed over its requests."""

    method: str
    label: str
    k: int
    num_model_steps: int | None
    workload: str
    num_requests: int
    num_output_tokens: int = 0
    num_decode_steps: int = 0
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    num_outputs_differing: int = 0
    """Requests whose output differs from the workload's first run (lossless: should be 0)."""
    seconds: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        if not self.num_verify_steps:
            return 1.0
        return (self.num_accepted_tokens + self.num_verify_steps) / self.num_verify_steps

    @property
    def acceptance_per_position(self) -> list[float]:
        """Per position up to k (a tree's: per depth, whatever its node count)."""
        rates = [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]
        return rates[: self.k]

    @property
    def tokens_per_step(self) -> float:
        return (self.num_output_tokens - self.num_requests) / max(self.num_decode_steps, 1)

    @property
    def drafted_fraction(self) -> float:
        return self.num_verify_steps / max(self.num_decode_steps, 1)

    def add(self, output: RequestOutput, num_steps: int) -> None:
        """Books one finished request that received tokens in `num_steps` engine steps."""
        stats = output.spec_stats
        self.num_output_tokens += len(output.token_ids)
        self.num_decode_steps += num_steps - 1  # the first token comes from the prefill step
        self.num_verify_steps += _int(stats.get("num_verify_steps"))
        self.num_draft_tokens += _int(stats.get("num_draft_tokens"))
        self.num_accepted_tokens += _int(stats.get("num_accepted_tokens"))
        _add_into(self.drafted_per_position, _ints(stats.get("drafted_per_position")))
        _add_into(self.accepted_per_position, _ints(stats.get("accepted_per_position")))

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_per_position": self.acceptance_per_position,
            "tokens_per_step": self.tokens_per_step,
            "drafted_fraction": self.drafted_fraction,
        }


def _int(value: object) -> int:
    return int(value) if isinstance(value, int | float) else 0


def _ints(value: object) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list) else []


def _add_into(total: list[int], counts: list[int]) -> None:
    total += [0] * (len(counts) - len(total))
    for j, count in enumerate(counts):
        total[j] += count


@dataclass
class Options:
    workloads: list[str]
    num_requests: int
    max_tokens: int
    max_num_seqs: int
    device: str
    dtype: Dtype
    workloads_dir: Path
    progress: bool = True


class AcceptanceBench:
    """Runs the matrix engine by engine; keeps each workload's first outputs as the reference."""

    def __init__(self, options: Options):
        self.options = options
        self.records = {
            w: load_workload(w, options.workloads_dir)[: options.num_requests] for w in options.workloads
        }
        self.reference_outputs: dict[str, list[int]] = {}
        self.next_id = 0

    def run(self, configs: list[MethodConfig]) -> list[RunResult]:
        groups: dict[str, list[MethodConfig]] = {}
        for config in configs:
            groups.setdefault(config.engine_key, []).append(config)
        total = len(configs) * len(self.records)
        results = []
        with tqdm(total=total, desc="acceptance", unit="run", disable=not self.options.progress) as bar:
            for key, group in groups.items():
                engine, suffix_index = self.make_engine(engine_speculative_config(key, group))
                for workload, records in self.records.items():
                    for config in group:
                        bar.set_postfix_str(f"{config.label} k={config.k} {workload}")
                        suffix_index.reset()
                        results.append(self.run_one(engine, config, workload, records))
                        bar.update(1)
                del engine
        return results

    def make_engine(self, spec: SpeculativeConfig) -> tuple[LLMEngine, FreshGlobalIndex]:
        """An engine with room for every prompt of every workload in its prefix cache."""
        # a tree's head also writes KV for its inner nodes past the newest token
        max_k = spec.max_num_drafts * (2 if spec.tree else 1)
        num_blocks = sum(
            -(-(r.num_prompt_tokens + self._max_tokens(r) + max_k + 1) // BLOCK_SIZE)
            for records in self.records.values()
            for r in records
        )
        model_dir = reference_dir(BASE_MODEL)
        capacity = (num_blocks + 64) * BLOCK_SIZE
        config = EngineConfig(
            model=str(model_dir),
            max_model_len=min(capacity, ModelConfig.from_dir(model_dir).max_position_embeddings),
            device=self.options.device,
            dtype=self.options.dtype,
            block_size=BLOCK_SIZE,
            num_kv_blocks=num_blocks + 64,
            max_num_seqs=self.options.max_num_seqs,
            speculative_config=spec,
        )
        suffix_index = FreshGlobalIndex(spec)
        return LLMEngine(config, suffix_index=suffix_index), suffix_index

    def _max_tokens(self, record: WorkloadRecord) -> int:
        return min(record.max_tokens, self.options.max_tokens)

    def run_one(
        self, engine: LLMEngine, config: MethodConfig, workload: str, records: list[WorkloadRecord]
    ) -> RunResult:
        """Submits the workload's requests at once; max_num_seqs of them run at a time, in order."""
        result = RunResult(
            config.method, config.label, config.k, config.num_model_steps, workload, len(records)
        )
        request_ids = {}
        for record in records:
            request_id = f"{record.id}@{self.next_id}"
            self.next_id += 1
            params = SamplingParams(
                temperature=0.0, max_tokens=self._max_tokens(record), speculative=config.override()
            )
            engine.add_request(request_id, prompt=record.prompt, params=params)
            request_ids[request_id] = record.id
        started = time.perf_counter()
        for output, num_steps in _drain(engine):
            result.add(output, num_steps)
            record_id = request_ids[output.request_id]
            reference = self.reference_outputs.setdefault(f"{workload}/{record_id}", output.token_ids)
            result.num_outputs_differing += reference != output.token_ids
        result.seconds = time.perf_counter() - started
        return result


def _drain(engine: LLMEngine) -> Iterator[tuple[RequestOutput, int]]:
    """Steps the engine until idle; yields each finished request with the number of steps that
    gave it tokens (its prefill's last chunk, then one per decode step)."""
    num_steps: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            num_steps[output.request_id] = num_steps.get(output.request_id, 0) + 1
            if output.finished:
                yield output, num_steps.pop(output.request_id)


# ---- reporting ------------------------------------------------------------------------------------


def _per_position(rates: list[float]) -> str:
    return "[" + ", ".join(f"{r:.2f}" for r in rates) + "]"


def _table_order(run: RunResult) -> tuple[int, int, int, int]:
    """Method, MTP chain length, workload, k: the order of every table."""
    workload = WORKLOADS.index(run.workload) if run.workload in WORKLOADS else len(WORKLOADS)
    return METHODS.index(run.method), run.num_model_steps or 0, workload, run.k


def full_table(results: list[RunResult]) -> str:
    """One row per (method, k, workload), grouped by method and workload."""
    lines = [
        "| method | k | workload | mean accepted length | tokens / step | drafted | per-position acceptance |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    for r in sorted(results, key=_table_order):
        lines.append(
            f"| {r.label} | {r.k} | {r.workload} | {r.mean_accepted_length:.2f} | {r.tokens_per_step:.2f} "
            f"| {r.drafted_fraction:.0%} | {_per_position(r.acceptance_per_position)} |"
        )
    return "\n".join(lines)


def summary_table(results: list[RunResult]) -> str:
    """Mean accepted length / first-position acceptance, one column per workload."""
    workloads = list(dict.fromkeys(r.workload for r in results))
    rows: dict[tuple[str, int], dict[str, RunResult]] = {}
    for r in sorted(results, key=lambda run: (*_table_order(run)[:2], run.k)):
        rows.setdefault((r.label, r.k), {})[r.workload] = r
    lines = [
        "| method | k | " + " | ".join(workloads) + " |",
        "|---|---:|" + "---:|" * len(workloads),
    ]
    for (label, k), by_workload in rows.items():
        cells = []
        for workload in workloads:
            run = by_workload.get(workload)
            first = run.acceptance_per_position[0] if run and run.acceptance_per_position else 0.0
            cells.append(f"{run.mean_accepted_length:.2f} / {first:.2f}" if run else "")
        lines.append(f"| {label} | {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goal_summary(results: list[RunResult]) -> dict[str, Any] | None:
    """MTP first-draft acceptance on held-out code continuation, per k, against the goal."""
    rows = [r for r in results if r.method == "mtp" and r.workload == "code_continuation"]
    if not rows:
        return None
    by_k = {r.k: r.acceptance_per_position[0] if r.acceptance_per_position else 0.0 for r in rows}
    headline = by_k.get(1, by_k[min(by_k)])
    return {
        "first_position_acceptance_by_k": by_k,
        "headline": headline,
        "goal": GOAL_FIRST_POSITION,
        "met": headline >= GOAL_FIRST_POSITION,
    }


def goal_line(goal: dict[str, Any] | None) -> str:
    if goal is None:
        return ""
    per_k = ", ".join(f"k={k}: {v:.3f}" for k, v in sorted(goal["first_position_acceptance_by_k"].items()))
    verdict = "met" if goal["met"] else "NOT met"
    return (
        f"MTP first-position acceptance on held-out code continuation: **{goal['headline']:.3f}** "
        f"(goal >= {goal['goal']}: {verdict}; {per_k})."
    )


def machine_description(device: str) -> str:
    """The GPU's name, or the CPU model and the cores this process may use."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        models = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line
        ]
        cpu = models[0] if models else cpu
    num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU ({cpu}), {num_cores} cores"


def render_markdown(report: dict[str, Any], results: list[RunResult]) -> str:
    settings = report["settings"]
    lines = [
        f"Measured {report['date']} on {report['machine']} (torch {report['torch']}, {settings['dtype']}, "
        f"device {settings['device']}), greedy, adaptive speculation off, with",
        "",
        "```bash",
        report["command"],
        "```",
        "",
        f"Requests per workload: the first {settings['num_requests']} of `benchmarks/workloads/<workload>.jsonl`, "
        f"at most {settings['max_tokens']} output tokens each, {settings['max_num_seqs']} running at a time. "
        "Mean accepted length counts the target's bonus / recovered token; per-position acceptance j is "
        "the share of verify steps with >= j drafts whose first j drafts were all accepted; tokens / step "
        "counts every decode step of the target (also those without drafts); drafted is the share of "
        "decode steps that carried drafts. N-gram and suffix drafts are shorter than k where their match "
        "is short, so their position j is measured on fewer, better-matched steps and can exceed position "
        "j - 1. Acceptance is a property of the weights and the verifier, "
        "so these figures hold on any device (within float rounding).",
    ]
    goal = goal_line(goal_summary(results))
    if goal:
        lines += ["", goal]
    differing = sum(r.num_outputs_differing for r in results)
    lines += [
        "",
        f"Outputs identical to the first run of each workload: {'all' if not differing else f'all but {differing}'} "
        f"of {len(results) * settings['num_requests']} requests (speculation is lossless).",
        "",
        "Mean accepted length / first-position acceptance:",
        "",
        summary_table(results),
        "",
        "Every run:",
        "",
        full_table(results),
    ]
    return "\n".join(lines) + "\n"


# ---- model cards and BENCHMARKS.md ------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_FILE = "BENCHMARKS.md"
BENCHMARKS_SECTION = "## Acceptance (reference models)"
CARD_SECTION = "## Speculative acceptance"
CARD_METHODS = {
    BASE_MODEL: None,  # every method (summary table)
    DRAFT_MODEL: ("draft_model",),
    MTP_HEAD: ("mtp", "mtp_ngram"),
    EAGLE3_HEAD: ("eagle3",),
}


def replace_section(text: str, heading: str, body: str, insert_after_title: bool = False) -> str:
    """`text` with the section under `heading` (up to the next `## ` heading) replaced by `body`;
    a missing section is appended (or put right after the `# ` title)."""
    section = f"{heading}\n\n{body.rstrip()}\n"
    if heading in text:
        before, rest = text.split(heading, 1)
        after = rest[rest.find("\n## ") + 1 :] if "\n## " in rest else ""
        return before + section + ("\n" + after if after else "")
    if insert_after_title and text.startswith("# "):
        title, _, rest = text.partition("\n")
        return f"{title}\n\n{section}\n{rest.lstrip()}" if rest.strip() else f"{title}\n\n{section}"
    return text.rstrip() + "\n\n" + section if text.strip() else section


def card_section(report: dict[str, Any], results: list[RunResult], name: str) -> str:
    methods = CARD_METHODS[name]
    settings = report["settings"]
    intro = (
        f"Measured by `python -m benchmarks.acceptance` on {report['date']} ({report['machine']}, "
        f"{settings['dtype']}): greedy, adaptive speculation off, held-out workloads of "
        f"`benchmarks/workloads/` ({settings['num_requests']} requests each, at most "
        f"{settings['max_tokens']} output tokens), `specmesh-code-15m` as the target. Mean accepted "
        "length includes the bonus token; acceptance at position j is the share of verify steps whose "
        "first j drafts were all accepted. Command, definitions and every run: `BENCHMARKS.md`."
    )
    goal = goal_line(goal_summary(results)) if methods is None or "mtp" in methods else ""
    if methods is None:
        tables = "Mean accepted length / first-position acceptance:\n\n" + summary_table(results)
    else:
        tables = full_table([r for r in results if r.method in methods])
    return "\n\n".join(part for part in (intro, goal, tables) if part)


def update_docs(report: dict[str, Any], results: list[RunResult], root: Path) -> list[Path]:
    """Writes the BENCHMARKS.md section and each model card's acceptance section."""
    written = []
    bench = root / BENCHMARKS_FILE
    old = bench.read_text() if bench.is_file() else "# specmesh benchmarks\n"
    bench.write_text(replace_section(old, BENCHMARKS_SECTION, render_markdown(report, results), True))
    written.append(bench)
    models_dir = reference_dir(BASE_MODEL).parent
    for name, methods in CARD_METHODS.items():
        rows = results if methods is None else [r for r in results if r.method in methods]
        if not rows:
            continue
        card = models_dir / name / "README.md"
        card.write_text(replace_section(card.read_text(), CARD_SECTION, card_section(report, results, name)))
        written.append(card)
    return written


# ---- command line ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="k values (1..5)")
    parser.add_argument(
        "--trees",
        nargs="+",
        default=list(DEFAULT_TREES),
        help="tree shapes of the tree methods: children per depth, comma-separated (3,2,1)",
    )
    parser.add_argument(
        "--tree-budget",
        type=int,
        help="*_tree_ngram: tokens of the tree query, root included, the n-gram branch gets what the "
        "head's tree leaves (default: the head's tree and 5 n-gram drafts)",
    )
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--num-requests", type=int, default=16, help="first N requests of each workload")
    parser.add_argument("--max-tokens", type=int, default=64, help="cap on each request's max_tokens")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="requests running at a time")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=get_args(Dtype))
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: on a shared box, OpenMP threads waiting for each other cost more than they gain)",
    )
    parser.add_argument("--workloads-dir", type=Path, default=WORKLOADS_DIR)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results")
    parser.add_argument("--markdown", type=Path, help="also write the markdown report here")
    parser.add_argument(
        "--update-docs",
        action="store_true",
        help="write the tables into BENCHMARKS.md and the model cards' acceptance sections",
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument(
        "--from-json", type=Path, help="render the tables of an earlier run's JSON instead of running"
    )
    args = parser.parse_args(argv)
    if not args.ks or min(args.ks) < 1 or max(args.ks) > 5:
        parser.error("--ks must be between 1 and 5")
    args.ks = sorted(set(args.ks))
    try:
        args.trees = [tuple(int(b) for b in shape.split(",")) for shape in args.trees]
    except ValueError:
        parser.error(f"--trees takes comma-separated branching factors such as 3,2,1, not {args.trees}")
    if not args.from_json and not method_matrix(args.methods, args.ks, args.trees, args.tree_budget):
        parser.error("no method allows these k values (mtp: k <= 3; mtp_ngram: k >= 2)")
    return args


def measure(args: argparse.Namespace, argv: list[str]) -> tuple[dict[str, Any], list[RunResult]]:
    """Runs the matrix the arguments ask for; returns the report (JSON-ready) and the results."""
    configs = method_matrix(args.methods, args.ks, args.trees, args.tree_budget)
    options = Options(
        args.workloads,
        args.num_requests,
        args.max_tokens,
        args.max_num_seqs,
        args.device,
        args.dtype,
        args.workloads_dir,
        args.progress,
    )
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        results = AcceptanceBench(options).run(configs)
    finally:
        torch.set_num_threads(threads)
    report: dict[str, Any] = {
        "command": "python -m benchmarks.acceptance " + shlex.join(argv),
        "date": datetime.date.today().isoformat(),
        "machine": machine_description(args.device),
        "torch": torch.__version__,
        "settings": {
            "workloads": args.workloads,
            "num_requests": args.num_requests,
            "max_tokens": args.max_tokens,
            "max_num_seqs": args.max_num_seqs,
            "device": args.device,
            "dtype": args.dtype,
            "threads": args.threads,
            "methods": args.methods,
            "ks": args.ks,
            "trees": [list(tree) for tree in args.trees],
            "tree_budget": args.tree_budget,
        },
        "seconds": time.perf_counter() - started,
        "goal": goal_summary(results),
        "results": [r.as_dict() for r in results],
    }
    return report, results


def load_report(path: Path) -> tuple[dict[str, Any], list[RunResult]]:
    """A report written by an earlier run (to re-render its tables without measuring again)."""
    report: dict[str, Any] = json.loads(path.read_text())
    names = {f.name for f in fields(RunResult)}
    results = [RunResult(**{k: v for k, v in r.items() if k in names}) for r in report["results"]]
    return report, results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.from_json:
        report, results = load_report(args.from_json)
    else:
        report, results = measure(args, argv)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    markdown = render_markdown(report, results)
    print(markdown)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown)
    if args.update_docs:
        for path in update_docs(report, results, REPO_ROOT):
            print(f"updated {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
