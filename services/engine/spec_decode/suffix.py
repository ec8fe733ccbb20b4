"""SuffixDecoding drafts: continue a request with what followed its context in earlier text.

SuffixDecoding (Oliaro et al. 2024, arXiv:2411.04975) keeps two suffix indexes: a *per-request*
one over the request's own prompt and output (`suffix_automaton.SuffixAutomaton`), which catches a
request repeating itself (code edits, lists, agent loops), and a *global* tree over the outputs of
earlier requests (`suffix_tree.GlobalSuffixIndex`), which catches requests repeating each other.
Each step, both are matched against the end of the request's tokens and the draft with the higher
score (expected accepted tokens) is proposed. The draft length follows the match length: at most
`floor(max_spec_factor * match_len)` tokens.

A request's own index is built at its first draft, from its tokens so far, and is lazy: it
holds the request's token list itself (the engine's `Sequence.token_ids`, which the engine
extends) and how many of those tokens it has indexed, and takes in the rest, in one bulk
`extend`, at the request's next `propose`, so that all of a step's index work happens in the one
call the drafter times and prices (adaptive speculation charges it per context token). A request
left at k = 0 (drafting paused, or not worth it) costs nothing per step. The index drafts as a
suffix tree of the same tokens would, whenever it is built or caught up, so drafts do not depend
on when that happened.

Cost per `propose`, with `D = max_tree_depth` and `k` draft tokens: on the per-request index
O(min(s, D)) per new token, for the s states of the sequence's repeated suffixes (a few on copied
text), and O(D + k * states tried) for the draft; on the global tree O(D) to match the context,
then O(1) per shorter match reached by a suffix link and O(k) per distinct continuation tried.
A request's first draft also indexes its n tokens so far.

The global tree sits behind the `GlobalIndex` interface: in process (`GlobalSuffixIndex`, the
default) or in the `suffix-cache` service that every decode worker shares
(`services.suffix_cache.client.RemoteSuffixIndex`), so a request drafts from outputs that any
worker produced. It is asked once per step for the whole batch, and may answer None for a query
(a remote index that did not answer in time): that request then drafts from its own index only.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from services.engine.sequence import Sequence
from services.engine.spec_decode.proposer import DraftBatch, Drafts, Proposer
from services.engine.spec_decode.suffix_automaton import SuffixAutomaton
from services.engine.spec_decode.suffix_tree import (
    DEFAULT_MAX_CACHED_REQUESTS,
    DEFAULT_MAX_TREE_DEPTH,
    GlobalSuffixIndex,
    SuffixDraft,
    check_spec_params,
    check_tree_params,
)
from shared.speculative_config import SpeculativeConfig

INSERT_CHUNK_TOKENS = 4
"""Tokens the deferred global index inserts between two looks at whether the device is still busy."""
PREPARE_CHUNK_TOKENS = 16
"""Tokens `prepare` indexes between two looks at whether the device is still busy."""
MAX_STARVED_PREPARES = 32
"""`prepare` calls an output may wait in the deferred global index without the device ever
outlasting the host's work; after that, one chunk a call goes in on the critical path."""


class GlobalIndex(Protocol):
    """The global suffix tree over finished requests' outputs, shared by every request.

    Implementations apply their own draft limits (`max_spec_factor`, `min_token_prob`) and tree
    depth. Both methods are called from the engine step and must return promptly.
    """

    def add_sequence(self, seq_id: str, token_ids: list[int]) -> None:
        """Indexes a finished sequence; adding `seq_id` again replaces it."""
        ...

    def speculate_batch(self, queries: list[tuple[list[int], int]]) -> list[SuffixDraft | None]:
        """The best draft for each (context, max_spec_tokens); None where there is no answer in time."""
        ...


