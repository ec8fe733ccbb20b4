"""SuffixDecoding: tree counts equal brute-force substring counts, drafts equal a plain reference."""

from __future__ import annotations

import gc
import math
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from services.engine.spec_decode import suffix
from services.engine.spec_decode.suffix import DeferredGlobalIndex, SuffixConfig, SuffixProposer
from services.engine.spec_decode.suffix_automaton import SuffixAutomaton
from services.engine.spec_decode.suffix_tree import (
    GlobalSuffixIndex,
    IndexedSequence,
    SuffixDraft,
    SuffixTree,
)

Path = tuple[int, ...]


def substring_counts(seqs: list[list[int]], depth: int) -> dict[Path, int]:
    """Occurrences of every substring of 1..depth tokens."""
    counts: Counter[Path] = Counter()
    for seq in seqs:
        for start in range(len(seq)):
            for stop in range(start + 1, min(start + depth, len(seq)) + 1):
                counts[tuple(seq[start:stop])] += 1
    return dict(counts)


def reference_draft(
    counts: dict[Path, int], context: list[int], depth: int, k: int, factor: float, min_prob: float
) -> tuple[list[int], float]:
    """Greedy draft from every matching suffix; the best score wins, the longer match on ties."""
    best: tuple[list[int], float] = ([], 0.0)
    for m in range(min(len(context), depth), 0, -1):
        path = tuple(context[-m:])
        if path not in counts:
            continue
        token_ids, score = greedy_from(counts, path, depth, min(k, math.floor(factor * m)), min_prob)
        if score > best[1]:
            best = (token_ids, score)
    return best


def greedy_from(
    counts: dict[Path, int], path: Path, depth: int, max_len: int, min_prob: float
) -> tuple[list[int], float]:
    token_ids: list[int] = []
    cum_prob, score = 1.0, 0.0
    while len(token_ids) < max_len and len(path) < depth:
        children = {p[-1]: c for p, c in counts.items() if len(p) == len(path) + 1 and p[:-1] == path}
        if not children:
            break
        token_id = min(children, key=lambda t: (-children[t], t))
        cum_prob *= children[token_id] / counts[path]
        if cum_prob < min_prob:
            break
        token_ids.append(token_id)
        score += cum_prob
        path += (token_id,)
    return token_ids, score


def random_seq(rng: random.Random, vocab: int, max_len: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(rng.randint(1, max_len))]


def occurs_in(needle: list[int], seqs: list[list[int]]) -> bool:
    n = len(needle)
    return any(seq[i : i + n] == needle for seq in seqs for i in range(len(seq) - n + 1))


# --- the tree against brute force ---


@pytest.mark.parametrize("seed", range(8))
def test_counts_equal_brute_force_under_chunked_growth(seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.randint(1, 6)
    tree = SuffixTree(depth)
    seqs = [random_seq(rng, vocab=3, max_len=30) for _ in range(3)]
    for i, tokens in enumerate(seqs):
        seq = tree.new_sequence()
        while len(seq.token_ids) < len(tokens):
            chunk = rng.randint(1, 5)
            tree.extend(seq, tokens[len(seq.token_ids) : len(seq.token_ids) + chunk])
            assert tree.path_counts() == substring_counts([*seqs[:i], seq.token_ids], depth)
    assert tree.num_tokens == sum(map(len, seqs))


@pytest.mark.parametrize("seed", range(8))
def test_removal_is_exact(seed: int) -> None:
    rng = random.Random(seed)
    index = GlobalSuffixIndex(max_tree_depth=rng.randint(1, 6), max_cached_requests=100)
    live: dict[str, list[int]] = {}
    for step in range(30):
        if live and rng.random() < 0.4:
            seq_id = rng.choice(sorted(live))
            assert index.remove_sequence(seq_id)
            del live[seq_id]
        else:
            live[f"r{step}"] = random_seq(rng, vocab=3, max_len=20)
            index.add_sequence(f"r{step}", live[f"r{step}"])
        assert index.tree.path_counts() == substring_counts(list(live.values()), index.tree.max_depth)
    for seq_id in list(live):
        index.remove_sequence(seq_id)
    assert index.tree.path_counts() == {} and index.tree.num_tokens == 0 == index.tree.num_nodes


@pytest.mark.parametrize("seed", range(10))
def test_drafts_equal_reference_and_occur_in_data(seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.randint(2, 7)
    seqs = [random_seq(rng, vocab=3, max_len=25) for _ in range(4)]
    index = GlobalSuffixIndex(max_tree_depth=depth, max_cached_requests=10)
    for i, seq in enumerate(seqs):
        index.add_sequence(f"r{i}", seq)
    counts = substring_counts(seqs, depth)
    for _ in range(20):
        context = random_seq(rng, vocab=3, max_len=10)
        k, factor, min_prob = rng.randint(0, 6), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.4])
        draft = index.speculate(context, k, factor, min_prob)
        assert (draft.token_ids, draft.score) == reference_draft(counts, context, depth, k, factor, min_prob)
        if draft.token_ids:
            matched = context[len(context) - draft.match_len :]
            assert occurs_in(matched + draft.token_ids, seqs)
            assert draft.match_len + len(draft.token_ids) <= depth
            for i, prob in enumerate(draft.probs):
                path = tuple(matched + draft.token_ids[:i])
                assert prob == counts[path + (draft.token_ids[i],)] / counts[path]


