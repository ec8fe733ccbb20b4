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
from typing import Protocol

import torch

import kernels
from kernels.verify_ref import GREEDY
from services.engine.input_batch import GatheredParams, InputBatch


class RowParams(Protocol):
    """Sampling parameters, one per row (`GatheredParams`, `DraftSampling`)."""

    @property
    def temperature(self) -> torch.Tensor: ...  # [num_rows] float32
    @property
    def top_k(self) -> torch.Tensor: ...  # [num_rows] int32
    @property
    def top_p(self) -> torch.Tensor: ...  # [num_rows] float32
    @property
    def min_p(self) -> torch.Tensor: ...  # [num_rows] float32
    @property
    def seeds(self) -> torch.Tensor: ...  # [num_rows] int64


def sample_each_row(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, contiguous
    params: RowParams,
    positions: torch.Tensor,  # [num_rows] int64: the output position each row samples (its noise's key)
    strategy: int,
    layout: tuple[torch.Tensor, torch.Tensor] | None = None,
    bitmask: torch.Tensor | None = None,  # [num_rows, num_words] int32 grammar masks
    masked_rows: torch.Tensor | None = None,  # [num_rows] int32, nonzero: apply the row's bitmask
) -> torch.Tensor:  # [num_rows] int32
    """Each row's own token (argmax at temperature 0, else its keyed sample) through the fused verify
    kernel, every row a request of its own with no draft to check. `layout`: that batch's
    [num_rows + 1] 0, 1, ... and [num_rows] -1 tensors, where the caller keeps them across calls."""
    num_rows, device = logits.shape[0], logits.device
    if layout is None:
        layout = (
            torch.arange(num_rows + 1, dtype=torch.int32, device=device),
            torch.full((num_rows,), -1, dtype=torch.int32, device=device),
        )
    rows, no_drafts = layout
    token_ids, *_ = kernels.verify_sample(
        logits,
        params.temperature,
        params.top_k,
        params.top_p,
        params.min_p,
        params.seeds,
        positions,
        no_drafts,
        rows,
        strategy,
        max_rows=1,
        request_of_row=rows[:-1],
        bitmask=bitmask,
        masked_rows=masked_rows,
    )
    return token_ids[:, 0]


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

    def draft_positions(self, num_drafts: int) -> torch.Tensor:
        """[num_drafts, num_seqs] int64: the output position of each request's drafts 0, 1, ...
        (their noise keys), computed at once for a chain of `num_drafts`."""
        if num_drafts == 1:
            return self.first_position[None]
        offsets = torch.arange(num_drafts, device=self.first_position.device)[:, None]
        return self.first_position[None] + offsets

    def sample(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[num_seqs] int32: each request's draft at output position `positions` ([num_seqs] int64,
        a row of `draft_positions`) from a drafting model's logits ([num_seqs, vocab_size] float32),
        through the fused sampler (a bonus row per request, no drafts to check), keyed as the
        target's row that will verify it."""
        return sample_each_row(
            logits.contiguous(), self, positions, GREEDY, layout=(self.rows, self.no_drafts)
        )


def sample_drafts(
    logits: torch.Tensor,  # [num_seqs, vocab_size] float32
    inputs: InputBatch,
    slots: torch.Tensor,  # [num_seqs] int64
    draft_index: int,
) -> torch.Tensor:  # [num_seqs] int32
    """Draft number `draft_index` of each request (after the tokens it has) from `logits`."""
    sampling = DraftSampling.gather(inputs, slots)
    return sampling.sample(logits, sampling.draft_positions(draft_index + 1)[draft_index])
