"""Trains a Llama-architecture causal language model from scratch and saves it in Hugging Face format.

The model is specmesh's own `LlamaForCausalLM` (the code that serves it), trained through its
`forward_dense` path with the next-token cross-entropy. Optimisation follows common small-LM
practice: AdamW (betas 0.9 / 0.95, weight decay 0.1 on matrices only), linear warm-up then cosine
decay, global gradient-norm clipping at 1.0, bf16 autocast over float32 master weights on CUDA.

Terms: *train loss* is the mean cross-entropy (nats per token) of a training batch; *validation
loss* is measured during training on the validation split (packages never trained on);
*held-out loss* once at the end on the held-out packages, with *perplexity* = exp(held-out loss).

Determinism: initial weights and the batch order come from the seed alone, so CPU runs repeat bit
for bit; on CUDA a few kernels (embedding backward) accumulate in a varying order, so runs agree
to rounding only.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from shared.model import LlamaForCausalLM, ModelConfig
from shared.model.loader import SHARD_INDEX, SINGLE_FILE, unfused_state_dict
from training.config import (
    Count,
    NonNegativeReal,
    PositiveCount,
    PositiveReal,
    TrainingRunConfig,
    warmup_cosine,
)
from training.corpus import contiguous_windows, random_offsets, windows_at
from training.tokenizer import EOS_TOKEN_ID, PAD_TOKEN_ID, TOKENIZER_FILES

logger = logging.getLogger(__name__)

TRAIN_LOG = "train_log.json"
LOSS_PLOT = "loss.png"
GENERATION_CONFIG = "generation_config.json"
SAVED_DTYPE = torch.bfloat16
TIME_LIMIT_MARGIN = 0.93
"""Share of the time left that a shortened plan's remaining steps may take (evaluations and the
final held-out pass take the rest)."""
SAFETENSORS_HEADER_SLACK_BYTES = 64 << 10
"""Room left in each shard for the safetensors JSON header (about 150 bytes per tensor)."""


@dataclass(frozen=True)
class LMShape:
    """Architecture of one model; the fields mirror the Hugging Face LlamaConfig ones."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int = 8192
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def hf_config(self) -> dict[str, Any]:
        """config.json: transformers<5 RoPE layout (`rope_theta` + `rope_scaling: null`), which
        transformers>=5 also reads, as does `shared.model.ModelConfig`."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "tie_word_embeddings": True,
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": None,
            "eos_token_id": EOS_TOKEN_ID,
            "pad_token_id": PAD_TOKEN_ID,
            "torch_dtype": str(SAVED_DTYPE).removeprefix("torch."),
        }

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.hf_config())


SHAPES: dict[str, LMShape] = {
    "base": LMShape(
        384, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2, intermediate_size=896
    ),
    "draft": LMShape(
        192, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, intermediate_size=512
    ),
    "tiny": LMShape(64, 2, 4, 2, 128, vocab_size=512, max_position_embeddings=256),
    "tiny-draft": LMShape(32, 1, 2, 1, 64, vocab_size=512, max_position_embeddings=256),
}
"""`base` (~14.6M parameters) and `draft` (~2.8M) are the shipped family; the tiny ones are for tests."""


class TrainLMConfig(TrainingRunConfig):
    """Optimisation settings of one run (the shared ones: training.config)."""

    seq_len: int = Field(default=512, ge=2)
    """Tokens the model reads per window."""
    held_out_max_windows: int = Field(default=2048, ge=1)
    """Windows of the held-out stream scored at the end (each token once)."""
    log_every: int = Field(default=10, ge=1)
    """Steps between host syncs: the progress bar and tokens/s refresh this often."""
    time_limit_s: float | None = Field(default=None, gt=0.0)
    """Wall time the training loop may take: at the measured speed, fewer steps are planned early in
    the run when the configured ones would not fit, and training stops (keeping the model) if it
    still runs over. None: run every configured step."""
    compile: bool = False
    """torch.compile the forward pass (faster on GPU after a compile of about a minute)."""

    # TrainingRunConfig's fields, with this run's defaults
    batch_size: PositiveCount = 64
    lr: PositiveReal = 2e-3
    warmup_steps: Count = 100
    weight_decay: NonNegativeReal = 0.1
    """AdamW weight decay of weight matrices and the embedding (not of norm weights)."""
    eval_every: PositiveCount = 250
    """Validation loss every this many steps (and after the last)."""
    eval_batches: PositiveCount = 8
    """Validation batches (of `batch_size` windows) per evaluation; always the same windows."""

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclass
class TokenStreams:
    """The three splits as token streams (see training.corpus)."""

    train: torch.Tensor  # [num_train_tokens] int32
    validation: torch.Tensor  # [num_validation_tokens] int32
    held_out: torch.Tensor  # [num_held_out_tokens] int32


@dataclass
class StepLog:
    """Per-step history, kept as columns (compact in train_log.json)."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    """Mean throughput of the `log_every` steps that include this one."""


@dataclass
class EvalPoint:
    step: int
    validation_loss: float


@dataclass
class LMResult:
    name: str
    out_dir: Path
    num_params: int
    steps: int
    """Steps actually run."""
    planned_steps: int
    """Steps configured; more than `steps` when the time limit shortened or stopped the run."""
    tokens_seen: int
    final_train_loss: float
    """Mean train loss of the last (up to) 50 steps."""
    validation_loss: float
    held_out_loss: float
    held_out_tokens: int
    elapsed_s: float
    """Wall time of training and evaluation, without saving."""
    tokens_per_s: float
    """Tokens trained on per second of the training loop (its validation passes included)."""
    device_name: str
    stopped_early: bool
    """The time limit stopped training before the end of its (possibly shortened) schedule."""
    shortened: bool
    """The time limit shortened the schedule early in the run."""
    history: StepLog
    evals: list[EvalPoint]

    @property
    def held_out_perplexity(self) -> float:
        return math.exp(self.held_out_loss)

    def summary(self) -> dict[str, Any]:
        """The scalar fields (not the machine-specific output path), for manifests."""
        skip = {"history", "evals", "out_dir"}
        scalars = {k: v for k, v in asdict(self).items() if k not in skip}
        return {**scalars, "held_out_perplexity": self.held_out_perplexity}


# --------------------------------------------------------------------------------------------- model


def build_model(shape: LMShape, max_positions: int, device: torch.device, seed: int) -> LlamaForCausalLM:
    """A freshly initialised float32 model on `device`, weights drawn from `seed` on the CPU."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(shape.model_config(), max_positions)
    init_weights(model)
    model = model.to(device)
    model.build_rotary(device)
    return model


