"""Choosing draft tokens from a drafting model's logits.

Greedy requests take the argmax (a one-hot draft distribution). Sampled requests draw from the
draft model's distribution under the request's temperature / top-k / top-p / min-p and keep it, so
that rejection sampling can accept with min(1, target / draft) and stay lossless.
"""

from __future__ import annotations

import torch

from services.engine.sampler import apply_temperature, truncated_probs
from services.engine.sequence import Sequence


def choose_drafts(
    logits: torch.Tensor,  # [num_seqs, vocab_size] float32, one row per sequence
    seqs: list[Sequence],
    default_generator: torch.Generator,
) -> tuple[list[int], list[torch.Tensor | None]]:
    """One draft token per sequence, and its draft distribution ([vocab_size]) where sampled."""
    params = [seq.params for seq in seqs]
    greedy_ids = logits.argmax(dim=-1).tolist()
    if all(p.greedy for p in params):
        return greedy_ids, [None] * len(seqs)
    probs = truncated_probs(apply_temperature(logits, params), params)
    noise = torch.empty_like(probs).exponential_(generator=default_generator)
    for i, seq in enumerate(seqs):
        if seq.generator is not None and not seq.params.greedy:
            noise[i].exponential_(generator=seq.generator)
    sampled_ids = (probs / noise).argmax(dim=-1).tolist()
    ids = [g if p.greedy else s for g, s, p in zip(greedy_ids, sampled_ids, params)]
    return ids, [None if p.greedy else probs[i] for i, p in enumerate(params)]


def stack_draft_probs(
    rows: list[torch.Tensor | None], token_ids: list[int], vocab_size: int
) -> torch.Tensor | None:
    """[k, vocab_size] draft distribution of a request's drafts; one-hot rows where none was kept.
    None when every row is one-hot (the verifier's cheaper default)."""
    if all(r is None for r in rows):
        return None
    device = next(r for r in rows if r is not None).device
    out = torch.zeros(len(rows), vocab_size, device=device)
    for j, (row, token) in enumerate(zip(rows, token_ids)):
        if row is None:
            out[j, token] = 1.0
        else:
            out[j] = row
    return out