class DeferredGlobalIndex:
    """An in-process `GlobalSuffixIndex` that the engine thread feeds while the device runs a step,
    as the mesh's suffix-cache service is fed by messages: `add_sequence` only queues a finished
    output, and `index_while(device_busy)` inserts queued outputs INSERT_CHUNK_TOKENS tokens at a
    time while the device is busy. Inserting costs tens of microseconds of Python a token; a thread
    doing it would hold the interpreter lock the engine thread needs between its device calls, a
    cost the step pays whatever its drafts. Look-ups see what is indexed so far.

    At most `max_cached_requests` outputs wait, the oldest dropped first: the tree keeps only that
    many, so inserting the dropped ones would evict them again before any look-up after the
    queue's end. Where the device never outlasts the host's work (steps launched ahead of a host
    that is behind), outputs would wait forever and the tree never grow: after
    MAX_STARVED_PREPARES windows without an insert, `insert_if_starved` puts one chunk in a call."""

    def __init__(self, index: GlobalSuffixIndex) -> None:
        self.index = index
        self._pending: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        self._inserting: Iterator[None] | None = None
        """The insertion under way: its next chunk (None between insertions)."""
        self._num_starved = 0
        """Windows in a row that ended with outputs waiting and none of their tokens inserted."""

    def add_sequence(self, seq_id: str, token_ids: list[int]) -> None:
        self._pending.pop(seq_id, None)
        self._pending[seq_id] = list(token_ids)
        while len(self._pending) > self.index.max_cached_requests:
            self._pending.popitem(last=False)

    def speculate_batch(self, queries: list[tuple[list[int], int]]) -> list[SuffixDraft | None]:
        return list(self.index.speculate_batch(queries))

    @property
    def num_pending(self) -> int:
        """Outputs queued or being inserted."""
        return len(self._pending) + (self._inserting is not None)

    def index_while(self, device_busy: Callable[[], bool]) -> None:
        """Inserts queued outputs, oldest first, a chunk per look at `device_busy()`."""
        while device_busy() and self.insert_chunk():
            pass

    def insert_if_starved(self) -> None:
        """Called at the end of each window: inserts one chunk, on the caller's time, where outputs
        have waited through more than MAX_STARVED_PREPARES windows since one was last inserted in a
        window's busy time."""
        if self.num_pending == 0:
            self._num_starved = 0
            return
        self._num_starved += 1
        if self._num_starved > MAX_STARVED_PREPARES:
            self._insert_next()

    def insert_chunk(self) -> bool:
        """Inserts the next INSERT_CHUNK_TOKENS tokens of the oldest queued output while the device
        is busy; False where none waits."""
        self._num_starved = 0
        return self._insert_next()

    def _insert_next(self) -> bool:
        if self._inserting is None:
            if not self._pending:
                return False
            seq_id, token_ids = self._pending.popitem(last=False)
            self._inserting = self.index.add_sequence_steps(seq_id, token_ids, INSERT_CHUNK_TOKENS)
        if next(self._inserting, True) is True:
            self._inserting = None
        return True

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self.index


def take_turns(chunks: list[Callable[[], bool]], device_busy: Callable[[], bool]) -> None:
    """Runs the chunk makers in turn, each until it returns False (nothing left), with a look at
    `device_busy()` before each chunk: the device waits for one chunk at most."""
    while chunks:
        for chunk in list(chunks):
            if not device_busy():
                return
            if not chunk():
                chunks.remove(chunk)


@dataclass(frozen=True)
class SuffixConfig:
    max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH
    """Longest path the trees hold, and so the longest match (>= 1)."""
    max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS
    """Finished requests the global tree keeps, oldest evicted first (>= 0; 0 disables it)."""
    max_spec_factor: float = 1.0
    """A match of m tokens drafts at most floor(max_spec_factor * m) tokens (> 0)."""
    min_token_prob: float = 0.1
    """A draft stops before its cumulative probability falls below this (in [0, 1])."""
    cache_prompts: bool = False
    """Index prompts as well as outputs in the global tree."""

    def __post_init__(self) -> None:
        check_tree_params(self.max_tree_depth, self.max_cached_requests)
        check_spec_params(0, self.max_spec_factor, self.min_token_prob)

    @classmethod
    def from_speculative_config(cls, config: SpeculativeConfig) -> SuffixConfig:
        """The `suffix_decoding_*` settings of a server's speculative config."""
        return cls(
            max_tree_depth=config.suffix_decoding_max_tree_depth,
            max_cached_requests=config.suffix_decoding_max_cached_requests,
            max_spec_factor=config.suffix_decoding_max_spec_factor,
            min_token_prob=config.suffix_decoding_min_token_prob,
        )

    def global_index(self) -> GlobalSuffixIndex:
        """An empty in-process global tree sized and limited by these settings."""
        return GlobalSuffixIndex(
            self.max_tree_depth, self.max_cached_requests, self.max_spec_factor, self.min_token_prob
        )


