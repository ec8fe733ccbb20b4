"""The training runs share one set of optimiser settings (training.config): each run keeps the
shared bounds and checks, whatever defaults it picks."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from training.build_reference import PRESETS, MTPPlan, with_steps
from training.config import HeadRunConfig, TrainingRunConfig, resolve_device
from training.train_eagle3 import TrainEagle3Config
from training.train_lm import TrainLMConfig
from training.train_mtp import TrainMTPConfig

RUN_CONFIGS = [TrainLMConfig, TrainMTPConfig]


@pytest.fixture
def mtp_paths(tmp_path: Path) -> dict[str, Any]:
    """The fields TrainMTPConfig needs besides the shared ones: a model directory, an output
    directory and a token file."""
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    np.save(tmp_path / "tokens.npy", np.arange(10))
    return {"base": tmp_path / "base", "out": tmp_path / "out", "data_tokens": tmp_path / "tokens.npy"}


def _make(
    config_class: type[TrainingRunConfig], mtp_paths: dict[str, Any], **fields: object
) -> TrainingRunConfig:
    extra = mtp_paths if config_class is TrainMTPConfig else {}
    return config_class.model_validate({**extra, **fields})


@pytest.mark.parametrize("config_class", RUN_CONFIGS)
def test_every_run_keeps_the_shared_fields_and_bounds(config_class: type[TrainingRunConfig]) -> None:
    """A field declared again for its own default must keep the base's type and bounds."""
    for name, shared in TrainingRunConfig.model_fields.items():
        field = config_class.model_fields[name]
        assert (field.annotation, field.metadata) == (shared.annotation, shared.metadata), name
        assert not field.is_required(), f"{config_class.__name__}.{name} has no default"


@pytest.mark.parametrize("config_class", RUN_CONFIGS)
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"steps": 0}, "greater than or equal to 1"),
        ({"lr": 0.0}, "greater than 0"),
        ({"warmup_steps": -1}, "greater than or equal to 0"),
        ({"min_lr_ratio": 1.5}, "less than or equal to 1"),
        ({"eval_every": 0}, "greater than or equal to 1"),
        ({"device": "tpu"}, "device must be auto, cpu, cuda or cuda:N, not 'tpu'"),
        ({"warmup_steps": 10, "steps": 10}, "warmup_steps (10) must be smaller than steps (10)"),
        ({"no_such_field": 1}, "Extra inputs are not permitted"),
    ],
)
def test_every_run_rejects_bad_shared_settings(
    config_class: type[TrainingRunConfig], mtp_paths: dict[str, Any], fields: dict, message: str
) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        _make(config_class, mtp_paths, **fields)


def test_the_mtp_run_names_the_flag_to_change(mtp_paths: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="lower --warmup-steps"):
        TrainMTPConfig(**mtp_paths, warmup_steps=10, steps=10)


def test_runs_keep_their_own_defaults(mtp_paths: dict[str, Any]) -> None:
    lm, mtp = TrainLMConfig(), TrainMTPConfig(**mtp_paths)
    assert (lm.batch_size, lm.lr, lm.warmup_steps, lm.weight_decay) == (64, 2e-3, 100, 0.1)
    assert (mtp.batch_size, mtp.lr, mtp.warmup_steps, mtp.weight_decay) == (8, 3e-4, 20, 0.01)
    assert lm.steps == mtp.steps == 1000 and lm.torch_device == mtp.torch_device == resolve_device("auto")


def test_rescaled_phases_keep_at_most_a_fifth_of_their_steps_for_warm_up() -> None:
    lm_configs = [config for preset in PRESETS.values() for config in (preset.base, preset.draft)]
    mtp_plans = [preset.mtp for preset in PRESETS.values()]
    for steps in (1, 2, 7, 100_000):
        for config in lm_configs:
            _check_rescaled(config.warmup_steps, with_steps(config, steps), steps)
        for plan in mtp_plans:
            _check_rescaled(plan.warmup_steps, with_steps(plan, steps), steps)


def _check_rescaled(warmup_steps: int, rescaled: TrainLMConfig | MTPPlan, steps: int) -> None:
    assert rescaled.steps == max(2, steps)
    assert rescaled.warmup_steps == min(warmup_steps, rescaled.steps // 5)


@pytest.mark.parametrize("config_class", [TrainMTPConfig, TrainEagle3Config])
def test_head_runs_refuse_a_base_that_is_no_model_and_an_out_that_is_a_file(
    config_class: type[HeadRunConfig], mtp_paths: dict[str, Any], tmp_path: Path
) -> None:
    corpus = (
        {"data_tokens": mtp_paths["data_tokens"]} if config_class is TrainMTPConfig else {"data": [tmp_path]}
    )
    with pytest.raises(ValidationError, match="is not a model directory"):
        config_class.model_validate({**corpus, "base": tmp_path, "out": tmp_path / "out"})
    (tmp_path / "file").write_text("")
    with pytest.raises(ValidationError, match="exists and is not a directory"):
        config_class.model_validate({**corpus, "base": mtp_paths["base"], "out": tmp_path / "file"})