def init_weights(model: LlamaForCausalLM, std: float = 0.02) -> None:
    """GPT-2 initialisation: N(0, std) for embeddings and projections, with the projections that
    write into the residual stream (o_proj, down_proj) scaled by 1 / sqrt(2 * num_layers) so the
    stream's variance does not grow with depth; norm weights stay 1."""
    residual_std = std / math.sqrt(2 * model.config.num_hidden_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim < 2:
                continue
            is_residual = name.endswith(("o_proj.weight", "down_proj.weight"))
            param.normal_(0.0, residual_std if is_residual else std)


def num_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding / LM head counts once)."""
    return sum(p.numel() for p in model.parameters())


def lm_loss(
    model: LlamaForCausalLM,
    windows: torch.Tensor,  # [batch, seq_len + 1]
) -> torch.Tensor:  # scalar float32: mean next-token cross-entropy
    hidden = model.forward_dense(windows[:, :-1])
    logits = model.compute_logits(hidden)  # [batch, seq_len, vocab] float32
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())


# ---------------------------------------------------------------------------------------------- loop


def train_lm(
    name: str,
    shape: LMShape,
    streams: TokenStreams,
    tokenizer_dir: Path,
    out_dir: Path,
    config: TrainLMConfig,
    max_shard_bytes: int | None = None,
) -> LMResult:
    """Trains one model, evaluates it, and saves it with its tokenizer, log and loss plot."""
    device = config.torch_device
    allow_tf32(device)
    started = time.perf_counter()
    model = build_model(shape, config.seq_len, device, config.seed)
    history, evals, plan = train_loop(model, streams, config, name)
    loop_s = time.perf_counter() - started
    held_out = contiguous_windows(streams.held_out, config.seq_len, config.held_out_max_windows)
    held_out_loss = mean_loss(model, held_out, config.batch_size, device)
    elapsed_s = time.perf_counter() - started
    result = LMResult(
        name=name,
        out_dir=out_dir,
        num_params=num_parameters(model),
        steps=len(history.step),
        planned_steps=plan.planned_steps,
        tokens_seen=len(history.step) * config.tokens_per_step,
        final_train_loss=sum(history.loss[-50:]) / len(history.loss[-50:]),
        validation_loss=evals[-1].validation_loss,
        held_out_loss=held_out_loss,
        held_out_tokens=held_out[:, 1:].numel(),
        elapsed_s=elapsed_s,
        tokens_per_s=len(history.step) * config.tokens_per_step / loop_s,
        device_name=device_name(device),
        stopped_early=plan.stopped_at is not None,
        shortened=plan.shortened,
        history=history,
        evals=evals,
    )
    save_model(model, shape, out_dir, tokenizer_dir, max_shard_bytes)
    write_train_log(result, shape, config)
    plot_losses(history, evals, out_dir / LOSS_PLOT, name)
    return result


def train_loop(
    model: LlamaForCausalLM, streams: TokenStreams, config: TrainLMConfig, name: str
) -> tuple[StepLog, list[EvalPoint], StepPlan]:
    """Runs the planned steps; returns the history, the validation points and the plan as it ended
    (shortened, or stopped, by the time limit)."""
    device = config.torch_device
    optimizer = make_optimizer(model, config)
    plan = StepPlan(config.steps, config.warmup_steps, config.min_lr_ratio)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, plan.lr_multiplier)
    train_tokens = streams.train.to(device)
    validation = contiguous_windows(
        streams.validation, config.seq_len, config.eval_batches * config.batch_size
    )
    generator = torch.Generator().manual_seed(config.seed)
    offsets = random_offsets(train_tokens.numel(), config.seq_len, config.steps, config.batch_size, generator)
    offsets = offsets.to(device)
    loss_fn = torch.compile(lm_loss) if config.compile else lm_loss
    history, evals = StepLog(), []
    pending: list[torch.Tensor] = []  # losses of the steps since the last sync, still on the device
    progress = tqdm(total=config.steps, desc=name, disable=not config.progress, unit="step", mininterval=5.0)
    clock = TrainClock(config.time_limit_s, calibration_step(config))
    step = 0
    while step < plan.total_steps:
        step += 1
        history.lr.append(float(schedule.get_last_lr()[0]))
        windows = windows_at(train_tokens, offsets[step - 1], config.seq_len)
        pending.append(train_step(model, loss_fn, windows, optimizer, config))
        schedule.step()
        out_of_time = clock.out_of_time()
        is_eval = step % config.eval_every == 0 or step == plan.total_steps or out_of_time
        if step % config.log_every == 0 or is_eval:
            synced_at = _record(history, pending, step, clock.last_sync_s, config, progress)
            if clock.should_fit(step, synced_at) and plan.fit_to_time(step, *clock.rate_and_time_left()):
                progress.total = plan.total_steps
                progress.write(f"{name}: shortened to {plan.total_steps} steps to end within the time limit")
        if is_eval:
            evals.append(EvalPoint(step, mean_loss(model, validation, config.batch_size, device)))
            progress.write(
                f"{name} step {step}/{plan.total_steps}: train loss {history.loss[-1]:.4f}, validation "
                f"loss {evals[-1].validation_loss:.4f}, {history.tokens_per_s[-1]:,.0f} tokens/s",
                sys.stderr,
            )
        if out_of_time and step < plan.total_steps:
            progress.write(f"{name}: time limit of {config.time_limit_s:.0f} s reached at step {step}")
            plan.stopped_at = step
            break
    progress.close()
    return history, evals, plan


@dataclass
class StepPlan:
    """The run's length and learning-rate schedule. The time limit may shorten it once, early in
    the run (the cosine decay shrinks with it, so the run still ends at the minimum learning rate),
    or, as a last resort, stop it."""

    total_steps: int
    warmup_steps: int
    min_lr_ratio: float
    planned_steps: int = 0
    """The configured step count (set at creation)."""
    stopped_at: int | None = None
    """The step the time limit stopped training at, when it did."""

    def __post_init__(self) -> None:
        self.planned_steps = self.total_steps

    def lr_multiplier(self, step: int) -> float:
        return warmup_cosine(step, self.warmup_steps, self.total_steps, self.min_lr_ratio)

    def fit_to_time(self, step: int, seconds_per_step: float, seconds_left: float) -> bool:
        """Shortens the plan when the remaining steps, at `seconds_per_step`, would not end within
        `seconds_left` (less a safety margin); returns whether it did."""
        affordable = step + int(TIME_LIMIT_MARGIN * seconds_left / seconds_per_step)
        if affordable >= self.total_steps:
            return False
        self.total_steps = max(step + 1, affordable)
        return True

    @property
    def shortened(self) -> bool:
        return self.total_steps < self.planned_steps


@dataclass
class TrainClock:
    """Wall time of a run against its time limit, as seen at host syncs."""

    time_limit_s: float | None
    calibration_step: int
    """The step from which the measured rate is trusted enough to shorten the plan."""
    started: float = field(default_factory=time.perf_counter)
    last_sync_s: float = 0.0
    first_sync: tuple[int, float] | None = None
    """(step, time) of the first sync: the rate is measured from there, past start-up costs."""
    latest_sync: tuple[int, float] = (0, 0.0)
    fitted: bool = False

    def __post_init__(self) -> None:
        self.last_sync_s = self.started

    def out_of_time(self) -> bool:
        return self.time_limit_s is not None and time.perf_counter() - self.started > self.time_limit_s

    def should_fit(self, step: int, synced_at: float) -> bool:
        """Records a sync; True once, at the first sync past the calibration step, under a time limit."""
        self.last_sync_s = synced_at
        self.latest_sync = (step, synced_at)
        if self.first_sync is None:
            self.first_sync = (step, synced_at)
            return False
        if self.fitted or self.time_limit_s is None or step < self.calibration_step:
            return False
        self.fitted = True
        return True

    def rate_and_time_left(self) -> tuple[float, float]:
        """(seconds per step since the first sync, seconds left before the limit)."""
        assert self.first_sync is not None and self.time_limit_s is not None
        (first_step, first_s), (step, now) = self.first_sync, self.latest_sync
        return (now - first_s) / max(1, step - first_step), self.time_limit_s - (now - self.started)


def calibration_step(config: TrainLMConfig) -> int:
    """About a tenth of the run (at most 200 steps), but at least two syncs in."""
    return max(2 * config.log_every, min(200, config.steps // 10))


def _record(
    history: StepLog,
    pending: list[torch.Tensor],
    step: int,
    interval_start: float,
    config: TrainLMConfig,
    progress: tqdm,
) -> float:
    """Syncs with the device, appends the pending steps to the history; returns the new interval start."""
    losses = torch.stack(pending).tolist()
    now = time.perf_counter()
    tokens_per_s = len(losses) * config.tokens_per_step / max(now - interval_start, 1e-9)
    first = step - len(losses) + 1
    history.step.extend(range(first, step + 1))
    history.loss.extend(losses)
    history.tokens_per_s.extend([tokens_per_s] * len(losses))
    pending.clear()
    progress.update(len(losses))
    progress.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
    return now


def make_optimizer(model: nn.Module, config: TrainLMConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (and the embedding) but not on norm weights."""
    params = list(model.parameters())
    decayed = [p for p in params if p.ndim >= 2]
    plain = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decayed, "weight_decay": config.weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    fused = config.torch_device.type == "cuda"
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def train_step(
    model: LlamaForCausalLM,
    loss_fn: Any,
    windows: torch.Tensor,  # [batch, seq_len + 1]
    optimizer: torch.optim.Optimizer,
    config: TrainLMConfig,
) -> torch.Tensor:  # the step's loss, detached, still on the device
    model.train()
    with autocast(windows.device):
        loss = loss_fn(model, windows)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    return loss.detach()