@dataclass
class _RequestState:
    token_ids: list[int]
    """The request's prompt and output so far: the engine's own list where the request came as a
    `Sequence` (`start`), which the engine extends in place (and cuts at a stop string)."""
    num_prompt_tokens: int
    index: SuffixAutomaton | None = None
    """The request's own index over the first `index.num_tokens` of them; None until it first drafts."""


class SuffixProposer(Proposer):
    """Drafts for running requests from their own tokens and from finished requests' outputs.

    `global_index` defaults to an in-process `GlobalSuffixIndex` sized and limited by `config`; a
    given one (e.g. the suffix-cache client) brings its own size and limits.
    """

    on_device = False

    def __init__(self, config: SuffixConfig | None = None, global_index: GlobalIndex | None = None) -> None:
        self.config = cfg = config or SuffixConfig()
        self.global_index: GlobalIndex = global_index if global_index is not None else cfg.global_index()
        self._requests: dict[str, _RequestState] = {}
        self._num_indexed_tokens = 0
        """Tokens put into per-request indexes so far, but by `prepare` (each `propose` reports its share)."""
        self._unprepared: dict[str, None] = {}
        """Running requests whose tokens `prepare` has not indexed yet, oldest first (an ordered set)."""

    def start_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        """Records (a copy of) the prompt; the request's index waits for its first draft."""
        self._start(request_id, list(prompt_token_ids), len(prompt_token_ids))

    def start(self, seq: Sequence) -> None:
        """Keeps the sequence's own token list, which the engine extends: a step's tokens cost
        nothing here until the request drafts."""
        self._start(seq.request_id, seq.token_ids, seq.num_prompt_tokens)

    def _start(self, request_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already started")
        self._requests[request_id] = _RequestState(token_ids, num_prompt_tokens)
        self._unprepared[request_id] = None

    def forget(self, request_id: str) -> None:
        self.stop_request(request_id)

    def backlog(self, request_id: str) -> int:
        """Tokens the request's own index has not taken in yet (all of them before it is built)."""
        state = self._state(request_id)
        return len(state.token_ids) - (state.index.num_tokens if state.index is not None else 0)

    def prepare(self, device_busy: Callable[[], bool]) -> None:
        """Indexes the tokens of requests that joined, oldest first, PREPARE_CHUNK_TOKENS at a time
        while the device is busy: off the step's critical path, and not charged to drafting. An index
        begun here is the one the request's first draft would build, so drafts do not change. A
        deferred global index takes in finished outputs in the same window, its chunks alternating
        with the prompts': neither waits for the other; outputs that no window has room for go in
        a chunk a call once starved (`DeferredGlobalIndex.insert_if_starved`)."""
        chunks = [self._index_prompt_chunk]
        if isinstance(self.global_index, DeferredGlobalIndex):
            chunks.append(self.global_index.insert_chunk)
        take_turns(chunks, device_busy)
        if isinstance(self.global_index, DeferredGlobalIndex):
            self.global_index.insert_if_starved()

    def _index_prompt_chunk(self) -> bool:
        """Indexes the next PREPARE_CHUNK_TOKENS tokens of the oldest request not indexed yet;
        False where none is left."""
        while self._unprepared:
            request_id = next(iter(self._unprepared))
            state = self._requests[request_id]
            if state.index is not None and state.index.num_tokens >= len(state.token_ids):
                del self._unprepared[request_id]  # all indexed (here, or by a draft)
                continue
            if state.index is None:
                state.index = SuffixAutomaton(self.config.max_tree_depth)
            done = state.index.num_tokens
            state.index.extend(state.token_ids[done : done + PREPARE_CHUNK_TOKENS])
            return True
        return False

    def propose(self, batch: DraftBatch) -> Drafts:
        requests = [(seq.request_id, seq.token_ids, k) for seq, k in zip(batch.seqs, batch.num_wanted_cpu)]
        num_indexed = self._num_indexed_tokens
        drafts = self.propose_batch(requests)
        return Drafts.from_lists(drafts, num_context_tokens=self._num_indexed_tokens - num_indexed)

    def add_tokens(self, request_id: str, token_ids: list[int]) -> None:
        """Appends accepted output tokens to the request, and to its index once it has one."""
        state = self._state(request_id)
        state.token_ids.extend(token_ids)
        if state.index is not None:
            self._sync(state.index, state.token_ids)

    def stop_request(self, request_id: str) -> None:
        """Moves the request's output (and prompt, with `cache_prompts`) into the global tree."""
        state = self._requests.pop(request_id, None)
        self._unprepared.pop(request_id, None)
        if state is None:
            return
        token_ids = state.token_ids
        if not self.config.cache_prompts:
            token_ids = token_ids[state.num_prompt_tokens :]
        if token_ids and self.config.max_cached_requests:
            self.global_index.add_sequence(request_id, token_ids)

    def propose_one(self, request_id: str, token_ids: list[int], max_spec_tokens: int) -> list[int]:
        """Up to `max_spec_tokens` draft ids after `token_ids` (the request's prompt and output)."""
        return self.propose_draft(request_id, token_ids, max_spec_tokens).token_ids

    def propose_batch(self, requests: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """`propose` for each (request_id, token_ids, max_spec_tokens), one global look-up for all."""
        return [draft.token_ids for draft in self.propose_drafts(requests)]

    def propose_draft(self, request_id: str, token_ids: list[int], max_spec_tokens: int) -> SuffixDraft:
        """The better-scored of the per-request and the global draft; the per-request one on ties."""
        return self.propose_drafts([(request_id, token_ids, max_spec_tokens)])[0]

    def propose_drafts(self, requests: list[tuple[str, list[int], int]]) -> list[SuffixDraft]:
        """`propose_draft` for each (request_id, token_ids, max_spec_tokens).

        The per-request drafts come first; then one batched call asks the global index for the
        requests whose draft it could still beat (a score is at most the draft length: none when
        `max_spec_tokens` is 0), with the context cut to the `max_tree_depth` tokens that can match.
        """
        drafts = [self._request_draft(*request) for request in requests]
        to_ask = [
            i
            for i, (draft, (_, _, max_spec_tokens)) in enumerate(zip(drafts, requests))
            if draft.score < max_spec_tokens
        ]
        if not to_ask or not self.config.max_cached_requests:
            return drafts
        depth = self.config.max_tree_depth
        queries = [(requests[i][1][-depth:], requests[i][2]) for i in to_ask]
        for i, shared in zip(to_ask, self.global_index.speculate_batch(queries)):
            if shared is not None and shared.score > drafts[i].score:
                drafts[i] = shared
        return drafts

    def _request_draft(self, request_id: str, token_ids: list[int], max_spec_tokens: int) -> SuffixDraft:
        state = self._state(request_id)
        self._catch_up(state, token_ids)
        cfg = self.config
        check_spec_params(max_spec_tokens, cfg.max_spec_factor, cfg.min_token_prob)
        if max_spec_tokens == 0:
            return SuffixDraft()  # what any index drafts for k = 0: no reason to build one
        return self._index(state).speculate(max_spec_tokens, cfg.max_spec_factor, cfg.min_token_prob)

    def _index(self, state: _RequestState) -> SuffixAutomaton:
        """The request's index over all its tokens; built from them the first time it is needed."""
        if state.index is None:
            state.index = SuffixAutomaton(self.config.max_tree_depth)
        self._sync(state.index, state.token_ids)
        return state.index

    def _sync(self, index: SuffixAutomaton, token_ids: list[int]) -> None:
        """Indexes the tokens `index` has not seen yet."""
        new = token_ids[index.num_tokens :]
        index.extend(new)
        self._num_indexed_tokens += len(new)

    def _state(self, request_id: str) -> _RequestState:
        state = self._requests.get(request_id)
        if state is None:
            raise KeyError(f"request {request_id!r} was not started (or already stopped)")
        return state

    def _catch_up(self, state: _RequestState, token_ids: list[int]) -> None:
        """Takes in tokens the caller has but `add_tokens` did not bring, so both ways of feeding work."""
        num_known = len(state.token_ids)
        if len(token_ids) < num_known:
            raise ValueError(
                f"token_ids has {len(token_ids)} tokens but the request already indexed {num_known}"
            )
        state.token_ids.extend(token_ids[num_known:])
