"""Verification of draft tokens against the target, and sampling of the token that follows them.

Each request contributes `k + 1` rows of target logits: row `j < k` scores draft `j` given the
drafts before it, row `k` is the *bonus* row. With `k = 0` this is plain sampling, so the engine
has one code path with or without speculation.

Strategies (per request; requests at temperature 0 always verify greedily):
- `greedy`: a draft is accepted while it equals the target's argmax.
- `target_match`: a draft is accepted while it equals the target's own sample at that row.
- `topp`: a draft is accepted while it lies in the target's truncated (top-k / top-p / min-p) set.
  Lossy, as in FastDeploy: the output is no longer an exact sample of the target.
- `rejection` (lossless, the default): Leviathan et al. 2023 ("Fast Inference from Transformers via
  Speculative Decoding", Algorithm 1) accept draft `x` drawn from q with probability
  min(1, p(x) / q(x)), p the target distribution, and at the first rejection sample the
  *recovered* token from the residual norm(max(0, p - q)); if all k are accepted, the *bonus*
  token is sampled from the last row. Every draft here is a fixed token from the verifier's point
  of view (a one-hot q: model-free drafts, and drafting models' drafts, which are sampled with the
  target's own noise: services/engine/spec_decode/draft_sampling.py), for which that test is the
  same as accepting the draft when it equals the target's own sample at its row, the residual
  being p without the draft: so that is what is done. The output is distributed exactly as p.

Randomness is keyed by (request seed, output position) (kernels/sampling_noise_ref.py), so a seeded
request's tokens depend neither on the batch nor on speculation: every emitted token is the
target's own sample at its position.

Accept policies `accept_all` / `reject_all` bound acceptance from above and below for debugging.

The step's tail verifies with one fused kernel (`kernels.verify_sample`, the same numbers as this
torch path); this path serves the requests the kernel cannot: penalties, min_tokens suppression,
logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.sampling_noise_ref import STREAM_TARGET, exponential_noise_ref
from services.engine.sampler import (
    SamplingBatch,
    apply_penalties,
    apply_temperature,
    gather_logprobs,
    truncated_probs,
)
from services.engine.sequence import TokenLogprobs
from shared.sampling_params import SamplingParams


@dataclass
class VerifyRequest:
    params: SamplingParams
    seed: int
    """The request's sampling seed (its own, or drawn for it at admission)."""
    position: int
    """Output position of the request's first row (tokens it has generated so far)."""
    draft_token_ids: list[int]

    @property
    def num_rows(self) -> int:
        return len(self.draft_token_ids) + 1


@dataclass
class VerifyResult:
    token_ids: list[int]
    """Accepted drafts followed by one recovered or bonus token."""
    num_accepted: int
    logprobs: list[TokenLogprobs | None]


