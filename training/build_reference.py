"""`python -m training.build_reference`: builds specmesh's reference model family in one command.

Phases, in order: split the Python sources by package (training.data) -> train the byte-level BPE
tokenizer on the train split (training.tokenizer) -> tokenize the three splits (training.corpus)
-> train the base model, then the draft model (training.train_lm) -> train the base's MTP head by
self-distillation (training.train_mtp) -> write model cards and `manifest.json` -> optionally
pack everything into a few bounded files (training.pack).

Output under --out:
    specmesh-code-15m/      the base (target) model, Hugging Face format, sharded safetensors
    specmesh-code-draft/    the draft model, same tokenizer
    specmesh-code-15m-mtp/  the MTP head for the base
    manifest.json           settings, per-phase wall time, data statistics, every file's SHA-256
    data_split.json.gz      the files of each split
    tokenizer/, corpus/     intermediate files (not packed)

The shipped family comes from one GPU command (an estimated 7.5 minutes on an H100), then, here:
    python -m training.build_reference --out /tmp/reference --pack "$OUT" --no-progress
    python -m training.unpack_reference PACKDIR --out models/

Step counts are fixed per preset, so a run is repeatable; `--steps-scale` scales them all after a
first timing. `--time-budget-min` is a safety net, not a schedule: each training phase must end by
its share of the budget (`PHASE_DEADLINES`). A language-model phase whose measured speed would not
make it shortens its schedule early in the run (its learning rate still decays fully) and, as a
last resort, stops; the MTP phase gets fewer steps. The log, the manifest and the cards say so.
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import safetensors
import tokenizers
import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from shared.model.loader import SINGLE_FILE
from training.config import resolve_device
from training.corpus import save_tokens, tokenize_files
from training.data import DataSplit, default_roots, split_corpus
from training.model_card import BuildFacts, write_lm_card, write_mtp_card
from training.pack import pack_reference, sha256_of
from training.tokenizer import save_tokenizer, train_tokenizer
from training.train_lm import SHAPES, LMResult, TokenStreams, TrainLMConfig, device_name, train_lm
from training.train_mtp import TRAIN_LOG, TrainMTPConfig, TrainResult, train_mtp

BASE_DIR = "specmesh-code-15m"
DRAFT_DIR = "specmesh-code-draft"
MTP_DIR = "specmesh-code-15m-mtp"
MODEL_DIRS = (BASE_DIR, DRAFT_DIR, MTP_DIR)
LM_DIRS = {"base": BASE_DIR, "draft": DRAFT_DIR}
"""The language models of the family, by role, in the order they are trained."""
TOKENIZER_DIR = "tokenizer"
CORPUS_DIR = "corpus"
MANIFEST = "manifest.json"
DATA_SPLIT = "data_split.json.gz"
PACKED_PATHS = [*MODEL_DIRS, MANIFEST, DATA_SPLIT]
MAX_MODELS_BYTES = 40 << 20
"""The three model directories together must fit in 40 MiB (they are committed to the repository)."""
PHASE_DEADLINES = {"base": 0.62, "draft": 0.80, "mtp": 0.95}
"""Fraction of --time-budget-min (from the start of the command) by which each phase must end."""
MTP_COST_PER_BASE_TOKEN = 0.8
"""Wall time of an MTP step per token relative to a base training step per token (a frozen base
forward, one layer forward + backward, two vocabulary-wide softmaxes), used only to shorten the
MTP phase when the time budget could not hold its planned steps."""
MTP_FIXED_COST_S = 15.0
"""Loading the base and the held-out evaluations of the MTP phase, budgeted on top of its steps."""


class MTPPlan(BaseModel):
    """The MTP phase's settings (passed on to TrainMTPConfig)."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    seq_len: int = Field(ge=3)
    lr: float = Field(gt=0.0)
    warmup_steps: int = Field(ge=0)
    eval_every: int = Field(ge=1)
    eval_batches: int = Field(ge=1)
    max_train_tokens: int = Field(ge=1)
    """Train-stream tokens given to the MTP phase."""
    max_held_out_tokens: int = Field(ge=1)
    """Held-out-stream tokens it evaluates on (appended after the train tokens)."""


