"""The global suffix tree in a child process answers as the in-process tree does, and never blocks a step."""

from __future__ import annotations

import functools
import os
import random
import signal
from collections.abc import Iterator

import pytest

from services.engine.spec_decode.suffix import SuffixConfig, SuffixProposer
from services.engine.spec_decode.suffix_process import ProcessGlobalIndex
from services.engine.spec_decode.suffix_tree import GlobalSuffixIndex

pytestmark = pytest.mark.timeout(60)

MAKE_INDEX = functools.partial(GlobalSuffixIndex, max_tree_depth=6, max_cached_requests=5)


@pytest.fixture(scope="module")
def remote() -> Iterator[ProcessGlobalIndex]:
    index = ProcessGlobalIndex(MAKE_INDEX, deadline_s=10.0)
    yield index
    index.close()


def random_tokens(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(4) for _ in range(length)]


@pytest.mark.parametrize("seed", range(3))
def test_look_ups_equal_the_in_process_index_after_adds_and_evictions(
    remote: ProcessGlobalIndex, seed: int
) -> None:
    rng = random.Random(seed)
    local = MAKE_INDEX()
    for i in range(8):  # more than max_cached_requests: the oldest are evicted on both sides
        seq_id, token_ids = f"s{seed}-{i % 6}", random_tokens(rng, rng.randint(1, 40))
        local.add_sequence(seq_id, token_ids)
        remote.add_sequence(seq_id, token_ids)
    remote.flush()
    queries = [(random_tokens(rng, rng.randint(1, 8)), rng.randint(0, 5)) for _ in range(30)]
    assert remote.speculate_batch(queries) == local.speculate_batch(queries)


def test_a_late_look_up_answers_none_and_the_next_one_its_own_answer() -> None:
    index = ProcessGlobalIndex(MAKE_INDEX, deadline_s=0.2)
    try:
        index.add_sequence("s", [1, 2, 3, 1, 2, 4])
        index.flush()
        pid = index._process.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # the child cannot answer in time
        try:
            assert index.speculate_batch([([1, 2], 3), ([3], 2)]) == [None, None]
        finally:
            os.kill(pid, signal.SIGCONT)
        index.deadline_s = 10.0
        expected = MAKE_INDEX()
        expected.add_sequence("s", [1, 2, 3, 1, 2, 4])
        assert index.speculate_batch([([3, 1], 2)]) == expected.speculate_batch([([3, 1], 2)])
    finally:
        index.close()


def test_the_child_stops_when_the_index_is_closed() -> None:
    index = ProcessGlobalIndex(MAKE_INDEX)
    index.close()
    assert not index._process.is_alive()
    with pytest.raises(ValueError, match="deadline_s"):
        ProcessGlobalIndex(MAKE_INDEX, deadline_s=0)


def test_a_proposer_drafts_the_same_with_the_tree_in_a_child_process() -> None:
    """Requests that finish feed the tree, later ones draft from it: every draft equals the one a
    proposer with the tree in process makes (the child is flushed before each step, so both trees
    hold the same outputs), and some differ from those of a proposer without a global tree."""
    rng = random.Random(7)
    config = SuffixConfig(max_tree_depth=8, max_cached_requests=4)
    remote = ProcessGlobalIndex(config.global_index, deadline_s=10.0)
    try:
        proposers = [
            SuffixProposer(config),
            SuffixProposer(config, remote),
            SuffixProposer(SuffixConfig(max_tree_depth=8, max_cached_requests=0)),
        ]
        shared_output = random_tokens(rng, 30)
        num_from_global = 0
        for r in range(6):
            request_id, token_ids = f"r{r}", random_tokens(rng, 5)
            for proposer in proposers:
                proposer.start_request(request_id, token_ids)
            for token_id in shared_output[: rng.randint(10, 30)] + random_tokens(rng, 5):
                remote.flush()
                in_process, in_child, own_only = (
                    p.propose_batch([(request_id, token_ids, 4)]) for p in proposers
                )
                assert in_child == in_process
                num_from_global += in_child != own_only
                token_ids = token_ids + [token_id]
                for proposer in proposers:
                    proposer.add_tokens(request_id, [token_id])
            for proposer in proposers:
                proposer.stop_request(request_id)
        assert num_from_global > 0
    finally:
        remote.close()