class RejectionSampler:
    def __init__(
        self, strategy: str = "rejection", accept_policy: str = "normal", logprobs_mode: str = "processed"
    ):
        self.strategy = strategy
        self.accept_policy = accept_policy
        self.logprobs_mode = logprobs_mode

    def __call__(
        self, logits: torch.Tensor, rows: SamplingBatch, requests: list[VerifyRequest]
    ) -> list[VerifyResult]:
        # logits: [num_rows, vocab_size] float32; rows: per-row sampling inputs (penalties see the drafts before)
        penalised = apply_penalties(logits, rows)
        scaled = apply_temperature(penalised, rows.params)
        target_probs = truncated_probs(scaled, rows.params)  # [num_rows, vocab_size]
        greedy_ids = penalised.argmax(dim=-1)
        seeds, positions = _row_keys(requests, logits.device)
        noise = _target_noise(seeds, positions, rows.params, logits.shape[-1])
        sampled_ids = greedy_ids if noise is None else (target_probs / noise).argmax(dim=-1)
        draft_ids = torch.tensor(
            [d for r in requests for d in r.draft_token_ids + [-1]], device=logits.device
        )
        accepted = self._accepted_rows(target_probs, greedy_ids, sampled_ids, draft_ids, requests)
        want_logprobs = any(p.logprobs is not None for p in rows.params)
        logprobs = (
            torch.log_softmax(logits if self.logprobs_mode == "raw" else scaled, dim=-1)
            if want_logprobs
            else None
        )
        return self._results(requests, accepted, greedy_ids, sampled_ids, logprobs, rows.params)

    def _accepted_rows(
        self,
        target_probs: torch.Tensor,
        greedy_ids: torch.Tensor,
        sampled_ids: torch.Tensor,
        draft_ids: torch.Tensor,
        requests: list[VerifyRequest],
    ) -> torch.Tensor:
        """[num_rows] bool: whether each draft row passes on its own (bonus rows: False)."""
        is_draft = draft_ids >= 0
        if self.accept_policy == "accept_all":
            return is_draft
        if self.accept_policy == "reject_all":
            return torch.zeros_like(is_draft)
        greedy_rows = _per_row([r.params.greedy for r in requests], requests, target_probs.device)
        if self.strategy == "greedy":
            passes = draft_ids == greedy_ids
        elif self.strategy == "topp":
            passes = target_probs.gather(1, draft_ids.clamp(min=0)[:, None])[:, 0] > 0
        else:  # target_match, and rejection with fixed drafts (see the module docstring)
            passes = draft_ids == sampled_ids
        passes = torch.where(greedy_rows, draft_ids == greedy_ids, passes)
        return passes & is_draft

    @staticmethod
    def _results(
        requests: list[VerifyRequest],
        accepted: torch.Tensor,
        greedy_ids: torch.Tensor,
        sampled_ids: torch.Tensor,
        logprobs: torch.Tensor | None,
        row_params: list[SamplingParams],
    ) -> list[VerifyResult]:
        accepted_cpu = accepted.tolist()
        greedy_cpu, sampled_cpu = greedy_ids.tolist(), sampled_ids.tolist()
        results = []
        start = 0
        for request in requests:
            k = len(request.draft_token_ids)
            num_accepted = 0
            while num_accepted < k and accepted_cpu[start + num_accepted]:
                num_accepted += 1
            row = start + num_accepted
            last = greedy_cpu[row] if request.params.greedy else sampled_cpu[row]
            token_ids = request.draft_token_ids[:num_accepted] + [last]
            token_logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
            if logprobs is not None and request.params.logprobs is not None:
                rows = list(range(start, row + 1))
                token_logprobs = gather_logprobs(
                    logprobs[rows], torch.tensor(token_ids), [row_params[r] for r in rows]
                )
            results.append(VerifyResult(token_ids, num_accepted, token_logprobs))
            start += k + 1
        return results


def _per_row(values: list[bool], requests: list[VerifyRequest], device: torch.device) -> torch.Tensor:
    """Repeats one flag per request over its rows."""
    return torch.tensor([v for v, r in zip(values, requests) for _ in range(r.num_rows)], device=device)


def _row_keys(requests: list[VerifyRequest], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_rows] seed and output position of every row."""
    seeds, positions = _row_key_lists(requests)
    return torch.tensor(seeds, dtype=torch.long, device=device), torch.tensor(
        positions, dtype=torch.long, device=device
    )


def _row_key_lists(requests: list[VerifyRequest]) -> tuple[list[int], list[int]]:
    """The seed and output position of every row: what keys its random numbers."""
    seeds = [r.seed for r in requests for _ in range(r.num_rows)]
    positions = [r.position + j for r in requests for j in range(r.num_rows)]
    return seeds, positions


def _target_noise(
    seeds: torch.Tensor, positions: torch.Tensor, params: list[SamplingParams], vocab_size: int
) -> torch.Tensor | None:
    """Exponential noise for the rows that sample (None when every row is greedy)."""
    if all(p.greedy for p in params):
        return None
    return exponential_noise_ref(seeds, positions, vocab_size, STREAM_TARGET)
