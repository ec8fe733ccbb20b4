"""Grammar-constrained decoding: each distinct grammar compiled once for the model's vocabulary, and
per request a matcher that gives the token bitmask of every row the step verifies.

A request with `k` drafts has `k + 1` verified rows; row `j` is sampled after the request's kept
tokens and its first `j` drafts, so its mask is the grammar's allowed next tokens in that state.
Before a step is scheduled, each request's drafts are cut at the first one its grammar refuses
(`cut_refused_drafts`): such a draft would be rejected at its row whatever the target says, so it
is rejected on the host rather than verified. The matcher is advanced over the drafts only to
check them and to fill the masks, rolled back at once, and then advanced by the tokens the step kept.

A step's masks are filled for the whole batch at once (`StepMasks`) into one host buffer, on
threads kept for the engine's life (`MaskFiller`): the requests are shared out among them, and each
thread walks its requests' drafts depth by depth with xgrammar's batched calls, which release the
GIL. The masks are an input of the fused verify (`kernels.verify_sample`); no draft distribution
needs one: drafting models draw their drafts with the target's own noise and the verifier treats
every draft as a fixed token (services/engine/rejection_sampler.py), so the acceptance test reads
only the masked target distribution. A drafting model proposes without the grammar (its chain runs on the device, the
matcher on the host).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels.verify_ref import num_mask_words
from shared.structured_output import StructuredOutput
from shared.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

    from services.engine.sequence import Sequence

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
"""Compiled grammars kept (least recently used dropped first); a JSON schema's is tens of KiB."""

MIN_ROWS_PER_PART = 8
"""Fewest verified rows in a part of the fill (what a thread takes at a time): most rows cost about
a microsecond (xgrammar's cached masks), less than the Python around one more part."""

PARTS_PER_THREAD = 4
"""Most parts of the fill per thread: the threads take parts until none is left, so a thread that
drew costly requests takes fewer."""


MAX_FILL_THREADS = 4
"""Most threads of the batched fill by default: past a few, its threads slow one another down
(BENCHMARKS.md, "Structured output on the GPU")."""

TRIAL_FILLS = 8
"""Fills timed on each thread count before the filler keeps the faster (`ThreadChoice`)."""

RETRIAL_EVERY_FILLS = 1024
"""Fills after which the thread counts are timed again (the batch and its grammars change)."""


class ThreadChoice:
    """How many threads the next fill runs on: one, or all of the filler's, whichever filled a row
    faster in the last trial. Which pays depends on the grammars (a cheap row costs less than
    handing it to another thread; an expensive one shares out) and on what else the host runs, so
    it is measured: the first TRIAL_FILLS fills of each count alternate, the faster count per row
    is kept, and the trial is repeated every RETRIAL_EVERY_FILLS fills."""

    def __init__(self, num_threads: int):
        self.counts = [1, num_threads] if num_threads > 1 else [1]
        self._fills = 0
        self._trial: dict[int, list[float]] = {count: [] for count in self.counts}
        self._kept = num_threads

    def next(self) -> int:
        """The thread count of the next fill."""
        if len(self.counts) == 1:
            return 1
        if self._in_trial():
            return self.counts[self._fills % len(self.counts)]
        return self._kept

    def _in_trial(self) -> bool:
        return self._fills % RETRIAL_EVERY_FILLS < TRIAL_FILLS * len(self.counts)

    def record(self, num_threads: int, seconds: float, num_rows: int) -> None:
        """A fill on `num_threads` threads took `seconds` for `num_rows` rows."""
        in_trial = self._in_trial()
        self._fills += 1
        if not in_trial or len(self.counts) == 1:
            return
        self._trial[num_threads].append(seconds / max(num_rows, 1))
        if self._fills % RETRIAL_EVERY_FILLS == TRIAL_FILLS * len(self.counts):
            self._kept = min(self.counts, key=lambda count: float(np.median(self._trial[count])))
            self._trial = {count: [] for count in self.counts}


def default_num_threads() -> int:
    """Threads for xgrammar's compiling and batched filling: half the cores this process may use,
    the rest left to the engine's own work."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // 2)


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab_size / 32)] int32, every token allowed."""
    return torch.full((num_rows, num_mask_words(vocab_size)), -1, dtype=torch.int32)


