"""Verification of draft tokens against the target, and sampling of the token that follows them.

Each request contributes `k + 1` rows of target logits: row `j < k` scores draft `j` given the
drafts before it, row `k` is the *bonus* row. With `k = 0` this is plain sampling, so the engine
has one code path with or without speculation.

Strategies (per request; requests at temperature 0 always verify greedily):
- `greedy`: a draft is accepted while it equals the target's argmax.
- `target_match`: a draft is accepted while it equals the target's own sample at that row.
- `topp`: a draft is accepted while it lies in the target's truncated (top-k / top-p / min-p) set.
  Lossy, as in FastDeploy: the output is no longer an exact sample of the target.
- `rejection` (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
  Decoding", Algorithm 1): draft `x` drawn from the draft distribution q is accepted with
  probability min(1, p(x) / q(x)), p the target distribution. At the first rejection the
  *recovered* token is sampled from the residual norm(max(0, p - q)); if all k are accepted, the
  *bonus* token is sampled from the last row. The output is distributed exactly as p. Model-free
  drafts have a one-hot q.

Accept policies `accept_all` / `reject_all` bound acceptance from above and below for debugging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    generator: torch.Generator | None
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None = None  # [k, vocab_size]; None: one-hot drafts

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
        self,
        default_generator: torch.Generator,
        strategy: str = "rejection",
        accept_policy: str = "normal",
        logprobs_mode: str = "processed",
    ):
        self.default_generator = default_generator
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
        noise, uniforms = self._random(target_probs, requests)
        sampled_ids = (target_probs / noise).argmax(dim=-1)
        draft_ids, draft_probs = self._drafts(requests, target_probs)
        accepted = self._accepted_rows(
            target_probs, greedy_ids, sampled_ids, draft_ids, draft_probs, uniforms, requests
        )
        recovered_ids = self._recovered(target_probs, draft_ids, draft_probs, noise, sampled_ids)
        want_logprobs = any(p.logprobs is not None for p in rows.params)
        logprobs = (
            torch.log_softmax(logits if self.logprobs_mode == "raw" else scaled, dim=-1)
            if want_logprobs
            else None
        )
        return self._results(
            requests, accepted, greedy_ids, sampled_ids, recovered_ids, logprobs, rows.params
        )

    def _random(
        self, target_probs: torch.Tensor, requests: list[VerifyRequest]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exponential noise per row (Gumbel-max sampling) and one uniform per draft row, drawn from
        each seeded request's own generator in a fixed order."""
        noise = torch.empty_like(target_probs).exponential_(generator=self.default_generator)
        uniforms = torch.rand(
            target_probs.shape[0], device=target_probs.device, generator=self.default_generator
        )
        start = 0
        for request in requests:
            end = start + request.num_rows
            if request.generator is not None:
                noise[start:end].exponential_(generator=request.generator)
                if request.draft_token_ids and self.strategy == "rejection":
                    uniforms[start : end - 1] = torch.rand(
                        end - 1 - start, device=uniforms.device, generator=request.generator
                    )
            start = end
        return noise, uniforms

    @staticmethod
    def _drafts(
        requests: list[VerifyRequest], target_probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft id per row (-1 on bonus rows) and, if any request has them, dense draft probs."""
        ids: list[int] = []
        for request in requests:
            ids += request.draft_token_ids + [-1]
        draft_ids = torch.tensor(ids, device=target_probs.device)
        if all(r.draft_probs is None for r in requests):
            return draft_ids, None
        draft_probs = torch.zeros_like(target_probs)
        start = 0
        for request in requests:
            k = len(request.draft_token_ids)
            if request.draft_probs is not None:
                draft_probs[start : start + k] = request.draft_probs
            else:
                draft_probs[
                    start + torch.arange(k), torch.tensor(request.draft_token_ids, dtype=torch.long)
                ] = 1.0
            start += k + 1
        return draft_ids, draft_probs

    def _accepted_rows(
        self,
        target_probs: torch.Tensor,
        greedy_ids: torch.Tensor,
        sampled_ids: torch.Tensor,
        draft_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        uniforms: torch.Tensor,
        requests: list[VerifyRequest],
    ) -> torch.Tensor:
        """[num_rows] bool: whether each draft row passes on its own (bonus rows: False)."""
        is_draft = draft_ids >= 0
        safe_ids = draft_ids.clamp(min=0)[:, None]
        if self.accept_policy == "accept_all":
            return is_draft
        if self.accept_policy == "reject_all":
            return torch.zeros_like(is_draft)
        greedy_rows = torch.tensor(
            [r.params.greedy for r in requests for _ in range(r.num_rows)], device=target_probs.device
        )
        target_of_draft = target_probs.gather(1, safe_ids)[:, 0]
        if self.strategy == "greedy":
            passes = draft_ids == greedy_ids
        elif self.strategy == "target_match":
            passes = draft_ids == sampled_ids
        elif self.strategy == "topp":
            passes = target_of_draft > 0
        else:
            draft_of_draft = (
                draft_probs.gather(1, safe_ids)[:, 0]
                if draft_probs is not None
                else torch.ones_like(target_of_draft)
            )
            passes = uniforms * draft_of_draft < target_of_draft
        passes = torch.where(greedy_rows, draft_ids == greedy_ids, passes)
        return passes & is_draft

    def _recovered(
        self,
        target_probs: torch.Tensor,
        draft_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        noise: torch.Tensor,
        sampled_ids: torch.Tensor,
    ) -> torch.Tensor:
        """[num_rows] the token emitted when a row's draft is rejected (rejection: from the residual)."""
        if self.strategy != "rejection" or self.accept_policy == "reject_all":
            return sampled_ids
        if draft_probs is None:
            draft_probs = torch.zeros_like(target_probs)
            rows = torch.nonzero(draft_ids >= 0)[:, 0]
            draft_probs[rows, draft_ids[rows]] = 1.0
        residual = (target_probs - draft_probs).clamp(min=0.0)
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, target_probs, residual)
        return (residual / noise).argmax(dim=-1)

    @staticmethod
    def _results(
        requests: list[VerifyRequest],
        accepted: torch.Tensor,
        greedy_ids: torch.Tensor,
        sampled_ids: torch.Tensor,
        recovered_ids: torch.Tensor,
        logprobs: torch.Tensor | None,
        row_params: list[SamplingParams],
    ) -> list[VerifyResult]:
        accepted_cpu = accepted.tolist()
        greedy_cpu, sampled_cpu, recovered_cpu = (
            greedy_ids.tolist(),
            sampled_ids.tolist(),
            recovered_ids.tolist(),
        )
        results = []
        start = 0
        for request in requests:
            k = len(request.draft_token_ids)
            num_accepted = 0
            while num_accepted < k and accepted_cpu[start + num_accepted]:
                num_accepted += 1
            row = start + num_accepted
            if request.params.greedy:
                last = greedy_cpu[row]
            else:
                last = recovered_cpu[row] if num_accepted < k else sampled_cpu[row]
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
