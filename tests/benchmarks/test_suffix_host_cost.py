"""The suffix host-cost replay verifies drafts as greedy verification does and times every step."""

from __future__ import annotations

import pytest

from benchmarks.suffix_host_cost import accepted_tokens, device_replay, drafter_replay, replay


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


@pytest.mark.parametrize("feed", ["window", "thread"])
def test_device_replay_times_each_step_and_drafts_as_the_plain_replay(feed: str) -> None:
    """Around an emulated device long enough for the window's (or the thread's) indexing, the
    replay drafts what the plain replay does, the second request drafting from the first's output
    in the global tree, and books every step's parts."""
    span = [11, 12, 13, 14, 15, 16, 17, 18]
    streams = [([40 + i for i in range(10)] + span, span * 4), ([50 + i for i in range(10)] + span, span * 4)]
    plain = replay(streams, concurrency=1, k=8, prepare=True, warm_global=False)
    times = device_replay(streams, concurrency=1, k=8, device_s=0.2, feed=feed, lock_releases=2)
    assert (times.num_accepted, times.num_drafted) == (plain.num_accepted, plain.num_drafted)
    assert len(times.after_s) == len(times.overrun_s) == len(times.wake_s) == len(plain.own_s)
    assert min(times.after_s + times.overrun_s + times.wake_s) >= 0.0


def test_drafter_replay_times_each_step_and_drafts_only_where_the_controller_probes() -> None:
    """The drafter's host work a step: naive and suffix paused never draft; suffix kept at k = 0
    drafts only on probe steps, far fewer request-steps than it runs; every step is booked."""
    span = [11, 12, 13, 14, 15, 16, 17, 18]
    streams = [(span * 3, span * 6), ([40 + i for i in range(10)] + span, span * 6)]
    runs = {mode: drafter_replay(streams, 2, mode) for mode in ("naive", "suffix-paused", "suffix-kept")}
    assert runs["naive"].num_drafted_steps == runs["suffix-paused"].num_drafted_steps == 0
    assert 0 < runs["suffix-kept"].num_drafted_steps < len(runs["suffix-kept"].host_s)
    for times in runs.values():
        assert len(times.host_s) == len(times.finish_s) and min(times.host_s) >= 0.0
    assert len(runs["naive"].idle_s) == len(runs["naive"].host_s)