@pytest.mark.parametrize("seed", range(6))
def test_request_tree_drafts_equal_matching_from_scratch(seed: int) -> None:
    """The kept active suffixes give the same draft as matching the whole context anew."""
    rng = random.Random(seed)
    depth = rng.randint(2, 8)
    tree = SuffixTree(depth)
    seq = tree.new_sequence()
    for _ in range(40):
        tree.extend(seq, [rng.randrange(3)])
        args = (rng.randint(1, 6), 1.0, 0.1)
        draft = tree.speculate_sequence(seq, *args)
        assert draft == tree.speculate(seq.token_ids, *args)
        counts = substring_counts([seq.token_ids], depth)
        assert (draft.token_ids, draft.score) == reference_draft(counts, seq.token_ids, depth, *args)


@pytest.mark.parametrize("seed", range(6))
def test_draft_length_is_bounded(seed: int) -> None:
    rng = random.Random(seed)
    index = GlobalSuffixIndex(max_tree_depth=16)
    for i in range(5):
        index.add_sequence(f"r{i}", random_seq(rng, vocab=2, max_len=60))
    for _ in range(50):
        k, factor = rng.randint(0, 10), rng.uniform(0.1, 3.0)
        draft = index.speculate(random_seq(rng, vocab=2, max_len=20), k, factor, min_token_prob=0.0)
        assert len(draft.token_ids) <= min(k, math.floor(factor * draft.match_len))
        assert len(draft.token_ids) == len(draft.probs)


def test_min_token_prob_prunes_rare_continuations() -> None:
    index = GlobalSuffixIndex(max_tree_depth=8)
    index.add_sequence("a", [1, 2, 3, 4])
    index.add_sequence("b", [1, 2, 3, 5])
    for i in range(8):
        index.add_sequence(f"other{i}", [1, 2, 10 + i])
    # count(1 2) = 10, count(1 2 3) = 2: the best continuation has probability 0.2
    assert index.speculate([1, 2], 4, 2.0, min_token_prob=0.25).token_ids == []
    draft = index.speculate([1, 2], 4, 2.0, min_token_prob=0.15)
    # then 4 and 5 tie at 1/2: the cumulative probability 0.1 is below 0.15, so the draft stops
    assert draft.token_ids == [3] and draft.probs == [0.2]
    assert index.speculate([1, 2], 4, 2.0, min_token_prob=0.1).token_ids == [3, 4]


def test_eviction_forgets_the_oldest_request_exactly() -> None:
    requests = {"r1": [7, 8, 9, 1, 2], "r2": [3, 4, 5, 1, 2], "r3": [3, 4, 6, 7, 8]}
    index = GlobalSuffixIndex(max_tree_depth=4, max_cached_requests=2)
    for seq_id, tokens in requests.items():
        index.add_sequence(seq_id, tokens)
        if seq_id == "r1":
            assert index.speculate([7, 8], 3).token_ids == [9, 1]
    assert "r1" not in index and len(index) == 2
    assert index.speculate([7, 8], 3).token_ids == []
    reference = GlobalSuffixIndex(max_tree_depth=4)
    reference.add_sequence("r2", requests["r2"])
    reference.add_sequence("r3", requests["r3"])
    assert index.tree.path_counts() == reference.tree.path_counts()
    assert index.tree.num_tokens == reference.tree.num_tokens


# --- the proposer ---


def test_request_drafts_its_own_repetition() -> None:
    proposer = SuffixProposer()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    proposer.start_request("r", prompt)
    proposer.add_tokens("r", [9, 1, 2, 3])
    draft = proposer.propose_draft("r", prompt + [9, 1, 2, 3], max_spec_tokens=8)
    assert draft.match_len == 3 and draft.token_ids == [4, 5, 6]
    assert draft.probs == [0.5, 1.0, 1.0]  # (1 2 3) occurs twice, once followed by 4
    assert proposer.propose_one("r", prompt + [9, 1, 2, 3], max_spec_tokens=2) == [4, 5]


def test_second_request_drafts_from_a_finished_request() -> None:
    proposer = SuffixProposer()
    proposer.start_request("first", [100, 101])
    proposer.add_tokens("first", [7, 8, 9, 10, 11, 12])
    proposer.start_request("second", [50, 7, 8, 9])
    assert proposer.propose_one("second", [50, 7, 8, 9], 5) == []  # outputs are shared once finished
    proposer.stop_request("first")
    assert proposer.propose_one("second", [50, 7, 8, 9], 5) == [10, 11, 12]
    assert proposer.propose_one("second", [50, 7, 8, 9], 2) == [10, 11]


def test_prompts_are_shared_only_when_asked() -> None:
    for cache_prompts, expected in [(False, []), (True, [4])]:
        proposer = SuffixProposer(SuffixConfig(cache_prompts=cache_prompts))
        proposer.start_request("a", [1, 2, 3, 4])
        proposer.add_tokens("a", [5])
        proposer.stop_request("a")
        proposer.start_request("b", [2, 3])
        assert proposer.propose_one("b", [2, 3], 1) == expected


