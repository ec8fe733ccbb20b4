"""Choosing draft tokens from a drafting model's logits.

Greedy requests take the argmax (a one-hot draft distribution). Sampled requests draw from the
draft model's distribution under the request's temperature / top-k / top-p / min-p and keep it, so
that rejection sampling can accept with min(1, target / draft) and stay lossless.
"""

from __future__ import annotations

import torch

from kernels.sampling_noise_ref import STREAM_DRAFT, exponential_noise_ref
from services.engine.sampler import apply_temperature, truncated_probs
from services.engine.sequence import Sequence


def choose_drafts(
    logits: torch.Tensor,  # [num_seqs, vocab_size] float32, one row per sequence
    seqs: list[Sequence],
    draft_index: list[int],
) -> tuple[list[int], list[torch.Tensor | None]]:
    """One draft token per sequence (its `draft_index[i]`-th draft), and its draft distribution
    ([vocab_size]) where sampled. Sampling noise is keyed by the request's seed and the draft's
    output position, like the target's."""
    params = [seq.params for seq in seqs]
    greedy_ids = logits.argmax(dim=-1).tolist()
    if all(p.greedy for p in params):
        return greedy_ids, [None] * len(seqs)
    probs = truncated_probs(apply_temperature(logits, params), params)
    seeds = torch.tensor([seq.seed for seq in seqs], dtype=torch.long, device=logits.device)
    positions = torch.tensor(
        [seq.num_output_tokens + j for seq, j in zip(seqs, draft_index)], device=logits.device
    )
    noise = exponential_noise_ref(seeds, positions, logits.shape[-1], STREAM_DRAFT)
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
