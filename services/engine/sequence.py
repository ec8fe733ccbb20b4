"""One request's state inside a worker: its tokens, its KV blocks and how far the cache has caught up."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from shared.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the client or the operator


@dataclass
class TokenLogprobs:
    """Log-probability of the sampled token and the top-n alternatives at one step."""

    token_id: int
    logprob: float
    top: dict[int, float]


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
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    generator: torch.Generator | None = None
    first_token_time: float | None = None

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
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