def test_zero_cached_requests_disables_the_global_tree() -> None:
    proposer = SuffixProposer(SuffixConfig(max_cached_requests=0))
    proposer.start_request("a", [1])
    proposer.add_tokens("a", [2, 3, 4])
    proposer.stop_request("a")
    proposer.start_request("b", [2, 3])
    assert len(proposer.global_index) == 0
    assert proposer.propose_one("b", [2, 3], 2) == []


def test_tokens_passed_to_propose_are_indexed_once() -> None:
    """Feeding outputs through `add_tokens` or only through `propose` builds the same tree."""
    rng = random.Random(0)
    tokens = random_seq(rng, vocab=3, max_len=40)
    fed, caught_up = SuffixProposer(), SuffixProposer()
    for proposer in (fed, caught_up):
        proposer.start_request("r", tokens[:5])
    for n in range(6, len(tokens) + 1):
        fed.add_tokens("r", tokens[n - 1 : n])
        assert fed.propose_one("r", tokens[:n], 4) == caught_up.propose_one("r", tokens[:n], 4)
    assert request_tree(fed, "r").path_counts() == request_tree(caught_up, "r").path_counts()
    with pytest.raises(ValueError, match="already indexed"):
        fed.propose_one("r", tokens[:3], 4)


def test_propose_batch_and_request_lifecycle() -> None:
    proposer = SuffixProposer()
    proposer.start_request("a", [1, 2, 1, 2, 1])
    proposer.start_request("b", [5, 6])
    assert proposer.propose_batch([("a", [1, 2, 1, 2, 1], 2), ("b", [5, 6], 2)]) == [[2, 1], []]
    with pytest.raises(ValueError, match="already started"):
        proposer.start_request("a", [])
    proposer.stop_request("a")
    proposer.stop_request("a")  # stopping twice is harmless
    with pytest.raises(KeyError):
        proposer.propose_one("a", [1], 2)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tree_depth", 0),
        ("max_cached_requests", -1),
        ("max_spec_factor", 0.0),
        ("min_token_prob", -0.1),
        ("min_token_prob", 1.5),
    ],
)
def test_bad_config_names_the_field(field: str, value: float) -> None:
    kwargs: dict[str, Any] = {field: value}
    with pytest.raises(ValueError, match=field):
        SuffixConfig(**kwargs)


def test_negative_max_spec_tokens_is_rejected() -> None:
    proposer = SuffixProposer()
    proposer.start_request("r", [1, 2])
    with pytest.raises(ValueError, match="max_spec_tokens"):
        proposer.propose_one("r", [1, 2], -1)


# --- the global index behind an interface ---


class RecordingIndex:
    """A `GlobalIndex` that answers from a local index, or not at all, and records each call."""

    def __init__(self, answer: bool = True, local: GlobalSuffixIndex | None = None) -> None:
        self.local = local or GlobalSuffixIndex(max_tree_depth=4)
        self.answer = answer
        self.calls: list[list[tuple[list[int], int]]] = []
        self.added: list[tuple[str, list[int]]] = []

    def add_sequence(self, seq_id: str, token_ids: list[int]) -> None:
        self.added.append((seq_id, list(token_ids)))
        self.local.add_sequence(seq_id, token_ids)

    def speculate_batch(self, queries: list[tuple[list[int], int]]) -> list[SuffixDraft | None]:
        self.calls.append(queries)
        return self.local.speculate_batch(queries) if self.answer else [None] * len(queries)


def test_the_global_index_is_asked_once_per_step_for_requests_it_could_improve() -> None:
    index = RecordingIndex()
    proposer = SuffixProposer(SuffixConfig(max_tree_depth=4), index)
    proposer.start_request("done", [0])
    proposer.add_tokens("done", [7, 8, 9, 10])
    proposer.stop_request("done")
    assert list(index.local._sequences) == ["done"]
    proposer.start_request("repeats", [1, 2, 1, 2, 1])
    proposer.start_request("fresh", [30, 31, 32, 33, 6, 7, 8])
    drafts = proposer.propose_batch(
        [("repeats", [1, 2, 1, 2, 1], 2), ("fresh", [30, 31, 32, 33, 6, 7, 8], 3)]
    )
    assert drafts == [[2, 1], [9, 10]]
    # one call for the batch, each context cut to the max_tree_depth tokens a match can use
    assert index.calls == [[([2, 1, 2, 1], 2), ([33, 6, 7, 8], 3)]]
    # k = 0: nothing to improve on, nothing asked
    assert proposer.propose_batch([("repeats", [1, 2, 1, 2, 1], 0)]) == [[]]
    assert len(index.calls) == 1