@torch.no_grad()
def mean_loss(
    model: LlamaForCausalLM,
    windows: torch.Tensor,  # [num_windows, seq_len + 1]
    batch_size: int,
    device: torch.device,
) -> float:
    """Mean next-token cross-entropy over every target token of `windows`."""
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)
    for batch in windows.split(batch_size):
        batch = batch.to(device)
        with autocast(device):
            logits = model.compute_logits(model.forward_dense(batch[:, :-1]))
        total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
    return float(total) / windows[:, 1:].numel()


def autocast(device: torch.device) -> torch.autocast:
    """bf16 autocast on CUDA (master weights stay float32); plain float32 on CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def allow_tf32(device: torch.device) -> None:
    """TF32 for the CUDA float32 matmuls left outside autocast (process-wide CUDA flags; CPU math,
    and so the CPU runs' exact repeatability, is left alone)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


# -------------------------------------------------------------------------------------------- output


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The weights under transformers' LlamaForCausalLM names, in SAVED_DTYPE on the CPU; a tied
    LM head is left out (transformers and specmesh both re-tie it to the embedding)."""
    tensors = unfused_state_dict(model, model.config)
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return {
        (name if name.startswith("lm_head.") else f"model.{name}"): t.to(SAVED_DTYPE).cpu()
        for name, t in tensors.items()
    }


def save_model(
    model: LlamaForCausalLM,
    shape: LMShape,
    out_dir: Path,
    tokenizer_dir: Path,
    max_shard_bytes: int | None = None,
) -> list[Path]:
    """Writes a Hugging Face model directory: config.json, generation_config.json, the weights
    (one file, or shards with an index when they exceed `max_shard_bytes`) and the tokenizer files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(shape.hf_config(), indent=2) + "\n")
    generation = {"bos_token_id": None, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID}
    (out_dir / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out_dir / name)
    return save_safetensors(hf_state_dict(model), out_dir, max_shard_bytes)


