"""The global suffix tree in a child process: its inserts and look-ups hold another interpreter's lock.

`ProcessGlobalIndex` is the `GlobalIndex` of an engine whose step is short (a GPU): a finished
output costs the engine thread one pipe write, and the tree's Python work (indexing an output,
matching a batch of contexts) runs in a spawned process, beside the engine thread rather than
taking turns with it for the GIL. A step submits its batch of look-ups first, drafts from the
per-request indexes while the child looks up, then collects (`SuffixProposer.propose_drafts`).

The child answers look-ups before it indexes: between two chunks of an insertion
(INSERT_CHUNK_TOKENS tokens) it answers every look-up waiting. A look-up sees the outputs indexed
so far; one not answered within `deadline_s` answers None for every query (the request drafts from
its own index) and its late reply is dropped.
"""

from __future__ import annotations

import itertools
import multiprocessing
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait

from services.engine.spec_decode.suffix_tree import GlobalSuffixIndex, SuffixDraft

INSERT_CHUNK_TOKENS = 8
"""Tokens the child indexes between two looks for waiting look-ups."""
DEFAULT_DEADLINE_S = 0.05
START_TIMEOUT_S = 60.0

Query = tuple[list[int], int]
"""(context, max_spec_tokens)."""
WireDraft = tuple[list[int], list[float], int, float]
"""A `SuffixDraft` as the pipe carries it: (token_ids, probs, match_len, score)."""


class ProcessGlobalIndex:
    """A `GlobalSuffixIndex` (built by `make_index` in the child) served from a spawned process."""

    def __init__(
        self, make_index: Callable[[], GlobalSuffixIndex], deadline_s: float = DEFAULT_DEADLINE_S
    ) -> None:
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.deadline_s = deadline_s
        context = multiprocessing.get_context("spawn")  # safe after CUDA is initialised
        self._lookups, child_lookups = context.Pipe()
        updates_out, self._updates = context.Pipe(duplex=False)
        self._process = context.Process(
            target=serve, args=(make_index, child_lookups, updates_out), name="suffix-index", daemon=True
        )
        self._process.start()
        child_lookups.close()
        updates_out.close()
        self._ids = itertools.count()
        self.flush(START_TIMEOUT_S)  # the child is up and its index built

    def add_sequence(self, seq_id: str, token_ids: list[int]) -> None:
        self._updates.send((seq_id, list(token_ids)))

    def speculate_batch(self, queries: list[Query]) -> list[SuffixDraft | None]:
        return self.submit_batch(queries)()

    def submit_batch(self, queries: list[Query]) -> Callable[[], list[SuffixDraft | None]]:
        """Sends the look-up now; the returned call waits for its answer (at most `deadline_s`)."""
        lookup_id = next(self._ids)
        self._lookups.send((lookup_id, queries))
        return lambda: self._collect(lookup_id, len(queries))

    def flush(self, timeout_s: float = 10.0) -> None:
        """Waits until every sequence added before this call is indexed."""
        flush_id = next(self._ids)
        self._updates.send(flush_id)  # an int: a marker in the stream of (seq_id, token_ids)
        if self._reply(flush_id, timeout_s) is None:
            raise TimeoutError(f"the suffix index process did not index its backlog in {timeout_s} s")

    def close(self) -> None:
        """Stops the child (it also stops on its own when this process's ends of the pipes close)."""
        self._lookups.close()
        self._updates.close()
        self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def _collect(self, lookup_id: int, num_queries: int) -> list[SuffixDraft | None]:
        drafts = self._reply(lookup_id, self.deadline_s)
        if drafts is None:
            return [None] * num_queries
        return [SuffixDraft(*draft) for draft in drafts]

    def _reply(self, reply_id: int, timeout_s: float) -> list[WireDraft] | None:
        """The payload of reply `reply_id`, dropping earlier (late) replies; None if not in time."""
        while self._lookups.poll(timeout_s):
            got_id, payload = self._lookups.recv()
            if got_id == reply_id:
                return payload
            if got_id > reply_id:
                raise RuntimeError(f"reply {got_id} came before the awaited {reply_id}")
        return None


def serve(make_index: Callable[[], GlobalSuffixIndex], lookups: Connection, updates: Connection) -> None:
    """The child's loop: answer waiting look-ups, take in updates, index a chunk; until a pipe closes."""
    index = make_index()
    backlog: deque[tuple[str, list[int]] | int] = deque()
    inserting: Iterator[None] | None = None
    try:
        while True:
            idle = inserting is None and not backlog
            ready = wait([lookups, updates], timeout=None if idle else 0)
            if lookups in ready:
                lookup_id, queries = lookups.recv()
                lookups.send((lookup_id, [_wire(draft) for draft in index.speculate_batch(queries)]))
                continue
            if updates in ready:
                backlog.append(updates.recv())
                continue
            if inserting is not None:
                if next(inserting, True) is True:
                    inserting = None
                continue
            update = backlog.popleft()
            if isinstance(update, int):  # a flush: everything added before it is indexed
                lookups.send((update, []))
            else:
                inserting = index.add_sequence_steps(*update, INSERT_CHUNK_TOKENS)
    except (EOFError, OSError):
        return  # the engine's ends of the pipes closed


def _wire(draft: SuffixDraft | None) -> WireDraft:
    assert draft is not None  # an in-process index always answers
    return (draft.token_ids, draft.probs, draft.match_len, draft.score)