def test_without_a_global_answer_requests_draft_from_their_own_tree() -> None:
    index = RecordingIndex(answer=False)
    proposer = SuffixProposer(SuffixConfig(max_tree_depth=4), index)
    proposer.start_request("done", [0])
    proposer.add_tokens("done", [7, 8, 9])
    proposer.stop_request("done")
    proposer.start_request("r", [5, 7, 8, 5, 7])
    assert proposer.propose_one("r", [5, 7, 8, 5, 7], 3) == [8, 5]
    index.answer = True
    assert proposer.propose_one("r", [5, 7, 8, 5, 7], 3) == [
        8,
        5,
    ]  # own: [8 5] scores 2 > global [8] scores 1
    assert proposer.propose_batch([("r", [5, 7, 8, 5, 7, 8], 3)]) == [[5, 7]]
    assert len(index.calls) == 3


def test_a_given_empty_index_is_used_and_zero_cached_requests_bypasses_it() -> None:
    given = GlobalSuffixIndex(max_tree_depth=8)
    proposer = SuffixProposer(global_index=given)
    assert proposer.global_index is given
    proposer.start_request("a", [1])
    proposer.add_tokens("a", [2, 3])
    proposer.stop_request("a")
    assert "a" in given
    bypassed = RecordingIndex()
    proposer = SuffixProposer(SuffixConfig(max_cached_requests=0), bypassed)
    proposer.start_request("a", [1])
    proposer.add_tokens("a", [2, 3])
    proposer.stop_request("a")
    proposer.start_request("b", [2])
    assert proposer.propose_one("b", [2], 2) == [] and bypassed.calls == [] and len(bypassed.local) == 0


@pytest.mark.parametrize("seed", range(4))
def test_speculate_batch_uses_the_index_limits(seed: int) -> None:
    rng = random.Random(seed)
    factor, min_prob = rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.4])
    index = GlobalSuffixIndex(max_tree_depth=6, max_spec_factor=factor, min_token_prob=min_prob)
    for i in range(4):
        index.add_sequence(f"r{i}", random_seq(rng, vocab=3, max_len=25))
    queries = [(random_seq(rng, vocab=3, max_len=10), rng.randint(0, 6)) for _ in range(10)]
    expected = [index.tree.speculate(context, k, factor, min_prob) for context, k in queries]
    assert index.speculate_batch(queries) == expected
    assert [index.speculate(context, k) for context, k in queries] == expected
    with pytest.raises(ValueError, match="max_spec_factor"):
        GlobalSuffixIndex(max_spec_factor=0.0)


def count_nodes(tree: SuffixTree) -> int:
    stack, count = [0], -1  # the root (node 0) is not counted
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(tree.children(node).values())
    return count


@pytest.mark.parametrize("seed", range(8))
def test_node_count_follows_adds_and_removals(seed: int) -> None:
    rng = random.Random(seed)
    index = GlobalSuffixIndex(max_tree_depth=rng.randint(1, 6), max_cached_requests=4)
    for step in range(40):
        if rng.random() < 0.2 and len(index):
            index.remove_sequence(rng.choice(sorted(index._sequences)))
        else:
            index.add_sequence(f"r{rng.randrange(8)}", random_seq(rng, vocab=3, max_len=20))
        assert index.tree.num_nodes == count_nodes(index.tree), step


def test_the_global_tree_holds_no_garbage_collected_object_per_node() -> None:
    """The global tree's nodes are ints in lists and int dicts, which the cyclic garbage collector
    does not track: indexing thousands of tokens adds a few tracked objects per sequence, so full
    collections do not walk the tree (an object per node paused engine steps for tens of ms)."""
    rng = random.Random(0)
    outputs = [copied_seq(rng, []) * 8 for _ in range(20)]
    index = GlobalSuffixIndex(max_tree_depth=16, max_cached_requests=30)
    gc.collect()
    before = len(gc.get_objects())
    for i, tokens in enumerate(outputs):
        index.add_sequence(f"r{i}", tokens)
    gc.collect()
    assert index.tree.num_nodes > 1000
    assert len(gc.get_objects()) - before <= 5 * len(outputs)
    for i in range(len(outputs)):  # removed nodes are reused, not leaked
        index.remove_sequence(f"r{i}")
    assert index.tree.num_nodes == 0 and index.tree.path_counts() == {}
    num_ids = len(index.tree._count)
    for i, tokens in enumerate(outputs):
        index.add_sequence(f"r{i}", tokens)
    assert len(index.tree._count) == num_ids


# --- per-request trees built at the first draft ---


def request_tree(proposer: SuffixProposer, request_id: str) -> SuffixAutomaton:
    index = proposer._requests[request_id].index
    assert index is not None, f"{request_id} has no tree"
    return index


