"""Suffix decoding in worker processes: the engine thread only sends tokens and receives drafts.

On a GPU a decode step takes a few milliseconds, and suffix decoding's Python (per-request index
updates and drafts, global tree look-ups, indexing finished outputs) would cost the engine thread
as much, under its GIL. `SuffixWorkers` is the suffix `Proposer` there: each running request lives
in one of `num_workers` worker processes (the least loaded when it starts), each holding a
`SuffixProposer` over its requests and a replica of the global tree over every finished output.

Per step the engine thread sends each worker its requests' new tokens and draft counts (deltas,
one message a worker), the workers draft in parallel, and the engine thread collects their drafts.
A finished request's output goes to every worker: its own moves it into its global tree at stop,
the others add it, in the same order everywhere, so every replica holds the same outputs. A worker
answers drafts first, then indexes finished outputs INSERT_CHUNK_TOKENS tokens at a time, and
indexes new prompts while it has nothing else to do. Drafts are those of one in-process
`SuffixProposer` whose global tree held the outputs the worker had indexed by then; a worker that
does not answer within `deadline_s` drafts nothing for its requests that step (its late reply is
dropped).

Processes rather than a compiled tree: no packaged suffix-tree drafter fits (arctic-inference's
C++ tree ships only as a source build that needs torch, and its calls hold the GIL).
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from services.engine.sequence import Sequence
from services.engine.spec_decode.proposer import DraftBatch, Drafts, Proposer
from services.engine.spec_decode.suffix import SuffixConfig, SuffixProposer
from services.engine.spec_decode.suffix_tree import GlobalSuffixIndex, SuffixDraft

INSERT_CHUNK_TOKENS = 8
"""Tokens a worker indexes into its global tree between two looks for a waiting step."""
DEFAULT_DEADLINE_S = 0.5
MAX_DEFAULT_WORKERS = 4
START_TIMEOUT_S = 60.0

StepRequest = tuple[str, list[int], int]
"""(request_id, its tokens since the last message, max_spec_tokens)."""


def default_num_workers() -> int:
    """A worker per 4 cores, 1 to MAX_DEFAULT_WORKERS: the rest are the engine's and the system's."""
    return max(1, min(MAX_DEFAULT_WORKERS, (os.cpu_count() or 1) // 4))


class SuffixWorkers(Proposer):
    """Suffix decoding drafted by `num_workers` processes (see the module docstring)."""

    on_device = False

    def __init__(
        self, config: SuffixConfig | None = None, num_workers: int = 1, deadline_s: float = DEFAULT_DEADLINE_S
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.config = config or SuffixConfig()
        self.deadline_s = deadline_s
        self._conns: list[Connection] = []
        self._processes: list[subprocess.Popen[bytes]] = []
        for _ in range(num_workers):
            conn, process = start_worker(self.config)
            self._conns.append(conn)
            self._processes.append(process)
        self._ids = itertools.count()
        self._worker_of: dict[str, int] = {}
        self._num_running = [0] * num_workers
        self._new_tokens: dict[str, list[int]] = {}
        """Per running request: tokens kept since its worker last heard of it."""
        self._shared_tokens: dict[str, list[int]] = {}
        """Per running request: what the global trees get when it finishes (its output; with
        `cache_prompts`, its prompt too)."""
        self.flush(START_TIMEOUT_S)  # the workers are up

    @property
    def num_workers(self) -> int:
        return len(self._conns)

    def start(self, seq: Sequence) -> None:
        request_id = seq.request_id
        if request_id in self._worker_of:
            raise ValueError(f"request {request_id!r} already started")
        worker = min(range(self.num_workers), key=self._num_running.__getitem__)
        self._worker_of[request_id] = worker
        self._num_running[worker] += 1
        self._new_tokens[request_id] = []
        self._shared_tokens[request_id] = list(seq.prompt_token_ids) if self.config.cache_prompts else []
        self._send(worker, ("start", request_id, list(seq.prompt_token_ids)))

    def append(self, seq: Sequence, token_ids: list[int]) -> None:
        self._new_tokens[seq.request_id].extend(token_ids)
        self._shared_tokens[seq.request_id].extend(token_ids)

    def forget(self, request_id: str) -> None:
        """The request's worker stops it; every worker's global tree gets its output."""
        worker = self._worker_of.pop(request_id, None)
        if worker is None:
            return
        self._num_running[worker] -= 1
        self._send(worker, ("stop", request_id, self._new_tokens.pop(request_id)))
        shared = self._shared_tokens.pop(request_id)
        if shared and self.config.max_cached_requests:
            for other in range(self.num_workers):
                if other != worker:
                    self._send(other, ("add", request_id, shared))

    def propose(self, batch: DraftBatch) -> Drafts:
        """Sends each worker its requests' new tokens and draft counts, then collects the drafts."""
        rows: list[list[int]] = [[] for _ in range(self.num_workers)]
        messages: list[list[StepRequest]] = [[] for _ in range(self.num_workers)]
        for row, (seq, max_spec_tokens) in enumerate(zip(batch.seqs, batch.num_wanted_cpu)):
            request_id = seq.request_id
            worker = self._worker_of[request_id]
            rows[worker].append(row)
            messages[worker].append((request_id, self._new_tokens[request_id], max_spec_tokens))
            self._new_tokens[request_id] = []
        step_ids = {}
        for worker, requests in enumerate(messages):
            if requests:
                step_ids[worker] = next(self._ids)
                self._send(worker, ("propose", step_ids[worker], requests))
        drafts: list[list[int]] = [[] for _ in batch.seqs]
        num_context_tokens = 0
        for worker, step_id in step_ids.items():
            reply = self._reply(worker, step_id, self.deadline_s)
            if reply is None:
                continue  # late: its requests draft nothing this step
            worker_drafts, num_indexed = reply
            num_context_tokens += num_indexed
            for row, draft in zip(rows[worker], worker_drafts):
                drafts[row] = draft
        return Drafts.from_lists(drafts, num_context_tokens=num_context_tokens)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Waits until every worker has indexed every output finished and every prompt started
        before this call."""
        flush_ids = {}
        for worker in range(self.num_workers):
            flush_ids[worker] = next(self._ids)
            self._send(worker, ("flush", flush_ids[worker]))
        for worker, flush_id in flush_ids.items():
            if self._reply(worker, flush_id, timeout_s) is None:
                raise TimeoutError(f"suffix worker {worker} did not index its backlog in {timeout_s} s")

    def close(self) -> None:
        """Stops the workers (each also stops on its own when this process's end of its socket closes)."""
        for conn in self._conns:
            conn.close()
        for process in self._processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _send(self, worker: int, message: tuple[Any, ...]) -> None:
        try:
            self._conns[worker].send(message)
        except OSError:
            raise self._exited(worker) from None

    def _exited(self, worker: int) -> RuntimeError:
        code = self._processes[worker].wait(timeout=5)
        return RuntimeError(f"suffix worker {worker} exited with code {code} (its error is on stderr)")

    def _reply(self, worker: int, reply_id: int, timeout_s: float) -> tuple[list[list[int]], int] | None:
        """Worker `worker`'s reply `reply_id`, dropping its earlier (late) ones; None if not in time."""
        conn = self._conns[worker]
        while conn.poll(timeout_s):
            try:
                got_id, payload = conn.recv()
            except (EOFError, OSError):
                raise self._exited(worker) from None
            if got_id == reply_id:
                return payload
            if got_id > reply_id:
                raise RuntimeError(f"suffix worker {worker} sent reply {got_id} before {reply_id}")
        return None


def start_worker(config: SuffixConfig) -> tuple[Connection, subprocess.Popen[bytes]]:
    """A worker process and this process's end of the socket to it. The worker runs this module
    (not the parent's main module, as multiprocessing's spawn would: an unguarded script that makes
    an engine would make one again in each worker), is safe beside CUDA (no fork), and stops when
    the socket closes."""
    ours, theirs = socket.socketpair()
    with theirs:
        process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno())], pass_fds=(theirs.fileno(),)
        )
    conn = Connection(ours.detach())
    conn.send(config)
    return conn, process


