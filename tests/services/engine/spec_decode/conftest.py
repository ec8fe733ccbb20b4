"""Fixtures of the speculative-engine tests: a small random target and its plain greedy output."""

from __future__ import annotations

import pytest
import torch

from services.engine.llm import LLM
from tests.services.engine.spec_decode.helpers import GREEDY, repetitive_prompts


@pytest.fixture(scope="module")
def target(make_checkpoint):
    return str(make_checkpoint("llama", num_hidden_layers=2))


@pytest.fixture(scope="module")
def naive_tokens(target) -> list[list[int]]:
    llm = LLM(target, device="cpu", max_model_len=192)
    return [o.token_ids for o in llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def mtp_head(target, tmp_path_factory) -> str:
    """An MTP head trained for a few seconds on the target's own greedy continuations."""
    from training.train_mtp import TrainMTPConfig, train_mtp

    llm = LLM(target, device="cpu", max_model_len=192)
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(8, seed=9), sampling_params=GREEDY)
    corpus = torch.tensor([t for o in outputs for t in o.prompt_token_ids + o.token_ids] * 4)
    out = tmp_path_factory.mktemp("mtp")
    torch.save(corpus, out / "corpus.pt")
    train_mtp(
        TrainMTPConfig(
            base=target,
            out=out / "head",
            data_tokens=out / "corpus.pt",
            steps=150,
            batch_size=8,
            seq_len=32,
            lr=1e-2,
            warmup_steps=10,
            eval_every=1000,
            device="cpu",
            progress=False,
        )
    )
    return str(out / "head")


@pytest.fixture(scope="module")
def eagle3_head(target, tmp_path_factory) -> str:
    """An EAGLE-3 head over half the vocabulary, trained for a few seconds (training-time test) on
    the target's own greedy continuations."""
    import time

    from shared.model import load_model
    from shared.model.eagle3 import default_aux_layers, save_eagle3_head
    from training.train_eagle3 import (
        Streams,
        TrainEagle3Config,
        draft_vocabulary,
        init_head_from_target,
        train_loop,
    )
    from training.train_mtp import make_windows

    llm = LLM(target, device="cpu", max_model_len=192)
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(8, seed=9), sampling_params=GREEDY)
    corpus = torch.tensor([t for o in outputs for t in o.prompt_token_ids + o.token_ids] * 4)
    out = tmp_path_factory.mktemp("eagle3")
    config = TrainEagle3Config(
        base=target,
        out=out / "head",
        data=[out],
        steps=60,
        batch_size=8,
        seq_len=32,
        ttt_steps=2,
        lr=1e-2,
        warmup_steps=5,
        eval_every=1000,
        device="cpu",
        progress=False,
    )
    model = load_model(target, torch.float32, torch.device("cpu"), 64).requires_grad_(False)
    vocab_size = model.config.vocab_size
    draft_ids = draft_vocabulary(torch.bincount(corpus, minlength=vocab_size), vocab_size // 2)
    windows = make_windows(corpus, config.seq_len)
    head = init_head_from_target(model, draft_ids, default_aux_layers(2), torch.device("cpu"))
    counts = torch.bincount(corpus, minlength=vocab_size)
    streams = Streams(windows, windows[:8], counts, counts, {})
    train_loop(head, model, streams, draft_ids, config, time.perf_counter())
    save_eagle3_head(head, out / "head")
    return str(out / "head")