class EagerSuffixProposer(SuffixProposer):
    """The reference: every request's tree built at its start and extended on every token, as
    before trees were built lazily; the global look-up (`propose_drafts`) is the proposer's own."""

    def __init__(self, config: SuffixConfig, global_index: RecordingIndex) -> None:
        super().__init__(config, global_index)
        self.eager: dict[str, tuple[SuffixTree, IndexedSequence, int]] = {}

    def start_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        tree = SuffixTree(self.config.max_tree_depth)
        seq = tree.new_sequence()
        tree.extend(seq, prompt_token_ids)
        self.eager[request_id] = (tree, seq, len(prompt_token_ids))

    def add_tokens(self, request_id: str, token_ids: list[int]) -> None:
        tree, seq, _ = self.eager[request_id]
        tree.extend(seq, token_ids)

    def stop_request(self, request_id: str) -> None:
        _, seq, num_prompt_tokens = self.eager.pop(request_id)
        token_ids = seq.token_ids if self.config.cache_prompts else seq.token_ids[num_prompt_tokens:]
        if token_ids and self.config.max_cached_requests:
            self.global_index.add_sequence(request_id, token_ids)

    def _request_draft(self, request_id: str, token_ids: list[int], max_spec_tokens: int) -> SuffixDraft:
        tree, seq, _ = self.eager[request_id]
        tree.extend(seq, token_ids[len(seq.token_ids) :])
        cfg = self.config
        return tree.speculate_sequence(seq, max_spec_tokens, cfg.max_spec_factor, cfg.min_token_prob)


def lazy_and_eager(config: SuffixConfig) -> tuple[SuffixProposer, EagerSuffixProposer]:
    def index() -> RecordingIndex:
        return RecordingIndex(local=GlobalSuffixIndex(config.max_tree_depth, config.max_cached_requests))

    return SuffixProposer(config, index()), EagerSuffixProposer(config, index())


def recorded(proposer: SuffixProposer) -> RecordingIndex:
    assert isinstance(proposer.global_index, RecordingIndex)
    return proposer.global_index


@pytest.mark.parametrize("seed", range(12))
def test_lazy_trees_draft_exactly_as_eager_ones(seed: int) -> None:
    """Random interleavings of start / add / propose (k often 0, or the request left out) / stop:
    every draft, and everything the global index receives, equals the eager reference's."""
    rng = random.Random(seed)
    config = SuffixConfig(
        max_tree_depth=rng.randint(1, 8),
        max_cached_requests=rng.choice([0, 3, 100]),
        max_spec_factor=rng.choice([0.5, 1.0, 2.0]),
        min_token_prob=rng.choice([0.0, 0.1, 0.4]),
        cache_prompts=rng.random() < 0.5,
    )
    lazy, eager = lazy_and_eager(config)
    vocab = rng.randint(2, 5)
    tokens: dict[str, list[int]] = {}
    """Each live request's prompt and output; tokens past `add_tokens` reach the proposer via propose."""
    for step in range(300):
        op = rng.random()
        if op < 0.1 or not tokens:
            request_id = f"r{step}"
            tokens[request_id] = random_seq(rng, vocab, max_len=20)[: rng.randint(0, 20)]
            for proposer in (lazy, eager):
                proposer.start_request(request_id, list(tokens[request_id]))
        elif op < 0.5:
            request_id = rng.choice(sorted(tokens))
            new = random_seq(rng, vocab, max_len=4)
            tokens[request_id] += new
            if rng.random() < 0.8:  # else the tokens come with the next propose
                for proposer in (lazy, eager):
                    proposer.add_tokens(request_id, new)
        elif op < 0.92:
            batch = [
                (request_id, list(token_ids), rng.choice([0, 0, 1, 2, 3, 6]))
                for request_id, token_ids in tokens.items()
                if rng.random() < 0.3
            ]
            assert lazy.propose_drafts(batch) == eager.propose_drafts(batch), step
        else:
            request_id = rng.choice(sorted(tokens))
            for proposer in (lazy, eager):
                proposer.stop_request(request_id)
            del tokens[request_id]
            assert recorded(lazy).added == recorded(eager).added, step
    for request_id in tokens:
        for proposer in (lazy, eager):
            proposer.stop_request(request_id)
    assert recorded(lazy).added == recorded(eager).added
    assert recorded(lazy).local.tree.path_counts() == recorded(eager).local.tree.path_counts()


@pytest.mark.parametrize("seed", range(6))
def test_requests_left_at_k0_draft_after_their_pause_as_eager_indexing_does(seed: int) -> None:
    """The engine's way: each request's index holds the sequence's own token list, which grows by
    a step's tokens with no proposer call while the request is left at k = 0 (drafting paused for
    runs of steps, or never worth it), and `prepare` runs at random between steps. Whenever a
    request drafts again, its draft equals that of an eager reference that indexed every token
    the step it came and was asked every step; the global index gets the same outputs."""
    from services.engine.sequence import Sequence
    from services.engine.spec_decode.proposer import DraftBatch
    from shared.sampling_params import SamplingParams

    rng = random.Random(seed)
    config = SuffixConfig(max_tree_depth=rng.choice([4, 8, 64]), max_cached_requests=100)
    lazy, eager = lazy_and_eager(config)
    vocab = rng.randint(2, 6)
    seqs: dict[str, Sequence] = {}
    paused_until: dict[str, int] = {}
    num_drafted = 0
    for step in range(200):
        if rng.random() < 0.08 or not seqs:
            seq = Sequence(f"r{step}", random_seq(rng, vocab, max_len=40), SamplingParams(), frozenset())
            seqs[seq.request_id] = seq
            lazy.start(seq)
            eager.start_request(seq.request_id, list(seq.token_ids))
            paused_until[seq.request_id] = step + rng.choice([0, 5, 30])
        for seq in seqs.values():
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
            seq.append_tokens(new)  # the engine's only write: no lazy proposer call
            eager.add_tokens(seq.request_id, new)
        if rng.random() < 0.3:
            lazy.prepare(looks(rng.randint(0, 4)))
        ks = {name: rng.choice([1, 4, 8]) for name in seqs}
        expected = eager.propose_drafts([(name, seqs[name].token_ids, k) for name, k in ks.items()])
        drafting = [name for name in seqs if step >= paused_until[name]]
        if drafting:
            batch = DraftBatch.on_host(None, [seqs[n] for n in drafting], [ks[n] for n in drafting])  # type: ignore[arg-type]
            drafts = lazy.propose(batch)
            got = [row[:n] for row, n in zip(drafts.token_ids.tolist(), drafts.num_drafts.tolist())]
            assert got == [expected[list(seqs).index(n)].token_ids for n in drafting], step
            num_drafted += sum(map(len, got))
        for name in [n for n in seqs if rng.random() < 0.03]:
            lazy.stop_request(name)
            eager.stop_request(name)
            del seqs[name]
            assert recorded(lazy).added == recorded(eager).added, step
        if rng.random() < 0.05:  # a pause of host drafting for every request
            paused_until = {name: step + rng.randint(1, 40) for name in seqs}
    assert num_drafted > 0


