"""Grammar-constrained decoding: each distinct grammar compiled once for the model's vocabulary, and
per request a matcher that gives the token bitmask of every row the step verifies.

A request with `k` drafts has `k + 1` verified rows; row `j` is sampled after the request's kept
tokens and its first `j` drafts, so its mask is the grammar's allowed next tokens in that state. A
draft the grammar refuses is masked out of its own row and so rejected there (whatever the
verification strategy); the rows after it are never used. The matcher is advanced over the drafts
only to fill the masks, rolled back at once, and then advanced by the tokens the step kept.

The masks are an input of the fused verify (`kernels.verify_sample`); no draft distribution needs
one: drafting models draw their drafts with the target's own noise and the verifier treats every
draft as a fixed token (services/engine/rejection_sampler.py), so the acceptance test reads only the
masked target distribution. A drafting model proposes without the grammar (its chain runs on the
device, the matcher on the host); a draft it proposes outside the grammar is rejected at its row.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
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


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab_size / 32)] int32, every token allowed."""
    return torch.full((num_rows, num_mask_words(vocab_size)), -1, dtype=torch.int32)


class StepMasks:
    """The grammar masks of a step's verified rows, filled on the host while the step's forward
    runs and copied into the verifier's input behind it. On a GPU the host buffer is page-locked,
    so the copy is queued on the stream and the host goes on; it is refilled only once the last
    copy out of it is done."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.num_words = num_mask_words(vocab_size)
        self.device = device
        self._host = torch.empty(0, self.num_words, dtype=torch.int32)
        self._copied: torch.cuda.Event | None = None

    def fill(self, seqs: list[Sequence], cu_num_rows: np.ndarray) -> torch.Tensor:
        """[num_rows, num_words] int32 on the host: request i's rows `cu_num_rows[i] ..` get the masks of its
        grammar after its first drafts (every token allowed where the grammar is terminated or a
        draft was refused before); rows of requests without a grammar are left unwritten."""
        host = self._buffer(int(cu_num_rows[-1]))
        for seq, start, end in zip(seqs, cu_num_rows[:-1].tolist(), cu_num_rows[1:].tolist()):
            if seq.grammar is not None:
                host[start:end] = -1
                seq.grammar.fill_rows(seq.spec.draft_token_ids[: end - start - 1], host, start)
        return host

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


class GrammarCompiler:
    """Compiles grammars on a thread of its own, off the step: a request's grammar starts compiling
    when the request arrives, and the step that first needs it waits only for what is left."""

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
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


class GrammarState:
    """One request's place in its grammar: advanced by the tokens the request kept, never by drafts."""

    def __init__(self, compiled: Future[xgrammar.CompiledGrammar], max_num_drafts: int):
        self._compiled = compiled
        self._max_num_drafts = max_num_drafts
        self._matcher: xgrammar.GrammarMatcher | None = None

    @property
    def matcher(self) -> xgrammar.GrammarMatcher:
        if self._matcher is None:
            import xgrammar

            self._matcher = xgrammar.GrammarMatcher(
                self._compiled.result(), max_rollback_tokens=max(self._max_num_drafts, 1)
            )
        return self._matcher

    def advance(self, token_ids: list[int]) -> bool:
        """Moves past kept tokens; False when the grammar refuses one (the state stays before it)."""
        matcher = self.matcher
        for token_id in token_ids:
            if matcher.is_terminated():
                return True  # its stop token was accepted: the request ends here
            if not matcher.accept_token(token_id):
                return False
        return True

    def fill_rows(self, draft_token_ids: list[int], bitmask: torch.Tensor, first_row: int) -> None:
        """Writes the masks of rows `first_row .. first_row + len(draft_token_ids)`: row j allows what
        may follow the kept tokens and the first j drafts. Rows after a refused draft stay as they
        were (the refused draft ends the request's accepted run)."""
        matcher = self.matcher
        if matcher.is_terminated():
            return
        matcher.fill_next_token_bitmask(bitmask, first_row)
        num_taken = 0
        for j, draft in enumerate(draft_token_ids):
            if not matcher.accept_token(draft):
                break
            num_taken += 1
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(bitmask, first_row + j + 1)
        if num_taken:
            matcher.rollback(num_taken)