class StepMasks:
    """The grammar masks of a step's verified rows, filled on the host for the whole batch while the
    step's forward runs and copied into the verifier's input behind it. On a GPU the host buffer is
    page-locked, so the copy is queued on the stream and the host goes on; it is refilled only once
    the last copy out of it is done."""

    def __init__(self, vocab_size: int, device: torch.device, num_threads: int | None = None):
        """`num_threads`: threads of the batched fill (None: `default_num_threads()`, at most
        MAX_FILL_THREADS)."""
        self.num_words = num_mask_words(vocab_size)
        self.device = device
        self.num_threads = num_threads or min(default_num_threads(), MAX_FILL_THREADS)
        self._host = torch.empty(0, self.num_words, dtype=torch.int32)
        self._copied: torch.cuda.Event | None = None
        self._filler: MaskFiller | None = None

    def fill(self, seqs: list[Sequence], cu_num_rows: np.ndarray) -> torch.Tensor:
        """[num_rows, num_words] int32 on the host: `write`, and every token allowed in the rows of
        requests without a grammar. No row is written twice: a whole-buffer write would cost as
        much as the fill of most rows, and torch would spread it over its own threads."""
        host = self._buffer(int(cu_num_rows[-1]))
        rows = host.numpy()
        for seq, start, end in zip(seqs, cu_num_rows[:-1].tolist(), cu_num_rows[1:].tolist()):
            if seq.grammar is None:
                rows[start:end] = -1
        self.write(seqs, cu_num_rows, host)
        return host

    def write(self, seqs: list[Sequence], cu_num_rows: np.ndarray, bitmask: torch.Tensor) -> None:
        """Request i's rows `cu_num_rows[i] ..` of `bitmask` get the masks of its grammar after its
        first drafts (`fill_masks`); rows of requests without a grammar are left as they were."""
        states: list[GrammarState] = []
        drafts: list[list[int]] = []
        first_rows: list[int] = []
        for seq, start, end in zip(seqs, cu_num_rows[:-1].tolist(), cu_num_rows[1:].tolist()):
            if seq.grammar is not None:
                states.append(seq.grammar)
                drafts.append(seq.spec.draft_token_ids[: end - start - 1])
                first_rows.append(start)
        if states:
            self.filler().fill([state.matcher for state in states], drafts, first_rows, bitmask)

    def copy_to(self, masks: torch.Tensor, out: torch.Tensor) -> None:
        """`masks` into `out` ([num_rows, num_words] on the device), queued behind the step's work."""
        out.copy_(masks, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _buffer(self, num_rows: int) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()
        if self._host.shape[0] < num_rows:
            pinned = self.device.type == "cuda"
            self._host = torch.empty(
                max(num_rows, 2 * self._host.shape[0]), self.num_words, dtype=torch.int32, pin_memory=pinned
            )
        return self._host[:num_rows]

    def filler(self) -> MaskFiller:
        """Built on first use, with its threads: an engine without grammar requests keeps none."""
        if self._filler is None:
            self._filler = MaskFiller(self.num_threads)
        return self._filler

    def close(self) -> None:
        """Stops the fill's threads (none were started without a grammar request)."""
        if self._filler is not None:
            self._filler.close()


class MaskFiller:
    """Fills a step's masks on up to `num_threads` threads started once (one, or all of them,
    as `ThreadChoice` measured faster). The requests are cut into parts
    of at least `MIN_ROWS_PER_PART` rows, request i into part i mod the number of parts (so that
    requests at costly places in their grammars, which stay costly at every draft depth, spread
    out), and the threads, the calling one among them, take the parts one at a time until none is
    left. A part's rows are filled at all
    draft depths by one thread (`fill_masks`). xgrammar's own `BatchGrammarMatcher(n)` starts n
    threads anew for every call and queues one task per row behind one lock, and a step with
    drafts calls it once per depth: its threads then cost more than they share out."""

    def __init__(self, num_threads: int):
        import xgrammar

        self.num_threads = num_threads
        self.choice = ThreadChoice(num_threads)
        self._serial = [xgrammar.BatchGrammarMatcher(1) for _ in range(num_threads)]
        self._pool = ThreadPoolExecutor(num_threads - 1, "grammar-fill") if num_threads > 1 else None

    def fill(
        self,
        matchers: list[xgrammar.GrammarMatcher],
        draft_token_ids: list[list[int]],
        first_rows: list[int],
        bitmask: torch.Tensor,
    ) -> None:
        """`fill_masks` for every request, part by part on the threads (as many as `choice` says)."""
        started = time.perf_counter()
        num_threads = self.choice.next()
        num_rows = len(matchers) + sum(len(drafts) for drafts in draft_token_ids)
        num_parts = min(self._num_parts(num_rows, num_threads), len(matchers))
        parts: queue.SimpleQueue[int] = queue.SimpleQueue()
        for part in range(num_parts):
            parts.put(part)

        def take_parts(batch: xgrammar.BatchGrammarMatcher) -> None:
            while True:
                try:
                    part = parts.get_nowait()
                except queue.Empty:
                    return
                drafts, rows = draft_token_ids[part::num_parts], first_rows[part::num_parts]
                fill_masks(batch, matchers[part::num_parts], drafts, rows, bitmask)

        pool = self._pool
        num_helpers = min(num_threads, num_parts) - 1
        helpers = [pool.submit(take_parts, self._serial[i + 1]) for i in range(num_helpers)] if pool else []
        take_parts(self._serial[0])
        for helper in helpers:
            helper.result()
        self.choice.record(num_threads, time.perf_counter() - started, num_rows)

    @staticmethod
    def _num_parts(num_rows: int, num_threads: int) -> int:
        """One part on one thread; else up to `PARTS_PER_THREAD` a thread, enough to even out what
        the threads take, each part adding its Python."""
        if num_threads == 1:
            return 1
        return max(1, min(num_rows // MIN_ROWS_PER_PART, PARTS_PER_THREAD * num_threads))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def fill_masks(
    batch: xgrammar.BatchGrammarMatcher,
    matchers: list[xgrammar.GrammarMatcher],
    draft_token_ids: list[list[int]],
    first_rows: list[int],
    bitmask: torch.Tensor,
) -> None:
    """Writes rows `first_rows[i] .. first_rows[i] + len(draft_token_ids[i])` of `bitmask` ([rows,
    num_words] int32 on the host): row j of request i allows what may follow its kept tokens and
    its first j drafts, filled for every request at draft depth j in one call of `batch` (one
    thread's: the GIL is released inside). Rows after a refused draft, or after the grammar ends,
    allow every token; every matcher ends where it was."""
    num_filled = [0] * len(matchers)

    def fill(live: list[int], depth: int) -> None:
        rows = [first_rows[i] + depth for i in live]
        batch.batch_fill_next_token_bitmask([matchers[i] for i in live], bitmask, rows)
        for i in live:
            num_filled[i] += 1

    walk_drafts(matchers, draft_token_ids, fill)
    rows = bitmask.numpy()
    for first_row, drafts, filled in zip(first_rows, draft_token_ids, num_filled):
        if filled <= len(drafts):
            rows[first_row + filled : first_row + len(drafts) + 1] = -1


def cut_refused_drafts(seqs: list[Sequence]) -> list[int]:
    """Cuts each structured request's drafts before the first one its grammar refuses (and after
    one that ends it); the number of drafts cut per request of `seqs`. The matchers end where they
    were."""
    drafting = [seq for seq in seqs if seq.grammar is not None and seq.spec.draft_token_ids]
    matchers = [seq.grammar.matcher for seq in drafting if seq.grammar is not None]
    num_taken = walk_drafts(matchers, [seq.spec.draft_token_ids for seq in drafting])
    num_cut = {id(seq): len(seq.spec.draft_token_ids) - kept for seq, kept in zip(drafting, num_taken)}
    for seq, kept in zip(drafting, num_taken):
        seq.spec.draft_token_ids = seq.spec.draft_token_ids[:kept]
    return [num_cut.get(id(seq), 0) for seq in seqs]


def walk_drafts(
    matchers: list[xgrammar.GrammarMatcher],
    draft_token_ids: list[list[int]],
    visit: Callable[[list[int], int], None] | None = None,
) -> list[int]:
    """Advances every matcher through its drafts depth by depth, one batched accept per depth, until
    it refuses one, ends or runs out; `visit(rows, depth)` first sees the rows still in the grammar
    after `depth` drafts. Rolls every matcher back; the drafts each one took."""
    import xgrammar

    num_taken = [0] * len(matchers)
    live = [i for i, matcher in enumerate(matchers) if not matcher.is_terminated()]
    depth = 0
    while live:
        if visit is not None:
            visit(live, depth)
        live = [i for i in live if depth < len(draft_token_ids[i])]
        if not live:
            break
        tokens = [draft_token_ids[i][depth] for i in live]
        accepted = xgrammar.BatchGrammarMatcher.batch_accept_token([matchers[i] for i in live], tokens)
        live = [i for i, ok in zip(live, accepted) if ok]
        for i in live:
            num_taken[i] += 1
        live = [i for i in live if not matchers[i].is_terminated()]
        depth += 1
    taken = [i for i, n in enumerate(num_taken) if n]
    if taken:
        xgrammar.BatchGrammarMatcher.batch_rollback(
            [matchers[i] for i in taken], [num_taken[i] for i in taken]
        )
    return num_taken


class GrammarCompiler:
    """Compiles grammars on a thread of its own, off the step: a request's grammar starts compiling
    when the request arrives, and the request stays queued until it is compiled while others can
    run (`Scheduler`). xgrammar spreads one compile (its token mask cache over the vocabulary) over
    its own threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._compiled: OrderedDict[StructuredOutput, Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self.num_compiled = 0
        """Grammars compiled so far (a cached one is not compiled again)."""

    def submit(self, structured: StructuredOutput) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar, now or later; compiled once per distinct grammar."""
        with self._lock:
            found = self._compiled.pop(structured, None)
            if found is None or (found.done() and found.exception() is not None):
                found = self._pool.submit(self._compile, structured)
            self._compiled[structured] = found
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return found

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, structured: StructuredOutput) -> xgrammar.CompiledGrammar:
        compiler = self._grammar_compiler()
        self.num_compiled += 1
        if structured.kind in ("regex", "choice"):
            return compiler.compile_regex(structured.regex())
        return compiler.compile_json_schema(structured.schema_text(), **structured.json_options())

    def _grammar_compiler(self) -> xgrammar.GrammarCompiler:
        """Built on first use: reading the vocabulary takes a moment no request without a grammar
        should pay."""
        if self._compiler is None:
            import xgrammar
            from transformers import PreTrainedTokenizerFast

            wrapped = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
            info = xgrammar.TokenizerInfo.from_huggingface(
                wrapped, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgrammar.GrammarCompiler(
                info, max_threads=default_num_threads(), cache_enabled=False
            )
        return self._compiler


class GrammarState:
    """One request's place in its grammar: advanced by the tokens the request kept, never by drafts."""

    def __init__(self, compiled: Future[xgrammar.CompiledGrammar], max_num_drafts: int):
        self._compiled = compiled
        self._max_num_drafts = max_num_drafts
        self._matcher: xgrammar.GrammarMatcher | None = None

    @property
    def is_compiled(self) -> bool:
        """Whether the grammar is compiled (or failed to): `matcher` would not wait."""
        return self._compiled.done()

    @property
    def matcher(self) -> xgrammar.GrammarMatcher:
        if self._matcher is None:
            import xgrammar

            self._matcher = xgrammar.GrammarMatcher(
                self._compiled.result(), max_rollback_tokens=max(self._max_num_drafts, 1)
            )
        return self._matcher

    def advance(self, token_ids: list[int]) -> bool:
        """Moves past kept tokens; False when the grammar refuses one (the state stays before it).
        Nothing to move past: no wait for the compile."""
        if not token_ids:
            return True
        matcher = self.matcher
        for token_id in token_ids:
            if matcher.is_terminated():
                return True  # its stop token was accepted: the request ends here
            if not matcher.accept_token(token_id):
                return False
        return True