class CountingTree(SuffixAutomaton):
    built = 0

    def __init__(self, max_depth: int) -> None:
        super().__init__(max_depth)
        CountingTree.built += 1


def test_a_request_that_never_drafts_builds_no_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(suffix, "SuffixAutomaton", CountingTree)
    monkeypatch.setattr(CountingTree, "built", 0)
    proposer = SuffixProposer(SuffixConfig(max_tree_depth=4))
    prompts = {f"r{i}": [i, 1, 2, 1, 2] for i in range(8)}
    for request_id, prompt in prompts.items():
        proposer.start_request(request_id, prompt)
    for step in range(20):
        for request_id, token_ids in prompts.items():
            token_ids.append(step % 3)
            proposer.add_tokens(request_id, [step % 3])
        # k = 0 is what any tree drafts nothing for
        assert proposer.propose_batch([(r, t, 0) for r, t in prompts.items()]) == [[]] * len(prompts)
    assert CountingTree.built == 0
    assert all(state.index is None for state in proposer._requests.values())

    draft = proposer.propose_draft("r0", prompts["r0"], 3)
    counts = substring_counts([prompts["r0"]], 4)
    assert draft.token_ids and (draft.token_ids, draft.score) == reference_draft(
        counts, prompts["r0"], 4, 3, 1.0, 0.1
    )
    assert CountingTree.built == 1
    proposer.add_tokens("r0", [1])
    proposer.add_tokens("r1", [1])
    prompts["r0"].append(1)
    tree = request_tree(proposer, "r0")
    assert tree.num_tokens == len(prompts["r0"])  # built once, then kept up to date
    assert tree.path_counts() == substring_counts([prompts["r0"]], 4)
    assert proposer._requests["r1"].index is None and CountingTree.built == 1
    for request_id in prompts:
        proposer.stop_request(request_id)
    assert CountingTree.built == 1


@pytest.mark.parametrize("cache_prompts", [False, True])
def test_the_global_index_gets_each_output_at_stop_whether_or_not_it_drafted(cache_prompts: bool) -> None:
    config = SuffixConfig(max_tree_depth=4, cache_prompts=cache_prompts)
    lazy, eager = lazy_and_eager(config)
    for proposer in (lazy, eager):
        proposer.start_request("drafted", [1, 2, 3])
        proposer.start_request("never", [4, 5])
        proposer.add_tokens("drafted", [1, 2])
        proposer.add_tokens("never", [6, 4])
        proposer.propose_one("drafted", [1, 2, 3, 1, 2, 3], 2)  # the last 3 comes with the draft
        proposer.add_tokens("drafted", [7])
        proposer.add_tokens("never", [5])
        assert recorded(proposer).added == []  # nothing before a request stops
        proposer.stop_request("never")
        proposer.stop_request("drafted")
    prompts = {"never": [4, 5], "drafted": [1, 2, 3]} if cache_prompts else {"never": [], "drafted": []}
    assert recorded(lazy).added == [
        ("never", prompts["never"] + [6, 4, 5]),
        ("drafted", prompts["drafted"] + [1, 2, 3, 7]),
    ]
    assert recorded(lazy).added == recorded(eager).added


def looks(num_busy: int) -> Callable[[], bool]:
    """A device that is busy for the first `num_busy` looks."""
    left = [num_busy]

    def device_busy() -> bool:
        left[0] -= 1
        return left[0] >= 0

    return device_busy


