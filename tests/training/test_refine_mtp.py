"""`python -m training.refine_mtp` refines an MTP head on its base's greedy output: it trains only on
train-split prompts, raises agreement on held-out generated text, ships bf16 weights like the build,
and repeats itself exactly given the seed."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from shared.model import load_model
from shared.model.mtp import load_mtp_head
from shared.tokenizer import Tokenizer
from training.corpus import tokenize_files
from training.data import split_corpus
from training.refine_mtp import SPLIT_SEED, indented_line_starts, main, sample_prompts
from training.tokenizer import EOS_TOKEN_ID
from training.train_mtp import TrainMTPConfig, train_mtp

PACKAGES = ("alpha", "beta", "gamma", "delta", "epsilon", "json")
"""Five train / validation packages and one held-out one."""
FLAGS = {
    "--num-prompts": 12,
    "--num-held-out-prompts": 6,
    "--prompt-tokens": 40,
    "--new-tokens": 12,
    "--seq-len": 64,
    "--eval-seq-len": 48,
    "--steps": 40,
    "--batch-size": 4,
    "--generated-batch-size": 4,
    "--lr": 3e-3,
    "--warmup-steps": 4,
    "--eval-every": 20,
    "--max-num-seqs": 8,
    "--device": "cpu",
}


def _module(rng: random.Random, name: str, held_out: bool) -> str:
    """A small module of indented functions, so prompts can end inside a block; held-out modules
    use other code, so a prompt found in the train stream cannot also be held-out text."""
    lines = [f'"""Module {name}."""\n', "import os\n"]
    for i in range(rng.randint(4, 8)):
        arg = rng.choice(["x", "value", "items", "path"])
        lines += [f"\n\ndef {name.replace('.', '_')}_{i}({arg}, n={i}):\n"]
        if held_out:
            lines += [f"    while {arg}:\n", f"        {arg} = {arg}.strip('{i}')\n", f"    return {arg}\n"]
        else:
            lines += [f"    total = {arg} * n\n", f"    for k in range({rng.randint(2, 9)}):\n"]
            lines += [f"        total += k - {i}\n", "    return total\n"]
    return "".join(lines)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """OpenMP threads waiting for each other on a shared two-core box cost more than they gain."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sources")
    rng = random.Random(0)
    for package in PACKAGES:
        (root / package).mkdir()
        for i in range(6):
            text = _module(rng, f"{package}.mod_{i}", held_out=package == "json")
            (root / package / f"mod_{i}.py").write_text(text)
    return root


@pytest.fixture(scope="module")
def head(make_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A head trained for a few steps by train-mtp, on random tokens."""
    tmp = tmp_path_factory.mktemp("head")
    np.save(tmp / "tokens.npy", np.random.default_rng(0).integers(0, 384, size=2000))
    config = TrainMTPConfig(
        base=make_checkpoint("llama"),
        out=tmp / "head",
        data_tokens=tmp / "tokens.npy",
        steps=8,
        batch_size=4,
        seq_len=16,
        warmup_steps=2,
        progress=False,
    )
    return train_mtp(config).out_dir


def _refine(base: Path, head: Path, sources: Path, out: Path, seed: int = 0) -> dict:
    flags = [str(v) for flag, value in FLAGS.items() for v in (flag, value)]
    args = ["--base", str(base), "--head", str(head), "--out", str(out), "--roots", str(sources)]
    assert main([*args, *flags, "--seed", str(seed), "--no-progress"]) == 0
    return json.loads((out / "train_log.json").read_text())


def test_refining_raises_agreement_on_generated_text(
    make_checkpoint, head: Path, sources: Path, tmp_path: Path
) -> None:
    base = make_checkpoint("llama")
    log = _refine(base, head, sources, tmp_path / "refined")

    generated = log["evals"]["held_out_generated"]
    assert [e["step"] for e in generated] == [0, 20, 40]
    assert generated[-1]["kl"] < generated[0]["kl"]
    assert generated[-1]["num_rows"] == 6 * 12  # continuation rows of the held-out prompts only
    assert set(log["evals"]) == {"held_out", "held_out_long", "held_out_generated"}
    assert log["data"]["held_out_packages"] == ["json"] and log["data"]["num_prompts"] == 12
    assert {s["generated"] for s in log["steps"]} == {True, False} and not log["stopped_early"]

    # shipped like the build's head: bf16 weights that load on the base
    out = tmp_path / "refined"
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    target = load_model(base, torch.float32, torch.device("cpu"), max_positions=64)
    load_mtp_head(out, target, torch.float32, torch.device("cpu"))


def test_refining_is_deterministic_given_the_seed(
    make_checkpoint, head: Path, sources: Path, tmp_path: Path
) -> None:
    base = make_checkpoint("llama")
    first, second = (_refine(base, head, sources, tmp_path / name) for name in ("a", "b"))
    assert first["steps"] == second["steps"] and first["evals"] == second["evals"]
    weights = [(tmp_path / name / "model.safetensors").read_bytes() for name in ("a", "b")]
    assert weights[0] == weights[1]


def test_prompts_come_from_their_stream_and_end_before_an_indented_line(
    make_checkpoint, sources: Path
) -> None:
    tokenizer = Tokenizer(make_checkpoint("llama"))
    split = split_corpus([sources], SPLIT_SEED, 0.03)
    train, held_out = (tokenize_files(s, tokenizer.backend).long() for s in (split.train, split.held_out))
    is_cut = indented_line_starts(tokenizer)
    prompts = sample_prompts(train, 50, 40, is_cut, torch.Generator().manual_seed(0))

    assert prompts.shape == (50, 40) and not (prompts == EOS_TOKEN_ID).any()
    followers: dict[tuple[int, ...], set[int]] = {}
    for window in train.unfold(0, 41, 1).tolist():
        followers.setdefault(tuple(window[:40]), set()).add(window[40])
    held_out_windows = set(map(tuple, held_out.unfold(0, 40, 1).tolist()))
    for prompt in map(tuple, prompts.tolist()):
        assert prompt not in held_out_windows
        assert any(is_cut[t] for t in followers[prompt])  # a train window, before an indented line
    line_break = tokenizer.encode("def f(x):\n    return x", add_special_tokens=False)[6]
    assert tokenizer.decode([line_break]) == "\n   " and is_cut[line_break]
    with pytest.raises(ValueError, match="no 40-token prompt"):
        sample_prompts(train[:30], 1, 40, is_cut, torch.Generator())
