"""Adaptive speculation: how many drafts each request gets, from acceptance and measured step cost.

With a per-draft acceptance rate a, a request verifying k drafts emits on average
E(k) = 1 + a + a^2 + ... + a^k tokens per step (Leviathan et al. 2023, eq. 1), so its k-th draft
is worth a^k tokens. Every draft also adds one query token to the target forward, whose time
T(n) for n batched tokens is learned online from the engine's own steps as T(n) = fixed + n * per_token.
Drafts are granted greedily, most valuable first, while they raise the batch's tokens per second
sum(E) / T(n); a lightly loaded GPU step is nearly flat in n, so requests get their full k, while
a saturated one grows with n, so k shrinks and speculation pauses when it would cost more than it
saves. A request whose acceptance stays below `min_acceptance` stops drafting and is probed with
one draft now and then so it can recover. One step in EXPLORE_EVERY_STEPS runs without drafts so
that the fit always sees steps of different sizes.
"""

from __future__ import annotations

import heapq
from collections import deque

from services.engine.sequence import Sequence

ACCEPTANCE_SMOOTHING = 0.3
PROBE_EVERY_STEPS = 16
COST_WINDOW = 256
EXPLORE_EVERY_STEPS = 32
"""Every this many steps nobody drafts: a step of another size, so the cost slope stays measurable
even when a busy server otherwise runs the same number of tokens every step."""


class StepCostModel:
    """Least-squares fit of step time against the number of tokens in the target forward."""

    def __init__(self, window: int = COST_WINDOW):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def record(self, num_tokens: int, seconds: float) -> None:
        self.samples.append((num_tokens, seconds))

    def fit(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token); per-token cost 0 until two distinct sizes are seen."""
        if not self.samples:
            return 1.0, 0.0
        n = len(self.samples)
        mean_x = sum(x for x, _ in self.samples) / n
        mean_y = sum(y for _, y in self.samples) / n
        var_x = sum((x - mean_x) ** 2 for x, _ in self.samples)
        if var_x == 0:
            return max(mean_y, 1e-9), 0.0
        slope = sum((x - mean_x) * (y - mean_y) for x, y in self.samples) / var_x
        slope = max(slope, 0.0)
        return max(mean_y - slope * mean_x, 1e-9), slope


class AdaptiveSpeculation:
    def __init__(self, enabled: bool, min_acceptance: float):
        self.enabled = enabled
        self.min_acceptance = min_acceptance
        self.cost = StepCostModel()
        self.step = 0

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Updates the request's acceptance estimate from one verify step (truncated-geometric MLE)."""
        if num_drafts == 0:
            return
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        rate = num_accepted / trials
        seq.spec.acceptance += ACCEPTANCE_SMOOTHING * (rate - seq.spec.acceptance)

    def choose(self, seqs: list[Sequence], num_other_tokens: int) -> list[int]:
        """k per sequence; `num_other_tokens` are the batch's tokens that are not drafts."""
        self.step += 1
        caps = [self._cap(seq) for seq in seqs]
        if not self.enabled:
            return caps
        if self.step % EXPLORE_EVERY_STEPS == 0:
            return [0] * len(seqs)
        fixed, per_token = self.cost.fit()
        num_tokens = num_other_tokens
        expected = float(len(seqs))
        ks = [0] * len(seqs)
        heap = [(-seq.spec.acceptance, i) for i, seq in enumerate(seqs) if caps[i] > 0]
        heapq.heapify(heap)
        while heap:
            neg_gain, i = heapq.heappop(heap)
            gain = -neg_gain
            if (expected + gain) / (fixed + per_token * (num_tokens + 1)) <= expected / (
                fixed + per_token * num_tokens
            ):
                break
            ks[i] += 1
            expected += gain
            num_tokens += 1
            if ks[i] < caps[i]:
                heapq.heappush(heap, (-(gain * seqs[i].spec.acceptance), i))
        return ks

    def _cap(self, seq: Sequence) -> int:
        """The request's own limit: max_k, or none while its acceptance is too low (with probes)."""
        if not self.enabled or seq.spec.acceptance >= self.min_acceptance:
            return seq.spec.max_k
        return min(1, seq.spec.max_k) if self.step % PROBE_EVERY_STEPS == 1 else 0
