"""`specmesh train-eagle3` runs end to end on a tiny model: it trains on the train split only,
writes a head the engine loads, raises held-out agreement; bad runs are refused clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.cli import main
from shared.model import load_model
from shared.model.eagle3 import load_eagle3_head
from tests.conftest import CORPUS
from training import train_eagle3


@pytest.fixture
def base(make_checkpoint) -> Path:
    return make_checkpoint("llama", num_hidden_layers=2)


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    """A source root of four packages: three to split into train and validation, and `json`, one
    of the held-out packages."""
    root = tmp_path / "root"
    for i, text in enumerate(CORPUS * 4):
        package = ["alpha", "beta", "gamma", "json"][i % 4]
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / f"module_{i:03d}.py").write_text(text + f"\n# {package} {i}\n")
    return root


def tiny_run_flags(steps: int) -> list[str]:
    """Flags of a training run small enough for a test: two windows of 16 tokens a step."""
    return [
        "--steps",
        str(steps),
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--warmup-steps",
        "1",
        "--eval-batches",
        "1",
    ]


def test_training_runs_end_to_end(base: Path, roots: Path, tmp_path: Path) -> None:
    out = tmp_path / "head"
    flags = ["--steps", "40", "--batch-size", "4", "--seq-len", "24", "--lr", "1e-2", "--warmup-steps", "4"]
    flags += ["--eval-every", "20", "--eval-batches", "2", "--draft-vocab-size", "200", "--ttt-steps", "2"]
    args = ["train-eagle3", "--base", str(base), "--out", str(out), "--data", str(roots), "--device", "cpu"]
    assert main([*args, *flags, "--no-progress"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["data"]["held_out_packages"] == ["json"]
    assert "json" not in log["data"]["validation_packages"]
    assert [e["step"] for e in log["evals"]] == [0, 20, 40]
    first, last = log["evals"][0], log["evals"][-1]
    assert len(last["agreement"]) == 2
    assert last["kl"] < first["kl"]
    assert last["chain_agreement"][0] > first["chain_agreement"][0]
    target = load_model(base, torch.float32, torch.device("cpu"), max_positions=64)
    head = load_eagle3_head(out, target, torch.float32, torch.device("cpu"))
    assert head.draft_vocab_size == 200 and head.aux_layers == (1, 1, 0)
    assert int(head.t2d.sum()) == 200
    resumed = ["--head", str(out), "--out", str(tmp_path / "resumed"), "--steps", "2", "--warmup-steps", "1"]
    assert main([*args[:3], *args[5:], *flags, *resumed, "--no-progress"]) == 0
    again = load_eagle3_head(tmp_path / "resumed", target, torch.float32, torch.device("cpu"))
    assert torch.equal(again.t2d, head.t2d) and again.aux_layers == head.aux_layers
    assert json.loads((tmp_path / "resumed" / "train_log.json").read_text())["evals"][0][
        "kl"
    ] == pytest.approx(last["kl"], rel=0.1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "0"], "steps: Input should be greater than or equal to 1"),
        (["--ttt-steps", "9"], "ttt_steps: Input should be less than or equal to 5"),
        (["--data", "/nonexistent/root"], "not a directory of source files: /nonexistent/root"),
        (["--warmup-steps", "50", "--steps", "10"], "warmup_steps (50) must be smaller than steps (10)"),
        (
            ["--generated-fraction", "0.5", "--seq-len", "16", "--new-tokens", "15"],
            "new_tokens (15) must leave a prompt of at least 2 tokens in seq_len (16)",
        ),
    ],
    ids=["steps-0", "ttt-steps", "missing-root", "warmup", "no-prompt-room"],
)
def test_bad_flags_exit_2_with_a_clear_message(
    base: Path, roots: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags, message
) -> None:
    args = ["train-eagle3", "--base", str(base), "--out", str(tmp_path / "out"), "--data", str(roots)]
    assert main([*args, *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_roots_without_held_out_packages_are_refused(
    base: Path, roots: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for path in (roots / "json").iterdir():
        path.unlink()
    (roots / "json").rmdir()
    assert (
        main(["train-eagle3", "--base", str(base), "--out", str(tmp_path / "out"), "--data", str(roots)]) == 2
    )
    assert "hold none of the held-out packages" in capsys.readouterr().err


def test_roots_default_to_the_interpreters_sources(
    base: Path, roots: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --data the head trains on the reference build's roots (training.data.default_roots)."""
    monkeypatch.setattr(train_eagle3, "default_roots", lambda: [roots])
    out = tmp_path / "head"
    flags = tiny_run_flags(steps=2)
    assert (
        main(
            [
                "train-eagle3",
                "--base",
                str(base),
                "--out",
                str(out),
                *flags,
                "--device",
                "cpu",
                "--no-progress",
            ]
        )
        == 0
    )
    log = json.loads((out / "train_log.json").read_text())
    assert log["data"]["roots"] == [str(roots)] and log["data"]["held_out_packages"] == ["json"]


