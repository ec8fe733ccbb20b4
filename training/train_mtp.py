"""`specmesh train-mtp`: self-distillation of a DeepSeek-V3-style MTP head from a frozen target.

The head (shared/model/mtp.py; DeepSeek-V3, arXiv 2412.19437, §2.2) reads the target's final-normed
hidden state h_i and the next token t_{i+1} and drafts t_{i+2}. It is trained to reproduce the
*target's own* next-token distribution at position i + 1, not the corpus: speculative decoding
accepts a draft when the target agrees with it (Leviathan et al. 2023, arXiv 2211.17192), so the
target's distribution is the right label, soft labels carry more signal per token than one-hot
ones, and no labelled data is needed beyond raw text. Per draft row i:

    loss_i = (1 - w) * KL(target_probs[i + 1] || head_probs[i]) + w * CE(head_logits[i], t_{i+2})

with w = `hard_label_weight` (0 by default: pure self-distillation). The *acceptance proxy*
reported on held-out text is the top-1 agreement argmax(head_logits[i]) == argmax(target_logits[i + 1]):
the rate at which a greedy first draft would be accepted under greedy verification.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, field_validator, model_validator
from tqdm import tqdm

from shared.model import LlamaForCausalLM, ModelConfig, load_model
from shared.model.mtp import MTPHead, save_mtp_head
from shared.tokenizer import Tokenizer
from training.config import (
    Count,
    HeadRunConfig,
    NonNegativeReal,
    PositiveCount,
    PositiveReal,
    warmup_cosine,
)

logger = logging.getLogger(__name__)

TOKEN_FILE_SUFFIXES = (".npy", ".pt")
TRAIN_LOG = "train_log.json"
LOSS_PLOT = "loss.png"


class TrainMTPConfig(HeadRunConfig):
    """One training run (the optimiser settings: training.config). Exactly one of `data` and
    `data_tokens` gives the corpus."""

    data: list[Path] = Field(default_factory=list)
    """Text files and/or directories searched with `data_glob`."""
    data_glob: str = "**/*.py"
    """Pattern for files inside `data` directories."""
    data_tokens: Path | None = None
    """A .npy or .pt file of token ids (1-D, or 2-D and flattened) used instead of `data`."""
    max_files: int | None = Field(default=None, ge=1)
    """Read at most this many files (in sorted order)."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Keep at most this many corpus tokens."""
    holdout_fraction: float = Field(default=0.05, gt=0.0, lt=1.0)
    """Fraction of the corpus windows (the last ones) kept out of training for evaluation."""
    seq_len: int = Field(default=256, ge=3)
    """Tokens per window; each window yields seq_len - 1 draft rows."""
    hard_label_weight: float = Field(default=0.0, ge=0.0, le=1.0)
    """Weight w of the cross-entropy on the corpus token t_{i+2}, mixed as (1 - w) * KL + w * CE."""

    # TrainingRunConfig's fields, with this run's defaults
    batch_size: PositiveCount = 8
    lr: PositiveReal = 3e-4
    warmup_steps: Count = 20
    weight_decay: NonNegativeReal = 0.01
    eval_every: PositiveCount = 100
    """Evaluate on the held-out windows every this many steps (and before and after training)."""
    eval_batches: PositiveCount = 16
    """Held-out batches per evaluation."""

    @field_validator("data")
    @classmethod
    def _data_exists(cls, data: list[Path]) -> list[Path]:
        missing = [str(p) for p in data if not p.exists()]
        if missing:
            raise ValueError(f"no such file or directory: {', '.join(missing)}")
        return data

    @field_validator("data_tokens")
    @classmethod
    def _token_file(cls, path: Path | None) -> Path | None:
        if path is not None and (path.suffix not in TOKEN_FILE_SUFFIXES or not path.is_file()):
            raise ValueError(f"{path} is not an existing {' or '.join(TOKEN_FILE_SUFFIXES)} file")
        return path

    @field_validator("device")
    @classmethod
    def _cuda_available(cls, device: str) -> str:
        """Runs after TrainingRunConfig's check of the device's form."""
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but no CUDA device is available")
        return device

    @model_validator(mode="after")
    def _check(self) -> TrainMTPConfig:
        """Replaces TrainingRunConfig._check (same name), to name the flag and check the corpus first."""
        if bool(self.data) == (self.data_tokens is not None):
            raise ValueError("give the corpus with exactly one of --data and --data-tokens")
        self._check_warmup(hint="; lower --warmup-steps")
        self._check_out()
        return self