PhaseSettings = TypeVar("PhaseSettings", TrainLMConfig, MTPPlan)
"""A phase's settings that `with_steps` rescales."""


@dataclass(frozen=True)
class Preset:
    """Everything that sizes a build."""

    base_shape: str
    draft_shape: str
    tokenizer_max_bytes: int | None
    """Train-split bytes the tokenizer learns from (the first files in the seeded order)."""
    max_train_tokens: int | None
    """Cap of the train stream."""
    max_eval_tokens: int
    """Cap of the validation and held-out streams."""
    validation_fraction: float
    base: TrainLMConfig
    draft: TrainLMConfig
    mtp: MTPPlan
    max_shard_mb: float
    """Shard safetensors files larger than this (MiB); the base must be committed in 15 MiB files."""

    def lm(self, role: str) -> tuple[str, TrainLMConfig]:
        """(shape name, training config) of the base or draft model."""
        return (self.base_shape, self.base) if role == "base" else (self.draft_shape, self.draft)


_FULL_LM_COMMON: dict[str, Any] = {
    "batch_size": 64,
    "seq_len": 512,
    "warmup_steps": 250,
    "eval_batches": 8,
    "held_out_max_windows": 2048,
}
"""What the full preset's base and draft train alike; they differ in steps, lr and eval cadence."""
_TINY_LM_COMMON: dict[str, Any] = {
    "batch_size": 8,
    "seq_len": 64,
    "lr": 3e-3,
    "warmup_steps": 4,
    "eval_batches": 2,
    "held_out_max_windows": 16,
    "log_every": 4,
}
"""What the tiny preset's base and draft train alike; they differ in steps and eval cadence."""

PRESETS: dict[str, Preset] = {
    # Sized for one H100 in about 7.5 minutes of a 9-minute budget, from an estimate of eager-mode
    # throughput (memory traffic of the elementwise ops dominates at these widths): base ~0.8M
    # tokens/s -> 5500 steps x 32k tokens ~ 3.8 min; draft ~3M tokens/s -> 8000 x 32k ~ 1.5 min;
    # MTP ~1.4M tokens/s -> 6000 x 16k ~ 1.2 min; data, tokenizer and corpus ~ 0.5 min.
    # Rescale with --steps-scale after the first timed run.
    "full": Preset(
        base_shape="base",
        draft_shape="draft",
        tokenizer_max_bytes=48_000_000,
        max_train_tokens=100_000_000,
        max_eval_tokens=4_000_000,
        validation_fraction=0.03,
        base=TrainLMConfig(steps=5500, lr=2e-3, eval_every=500, **_FULL_LM_COMMON),
        draft=TrainLMConfig(steps=8000, lr=3e-3, eval_every=1000, **_FULL_LM_COMMON),
        mtp=MTPPlan(
            steps=6000,
            batch_size=32,
            seq_len=512,
            lr=5e-4,
            warmup_steps=100,
            eval_every=1000,
            eval_batches=8,
            max_train_tokens=40_000_000,
            max_held_out_tokens=1_000_000,
        ),
        max_shard_mb=15.0,
    ),
    # Seconds on two CPU cores: for tests of the pipeline, not for use.
    "tiny": Preset(
        base_shape="tiny",
        draft_shape="tiny-draft",
        tokenizer_max_bytes=None,
        max_train_tokens=None,
        max_eval_tokens=20_000,
        validation_fraction=0.1,
        base=TrainLMConfig(steps=24, eval_every=12, **_TINY_LM_COMMON),
        draft=TrainLMConfig(steps=16, eval_every=8, **_TINY_LM_COMMON),
        mtp=MTPPlan(
            steps=12,
            batch_size=4,
            seq_len=64,
            lr=1e-3,
            warmup_steps=2,
            eval_every=6,
            eval_batches=2,
            max_train_tokens=20_000,
            max_held_out_tokens=1_024,
        ),
        max_shard_mb=0.2,
    ),
}


