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
  drafts have a one-hot q, for which this is the same as `target_match`.

Randomness is keyed by (request seed, output position) (kernels/sampling_noise_ref.py), so a seeded
request's tokens do not depend on the batch, and with model-free drafts not on speculation either.

Accept policies `accept_all` / `reject_all` bound acceptance from above and below for debugging.

On a GPU, batches with one-hot drafts and no logprobs are verified and sampled by one fused kernel
(`kernels.verify_sample`, the same numbers as the torch path below); draft distributions (rejection
against a draft model's probabilities) and logprobs take the torch path.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

import kernels
from kernels.sampling_noise_ref import STREAM_ACCEPT, STREAM_TARGET, exponential_noise_ref, uniform_ref
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
    draft_probs: torch.Tensor | None = None  # [k, vocab_size]; None: one-hot drafts

    @property
    def num_rows(self) -> int:
        return len(self.draft_token_ids) + 1


@dataclass
class RowSampling:
    """The fused verify kernel's per-row inputs: how each logit row samples, its noise key and the
    draft it checks (one request's rows in a run, its bonus row last)."""

    temperature: list[float]
    """0 on greedy rows."""
    top_k: list[int]
    """0: no top-k."""
    top_p: list[float]
    min_p: list[float]
    seeds: list[int]
    positions: list[int]
    draft_ids: list[int]
    """-1 on bonus rows."""

    @classmethod
    def of(cls, params: list[SamplingParams], requests: list[VerifyRequest]) -> RowSampling:
        """`params`: each row's sampling parameters (SamplingBatch.params)."""
        seeds, positions = _row_key_lists(requests)
        return cls(
            temperature=[0.0 if p.greedy else p.temperature for p in params],
            top_k=[max(p.top_k, 0) for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
            seeds=seeds,
            positions=positions,
            draft_ids=[d for r in requests for d in r.draft_token_ids + [-1]],
        )


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
        if self._fused(logits, rows, requests):
            return self._verify_fused(apply_penalties(logits, rows), rows, requests)
        penalised = apply_penalties(logits, rows)
        scaled = apply_temperature(penalised, rows.params)
        target_probs = truncated_probs(scaled, rows.params)  # [num_rows, vocab_size]
        greedy_ids = penalised.argmax(dim=-1)
        seeds, positions = _row_keys(requests, logits.device)
        noise = _target_noise(seeds, positions, rows.params, logits.shape[-1])
        sampled_ids = greedy_ids if noise is None else (target_probs / noise).argmax(dim=-1)
        draft_ids, draft_probs = self._drafts(requests, target_probs)
        accepted = self._accepted_rows(
            target_probs, greedy_ids, sampled_ids, draft_ids, draft_probs, seeds, positions, requests
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

    @staticmethod
    def _fused(logits: torch.Tensor, rows: SamplingBatch, requests: list[VerifyRequest]) -> bool:
        return (
            kernels.cuda_available(logits)
            and all(r.draft_probs is None for r in requests)
            and all(p.logprobs is None for p in rows.params)
        )

    def fusable(self, logits: torch.Tensor, rows: SamplingBatch, requests: list[VerifyRequest]) -> bool:
        """Whether the fused kernel alone verifies this batch (nothing to apply to the logits first):
        what the CUDA-graph step's tail needs."""
        return (
            self._fused(logits, rows, requests)
            and not any(p.has_penalties for p in rows.params)
            and not any(rows.suppressed_token_ids)
        )

    def _verify_fused(
        self, penalised: torch.Tensor, rows: SamplingBatch, requests: list[VerifyRequest]
    ) -> list[VerifyResult]:
        """One launch for the batch; one device-to-host copy of the emitted tokens."""
        from kernels.verify import verify_sample_cuda
        from kernels.verify_ref import POLICIES, STRATEGIES

        device = penalised.device
        sampling = RowSampling.of(rows.params, requests)
        num_rows = len(rows.params)
        floats = torch.tensor(sampling.temperature + sampling.top_p + sampling.min_p, dtype=torch.float32)
        request_of_row = [i for i, request in enumerate(requests) for _ in range(request.num_rows)]
        cu_num_rows = [0, *itertools.accumulate(request.num_rows for request in requests)]
        ints = torch.tensor(
            sampling.top_k + sampling.draft_ids + request_of_row + cu_num_rows, dtype=torch.int32
        )
        longs = torch.tensor(sampling.seeds + sampling.positions, dtype=torch.long)
        floats, ints, longs = (t.to(device, non_blocking=True) for t in (floats, ints, longs))
        token_ids, num_accepted, *_ = verify_sample_cuda(
            penalised.contiguous(),
            floats[:num_rows],
            ints[:num_rows],
            floats[num_rows : 2 * num_rows],
            floats[2 * num_rows :],
            longs[:num_rows],
            longs[num_rows:],
            ints[num_rows : 2 * num_rows],
            ints[3 * num_rows :],
            STRATEGIES[self.strategy],
            POLICIES[self.accept_policy],
            max_rows=max(r.num_rows for r in requests),
            request_of_row=ints[2 * num_rows : 3 * num_rows],
        )
        packed = torch.cat([num_accepted[:, None], token_ids], dim=1).cpu().tolist()
        results = []
        for row in packed:
            tokens = row[1 : row[0] + 2]
            results.append(VerifyResult(tokens, row[0], [None] * len(tokens)))
        return results

    @staticmethod
    def _drafts(
        requests: list[VerifyRequest], target_probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft id per row (-1 on bonus rows) and, if any request has them, dense draft probs
        (rows of requests with one-hot drafts stay zero: they are verified by coupling, below)."""
        ids: list[int] = []
        for request in requests:
            ids += request.draft_token_ids + [-1]
        draft_ids = torch.tensor(ids, device=target_probs.device)
        if all(r.draft_probs is None for r in requests):
            return draft_ids, None
        draft_probs = torch.zeros_like(target_probs)
        start = 0
        for request in requests:
            if request.draft_probs is not None:
                draft_probs[start : start + len(request.draft_token_ids)] = request.draft_probs
            start += request.num_rows
        return draft_ids, draft_probs

    def _accepted_rows(
        self,
        target_probs: torch.Tensor,
        greedy_ids: torch.Tensor,
        sampled_ids: torch.Tensor,
        draft_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        seeds: torch.Tensor,
        positions: torch.Tensor,
        requests: list[VerifyRequest],
    ) -> torch.Tensor:
        """[num_rows] bool: whether each draft row passes on its own (bonus rows: False).

        A one-hot draft d has q(d) = 1, so rejection sampling accepts it with probability p(d): the
        same as accepting when d equals the target's own sample at that position, which is what is
        done (the coupled form keeps seeded outputs identical with and without speculation)."""
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
        else:
            passes = draft_ids == sampled_ids
            if self.strategy == "rejection" and draft_probs is not None:
                passes = torch.where(
                    self._has_draft_probs(requests, target_probs.device),
                    self._rejection_test(target_probs, draft_ids, draft_probs, seeds, positions),
                    passes,
                )
        passes = torch.where(greedy_rows, draft_ids == greedy_ids, passes)
        return passes & is_draft

    @staticmethod
    def _has_draft_probs(requests: list[VerifyRequest], device: torch.device) -> torch.Tensor:
        return _per_row([r.draft_probs is not None for r in requests], requests, device)

    @staticmethod
    def _rejection_test(
        target_probs: torch.Tensor,
        draft_ids: torch.Tensor,
        draft_probs: torch.Tensor,
        seeds: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """Leviathan et al.: accept draft x with probability min(1, p(x) / q(x))."""
        index = draft_ids.clamp(min=0)[:, None]
        target_of_draft = target_probs.gather(1, index)[:, 0]
        draft_of_draft = draft_probs.gather(1, index)[:, 0]
        uniforms = uniform_ref(seeds, positions, STREAM_ACCEPT)
        return uniforms * draft_of_draft < target_of_draft

    def _recovered(
        self,
        target_probs: torch.Tensor,
        draft_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        noise: torch.Tensor | None,
        sampled_ids: torch.Tensor,
    ) -> torch.Tensor:
        """[num_rows] the token emitted when a row's draft is rejected. With a one-hot draft the
        coupled sample already differs from the draft and is distributed as the residual; with
        draft probabilities it is drawn from the residual norm(max(0, p - q))."""
        if (
            self.strategy != "rejection"
            or self.accept_policy == "reject_all"
            or draft_probs is None
            or noise is None
        ):
            return sampled_ids
        has_draft = draft_probs.sum(dim=-1) > 0
        residual = (target_probs - draft_probs).clamp(min=0.0)
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, target_probs, residual)
        return torch.where(has_draft, (residual / noise).argmax(dim=-1), sampled_ids)

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