@pytest.mark.parametrize("seed", range(3))
def test_deferred_global_index_inserts_while_the_device_is_busy(seed: int) -> None:
    """Finished outputs are only queued; each look at a busy device inserts a chunk of one, and
    a look that finds the device done stops. Once all are in, look-ups equal a synchronous
    index's, replacements and evictions included, and look-ups in between always answer."""
    rng = random.Random(seed)
    sync = GlobalSuffixIndex(max_tree_depth=6, max_cached_requests=3)
    deferred = DeferredGlobalIndex(GlobalSuffixIndex(max_tree_depth=6, max_cached_requests=3))
    sequences = [(f"s{rng.randrange(5)}", random_seq(rng, vocab=4, max_len=30)) for _ in range(7)]
    for seq_id, token_ids in sequences:
        sync.add_sequence(seq_id, token_ids)
        deferred.add_sequence(seq_id, token_ids)
    queries = [(random_seq(rng, vocab=4, max_len=8), 4) for _ in range(20)]
    assert len(deferred.index) == 0  # nothing inserted on the step that finished them
    deferred.index_while(looks(1))
    assert deferred.num_pending > 0 and len(deferred.index) == 0  # one chunk: the first output begun
    while deferred.num_pending:
        assert all(draft is not None for draft in deferred.speculate_batch(queries))
        deferred.index_while(looks(rng.randint(0, 3)))
    assert deferred.speculate_batch(queries) == sync.speculate_batch(queries)
    assert deferred.index.tree.path_counts() == sync.tree.path_counts()
    assert list(deferred.index._sequences) == list(sync._sequences)


def test_deferred_global_index_keeps_at_most_the_cached_requests_waiting() -> None:
    """More outputs waiting than the tree keeps: the oldest are dropped, and the tree ends as if
    all had been inserted (the dropped ones evicted)."""
    sync = GlobalSuffixIndex(max_cached_requests=2)
    deferred = DeferredGlobalIndex(GlobalSuffixIndex(max_cached_requests=2))
    for i in range(5):
        sync.add_sequence(f"s{i}", [i, 7, i, 8])
        deferred.add_sequence(f"s{i}", [i, 7, i, 8])
    assert deferred.num_pending == 2
    deferred.index_while(lambda: True)
    assert deferred.num_pending == 0
    assert deferred.index.tree.path_counts() == sync.tree.path_counts()
    assert "s4" in deferred and "s0" not in deferred


def test_prepare_feeds_a_deferred_global_index_beside_the_prompts() -> None:
    """The proposer's `prepare` (called while the device runs a step) indexes joined requests'
    prompts and inserts stopped requests' outputs into a deferred global index, alternately, a
    chunk per look at the device."""
    deferred = DeferredGlobalIndex(GlobalSuffixIndex())
    proposer = SuffixProposer(global_index=deferred)
    proposer.start_request("done", [1, 2, 3])
    proposer.add_tokens("done", [4, 5, 6, 4, 5, 6, 4, 5])
    proposer.stop_request("done")
    proposer.start_request("joined", [9] * 2 * suffix.PREPARE_CHUNK_TOKENS)
    proposer.prepare(looks(4))  # the prompt's two chunks, the output's two (of 4 tokens each)
    assert request_tree(proposer, "joined").num_tokens == 2 * suffix.PREPARE_CHUNK_TOKENS
    assert deferred.num_pending == 1 and "done" not in deferred
    proposer.prepare(looks(2))  # no prompt left; the insertion ends
    assert deferred.num_pending == 0 and "done" in deferred
    proposer.prepare(lambda: True)
    assert deferred.num_pending == 0 and "done" in deferred
    sync = GlobalSuffixIndex()
    sync.add_sequence("done", [4, 5, 6, 4, 5, 6, 4, 5])
    assert deferred.speculate_batch([([4, 5], 3)]) == sync.speculate_batch([([4, 5], 3)])


# --- prompts indexed while the device runs a step ---