@dataclass
class BuildOptions:
    out: Path
    preset: str = "full"
    seed: int = 0
    roots: list[Path] | None = None
    """Directories of Python sources; None: the interpreter's stdlib and site-packages."""
    time_budget_min: float = 9.0
    """0 disables the per-phase deadlines."""
    steps_scale: float = 1.0
    max_shard_mb: float | None = None
    """None: the preset's."""
    max_train_tokens: int | None = None
    """Cap of the train stream; None: the preset's."""
    device: str = "auto"
    progress: bool = True
    compile: bool = False
    pack: Path | None = None
    command: str = ""


@dataclass
class PhaseClock:
    """Wall time of each phase since the build started; deadlines as fractions of the budget."""

    budget_s: float | None
    started: float = field(default_factory=time.perf_counter)
    phases_s: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        _say(f"phase {name} ...")
        yield
        self.phases_s[name] = time.perf_counter() - start
        _say(f"phase {name} done in {self.phases_s[name]:.1f} s ({self.elapsed_s:.1f} s since start)")

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def seconds_left(self, phase: str) -> float | None:
        """Time until `phase` must end, or None without a budget."""
        if self.budget_s is None:
            return None
        return max(1.0, PHASE_DEADLINES[phase] * self.budget_s - self.elapsed_s)


# ---------------------------------------------------------------------------------------------- build


