"""A request's suffix automaton drafts exactly as a suffix tree of the same tokens, for a bounded
amount of work per token."""

from __future__ import annotations

import random

import pytest

from services.engine.spec_decode.suffix_automaton import SuffixAutomaton
from services.engine.spec_decode.suffix_tree import SuffixTree
from tests.services.engine.spec_decode.test_suffix import reference_draft, substring_counts


def copy_heavy_tokens(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Fresh tokens, runs of one token, and spans copied from earlier (the text suffix decoding is for)."""
    tokens: list[int] = []
    while len(tokens) < length:
        op = rng.random()
        if op < 0.4 or len(tokens) < 4:
            tokens.append(rng.randrange(vocab))
        elif op < 0.5:
            tokens += [rng.randrange(vocab)] * rng.randint(2, 30)
        else:
            start = rng.randrange(len(tokens))
            tokens += tokens[start : start + rng.randint(1, 40)]
    return tokens[:length]


def draft_args(rng: random.Random) -> tuple[int, float, float]:
    return rng.randint(0, 12), rng.choice([0.3, 0.5, 1.0, 2.0, 5.0]), rng.choice([0.0, 0.05, 0.1, 0.4])


@pytest.mark.parametrize("seed", range(40))
def test_drafts_and_counts_equal_the_suffix_tree_token_by_token(seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.choice([1, 2, 3, 5, 8, 16, 64])
    tokens = copy_heavy_tokens(rng, rng.randint(1, 300), vocab=rng.randint(1, 12))
    tree, automaton = SuffixTree(depth), SuffixAutomaton(depth)
    seq = tree.new_sequence()
    for token_id in tokens:
        tree.extend(seq, [token_id])
        automaton.extend([token_id])
        args = draft_args(rng)
        assert automaton.speculate(*args) == tree.speculate_sequence(seq, *args), (len(seq.token_ids), args)
    assert automaton.path_counts() == tree.path_counts()
    assert automaton.num_tokens == len(tokens)


@pytest.mark.parametrize("seed", range(6))
def test_drafts_equal_brute_force_on_short_sequences(seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.randint(1, 7)
    automaton, tokens = SuffixAutomaton(depth), []
    for _ in range(40):
        tokens.append(rng.randrange(3))
        automaton.extend(tokens[-1:])
        assert automaton.path_counts() == substring_counts([tokens], depth)
        args = draft_args(rng)
        draft = automaton.speculate(*args)
        assert (draft.token_ids, draft.score) == reference_draft(
            substring_counts([tokens], depth), tokens, depth, *args
        )


def test_an_empty_index_drafts_nothing() -> None:
    automaton = SuffixAutomaton(4)
    assert automaton.speculate(8, 1.0, 0.0).token_ids == []
    automaton.extend([3])
    assert automaton.speculate(8, 1.0, 0.0).token_ids == []
    with pytest.raises(ValueError, match="max_tree_depth"):
        SuffixAutomaton(0)


@pytest.mark.parametrize("tokens", [[7] * 3000, [1, 2] * 1500, list(range(50)) * 60])
def test_an_appended_token_touches_at_most_max_depth_counts(tokens: list[int]) -> None:
    """A run of one token puts every suffix in its own state: without the depth bound each token
    would add an occurrence to every one of them (thousands); with it, to at most max_depth + 1
    (the root included)."""
    depth = 8
    automaton = SuffixAutomaton(depth)
    most_changed = 0
    for i, token_id in enumerate(tokens):
        sampled = i % 100 == 99  # comparing every state is O(states): a sample of the appends
        before = list(automaton._count) if sampled else []
        automaton.extend([token_id])
        if sampled:
            changed = sum(1 for old, new in zip(before, automaton._count) if old != new)
            most_changed = max(most_changed, changed)
    assert 0 < most_changed <= depth + 1
    assert automaton.path_counts() == substring_counts([tokens], depth)