@dataclass
class EvalStats:
    step: int
    kl: float
    """Mean KL(target || head) per draft row, in nats."""
    agreement: float
    """Top-1 agreement of head and target: the first-draft acceptance proxy."""
    num_rows: int


@dataclass
class TrainResult:
    out_dir: Path
    losses: list[float]
    """Training loss of every step."""
    evals: list[EvalStats]
    """Held-out evaluations; the first is of the untrained head (step 0), the last of the saved one."""
    elapsed_s: float
    loss_plot: Path | None
    """loss.png, or None when matplotlib is not installed."""

    @property
    def initial(self) -> EvalStats:
        return self.evals[0]

    @property
    def final(self) -> EvalStats:
        return self.evals[-1]


@dataclass
class Corpus:
    train: torch.Tensor  # [num_train_windows, seq_len] int64
    held_out: torch.Tensor  # [num_held_out_windows, seq_len] int64
    num_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- data


def collect_files(paths: list[Path], pattern: str, max_files: int | None = None) -> list[Path]:
    """Files named directly, then those under each directory matching `pattern`, in sorted order."""
    files: list[Path] = []
    for path in paths:
        files.extend([path] if path.is_file() else sorted(p for p in path.glob(pattern) if p.is_file()))
    if not files:
        raise ValueError(f"no files matching {pattern!r} in {', '.join(map(str, paths))}")
    return files[:max_files]


def tokenize_files(
    files: list[Path], tokenizer: Tokenizer, eos_id: int | None, max_tokens: int | None = None
) -> torch.Tensor:  # [num_tokens] int64
    """Encodes each file and concatenates them, each followed by `eos_id` (when there is one)."""
    chunks: list[list[int]] = []
    total = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text:
            continue
        ids = tokenizer.encode(text) + ([] if eos_id is None else [eos_id])
        chunks.append(ids)
        total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    tokens = torch.tensor([t for ids in chunks for t in ids], dtype=torch.int64)
    return tokens[:max_tokens]


def load_token_file(path: Path) -> torch.Tensor:  # [num_tokens] int64
    """Token ids from a .npy (numpy) or .pt (torch) file; any shape, flattened in order."""
    if path.suffix == ".npy":
        tokens = torch.from_numpy(np.load(path, allow_pickle=False))
    else:
        tokens = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(tokens, torch.Tensor):
            raise ValueError(f"{path} holds a {type(tokens).__name__}, not a tensor of token ids")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ValueError(f"{path} holds {tokens.dtype} values, not integer token ids")
    return tokens.flatten().long()


def make_windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    # tokens: [num_tokens] -> [num_tokens // seq_len, seq_len]; the tail shorter than a window is dropped
    num_windows = tokens.numel() // seq_len
    return tokens[: num_windows * seq_len].view(num_windows, seq_len)


