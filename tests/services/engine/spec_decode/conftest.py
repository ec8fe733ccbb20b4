"""Fixtures of the speculative-engine tests: a small random target and its plain greedy output."""

from __future__ import annotations

import pytest

from services.engine.llm import LLM
from tests.services.engine.spec_decode.helpers import GREEDY, repetitive_prompts


@pytest.fixture(scope="module")
def target(make_checkpoint):
    return str(make_checkpoint("llama", num_hidden_layers=2))


@pytest.fixture(scope="module")
def naive_tokens(target) -> list[list[int]]:
    llm = LLM(target, device="cpu", max_model_len=192)
    return [o.token_ids for o in llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY)]
