"""Choosing draft tokens from a drafting model's logits, coupled with the target's sampling.

Greedy requests take the argmax. A sampled request's draft at output position i is drawn from
the drafting model's distribution q with the same Exp(1) noise e_i that the target's verification
uses at that position (kernels/sampling_noise_ref.py, STREAM_TARGET): draft = argmax(q / e_i),
while the target's token is argmax(p / e_i) (the exponential race, i.e. Gumbel-max). The verifier
accepts a draft exactly when the two agree, so every emitted token is the target's own sample:
the output is distributed as the target's (lossless) and a seed fixes it whatever the method, k
or batch. Sharing the noise makes the two samples agree often: with probability at least
(1 - TV) / (1 + TV), TV the total variation between p and q (the Gumbel-max coupling; Leviathan
et al.'s rejection test with q kept reaches 1 - TV but ties the output to the drafts).
"""

from __future__ import annotations

import torch

import kernels
from kernels.verify_ref import GREEDY
from services.engine.input_batch import InputBatch


def sample_drafts(
    logits: torch.Tensor,  # [num_seqs, vocab_size] float32
    inputs: InputBatch,
    slots: torch.Tensor,  # [num_seqs] int64
    positions: torch.Tensor,  # [num_seqs] int64 output position each draft will be verified at
) -> torch.Tensor:  # [num_seqs] int64
    """One draft per request through the fused sampler (a bonus row per request, no drafts)."""
    num_seqs = logits.shape[0]
    device = logits.device
    rows = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
    token_ids, *_ = kernels.verify_sample(
        logits.contiguous(),
        inputs.temperature[slots],
        inputs.top_k[slots],
        inputs.top_p[slots],
        inputs.min_p[slots],
        inputs.seeds[slots],
        positions,
        torch.full((num_seqs,), -1, dtype=torch.int32, device=device),
        rows,
        GREEDY,
        max_rows=1,
        request_of_row=rows[:-1],
    )
    return token_ids[:, 0].long()