def save_safetensors(
    tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int | None = None
) -> list[Path]:
    """model.safetensors, or, when the tensors exceed `max_shard_bytes`, the Hugging Face sharded
    layout: model-0000N-of-0000M.safetensors plus model.safetensors.index.json."""
    metadata = {"format": "pt"}
    total_bytes = sum(tensor_bytes(t) for t in tensors.values())
    if max_shard_bytes is None or total_bytes + SAFETENSORS_HEADER_SLACK_BYTES <= max_shard_bytes:
        save_file(tensors, str(out_dir / SINGLE_FILE), metadata=metadata)
        return [out_dir / SINGLE_FILE]
    shards = plan_shards(tensors, max_shard_bytes - SAFETENSORS_HEADER_SLACK_BYTES)
    paths, weight_map = [], {}
    for index, names in enumerate(shards, start=1):
        path = out_dir / f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(path), metadata=metadata)
        weight_map.update(dict.fromkeys(names, path.name))
        paths.append(path)
    index_json = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out_dir / SHARD_INDEX).write_text(json.dumps(index_json, indent=2) + "\n")
    oversized = [f"{p.name} ({p.stat().st_size} bytes)" for p in paths if p.stat().st_size > max_shard_bytes]
    if oversized:
        raise ValueError(f"shards over {max_shard_bytes} bytes: {', '.join(oversized)}")
    return paths


