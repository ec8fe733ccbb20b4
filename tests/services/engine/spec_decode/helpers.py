"""What the speculative-engine tests share: prompts that make drafts pay, and greedy sampling."""

from __future__ import annotations

import torch

from shared.sampling_params import SamplingParams

MAX_TOKENS = 40


def repetitive_prompts(count: int = 6, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a span, so n-gram and suffix drafts get accepted."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        span = torch.randint(3, 384, (6 + i,), generator=generator).tolist()
        tail = torch.randint(3, 384, (i * 3,), generator=generator).tolist()
        prompts.append(tail + span * 3 + span[:2])
    return prompts


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
