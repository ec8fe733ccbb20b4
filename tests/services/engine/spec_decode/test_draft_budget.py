"""Drafts trimmed to what fits the largest CUDA graph: the most valuable ones are kept."""

from __future__ import annotations

import itertools
import random

from services.engine.spec_decode.drafter import fit_draft_budget


def expected_tokens(ks: list[int], acceptance: list[float]) -> float:
    return sum(a**j for k, a in zip(ks, acceptance) for j in range(1, k + 1))


def test_within_budget_nothing_changes() -> None:
    assert fit_draft_budget([3, 0, 5], [0.5, 0.9, 0.7], 8) == [3, 0, 5]


def test_trimming_keeps_the_best_prefixes() -> None:
    # 0.9^1..3 = .9 .81 .73; 0.5^1..2 = .5 .25; budget 4 keeps .9 .81 .73 .5
    assert fit_draft_budget([3, 2], [0.9, 0.5], 4) == [3, 1]
    assert fit_draft_budget([3, 2], [0.9, 0.5], 0) == [0, 0]
    assert fit_draft_budget([3, 2], [0.9, 0.5], -5) == [0, 0]


def test_trimming_is_the_brute_force_optimum() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randrange(1, 5)
        ks = [rng.randrange(0, 4) for _ in range(n)]
        acceptance = [rng.random() for _ in range(n)]
        budget = rng.randrange(0, sum(ks) + 2)
        got = fit_draft_budget(ks, acceptance, budget)
        assert all(0 <= g <= k for g, k in zip(got, ks)) and sum(got) == min(budget, sum(ks))
        best = max(
            expected_tokens(list(c), acceptance)
            for c in itertools.product(*(range(k + 1) for k in ks))
            if sum(c) <= budget
        )
        assert abs(expected_tokens(got, acceptance) - best) < 1e-12
