"""Settings every training run shares: AdamW, its learning-rate schedule and the run's cadence.

`TrainingRunConfig` holds the fields `TrainLMConfig` (training.train_lm) and `TrainMTPConfig`
(training.train_mtp) both have, with the same names, bounds and meaning. A language model and an
MTP head train at different scales, so fields whose defaults differ have none here: each subclass
declares them again with its own default and the bound types below (e.g.
`batch_size: PositiveCount = 8`), so the bounds stay the ones written here. `HeadRunConfig` adds
what a drafting head's run (MTP, EAGLE-3) reads and writes: the target's directory and its own.

Schedule: `warmup_steps` of linear warm-up to `lr`, then cosine decay to `min_lr_ratio` x `lr` at
the last step (`warmup_cosine`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PositiveCount = Annotated[int, Field(ge=1)]
"""Steps, windows or batches: at least one."""
Count = Annotated[int, Field(ge=0)]
PositiveReal = Annotated[float, Field(gt=0.0)]
NonNegativeReal = Annotated[float, Field(ge=0.0)]


class TrainingRunConfig(BaseModel):
    """Optimiser, schedule, evaluation cadence, seed, device and progress bar of one run."""

    model_config = ConfigDict(extra="forbid")

    steps: PositiveCount = 1000
    """Optimizer steps."""
    batch_size: PositiveCount
    """Windows per step."""
    lr: PositiveReal
    """Peak AdamW learning rate."""
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    """Learning rate at the end of the cosine decay, as a fraction of `lr`."""
    warmup_steps: Count
    """Steps of linear warm-up before the cosine decay."""
    weight_decay: NonNegativeReal
    """AdamW weight decay."""
    grad_clip: PositiveReal = 1.0
    """Clip the global gradient norm to this value."""
    eval_every: PositiveCount
    """Evaluate every this many steps (and after the last)."""
    eval_batches: PositiveCount
    """Batches (of `batch_size` windows) per evaluation; always the same windows."""
    seed: Count = 0
    """Seeds the run's random draws (initial weights, batch order): CPU runs repeat bit for bit."""
    device: str = "auto"
    """auto (cuda when available), cpu, cuda or cuda:N."""
    progress: bool = True
    """Show a tqdm progress bar."""

    @field_validator("device")
    @classmethod
    def _device(cls, device: str) -> str:
        if device not in ("auto", "cpu") and not device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {device!r}")
        return device

    @model_validator(mode="after")
    def _check(self) -> TrainingRunConfig:
        self._check_warmup()
        return self

    def _check_warmup(self, hint: str = "") -> None:
        """Raises when the warm-up would take the whole run; `hint` ends the message."""
        if self.warmup_steps >= self.steps:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must be smaller than steps ({self.steps}){hint}"
            )

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)


class HeadRunConfig(TrainingRunConfig):
    """A drafting head's run (`TrainMTPConfig`, `TrainEagle3Config`): the frozen target it reads and
    the directory it is written to."""

    base: Path
    """The frozen target: a Hugging Face model directory with config.json and tokenizer.json."""
    out: Path
    """Directory the head (config.json, model.safetensors), train_log.json and loss.png go to."""

    @field_validator("base")
    @classmethod
    def _base_is_model_dir(cls, base: Path) -> Path:
        if not (base / "config.json").is_file():
            raise ValueError(f"{base} is not a model directory (no config.json)")
        return base

    def _check_out(self) -> None:
        """Raises when `out` exists and is not a directory."""
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"out: {self.out} exists and is not a directory")


def resolve_device(device: str) -> torch.device:
    """The torch device a `device` setting names; "auto" is cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def warmup_cosine(
    step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, time_fraction: float = 0.0
) -> float:
    """Learning-rate multiplier: linear warm-up to 1, then cosine decay to `min_lr_ratio`. A run
    with a time budget passes `time_fraction`, the share of it spent: the decay then follows steps
    or time, whichever is further along, so a run the budget cuts short still ends decayed."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, max(time_fraction, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
