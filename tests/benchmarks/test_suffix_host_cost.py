"""The suffix host-cost replay verifies drafts as greedy verification does and times every step."""

from __future__ import annotations

import pytest

from benchmarks.suffix_host_cost import accepted_tokens, replay


def test_greedy_verification_keeps_the_matching_drafts_and_one_token() -> None:
    output = [5, 6, 7, 8, 9]
    assert accepted_tokens([5, 6, 0], output, 0) == [5, 6, 7]  # two accepted, then the output's own
    assert accepted_tokens([], output, 2) == [7]
    assert accepted_tokens([8, 9, 1], output, 3) == [8, 9]  # the output ends: nothing after it


@pytest.mark.parametrize("prepare", [False, True])
def test_replay_drafts_repeated_text_and_times_each_step(prepare: bool) -> None:
    span = [11, 12, 13, 14, 15, 16, 17, 18]
    streams = [(span * 3, span * 4), ([40 + i for i in range(10)] + span, span * 2)]
    times = replay(streams, concurrency=2, k=8, prepare=prepare, warm_global=False)
    num_output_tokens = sum(len(out) for _, out in streams)
    assert 0 < times.num_accepted <= times.num_drafted
    assert len(times.own_s) < num_output_tokens  # accepted drafts save steps
    assert len(times.own_s) == len(times.global_s) == len(times.insert_s)
    assert min(times.own_s + times.global_s + times.insert_s) >= 0.0
    warm = replay(streams, concurrency=2, k=8, prepare=prepare, warm_global=True)
    assert warm.num_accepted > times.num_accepted  # the second request now finds the first's output
