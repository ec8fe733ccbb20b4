"""The input ids of a step: a slice of the sequence's tokens then its drafts, for every slice."""

from __future__ import annotations

from services.engine.model_runner import token_span
from services.engine.sequence import Sequence
from shared.sampling_params import SamplingParams


def test_every_slice_of_tokens_then_drafts() -> None:
    seq = Sequence("r", [10, 11, 12], SamplingParams(), frozenset())
    seq.append_token(13)
    seq.spec.draft_token_ids = [20, 21, 22]
    joined = seq.token_ids + seq.spec.draft_token_ids
    for start in range(len(joined) + 1):
        for end in range(start, len(joined) + 1):
            assert token_span(seq, start, end) == joined[start:end], (start, end)


def test_without_drafts() -> None:
    seq = Sequence("r", [1, 2, 3, 4], SamplingParams(), frozenset())
    assert token_span(seq, 3, 4) == [4]
    assert token_span(seq, 0, 4) == [1, 2, 3, 4]
    assert token_span(seq, 4, 4) == []
