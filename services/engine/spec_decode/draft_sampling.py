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

from dataclasses import dataclass

import torch

import kernels
from kernels.verify_ref import GREEDY
from services.engine.input_batch import GatheredParams, InputBatch


@dataclass
class DraftSampling:
    """The sampling parameters of a step's requests, gathered from their slots once and reused by
    every draft of a chain (a chain step then launches one sampling kernel, not a dozen)."""

    temperature: torch.Tensor  # [num_seqs] float32
    top_k: torch.Tensor  # [num_seqs] int32
    top_p: torch.Tensor  # [num_seqs] float32
    min_p: torch.Tensor  # [num_seqs] float32
    seeds: torch.Tensor  # [num_seqs] int64
    first_position: torch.Tensor  # [num_seqs] int64 output position of each request's first draft
    rows: torch.Tensor  # [num_seqs + 1] int32 0, 1, ...: one row per request
    no_drafts: torch.Tensor  # [num_seqs] int32 -1s: every row samples

    @classmethod
    def gather(cls, inputs: InputBatch, slots: torch.Tensor) -> DraftSampling:
        """For the requests in `slots` ([num_seqs] int64), their drafts following the tokens they have."""
        return cls.of(inputs.gather(slots), inputs.num_output[slots])

    @classmethod
    def of(cls, params: GatheredParams, num_output: torch.Tensor) -> DraftSampling:
        """From the requests' gathered parameters and output counts ([num_seqs] int32)."""
        num_seqs, device = num_output.shape[0], num_output.device
        return cls(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            seeds=params.seeds,
            first_position=num_output.long(),
            rows=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
            no_drafts=torch.full((num_seqs,), -1, dtype=torch.int32, device=device),
        )

    def sample(self, logits: torch.Tensor, draft_index: int) -> torch.Tensor:
        """[num_seqs] int64: each request's draft number `draft_index` from a drafting model's
        logits ([num_seqs, vocab_size] float32), through the fused sampler (a bonus row per request,
        no drafts to check), keyed as the target's row that will verify it."""
        token_ids, *_ = kernels.verify_sample(
            logits.contiguous(),
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.seeds,
            self.first_position + draft_index,
            self.no_drafts,
            self.rows,
            GREEDY,
            max_rows=1,
            request_of_row=self.rows[:-1],
        )
        return token_ids[:, 0].long()


def sample_drafts(
    logits: torch.Tensor,  # [num_seqs, vocab_size] float32
    inputs: InputBatch,
    slots: torch.Tensor,  # [num_seqs] int64
    draft_index: int,
) -> torch.Tensor:  # [num_seqs] int64
    """Draft number `draft_index` of each request (after the tokens it has) from `logits`."""
    return DraftSampling.gather(inputs, slots).sample(logits, draft_index)
