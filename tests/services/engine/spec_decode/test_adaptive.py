"""Adaptive speculation: k follows acceptance, and speculation backs off when verifying costs more than it saves."""

from __future__ import annotations

import itertools

import pytest

from services.engine.sequence import Sequence
from services.engine.spec_decode.adaptive import PROBE_EVERY_STEPS, AdaptiveSpeculation, StepCostModel
from shared.sampling_params import SamplingParams


def seqs(acceptances: list[float], max_k: int = 5) -> list[Sequence]:
    out = []
    for i, a in enumerate(acceptances):
        seq = Sequence(f"r{i}", [1, 2, 3], SamplingParams(), frozenset())
        seq.spec.max_k, seq.spec.acceptance = max_k, a
        out.append(seq)
    return out


def with_cost(fixed_s: float, per_token_s: float) -> AdaptiveSpeculation:
    adaptive = AdaptiveSpeculation(enabled=True, min_acceptance=0.2)
    for n in (1, 64, 256, 1024):
        adaptive.cost.record(n, fixed_s + per_token_s * n)
    return adaptive


def test_cost_model_recovers_a_linear_step_time() -> None:
    model = StepCostModel()
    for n in (4, 16, 64, 128):
        model.record(n, 0.010 + 0.0002 * n)
    fixed, per_token = model.fit()
    assert abs(fixed - 0.010) < 1e-9 and abs(per_token - 0.0002) < 1e-12


def test_flat_step_cost_grants_the_full_k() -> None:
    """A memory-bound step (time barely grows with tokens): every useful draft is worth it."""
    adaptive = with_cost(fixed_s=0.010, per_token_s=1e-9)
    assert adaptive.choose(seqs([0.8, 0.5, 0.3]), num_other_tokens=3) == [5, 5, 5]


def expected_tokens(acceptance: float, k: int) -> float:
    return sum(acceptance**j for j in range(k + 1))


@pytest.mark.parametrize(("fixed_s", "per_token_s"), [(0.001, 0.001), (0.01, 0.0005), (0.002, 0.0001)])
def test_choice_maximises_tokens_per_second(fixed_s: float, per_token_s: float) -> None:
    """The greedy allocation equals the brute-force best k vector for sum(E_i(k_i)) / T(n)."""
    acceptances = [0.9, 0.5, 0.25]
    adaptive = with_cost(fixed_s, per_token_s)
    chosen = adaptive.choose(seqs(acceptances), num_other_tokens=3)

    def rate(ks: tuple[int, ...]) -> float:
        tokens = sum(expected_tokens(a, k) for a, k in zip(acceptances, ks))
        return tokens / (fixed_s + per_token_s * (3 + sum(ks)))

    best = max(itertools.product(range(6), repeat=3), key=rate)
    assert rate(tuple(chosen)) == pytest.approx(rate(best), rel=1e-9)
    assert chosen[0] >= chosen[1] >= chosen[2]


def test_saturated_batch_pauses_speculation() -> None:
    """A compute-bound step (time proportional to tokens) gains nothing from drafts that pass
    less than always."""
    adaptive = with_cost(fixed_s=1e-6, per_token_s=0.001)
    assert adaptive.choose(seqs([0.6] * 64), num_other_tokens=64) == [0] * 64


def test_low_acceptance_stops_drafting_but_probes() -> None:
    adaptive = AdaptiveSpeculation(enabled=True, min_acceptance=0.2)
    batch = seqs([0.05])
    ks = [adaptive.choose(batch, num_other_tokens=1)[0] for _ in range(PROBE_EVERY_STEPS * 2)]
    assert ks.count(1) == 2 and ks.count(0) == len(ks) - 2


def test_acceptance_estimate_tracks_verify_results() -> None:
    adaptive = AdaptiveSpeculation(enabled=True, min_acceptance=0.2)
    (seq,) = seqs([0.7])
    for _ in range(30):
        adaptive.observe(seq, num_drafts=4, num_accepted=4)
    assert seq.spec.acceptance > 0.99
    for _ in range(30):
        adaptive.observe(seq, num_drafts=4, num_accepted=0)
    assert seq.spec.acceptance < 0.01


def test_disabled_always_uses_max_k() -> None:
    adaptive = AdaptiveSpeculation(enabled=False, min_acceptance=0.2)
    assert adaptive.choose(seqs([0.0, 0.9], max_k=3), num_other_tokens=2) == [3, 3]


def test_a_step_without_drafts_now_and_then_keeps_the_cost_slope_measurable() -> None:
    from services.engine.spec_decode.adaptive import EXPLORE_EVERY_STEPS

    adaptive = with_cost(fixed_s=0.010, per_token_s=1e-9)
    ks = [adaptive.choose(seqs([0.8, 0.8]), num_other_tokens=2) for _ in range(EXPLORE_EVERY_STEPS)]
    assert ks[-1] == [0, 0]
    assert all(k == [5, 5] for k in ks[:-1])