def hold_out(windows: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Splits off the last `fraction` of the windows (at least one) for evaluation.

    The tail rather than a random sample: neighbouring windows of one file share names and idioms,
    so a random split would leak them and flatter the held-out numbers.
    """
    num_held_out = max(1, round(len(windows) * fraction))
    if len(windows) - num_held_out < 1:
        raise ValueError(
            f"the corpus gives only {len(windows)} window(s) of seq_len tokens; need at least 2 "
            "(one to train on, one held out): add data or lower --seq-len"
        )
    return windows[:-num_held_out], windows[-num_held_out:]


def load_corpus(config: TrainMTPConfig, model_config: ModelConfig) -> Corpus:
    """Reads, tokenizes, checks and windows the corpus the config names."""
    if config.data_tokens is not None:
        tokens = load_token_file(config.data_tokens)[: config.max_tokens]
        meta: dict[str, Any] = {"source": str(config.data_tokens)}
    else:
        files = collect_files(config.data, config.data_glob, config.max_files)
        tokenizer = Tokenizer(config.base)
        tokens = tokenize_files(files, tokenizer, _eos_id(model_config, tokenizer), config.max_tokens)
        meta = {"source": [str(p) for p in config.data], "num_files": len(files)}
    if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < model_config.vocab_size:
        raise ValueError(
            f"token ids span [{int(tokens.min())}, {int(tokens.max())}], outside the base model's "
            f"vocabulary of {model_config.vocab_size}"
        )
    train, held_out = hold_out(make_windows(tokens, config.seq_len), config.holdout_fraction)
    return Corpus(train, held_out, tokens.numel(), meta)


def _eos_id(model_config: ModelConfig, tokenizer: Tokenizer) -> int | None:
    eos_ids = model_config.eos_token_ids or tuple(sorted(tokenizer.eos_token_ids))
    if not eos_ids:
        logger.warning("the base model defines no EOS token; files are concatenated without separators")
        return None
    return eos_ids[0]


# --------------------------------------------------------------------------------------------- model


def init_head_from_target(target: LlamaForCausalLM, device: torch.device) -> MTPHead:
    """A float32 head that starts as "the target's last layer applied once more".

    Its decoder layer is a copy of the target's last one and eh_proj = [0 | I], so the head first
    computes LastLayer(hnorm(h_i)). Why: the LM head it reads out through is the target's and
    frozen, so the head must produce features in the target's late-layer space; starting from the
    layer that produces exactly those features, training only learns the shift by one position,
    where a random layer would first have to find that space. The embedding half of eh_proj starts
    at zero and still learns from the first step, since its input enorm(embed(t_{i+1})) is never
    zero. (On the tests' random-weight bases, whose weights are drawn far larger than a default
    init, a fresh layer can train faster; the copy is meant for trained targets.)
    """
    head = MTPHead(target).to(device)
    head.layer.load_state_dict(target.layers[-1].state_dict())
    hidden_size = head.config.hidden_size
    with torch.no_grad():
        head.eh_proj.weight.zero_()
        head.eh_proj.weight[:, hidden_size:] = torch.eye(hidden_size, device=device)
    return head


# ---------------------------------------------------------------------------------------------- loss


@torch.no_grad()
def target_pass(
    target: LlamaForCausalLM,
    token_ids: torch.Tensor,  # [batch, seq]
) -> tuple[torch.Tensor, torch.Tensor]:  # hidden [batch, seq, hidden], logits [batch, seq, vocab] float32
    hidden = target.forward_dense(token_ids)
    return hidden, target.compute_logits(hidden)


def head_pass(
    head: MTPHead,
    token_ids: torch.Tensor,  # [batch, seq]
    target_hidden: torch.Tensor,  # [batch, seq, hidden]
) -> torch.Tensor:  # [batch, seq - 1, vocab] float32: row i drafts t_{i+2}
    return head.logits(head.forward_dense(token_ids[:, 1:], target_hidden[:, :-1]))


def distillation_kl(
    head_logits: torch.Tensor,  # [batch, seq - 1, vocab]
    target_logits: torch.Tensor,  # [batch, seq, vocab]
) -> torch.Tensor:  # scalar: mean over rows of KL(target_probs[i + 1] || head_probs[i])
    head_logprobs = F.log_softmax(head_logits.float(), dim=-1)
    target_logprobs = F.log_softmax(target_logits[:, 1:].float(), dim=-1)
    kl = F.kl_div(head_logprobs, target_logprobs, log_target=True, reduction="none")
    return kl.sum(-1).mean()


def hard_label_ce(
    head_logits: torch.Tensor,  # [batch, seq - 1, vocab]
    token_ids: torch.Tensor,  # [batch, seq]
) -> torch.Tensor:  # scalar: cross-entropy against t_{i+2}; the last row has no label
    return F.cross_entropy(head_logits[:, :-1].flatten(0, 1).float(), token_ids[:, 2:].flatten())


def training_loss(
    head_logits: torch.Tensor, target_logits: torch.Tensor, token_ids: torch.Tensor, hard_label_weight: float
) -> torch.Tensor:
    loss = distillation_kl(head_logits, target_logits)
    if hard_label_weight == 0.0:
        return loss
    return (1.0 - hard_label_weight) * loss + hard_label_weight * hard_label_ce(head_logits, token_ids)


def num_agreements(
    head_logits: torch.Tensor,  # [batch, seq - 1, vocab]
    target_logits: torch.Tensor,  # [batch, seq, vocab]
) -> int:
    """Rows where the head's greedy draft equals the target's greedy next token."""
    return int((head_logits.argmax(-1) == target_logits[:, 1:].argmax(-1)).sum())


# ---------------------------------------------------------------------------------------------- loop


def train_mtp(config: TrainMTPConfig) -> TrainResult:
    """Trains a head on the frozen base, evaluating as it goes; saves it with its log and plot."""
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    device = config.torch_device
    model_config = ModelConfig.from_dir(config.base)
    if config.seq_len > model_config.max_position_embeddings:
        raise ValueError(
            f"seq_len ({config.seq_len}) exceeds the base model's max_position_embeddings "
            f"({model_config.max_position_embeddings})"
        )
    corpus = load_corpus(config, model_config)
    target_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    target = load_model(config.base, target_dtype, device, max_positions=config.seq_len).requires_grad_(False)
    head = init_head_from_target(target, device)
    losses, learning_rates, evals = train_loop(head, target, corpus, config)
    save_mtp_head(head, config.out)
    elapsed_s = time.perf_counter() - started
    write_train_log(config, corpus, losses, learning_rates, evals, elapsed_s)
    loss_plot = plot_losses(losses, evals, config.out / LOSS_PLOT)
    return TrainResult(config.out, losses, evals, elapsed_s, loss_plot)


def train_loop(
    head: MTPHead, target: LlamaForCausalLM, corpus: Corpus, config: TrainMTPConfig
) -> tuple[list[float], list[float], list[EvalStats]]:
    """AdamW with warm-up + cosine decay; returns per-step losses and learning rates, and the evals."""
    device = config.torch_device
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, config.warmup_steps, config.steps, config.min_lr_ratio)
    )
    batches = torch.Generator().manual_seed(config.seed)
    progress = tqdm(range(1, config.steps + 1), desc="train-mtp", disable=not config.progress, unit="step")
    progress.write(_describe_corpus(corpus, config, device), file=sys.stderr)
    evals = [evaluate(head, target, corpus.held_out, config, step=0)]
    progress.write(_describe(evals[0]), file=sys.stderr)
    losses: list[float] = []
    learning_rates: list[float] = []
    for step in progress:
        learning_rates.append(float(schedule.get_last_lr()[0]))
        batch = sample_batch(corpus.train, config.batch_size, batches).to(device)
        losses.append(train_step(head, target, batch, optimizer, config))
        schedule.step()
        progress.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
        if step % config.eval_every == 0 or step == config.steps:
            evals.append(evaluate(head, target, corpus.held_out, config, step))
            progress.write(_describe(evals[-1]), file=sys.stderr)
    progress.close()
    return losses, learning_rates, evals


def sample_batch(windows: torch.Tensor, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    # windows: [num_windows, seq_len] -> [batch_size, seq_len], drawn with replacement
    return windows[torch.randint(len(windows), (batch_size,), generator=generator)]


def train_step(
    head: MTPHead,
    target: LlamaForCausalLM,
    token_ids: torch.Tensor,  # [batch, seq]
    optimizer: torch.optim.Optimizer,
    config: TrainMTPConfig,
) -> float:
    head.train()
    with bf16_autocast(token_ids.device):
        target_hidden, target_logits = target_pass(target, token_ids)
        head_logits = head_pass(head, token_ids, target_hidden)
        loss = training_loss(head_logits, target_logits, token_ids, config.hard_label_weight)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), config.grad_clip)
    optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def evaluate(
    head: MTPHead, target: LlamaForCausalLM, windows: torch.Tensor, config: TrainMTPConfig, step: int
) -> EvalStats:
    """Mean KL and top-1 agreement over the first `eval_batches` batches of held-out windows."""
    windows = windows[: config.eval_batches * config.batch_size]
    return score_windows(head, target, windows, config.batch_size, config.torch_device, step)


@torch.no_grad()
def score_windows(
    head: MTPHead,
    target: LlamaForCausalLM,
    windows: torch.Tensor,  # [num_windows, seq_len]
    batch_size: int,
    device: torch.device,
    step: int,
    first_row: int = 0,
) -> EvalStats:
    """Mean KL and top-1 agreement of the draft rows from `first_row` on (row i drafts t_{i+2}),
    e.g. only the rows of a generated continuation after its prompt."""
    head.eval()
    kl_sum, agreements, num_rows = 0.0, 0, 0
    for batch in windows.split(batch_size):
        token_ids = batch.to(device)
        with bf16_autocast(token_ids.device):
            target_hidden, target_logits = target_pass(target, token_ids)
            head_logits = head_pass(head, token_ids, target_hidden)
        head_logits, target_logits = head_logits[:, first_row:], target_logits[:, first_row:]
        rows = head_logits.shape[0] * head_logits.shape[1]
        kl_sum += float(distillation_kl(head_logits, target_logits)) * rows
        agreements += num_agreements(head_logits, target_logits)
        num_rows += rows
    return EvalStats(step=step, kl=kl_sum / num_rows, agreement=agreements / num_rows, num_rows=num_rows)


def bf16_autocast(device: torch.device) -> torch.autocast:
    """bf16 autocast on CUDA (the head's weights stay float32); plain float32 on CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _describe_corpus(corpus: Corpus, config: TrainMTPConfig, device: torch.device) -> str:
    return (
        f"train-mtp: {corpus.num_tokens} tokens -> {len(corpus.train)} training / {len(corpus.held_out)} "
        f"held-out windows of {config.seq_len} tokens, on {device}"
    )


def _describe(stats: EvalStats) -> str:
    return (
        f"step {stats.step}: held-out KL {stats.kl:.4f} nats, "
        f"top-1 agreement {stats.agreement:.3f} ({stats.num_rows} rows)"
    )


# -------------------------------------------------------------------------------------------- output


def write_train_log(
    config: TrainMTPConfig,
    corpus: Corpus,
    losses: list[float],
    learning_rates: list[float],
    evals: list[EvalStats],
    elapsed_s: float,
) -> Path:
    log = {
        "config": config.model_dump(mode="json"),
        "corpus": {
            **corpus.meta,
            "num_tokens": corpus.num_tokens,
            "num_train_windows": len(corpus.train),
            "num_held_out_windows": len(corpus.held_out),
        },
        "steps": [
            {"step": i + 1, "loss": loss, "lr": lr}
            for i, (loss, lr) in enumerate(zip(losses, learning_rates))
        ],
        "evals": [asdict(stats) for stats in evals],
        "elapsed_s": elapsed_s,
    }
    path = config.out / TRAIN_LOG
    path.write_text(json.dumps(log, indent=2) + "\n")
    return path


def plot_losses(losses: list[float], evals: list[EvalStats], path: Path) -> Path | None:
    """Training loss per step and held-out KL / agreement, as a PNG; None without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'specmesh[train]'); not writing %s", path)
        return None
    figure = Figure(figsize=(10, 4), layout="constrained")
    loss_axes, agreement_axes = figure.subplots(1, 2)
    loss_axes.plot(range(1, len(losses) + 1), losses, label="train loss", linewidth=0.8)
    loss_axes.plot([e.step for e in evals], [e.kl for e in evals], "o-", label="held-out KL")
    loss_axes.set(xlabel="step", ylabel="nats", yscale="log", title="distillation loss")
    loss_axes.legend()
    agreement_axes.plot([e.step for e in evals], [e.agreement for e in evals], "o-")
    agreement_axes.set(
        xlabel="step", ylabel="top-1 agreement", ylim=(0, 1), title="first-draft acceptance proxy"
    )
    figure.savefig(path, dpi=100)
    return path


# ----------------------------------------------------------------------------------------------- CLI


def add_train_mtp_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds `train-mtp`. Unset flags are left out of the namespace so defaults live in TrainMTPConfig."""
    parser = subparsers.add_parser(
        "train-mtp",
        help="train an MTP draft head on a frozen base model (self-distillation)",
        description=(
            "Self-distillation of a DeepSeek-V3-style MTP draft head from a frozen base model; "
            f"writes the head (config.json, model.safetensors), {TRAIN_LOG} and {LOSS_PLOT} to --out."
        ),
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--base", type=Path, required=True, help="base (target) model directory")
    parser.add_argument("--out", type=Path, required=True, help="directory to write the head to")
    data = parser.add_argument_group("data")
    data.add_argument("--data", type=Path, nargs="+", help="text files and/or directories")
    data.add_argument("--data-glob", help=_help("data_glob", "pattern for files in --data directories"))
    data.add_argument("--data-tokens", type=Path, help="a .npy or .pt file of token ids, instead of --data")
    data.add_argument("--max-files", type=int, help="read at most this many files")
    data.add_argument("--max-tokens", type=int, help="keep at most this many tokens")
    data.add_argument("--holdout-fraction", type=float, help=_help("holdout_fraction", "held-out share"))
    optim = parser.add_argument_group("optimisation")
    optim.add_argument("--steps", type=int, help=_help("steps", "optimizer steps"))
    optim.add_argument("--batch-size", type=int, help=_help("batch_size", "windows per step"))
    optim.add_argument("--seq-len", type=int, help=_help("seq_len", "tokens per window"))
    optim.add_argument("--lr", type=float, help=_help("lr", "peak AdamW learning rate"))
    optim.add_argument("--min-lr-ratio", type=float, help=_help("min_lr_ratio", "final lr / peak lr"))
    optim.add_argument("--warmup-steps", type=int, help=_help("warmup_steps", "linear warm-up steps"))
    optim.add_argument("--weight-decay", type=float, help=_help("weight_decay", "AdamW weight decay"))
    optim.add_argument("--grad-clip", type=float, help=_help("grad_clip", "max global gradient norm"))
    optim.add_argument(
        "--hard-label-weight",
        type=float,
        help=_help("hard_label_weight", "mix in cross-entropy on the corpus token: (1-w) KL + w CE"),
    )
    optim.add_argument("--seed", type=int, help=_help("seed", "random seed"))
    parser.add_argument("--device", help=_help("device", "auto, cpu, cuda or cuda:N"))
    parser.add_argument("--eval-every", type=int, help=_help("eval_every", "steps between evaluations"))
    parser.add_argument("--eval-batches", type=int, help=_help("eval_batches", "held-out batches per eval"))
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.set_defaults(handler=cmd_train_mtp)


def cmd_train_mtp(args: argparse.Namespace) -> int:
    fields = {name: value for name, value in vars(args).items() if name in TrainMTPConfig.model_fields}
    result = train_mtp(TrainMTPConfig(**fields))
    print(
        f"saved the MTP head to {result.out_dir} in {result.elapsed_s:.1f} s | held-out KL "
        f"{result.initial.kl:.4f} -> {result.final.kl:.4f} nats | top-1 agreement "
        f"{result.initial.agreement:.3f} -> {result.final.agreement:.3f}",
        file=sys.stderr,
    )
    return 0


def _help(name: str, text: str) -> str:
    return f"{text} (default: {TrainMTPConfig.model_fields[name].default})"