def plan_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped greedily, in order, into shards of at most `max_bytes` (a tensor larger
    than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor_bytes(tensor)
        if shards[-1] and shard_bytes + size > max_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += size
    return shards


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def write_train_log(result: LMResult, shape: LMShape, config: TrainLMConfig) -> Path:
    """train_log.json: the run's settings and results, the per-step history and the eval points."""
    history = result.history
    log = {
        "summary": result.summary(),
        "shape": asdict(shape),
        "config": config.model_dump(mode="json"),
        "history": {
            "step": history.step,
            "loss": [round(x, 5) for x in history.loss],
            "lr": [float(f"{x:.5g}") for x in history.lr],
            "tokens_per_s": [round(x) for x in history.tokens_per_s],
        },
        "evals": [asdict(point) for point in result.evals],
    }
    path = result.out_dir / TRAIN_LOG
    path.write_text(json.dumps(log, separators=(",", ":")) + "\n")
    return path


def plot_losses(history: StepLog, evals: list[EvalPoint], path: Path, title: str) -> Path | None:
    """Train loss per step and validation loss, as a PNG; None without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'specmesh[train]'); not writing %s", path)
        return None
    figure = Figure(figsize=(7, 4), layout="constrained")
    axes = figure.subplots()
    axes.plot(history.step, history.loss, label="train", linewidth=0.6, alpha=0.8)
    axes.plot([e.step for e in evals], [e.validation_loss for e in evals], "o-", label="validation")
    axes.set(xlabel="step", ylabel="cross-entropy (nats / token)", title=title)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=100)
    return path