def build_reference(options: BuildOptions) -> dict[str, Any]:
    """Runs every phase (module docstring) and returns the manifest it wrote."""
    preset, out = PRESETS[options.preset], options.out
    prepare_output(out, options.pack)
    clock = PhaseClock(options.time_budget_min * 60 if options.time_budget_min > 0 else None)
    with clock.phase("data"):
        split = split_sources(out, options, preset)
    with clock.phase("tokenizer"):
        tokenizer = build_tokenizer(out, split, preset)
    with clock.phase("corpus"):
        streams = build_streams(out, split, tokenizer, preset, options.max_train_tokens)
    results: dict[str, LMResult] = {}
    for role in LM_DIRS:
        with clock.phase(role):
            results[role] = train_family_lm(role, out, streams, preset, options, clock.seconds_left(role))
    with clock.phase("mtp"):
        mtp_plan = scaled_mtp_plan(preset.mtp, options.steps_scale)
        mtp_plan = fit_mtp_to_budget(mtp_plan, results["base"], clock.seconds_left("mtp"))
        mtp_result = train_reference_mtp(out, streams, mtp_plan, options)
    with clock.phase("cards"):
        facts = build_facts(split, tokenizer, streams, preset, options)
        write_cards(out, facts, results, mtp_result, mtp_plan, preset, options)
    manifest = write_manifest(out, options, facts, results, mtp_result, mtp_plan, clock)
    check_models_size(out)
    if options.pack is not None:
        with clock.phase("pack"):
            packed = pack_reference(out, options.pack, PACKED_PATHS)
            _say("packed: " + ", ".join(f"{p.name} ({p.stat().st_size / 2**20:.2f} MiB)" for p in packed))
    _say("phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in clock.phases_s.items()))
    _say(f"total {clock.elapsed_s:.1f} s")
    return manifest


def split_sources(out: Path, options: BuildOptions, preset: Preset) -> DataSplit:
    """The package split of the roots; its file lists go to data_split.json."""
    split = split_corpus(options.roots or default_roots(), options.seed, preset.validation_fraction)
    # gzip, with a fixed mtime so the bytes only depend on the split
    (out / DATA_SPLIT).write_bytes(
        gzip.compress((json.dumps(split.file_lists(), indent=0) + "\n").encode(), mtime=0)
    )
    _say(f"data: {json.dumps(split.summary()['train'])} train, held out {_held_out_summary(split)}")
    return split


def build_tokenizer(out: Path, split: DataSplit, preset: Preset) -> Tokenizer:
    """The tokenizer, trained on the train split and saved under tokenizer/."""
    shape = SHAPES[preset.base_shape]
    tokenizer = train_tokenizer(split.train, shape.vocab_size, preset.tokenizer_max_bytes)
    save_tokenizer(tokenizer, out / TOKENIZER_DIR, shape.max_position_embeddings)
    return tokenizer


def build_streams(
    out: Path, split: DataSplit, tokenizer: Tokenizer, preset: Preset, max_train_tokens: int | None
) -> TokenStreams:
    """The three token streams, also saved as corpus/<split>.npy."""
    streams = TokenStreams(
        train=tokenize_files(split.train, tokenizer, max_train_tokens or preset.max_train_tokens),
        validation=tokenize_files(split.validation, tokenizer, preset.max_eval_tokens),
        held_out=tokenize_files(split.held_out, tokenizer, preset.max_eval_tokens),
    )
    for name, tokens in _token_streams(streams).items():
        save_tokens(tokens, out / CORPUS_DIR / f"{name}.npy")
    _say(f"corpus: {_token_counts(streams)} tokens")
    return streams


def train_family_lm(
    role: str,
    out: Path,
    streams: TokenStreams,
    preset: Preset,
    options: BuildOptions,
    seconds_left: float | None,
) -> LMResult:
    """Trains and saves the base (`role` "base") or the draft model."""
    shape_name, config = preset.lm(role)
    result = train_lm(
        LM_DIRS[role],
        SHAPES[shape_name],
        streams,
        out / TOKENIZER_DIR,
        out / LM_DIRS[role],
        phase_config(config, options, seconds_left),
        max_shard_bytes=int((options.max_shard_mb or preset.max_shard_mb) * 2**20),
    )
    _say(_describe_lm(result))
    return result


def build_facts(
    split: DataSplit, tokenizer: Tokenizer, streams: TokenStreams, preset: Preset, options: BuildOptions
) -> BuildFacts:
    return BuildFacts(
        data={**split.summary(), "tokens": _token_counts(streams)},
        tokenizer={
            "vocab_size": tokenizer.get_vocab_size(),
            "trained_on_bytes": _tokenizer_bytes(split, preset.tokenizer_max_bytes),
        },
        base_name=BASE_DIR,
        draft_name=DRAFT_DIR,
        mtp_name=MTP_DIR,
        command=options.command,
    )


def write_cards(
    out: Path,
    facts: BuildFacts,
    results: dict[str, LMResult],
    mtp_result: TrainResult,
    mtp_plan: MTPPlan,
    preset: Preset,
    options: BuildOptions,
) -> None:
    for role, result in results.items():
        write_lm_card(result, phase_config(preset.lm(role)[1], options, None), facts, role)
    mtp_info = {**mtp_plan.model_dump(), "device_name": device_name(resolve_device(options.device))}
    write_mtp_card(mtp_result, count_checkpoint_params(out / MTP_DIR), mtp_info, facts)


def prepare_output(out: Path, pack_dir: Path | None) -> None:
    """Checks the pack directory before any training, and clears the model
    directories of an earlier build (a stale shard would otherwise be packed and counted)."""
    if pack_dir is not None and pack_dir.exists() and any(pack_dir.iterdir()):
        raise ValueError(f"the pack directory {pack_dir} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    for name in MODEL_DIRS:
        if (out / name).is_dir():
            shutil.rmtree(out / name)


def phase_config(config: TrainLMConfig, options: BuildOptions, seconds_left: float | None) -> TrainLMConfig:
    """The preset's config with the build's seed, device, step scale and time limit."""
    scaled = with_steps(config, round(config.steps * options.steps_scale))
    return scaled.model_copy(
        update={
            "seed": options.seed,
            "device": options.device,
            "progress": options.progress,
            "compile": options.compile,
            "time_limit_s": seconds_left,
        }
    )


def scaled_mtp_plan(plan: MTPPlan, steps_scale: float) -> MTPPlan:
    return with_steps(plan, round(plan.steps * steps_scale))


def fit_mtp_to_budget(plan: MTPPlan, base: LMResult, seconds_left: float | None) -> MTPPlan:
    """Fewer MTP steps when, at the base's measured throughput, the planned ones would overrun the
    budget (train_mtp has no time limit of its own)."""
    if seconds_left is None:
        return plan
    step_s = MTP_COST_PER_BASE_TOKEN * plan.batch_size * plan.seq_len / base.tokens_per_s
    affordable = int((seconds_left - MTP_FIXED_COST_S) / step_s)
    if affordable >= plan.steps:
        return plan
    steps = max(2, affordable)
    _say(f"mtp: the time budget allows about {steps} of the planned {plan.steps} steps; shortening")
    return with_steps(plan, steps)


def with_steps(config: PhaseSettings, steps: int) -> PhaseSettings:
    """`config` run for `steps` steps (at least 2), its warm-up cut to at most a fifth of them."""
    steps = max(2, steps)
    return config.model_copy(update={"steps": steps, "warmup_steps": min(config.warmup_steps, steps // 5)})


def train_reference_mtp(
    out: Path, streams: TokenStreams, plan: MTPPlan, options: BuildOptions
) -> TrainResult:
    """Trains the MTP head on train-stream windows and evaluates it on held-out ones: both go in one
    token file, held-out last, with `holdout_fraction` set so train_mtp's tail split falls exactly
    on the boundary."""
    seq_len = plan.seq_len
    num_train = min(streams.train.numel(), plan.max_train_tokens) // seq_len * seq_len
    num_held_out = min(streams.held_out.numel(), plan.max_held_out_tokens) // seq_len * seq_len
    if num_train < seq_len or num_held_out < seq_len:
        raise ValueError(f"the MTP phase needs at least {seq_len} train and held-out tokens")
    tokens = torch.cat([streams.train[:num_train], streams.held_out[:num_held_out]])
    token_file = save_tokens(tokens, out / CORPUS_DIR / "mtp.npy")
    config = TrainMTPConfig(
        base=out / BASE_DIR,
        out=out / MTP_DIR,
        data_tokens=token_file,
        holdout_fraction=num_held_out / (num_train + num_held_out),
        steps=plan.steps,
        batch_size=plan.batch_size,
        seq_len=seq_len,
        lr=plan.lr,
        warmup_steps=plan.warmup_steps,
        eval_every=plan.eval_every,
        eval_batches=plan.eval_batches,
        seed=options.seed,
        device=options.device,
        progress=options.progress,
    )
    result = train_mtp(config)
    shrink_mtp_dir(config.out)
    _say(
        f"mtp: held-out KL {result.initial.kl:.4f} -> {result.final.kl:.4f} nats, top-1 agreement "
        f"{result.initial.agreement:.3f} -> {result.final.agreement:.3f}, {result.elapsed_s:.1f} s"
    )
    return result


def shrink_mtp_dir(mtp_dir: Path) -> None:
    """Halves what the head takes in the repository: its float32 weights rewritten as bfloat16, like
    the base's (it is served in the base's dtype anyway), and its train log as compact JSON."""
    log_path = mtp_dir / TRAIN_LOG
    log_path.write_text(json.dumps(json.loads(log_path.read_text()), separators=(",", ":")) + "\n")
    path = mtp_dir / SINGLE_FILE
    tensors = {name: t.to(torch.bfloat16) for name, t in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    config_path = mtp_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["torch_dtype"] = "bfloat16"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def count_checkpoint_params(model_dir: Path) -> int:
    return sum(
        t.numel() for path in sorted(model_dir.glob("*.safetensors")) for t in load_file(str(path)).values()
    )


# ------------------------------------------------------------------------------------------- outputs


def write_manifest(
    out: Path,
    options: BuildOptions,
    facts: BuildFacts,
    results: dict[str, LMResult],
    mtp_result: TrainResult,
    mtp_plan: MTPPlan,
    clock: PhaseClock,
) -> dict[str, Any]:
    """manifest.json: how the family was built, what it measured, and every model file's SHA-256."""
    manifest: dict[str, Any] = {
        "family": {"base": BASE_DIR, "draft": DRAFT_DIR, "mtp": MTP_DIR},
        "command": options.command,
        "preset": options.preset,
        "seed": options.seed,
        "steps_scale": options.steps_scale,
        "time_budget_min": options.time_budget_min,
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__,
            "device": device_name(resolve_device(options.device)),
        },
        "phases_s": {k: round(v, 2) for k, v in clock.phases_s.items()},
        "data": facts.data,
        "tokenizer": facts.tokenizer,
        "models": {
            BASE_DIR: {"role": "base", **results["base"].summary()},
            DRAFT_DIR: {"role": "draft", **results["draft"].summary()},
            MTP_DIR: {
                "role": "mtp",
                "num_params": count_checkpoint_params(out / MTP_DIR),
                "plan": mtp_plan.model_dump(),
                "steps": len(mtp_result.losses),
                "planned_steps": scaled_mtp_plan(PRESETS[options.preset].mtp, options.steps_scale).steps,
                "elapsed_s": mtp_result.elapsed_s,
                "held_out_kl": [mtp_result.initial.kl, mtp_result.final.kl],
                "held_out_top1_agreement": [mtp_result.initial.agreement, mtp_result.final.agreement],
            },
        },
        "files": {name: _file_digests(out / name) for name in MODEL_DIRS},
    }
    manifest["models_total_bytes"] = sum(
        entry["bytes"] for files in manifest["files"].values() for entry in files.values()
    )
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def check_models_size(out: Path) -> int:
    """Raises when the model directories together exceed MAX_MODELS_BYTES."""
    total = sum(p.stat().st_size for name in MODEL_DIRS for p in (out / name).rglob("*") if p.is_file())
    if total > MAX_MODELS_BYTES:
        raise ValueError(
            f"the model directories hold {total / 2**20:.2f} MiB, over the {MAX_MODELS_BYTES >> 20} MiB "
            "they may take in the repository"
        )
    _say(f"model directories: {total / 2**20:.2f} MiB ({total:,} bytes) of {MAX_MODELS_BYTES >> 20} MiB")
    return total


def _file_digests(model_dir: Path) -> dict[str, dict[str, Any]]:
    return {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
        for p in sorted(model_dir.iterdir())
        if p.is_file()
    }


def _token_streams(streams: TokenStreams) -> dict[str, torch.Tensor]:
    return {"train": streams.train, "validation": streams.validation, "held_out": streams.held_out}


def _token_counts(streams: TokenStreams) -> dict[str, int]:
    return {name: int(tokens.numel()) for name, tokens in _token_streams(streams).items()}


def _tokenizer_bytes(split: DataSplit, max_bytes: int | None) -> int:
    """Bytes the tokenizer trainer read (whole files up to and including the one crossing the cap)."""
    total = 0
    for f in split.train:
        if max_bytes is not None and total >= max_bytes:
            break
        total += f.num_bytes
    return total


def _held_out_summary(split: DataSplit) -> str:
    stats = split.stats("held_out")
    return f"{stats.num_files} files of {', '.join(stats.packages)}"


def _describe_lm(result: LMResult) -> str:
    return (
        f"{result.name}: {result.num_params:,} parameters, {result.steps} steps, "
        f"{result.tokens_per_s:,.0f} tokens/s, train {result.final_train_loss:.4f}, "
        f"validation {result.validation_loss:.4f}, held-out {result.held_out_loss:.4f} "
        f"(perplexity {result.held_out_perplexity:.2f}), {result.elapsed_s:.1f} s"
    )


def _say(message: str) -> None:
    print(f"build-reference: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> BuildOptions:
    parser = argparse.ArgumentParser(
        prog="python -m training.build_reference", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="build directory")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--roots", type=Path, nargs="+", help="source roots (default: stdlib + site-packages)"
    )
    parser.add_argument("--time-budget-min", type=float, default=9.0, help="per-phase deadlines; 0: none")
    parser.add_argument("--steps-scale", type=float, default=1.0, help="multiply every phase's steps")
    parser.add_argument("--max-shard-mb", type=float, help="shard safetensors over this many MiB")
    parser.add_argument(
        "--max-train-tokens", type=int, help="cap of the train stream (default: the preset's)"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    parser.add_argument("--compile", action="store_true", help="torch.compile the LM training forward")
    parser.add_argument("--pack", type=Path, help="also pack the family into this directory")
    args = parser.parse_args(argv)
    if args.steps_scale <= 0:
        parser.error("--steps-scale must be positive")
    command = shlex.join(
        ["python", "-m", "training.build_reference", *(sys.argv[1:] if argv is None else argv)]
    )
    return BuildOptions(**vars(args), command=command)


def main(argv: list[str] | None = None) -> int:
    build_reference(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
