"""Grammar-constrained decoding: each distinct grammar compiled once for the model's vocabulary, and
per request a matcher that gives the token bitmask of every row the step verifies.

A request with `k` drafts has `k + 1` verified rows; row `j` is sampled after the request's kept
tokens and its first `j` drafts, so its mask is the grammar's allowed next tokens in that state. A
draft the grammar refuses is masked out of its own row and so rejected there (whatever the
verification strategy); the rows after it are never used. The matcher is advanced over the drafts
only to fill the masks, rolled back at once, and then advanced by the tokens the step kept.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from shared.structured_output import StructuredOutput
from shared.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
"""Compiled grammars kept (least recently used dropped first); a JSON schema's is tens of KiB."""


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab_size / 32)] int32, every token allowed."""
    return torch.full((num_rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


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