def test_prepare_indexes_prompts_while_the_device_is_busy_and_drafts_do_not_change() -> None:
    """`prepare` indexes joined requests' tokens a chunk per look at the device, oldest first, and
    stops once the device is done; drafts then equal those of a proposer that never prepared, whose
    `propose` reports the prompts as context tokens where the prepared one reports only the outputs."""
    from services.engine.sequence import Sequence
    from services.engine.spec_decode.proposer import DraftBatch
    from shared.sampling_params import SamplingParams

    rng = random.Random(0)
    seqs = {
        name: Sequence(name, [rng.randrange(6) for _ in range(150)], SamplingParams(), frozenset())
        for name in ("first", "second")
    }
    prepared, plain = SuffixProposer(), SuffixProposer()
    for proposer in (prepared, plain):
        for seq in seqs.values():
            proposer.start(seq)
    prepared.prepare(looks(-(-150 // suffix.PREPARE_CHUNK_TOKENS)))  # the first prompt whole, no more
    first, second = (prepared._requests[name].index for name in seqs)
    assert first is not None and first.num_tokens == 150 and second is None
    prepared.prepare(lambda: False)
    assert prepared._requests["second"].index is None
    prepared.prepare(lambda: True)
    assert all(prepared._requests[name].index is not None for name in seqs)

    num_outputs = 0
    for step in range(12):
        new = {name: [rng.randrange(6) for _ in range(rng.randint(1, 4))] for name in seqs}
        for name, seq in seqs.items():
            seq.token_ids += new[name]
            num_outputs += len(new[name])
        batch = DraftBatch.on_host(None, list(seqs.values()), [4, 4])  # type: ignore[arg-type]
        drafts, reference = prepared.propose(batch), plain.propose(batch)
        assert drafts.token_ids.tolist() == reference.token_ids.tolist(), step
        assert drafts.num_context_tokens == sum(map(len, new.values()))
        assert reference.num_context_tokens == drafts.num_context_tokens + (300 if step == 0 else 0)
    assert num_outputs > 0
    for name in seqs:
        prepared.stop_request(name)
    assert not prepared._unprepared and not prepared._requests  # nothing kept for stopped requests


def test_prepare_skips_requests_that_stopped() -> None:
    proposer = SuffixProposer()
    proposer.start_request("gone", [1, 2, 3])
    proposer.start_request("kept", [4, 5, 6])
    proposer.stop_request("gone")
    proposer.prepare(lambda: True)
    assert request_tree(proposer, "kept").num_tokens == 3
    assert "gone" not in proposer._requests


@pytest.mark.parametrize("seed", range(4))
def test_a_sequence_added_in_chunks_is_the_one_added_whole(seed: int) -> None:
    """The background index inserts a chunk at a time, with look-ups in between: the tree it ends
    with (replacements and evictions included) is the one whole insertions make."""
    rng = random.Random(seed)
    whole = GlobalSuffixIndex(max_tree_depth=5, max_cached_requests=3)
    chunked = GlobalSuffixIndex(max_tree_depth=5, max_cached_requests=3)
    for i in range(8):
        tokens = random_seq(rng, vocab=3, max_len=40)
        whole.add_sequence(f"r{i % 4}", tokens)
        pauses = 0
        for _ in chunked.add_sequence_steps(f"r{i % 4}", tokens, 7):
            pauses += 1
            chunked.speculate(random_seq(rng, vocab=3, max_len=6), 3)
        assert pauses == -(-len(tokens) // 7)
        assert chunked.tree.path_counts() == whole.tree.path_counts()
        assert list(chunked._sequences) == list(whole._sequences)
    with pytest.raises(ValueError, match="chunk_tokens"):
        next(chunked.add_sequence_steps("r9", [1], 0))


def drafts_matching_from_the_root(
    tree: SuffixTree, context: list[int], k: int, factor: float, min_prob: float
) -> SuffixDraft:
    """The best draft, every match length's node found from the root and every one grown."""
    context = context[-tree.max_depth :]
    best = SuffixDraft()
    longest = max(m for m in range(len(context) + 1) if tree.find(context[-m:] if m else []) is not None)
    for m in range(longest, 0, -1):
        max_len = min(k, math.floor(factor * m))
        if max_len <= best.score:
            break
        node = tree.find(context[-m:])
        assert node is not None
        draft = tree._grow_draft(node, m, max_len, min_prob)
        if draft.score > best.score:
            best = draft
    return best


def copied_seq(rng: random.Random, earlier: list[list[int]]) -> list[int]:
    """A random sequence that copies spans of earlier ones (long matches, repeated counts)."""
    tokens = random_seq(rng, vocab=4, max_len=10)
    while len(tokens) < rng.randint(10, 60):
        if earlier and rng.random() < 0.7:
            source = rng.choice(earlier)
            start = rng.randrange(len(source))
            tokens += source[start : start + rng.randint(1, 20)]
        else:
            tokens.append(rng.randrange(4))
    return tokens


@pytest.mark.parametrize("seed", range(12))
def test_suffix_links_find_every_match_and_draft_as_matching_from_the_root(seed: int) -> None:
    """Under random adds (in chunks, looked up between them), removals and evictions, the shorter
    matches reached by suffix links are the nodes `find` gives, and drafts (shorter matches of
    equal count not grown) equal those that grow every match found from the root."""
    rng = random.Random(seed)
    index = GlobalSuffixIndex(max_tree_depth=rng.randint(3, 16), max_cached_requests=rng.randint(2, 6))
    tree = index.tree
    live: list[list[int]] = []

    def check() -> None:
        for _ in range(10):
            context = copied_seq(rng, live)[-rng.randint(1, 30) :]
            k, factor, min_prob = rng.randint(1, 8), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.4])
            trimmed = context[-tree.max_depth :]
            longest = max(
                m for m in range(len(trimmed) + 1) if tree.find(trimmed[-m:] if m else []) is not None
            )
            assert tree.longest_match(trimmed) == tree.longest_match(context) == longest
            linked = list(tree._suffix_nodes(trimmed))
            assert [(m, node) for m, node in linked] == [
                (m, tree.find(trimmed[-m:])) for m in range(longest, 0, -1)
            ]
            expected = drafts_matching_from_the_root(tree, context, k, factor, min_prob)
            assert index.speculate(context, k, factor, min_prob) == expected

    for step in range(25):
        if len(index) and rng.random() < 0.2:
            index.remove_sequence(rng.choice(sorted(index._sequences)))
        else:
            tokens = copied_seq(rng, live)
            live.append(tokens)
            for _ in index.add_sequence_steps(f"r{step % 9}", tokens, rng.randint(1, 16)):
                check()
        check()
