"""One request's state inside a worker: its tokens, its KV blocks and how far the cache has caught up."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from services.engine.grammar import GrammarState
from shared.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the client or the operator
    HANDOFF = "handoff"  # prefill done here; decoding continues on another instance (internal)


@dataclass
class TokenLogprobs:
    """Log-probability of the sampled token and the top-n alternatives at one step."""

    token_id: int
    logprob: float
    top: dict[int, float]
    rank: int | None = None
    """The token's rank in the vocabulary by logprob (1: the most likely); prompt tokens only."""


@dataclass
class SpecState:
    """A request's speculative decoding state and statistics."""

    method: str = "naive"
    max_k: int = 0
    """The most drafts this request may get per step (engine limit or the request's override)."""
    k: int = 0
    """Drafts to ask for next step (adaptive, at most max_k)."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Drafts proposed for the next step; not part of token_ids until verified."""
    draft_parents: list[int] = field(default_factory=list)
    """Where the drafts are a tree: each draft's parent node (0: the root, the newest token; draft j
    is node j + 1), at least as long as draft_token_ids (whose prefix a step may keep)."""
    acceptance: float = 0.7
    """Running estimate of the chance that one draft is accepted."""
    num_refused: int = 0
    """Drafts of the pending step its grammar refused, cut before verification (counted as a rejection)."""
    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_refused_draft_tokens: int = 0
    """Drafts its grammar refused on the host, never verified (not in num_draft_tokens)."""
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """Books one verify step with `num_drafts` drafts of which the first `num_accepted` passed,
        after the grammar refused `num_refused` more."""
        self.num_refused_draft_tokens += self.num_refused
        if num_drafts == 0:
            return
        self.num_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        grow = num_drafts - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for j in range(num_drafts):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += j < num_accepted

    def stats(self) -> dict[str, object]:
        """Draft / accepted counts, mean accepted length (bonus token included), per-position acceptance."""
        steps = max(self.num_steps, 1)
        return {
            "method": self.method,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_refused_draft_tokens": self.num_refused_draft_tokens,
            "num_verify_steps": self.num_steps,
            "mean_accepted_length": (self.num_accepted_tokens + self.num_steps) / steps
            if self.num_steps
            else 1.0,
            "acceptance_per_position": [
                a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)
            ],
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
        }


@dataclass
class Sequence:
    """Tokens of one request and their KV-cache bookkeeping.

    `num_computed_tokens` counts tokens whose keys and values are in the cache; the last sampled
    token is never among them until the next step feeds it to the model.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.monotonic)
    queued_at: float = field(default_factory=time.time)
    """Wall-clock time the request arrived at the mesh (kept when it is placed again): its place in
    the waiting queue."""
    token_ids: list[int] = field(init=False)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    """Prefix-cache chain hashes of the leading full blocks already offered to the cache."""
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache at admission."""
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the request, if any."""
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    """One per output token when the request asked for logprobs; None for a token sampled on
    another instance (a resumed request's earlier output, a handed-off request's first token)."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """Per prompt position (None at 0, and where not computed yet), for requests that asked for
    them and run their prompt here; None otherwise."""
    seed: int = 0
    """Sampling seed: the request's own, or drawn for it at admission."""
    first_token_time: float | None = None
    spec: SpecState = field(default_factory=SpecState)
    handoff: bool = False
    """Prefill-only: after the first token, the request's KV moves to a decode instance."""
    grammar: GrammarState | None = None
    """Where the request stands in its grammar (requests with structured output)."""

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """All tokens but the last sampled one are in the cache: the next step is a decode."""
        return self.num_uncomputed_tokens == 1 and self.finish_reason is None

    @property
    def scores_prompt(self) -> bool:
        """Whether this request's prefill must compute its prompt's logprobs (it asked for them and
        has not produced a token yet): it then takes no prefix-cache hit."""
        return self.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def append_tokens(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        if self.first_token_time is None and token_ids:
            self.first_token_time = time.monotonic()