class DeferredGlobalIndex:
    """A worker's global tree: `add_sequence` queues the output, `index_chunk` indexes a chunk of
    the queue, so that a step waiting on the worker waits for a chunk at most."""

    def __init__(self, index: GlobalSuffixIndex) -> None:
        self.index = index
        self._queue: deque[tuple[str, list[int]]] = deque()
        self._inserting: Iterator[None] | None = None

    def add_sequence(self, seq_id: str, token_ids: list[int]) -> None:
        self._queue.append((seq_id, list(token_ids)))

    def speculate_batch(self, queries: list[tuple[list[int], int]]) -> list[SuffixDraft | None]:
        return list(self.index.speculate_batch(queries))

    @property
    def backlog(self) -> bool:
        """Whether outputs are waiting to be (fully) indexed."""
        return self._inserting is not None or bool(self._queue)

    def index_chunk(self) -> None:
        if self._inserting is None:
            self._inserting = self.index.add_sequence_steps(*self._queue.popleft(), INSERT_CHUNK_TOKENS)
        if next(self._inserting, True) is True:
            self._inserting = None


def serve(config: SuffixConfig, conn: Connection) -> None:
    """A worker's loop: handle every waiting message (a step's drafts answered at once), then index a
    chunk of finished outputs, else new prompts, else answer flushes; until the engine's end of the
    socket closes."""
    global_index = DeferredGlobalIndex(config.global_index())
    proposer = SuffixProposer(config, global_index)
    flushes: list[int] = []
    try:
        while True:
            if conn.poll(0):
                handle(conn, proposer, global_index, conn.recv(), flushes)
            elif global_index.backlog:
                global_index.index_chunk()
            elif proposer.has_unprepared:
                proposer.prepare(lambda: not conn.poll(0))
            elif flushes:
                conn.send((flushes.pop(0), ([], 0)))
            else:
                handle(conn, proposer, global_index, conn.recv(), flushes)  # waits for the engine
    except (EOFError, OSError):
        return  # the engine's end of the socket closed


def handle(
    conn: Connection,
    proposer: SuffixProposer,
    global_index: DeferredGlobalIndex,
    message: tuple[Any, ...],
    flushes: list[int],
) -> None:
    kind = message[0]
    if kind == "propose":
        _, step_id, requests = message
        num_indexed = proposer.num_indexed_tokens
        for request_id, new_tokens, _ in requests:
            proposer.record_tokens(request_id, new_tokens)
        drafts = proposer.propose_drafts(
            [(request_id, proposer.token_ids(request_id), k) for request_id, _, k in requests]
        )
        conn.send(
            (step_id, ([draft.token_ids for draft in drafts], proposer.num_indexed_tokens - num_indexed))
        )
    elif kind == "start":
        proposer.start_request(message[1], message[2])
    elif kind == "stop":
        _, request_id, new_tokens = message
        proposer.record_tokens(request_id, new_tokens)
        proposer.stop_request(request_id)
    elif kind == "add":
        global_index.add_sequence(message[1], message[2])
    elif kind == "flush":
        flushes.append(message[1])
    else:
        raise ValueError(f"unknown suffix worker message {kind!r}")


if __name__ == "__main__":
    worker_conn = Connection(int(sys.argv[1]))
    serve(worker_conn.recv(), worker_conn)
