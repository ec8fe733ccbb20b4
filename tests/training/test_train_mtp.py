"""`specmesh train-mtp` teaches the MTP head to agree with its base model, repeatably, and refuses
bad runs with a clear message."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.cli import main
from shared.model import load_model
from shared.model.mtp import load_mtp_head
from tests.conftest import CORPUS
from training.train_mtp import (
    TrainMTPConfig,
    collect_files,
    evaluate,
    hold_out,
    load_corpus,
    make_windows,
    train_mtp,
    warmup_cosine,
)

TRAIN_FLAGS = [
    "--steps",
    "120",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--lr",
    "1e-2",
    "--warmup-steps",
    "10",
]


@pytest.fixture
def base(make_checkpoint) -> Path:
    return make_checkpoint("llama", num_hidden_layers=2)


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    """The tests' CORPUS as one small Python file each, plus a file the default glob skips."""
    data = tmp_path / "data"
    data.mkdir()
    for i, text in enumerate(CORPUS):
        (data / f"snippet_{i:03d}.py").write_text(text)
    (data / "notes.txt").write_text("not python")
    return data


def test_training_raises_agreement_with_the_base(base: Path, corpus_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "head"
    args = ["train-mtp", "--base", str(base), "--out", str(out), "--data", str(corpus_dir)]
    code = main([*args, *TRAIN_FLAGS, "--eval-every", "60", "--holdout-fraction", "0.2"])
    assert code == 0

    log = json.loads((out / "train_log.json").read_text())
    untrained, trained = log["evals"][0], log["evals"][-1]
    assert [e["step"] for e in log["evals"]] == [0, 60, 120]
    assert trained["kl"] < 0.7 * untrained["kl"]
    assert trained["agreement"] > untrained["agreement"] + 0.1
    losses = [s["loss"] for s in log["steps"]]
    assert len(losses) == 120 and np.mean(losses[-10:]) < 0.7 * np.mean(losses[:10])

    # the saved head is the evaluated one
    target = load_model(base, torch.float32, torch.device("cpu"), max_positions=32)
    head = load_mtp_head(out, target, torch.float32, torch.device("cpu"))
    config = TrainMTPConfig(**log["config"])
    held_out = load_corpus(config, target.config).held_out
    assert evaluate(head, target, held_out, config, step=120).agreement == trained["agreement"]


def test_training_is_deterministic_given_the_seed(base: Path, tmp_path: Path) -> None:
    tokens = np.random.default_rng(0).integers(0, 384, size=2000)
    np.save(tmp_path / "tokens.npy", tokens)

    def run(seed: int, name: str) -> list[float]:
        config = TrainMTPConfig(
            base=base,
            out=tmp_path / name,
            data_tokens=tmp_path / "tokens.npy",
            steps=8,
            batch_size=4,
            seq_len=16,
            warmup_steps=2,
            seed=seed,
            progress=False,
        )
        return train_mtp(config).losses

    assert run(1, "a") == run(1, "b")
    assert run(1, "a") != run(2, "c")


def test_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train-mtp", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--base", "--out", "--data", "--data-tokens", "--steps", "--seq-len", "--eval-every"):
        assert flag in help_text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "0"], "steps: Input should be greater than or equal to 1"),
        (["--base", "/nonexistent/model"], "/nonexistent/model is not a model directory"),
        (["--data-tokens", "{tokens}"], "exactly one of --data and --data-tokens"),
        (["--warmup-steps", "50", "--steps", "10"], "warmup_steps (50) must be smaller than steps (10)"),
    ],
    ids=["steps-0", "missing-base", "two-corpora", "warmup"],
)
def test_bad_flags_exit_2_with_a_clear_message(
    base: Path, corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags, message
) -> None:
    args = ["train-mtp", "--base", str(base), "--out", str(tmp_path / "out"), "--data", str(corpus_dir)]
    np.save(tmp_path / "tokens.npy", np.arange(100))
    flags = [flag.format(tokens=tmp_path / "tokens.npy") for flag in flags]
    assert main([*args, *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_corpus_helpers(corpus_dir: Path) -> None:
    files = collect_files([corpus_dir], "**/*.py", max_files=7)
    assert [f.name for f in files] == [f"snippet_{i:03d}.py" for i in range(7)]
    windows = make_windows(torch.arange(103), 10)
    assert windows.shape == (10, 10) and windows[-1, -1].item() == 99
    train, held_out = hold_out(windows, 0.2)
    assert torch.equal(torch.cat([train, held_out]), windows) and len(held_out) == 2
    with pytest.raises(ValueError, match="only 1 window"):
        hold_out(windows[:1], 0.5)


def test_learning_rate_warms_up_then_decays_to_the_floor() -> None:
    factors = [warmup_cosine(step, 5, 50, 0.1) for step in range(50)]
    assert factors[:5] == sorted(factors[:5]) and factors[4] == 1.0
    assert factors[5:] == sorted(factors[5:], reverse=True)
    assert warmup_cosine(50, 5, 50, 0.1) == pytest.approx(0.1)


def test_a_spent_time_budget_decays_the_learning_rate_before_the_last_step() -> None:
    """A run cut short by its time budget ends at the floor, not at the peak of a schedule laid
    out for steps it never reaches; time never speeds up the warm-up."""
    assert warmup_cosine(10, 5, 1000, 0.1, time_fraction=1.0) == pytest.approx(0.1)
    assert warmup_cosine(10, 5, 1000, 0.1, time_fraction=0.5) == pytest.approx(0.55)
    assert warmup_cosine(900, 5, 1000, 0.1, time_fraction=0.1) == warmup_cosine(900, 5, 1000, 0.1)
    assert warmup_cosine(2, 5, 1000, 0.1, time_fraction=0.9) == pytest.approx(0.6)
