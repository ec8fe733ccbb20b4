"""Per-request sampling parameters, validated once where the request enters the system."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.json_types import INTEGRAL
from shared.speculative_config import SpeculativeOverride
from shared.structured_output import StructuredOutput

MAX_LOGPROBS = 20
"""Upper bound on `logprobs` (top-n alternatives returned per generated token)."""

# The range of each field, declared once: `SamplingParams` and the gateway's request bodies (and so
# its OpenAPI document) use these types.
Temperature = Annotated[float, Field(ge=0.0, le=100.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=-1), INTEGRAL]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
Seed = Annotated[int, Field(ge=0, lt=2**63), INTEGRAL]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
"""Presence and frequency penalties."""
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=10.0)]
MaxTokens = Annotated[int, Field(ge=1), INTEGRAL]
MinTokens = Annotated[int, Field(ge=0), INTEGRAL]
TokenId = Annotated[int, Field(ge=0), INTEGRAL]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL]
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0)]
"""Added to a token's logit (OpenAI's range: -100 bans a token, 100 all but forces it)."""
MAX_LOGIT_BIAS_TOKENS = 1024
"""Most tokens one request may bias: the bias is written into every verified row's logits."""


class SamplingParams(BaseModel):
    """How one request turns the target model's logits into tokens, and when it stops.

    Processing order per step (as vLLM v1): grammar mask → logit bias → repetition / frequency / presence penalties →
    temperature → min_p → top_k → top_p → sample. `temperature == 0` means greedy (argmax of the
    penalised logits; the truncation settings are then irrelevant).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: Temperature = 1.0
    """Softmax temperature; 0 selects greedy decoding."""
    top_p: TopP = 1.0
    """Keep the smallest set of most likely tokens whose probability mass reaches `top_p`."""
    top_k: TopK = 0
    """Keep the `top_k` most likely tokens; 0 or -1 disables."""
    min_p: MinP = 0.0
    """Drop tokens whose probability is below `min_p` times the most likely token's."""
    seed: Seed | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    presence_penalty: Penalty = 0.0
    """Subtracted once from the logit of every token already generated."""
    frequency_penalty: Penalty = 0.0
    """Subtracted from a token's logit once per time it was generated."""
    repetition_penalty: RepetitionPenalty = 1.0
    """CTRL-style penalty on tokens of prompt and output: positive logits divided, negative multiplied."""
    max_tokens: MaxTokens = 16
    """Most tokens to generate."""
    min_tokens: MinTokens = 0
    """EOS and stop token ids are suppressed, and stop strings ignored, until this many tokens exist."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings; the text ends just before the first one (it is not returned)."""
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    """Token ids that end the request (kept in `token_ids`, left out of the text)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    logit_bias: dict[TokenId, LogitBias] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS_TOKENS)
    """Token id -> value added to its logit before anything else, at every position."""
    logprobs: Logprobs | None = None
    """Return the sampled token's log-probability and the top-n alternatives of each step."""
    prompt_logprobs: Logprobs | None = None
    """Return each prompt token's log-probability (given the tokens before it; the first token has
    none) and the top-n alternatives at its position; 0: the prompt token's own only (vLLM's field).
    Such a request takes no prefix-cache hits: every prompt position must run through the model."""
    skip_special_tokens: bool = True
    """Leave special tokens (EOS, chat markers) out of the text."""
    speculative: SpeculativeOverride | None = None
    """This request's own speculative method / k, or speculation off (within the server's limits)."""
    structured: StructuredOutput | None = None
    """The grammar the output must follow (JSON schema, JSON object, regex, choice); every sampled
    and verified row is masked to the tokens it allows."""

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @model_validator(mode="after")
    def _check_ranges(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def changes_logits(self) -> bool:
        """Whether the logits are changed before temperature: penalties, a logit bias or a grammar."""
        return self.has_penalties or bool(self.logit_bias) or self.structured is not None

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