def test_a_spent_time_budget_stops_training_and_saves_the_best_head(
    base: Path, roots: Path, tmp_path: Path
) -> None:
    """A budget already spent by data loading still trains one step, evaluates it and writes the
    head, the log saying it stopped early; the draft vocabulary's held-out coverage is logged, and
    the plot can be drawn again from the log."""
    out = tmp_path / "head"
    flags = tiny_run_flags(steps=50)
    args = ["train-eagle3", "--base", str(base), "--out", str(out), "--data", str(roots), "--device", "cpu"]
    assert main([*args, *flags, "--time-limit-s", "0.001", "--draft-vocab-size", "100", "--no-progress"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["stopped_early"] and len(log["steps"]) == 1
    assert [e["step"] for e in log["evals"]] == [0, 1] and log["best_step"] in (0, 1)
    assert 0.0 < log["data"]["draft_vocab_coverage"] < 1.0
    assert (out / "model.safetensors").is_file()
    (out / "loss.png").unlink()  # as after a run on a machine without matplotlib
    assert train_eagle3.replot(out) == out / "loss.png" and (out / "loss.png").stat().st_size > 0


def test_the_best_evaluated_weights_are_kept_not_the_last(base: Path) -> None:
    """BestHead keeps the weights of the evaluation with the highest mean accepted length."""
    target = load_model(base, torch.float32, torch.device("cpu"), max_positions=64)
    head = train_eagle3.init_head_from_target(target, torch.arange(50), (1, 1, 0), torch.device("cpu"))
    best = train_eagle3.BestHead()

    def stats(step: int, chain: list[float]) -> train_eagle3.EvalStats:
        return train_eagle3.EvalStats(step, kl=1.0, agreement=chain, chain_agreement=chain, num_rows=10)

    best.offer(stats(0, [0.2, 0.1]), head)
    good = head.fc.weight.detach().clone()
    with torch.no_grad():
        head.fc.weight.add_(1.0)
    best.offer(stats(1, [0.4, 0.2]), head)
    better = head.fc.weight.detach().clone()
    with torch.no_grad():
        head.fc.weight.add_(1.0)
    best.offer(stats(2, [0.3, 0.25]), head)
    assert best.restore(head).step == 1 and best.stats is not None
    assert best.stats.mean_accepted_length == pytest.approx(1.6)
    assert torch.equal(head.fc.weight, better) and not torch.equal(head.fc.weight, good)


def test_vocabulary_coverage_counts_tokens_inside_the_draft_vocabulary() -> None:
    counts = torch.tensor([5, 0, 3, 2])
    assert train_eagle3.vocabulary_coverage(torch.tensor([0, 3]), counts) == pytest.approx(0.7)
    assert train_eagle3.vocabulary_coverage(train_eagle3.draft_vocabulary(counts, None), counts) == 1.0
    assert train_eagle3.vocabulary_coverage(train_eagle3.draft_vocabulary(counts, 1), counts) == 0.5


def test_generated_steps_train_on_the_bases_own_continuations(
    base: Path, roots: Path, tmp_path: Path
) -> None:
    """With --generated-fraction 1 every step draws train-split prompts continued greedily by the base."""
    for package in ("alpha", "beta", "gamma"):  # prompts end where an indented line starts
        blocks = [
            f"def {package}_{i}(x):\n    for k in range({i}):\n        x += k\n    return x\n"
            for i in range(9)
        ]
        (roots / package / "blocks.py").write_text("\n\n".join(blocks))
    out = tmp_path / "head"
    flags = [
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--seq-len",
        "40",
        "--warmup-steps",
        "1",
        "--eval-batches",
        "1",
    ]
    flags += ["--generated-fraction", "1", "--num-prompts", "4", "--new-tokens", "8", "--ttt-steps", "2"]
    args = ["train-eagle3", "--base", str(base), "--out", str(out), "--data", str(roots), "--device", "cpu"]
    assert main([*args, *flags, "--no-progress"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert [s["generated"] for s in log["steps"]] == [True, True, True]
    assert log["data"]["generated"] == {"sequences": 4, "new_tokens": 8}


def test_the_loss_scores_only_rows_from_the_first_generated_one() -> None:
    """Rows before `first_row` (prompt text the base did not generate) never move the loss."""
    torch.manual_seed(0)
    head_logits = [torch.randn(2, 9, 6) for _ in range(2)]  # [batch, seq - 1, draft_vocab] per step
    target_logits = torch.randn(2, 10, 8)
    draft_ids = torch.tensor([0, 2, 3, 4, 6, 7])
    loss = train_eagle3.training_loss(head_logits, target_logits, draft_ids, 0.8, first_row=4)
    changed = [logits.clone() for logits in head_logits]
    for logits in changed:
        logits[:, :4] += 5 * torch.randn(2, 4, 6)
    assert train_eagle3.training_loss(changed, target_logits, draft_ids, 0.8, first_row=4) == pytest.approx(
        float(loss)
    )
    changed[1][:, 4] += 5.0 * torch.randn(2, 6)
    assert train_eagle3.training_loss(changed, target_logits, draft_ids, 0.8, first_row=4) != pytest.approx(
        float(loss)
    )
    assert train_eagle3.training_loss(changed, target_logits, draft_ids, 0.8) != pytest.approx(float(loss))
