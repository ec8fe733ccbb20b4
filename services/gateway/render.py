"""From token events to OpenAI bodies: whole responses, stream chunks, usage and logprobs.

Text is passed through as the workers send it: each `TokenEvent.text` is a delta already decoded
at UTF-8 character boundaries (the worker's incremental detokenizer holds back a partial
character), so the gateway never re-splits or re-decodes it. Token strings for logprobs are the
tokenizer's own decoding of each token id.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from services.gateway.openai_api import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    SpeculativeUsage,
    TopLogprob,
    Usage,
)
from services.gateway.prepare import Job
from services.gateway.streaming import DeltaTemplate
from services.gateway.tool_calls import ToolCallStream, parse_tool_calls
from shared.protocol import TokenEvent, TokenLogprob
from shared.tokenizer import Tokenizer

OpenAIBody = Completion | ChatCompletion | ChatCompletionChunk


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_output_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    spec_stats: dict[str, Any] = field(default_factory=dict)
    text_offset: int = 0
    """Characters of token strings given in completion logprobs so far (their `text_offset`)."""
    tool_stream: ToolCallStream | None = None
    """Chat with tools, streamed: what the text deltas become."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """The prompt's, per position (None at 0), when the request asked for them."""
    first_token_at: float | None = None
    finished_at: float | None = None
    """time.perf_counter() of the first token and of the end (TTFT and TPOT)."""

    def note_prompt(self, event: TokenEvent) -> None:
        """Keeps the prompt's logprobs, which ride on the request's first event."""
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs

    def add(self, event: TokenEvent) -> None:
        self.note_prompt(event)
        now = time.perf_counter()
        if self.first_token_at is None and (event.token_ids or event.text):
            self.first_token_at = now
        self.text_parts.append(event.text)
        self.logprobs.extend(event.logprobs)
        self.num_output_tokens = max(self.num_output_tokens + len(event.token_ids), event.num_output_tokens)
        if event.spec_stats:  # cumulative per request; the latest wins
            self.spec_stats = event.spec_stats
        if event.finished:
            self.finished_at = now
            self.finish_reason = event.finish_reason
            self.stop_reason = event.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class TokenText:
    """Token strings and bytes for logprobs, cached per token id.

    For byte-level BPE vocabularies the bytes are a token's true bytes (a token holding half of a
    UTF-8 character has bytes, not U+FFFD's); for others, the UTF-8 of its decoded string.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._byte_level = _decoder_type(tokenizer) == "ByteLevel"
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.token_to_text(token_id)

    def _bytes(self, token_id: int) -> list[int]:
        if self._byte_level:
            piece = self.tokenizer.backend.id_to_token(token_id)
            if piece is not None and all(ch in _BYTE_OF_CHAR for ch in piece):
                return [_BYTE_OF_CHAR[ch] for ch in piece]
        return list(self.text(token_id).encode("utf-8"))


def usage(job: Job, choices: list[ChoiceState]) -> Usage:
    completion_tokens = sum(c.num_output_tokens for c in choices)
    return Usage(
        prompt_tokens=job.num_prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=job.num_prompt_tokens + completion_tokens,
        speculative=speculative_usage(choices),
    )


def speculative_usage(choices: list[ChoiceState]) -> SpeculativeUsage | None:
    """Draft and accepted tokens summed over the choices; None when no choice reported any."""
    stats = [c.spec_stats for c in choices if c.spec_stats]
    if not stats:
        return None
    num_drafts = sum(int(s.get("num_draft_tokens", 0)) for s in stats)
    num_accepted = sum(int(s.get("num_accepted_tokens", 0)) for s in stats)
    num_steps = sum(int(s.get("num_verify_steps", 0)) for s in stats)
    return SpeculativeUsage(
        num_draft_tokens=num_drafts,
        num_accepted_tokens=num_accepted,
        num_verify_steps=num_steps,
        mean_accepted_length=(num_accepted + num_steps) / num_steps if num_steps else 1.0,
    )


class Renderer:
    """Builds one job's bodies; `completion` and `chat` differ in shapes and logprobs format."""

    def __init__(self, job: Job, model: str, token_text: TokenText):
        self.job = job
        self.model = model
        self.token_text = token_text
        self._delta_templates: dict[int, DeltaTemplate] = {}
        """Per choice index, its text-only chunk (`delta_event`)."""

    def response(self, choices: list[ChoiceState]) -> Completion | ChatCompletion:
        job = self.job
        if job.kind == "completion":
            return Completion(
                id=job.request_id,
                created=job.created,
                model=self.model,
                choices=[
                    CompletionChoice(
                        index=c.index,
                        text=self._echo(c.index) + c.text,
                        logprobs=self._completion_logprobs(c, c.logprobs, echo=bool(job.echo_texts)),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=self._prompt_logprobs(c),
                    )
                    for c in choices
                ],
                usage=usage(job, choices),
            )
        return ChatCompletion(
            id=job.request_id,
            created=job.created,
            model=self.model,
            choices=[self._chat_choice(c) for c in choices],
            usage=usage(job, choices),
            prompt_logprobs=self._prompt_logprobs(choices[0]) if choices else None,
        )

    def _chat_choice(self, choice: ChoiceState) -> ChatChoice:
        """The message, with the tool calls found in the text when the request has tools."""
        message = ChatMessageOut(content=choice.text)
        finish_reason = choice.finish_reason
        if self.job.tools is not None:
            content, calls = parse_tool_calls(self.job.tools, choice.text)
            message = ChatMessageOut(content=content, tool_calls=[call.tool_call() for call in calls])
            finish_reason = _tool_finish_reason(finish_reason, bool(calls))
        return ChatChoice(
            index=choice.index,
            message=message,
            logprobs=self._chat_logprobs(choice.logprobs),
            finish_reason=finish_reason,
            stop_reason=choice.stop_reason,
        )

    def first_chunks(self, choices: list[ChoiceState]) -> list[OpenAIBody]:
        """Chat streams open each choice with a chunk carrying `role: assistant`; completion streams
        with `echo`, with one carrying the choice's prompt text (and with `logprobs`, the prompt's:
        each choice's first event brought them)."""
        if self.job.kind == "completion":
            return [
                Completion(
                    id=self.job.request_id,
                    created=self.job.created,
                    model=self.model,
                    choices=[
                        CompletionChoice(
                            index=i, text=text, logprobs=self._completion_logprobs(choices[i], [], echo=True)
                        )
                    ],
                )
                for i, text in enumerate(self.job.echo_texts)
            ]
        return [
            self._chat_chunk(ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")))
            for i in range(len(self.job.requests))
        ]

    def chunks(self, choice: ChoiceState, event: TokenEvent) -> list[OpenAIBody]:
        """The chunks for one event of `choice` (already added to it): one, none when it carries
        nothing, or with tools one per content piece and tool-call piece."""
        if self.job.tools is not None:
            return self._tool_chunks(choice, event)
        chunk = self.chunk(choice, event)
        return [chunk] if chunk is not None else []

    def _tool_chunks(self, choice: ChoiceState, event: TokenEvent) -> list[OpenAIBody]:
        assert self.job.tools is not None
        if choice.tool_stream is None:
            choice.tool_stream = ToolCallStream(self.job.tools)
        stream = choice.tool_stream
        deltas = stream.feed(event.text) + (stream.finish() if event.finished else [])
        chunks: list[OpenAIBody] = [
            self._chat_chunk(ChatChunkChoice(index=choice.index, delta=delta)) for delta in deltas
        ]
        if event.finished:
            finish_reason = _tool_finish_reason(event.finish_reason, stream.num_calls > 0)
            last = ChatChunkChoice(
                index=choice.index,
                delta=ChatDelta(),
                finish_reason=finish_reason,
                stop_reason=event.stop_reason,
            )
            chunks.append(self._chat_chunk(last))
        return chunks

    def delta_event(self, choice: ChoiceState, event: TokenEvent) -> bytes | None:
        """The SSE event of an event of `choice` that only adds text (no logprobs asked, no tools,
        not its end), from the choice's template: what `chunks` would give, serialized. None for
        any other event."""
        if not event.text or event.finished or self.job.logprobs is not None or self.job.tools is not None:
            return None
        template = self._delta_templates.get(choice.index)
        if template is None:
            body = self.chunk(choice, TokenEvent(event.request_id, text=DeltaTemplate.PLACEHOLDER))
            assert body is not None
            template = self._delta_templates[choice.index] = DeltaTemplate(body, self.job.include_usage)
        return template.event(event.text)

    def chunk(self, choice: ChoiceState, event: TokenEvent) -> OpenAIBody | None:
        """The chunk for one event of `choice` (already added to it); None when it carries nothing."""
        if not (event.text or event.logprobs or event.finished):
            return None
        finish_reason = event.finish_reason if event.finished else None
        stop_reason = event.stop_reason if event.finished else None
        if self.job.kind == "completion":
            return Completion(
                id=self.job.request_id,
                created=self.job.created,
                model=self.model,
                choices=[
                    CompletionChoice(
                        index=choice.index,
                        text=event.text,
                        logprobs=self._completion_logprobs(choice, event.logprobs),
                        finish_reason=finish_reason,
                        stop_reason=stop_reason,
                    )
                ],
            )
        return self._chat_chunk(
            ChatChunkChoice(
                index=choice.index,
                delta=ChatDelta(content=event.text) if event.text else ChatDelta(),
                logprobs=self._chat_logprobs(event.logprobs),
                finish_reason=finish_reason,
                stop_reason=stop_reason,
            )
        )

    def usage_chunk(self, choices: list[ChoiceState]) -> OpenAIBody:
        if self.job.kind == "completion":
            return Completion(
                id=self.job.request_id,
                created=self.job.created,
                model=self.model,
                choices=[],
                usage=usage(self.job, choices),
            )
        return ChatCompletionChunk(
            id=self.job.request_id,
            created=self.job.created,
            model=self.model,
            choices=[],
            usage=usage(self.job, choices),
        )

    def _echo(self, index: int) -> str:
        return self.job.echo_texts[index] if self.job.echo_texts else ""

    def _chat_chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.job.request_id, created=self.job.created, model=self.model, choices=[choice]
        )

    def _completion_logprobs(
        self, choice: ChoiceState, logprobs: list[TokenLogprob], echo: bool = False
    ) -> CompletionLogprobs | None:
        """OpenAI's legacy format, after the prompt's with `echo` (the first prompt token's logprob
        and alternatives are null); `text_offset` runs on across the chunks of a stream."""
        if self.job.logprobs is None:
            return None
        out = CompletionLogprobs()
        if echo:
            prompt_ids = self.job.requests[choice.index].prompt_token_ids
            entries = choice.prompt_logprobs or [None] * len(prompt_ids)
            for token_id, entry in zip(prompt_ids, entries):
                top = None if entry is None else entry.top[: self.job.logprobs]
                self._add_legacy(out, choice, token_id, None if entry is None else entry.logprob, top)
        for lp in logprobs:
            self._add_legacy(out, choice, lp.token_id, lp.logprob, lp.top)
        return out

    def _add_legacy(
        self,
        out: CompletionLogprobs,
        choice: ChoiceState,
        token_id: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
    ) -> None:
        token = self.token_text.text(token_id)
        out.tokens.append(token)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(None if top is None else {self.token_text.text(t): v for t, v in top})
        out.text_offset.append(choice.text_offset)
        choice.text_offset += len(token)

    def _prompt_logprobs(self, choice: ChoiceState) -> PromptLogprobs | None:
        """vLLM's `prompt_logprobs`: per position the prompt token's entry, then its alternatives."""
        if self.job.prompt_logprobs is None:
            return None
        prompt_ids = self.job.requests[choice.index].prompt_token_ids
        entries = choice.prompt_logprobs or [None] * len(prompt_ids)
        out: PromptLogprobs = []
        for token_id, entry in zip(prompt_ids, entries):
            if entry is None:
                out.append(None)
                continue
            tokens = {str(token_id): self._prompt_logprob(token_id, entry.logprob, entry.rank)}
            for rank, (t, v) in enumerate(entry.top[: self.job.prompt_logprobs], start=1):
                tokens.setdefault(str(t), self._prompt_logprob(t, v, rank))
            out.append(tokens)
        return out

    def _prompt_logprob(self, token_id: int, logprob: float, rank: int | None) -> PromptLogprob:
        return PromptLogprob(logprob=logprob, rank=rank, decoded_token=self.token_text.text(token_id))

    def _chat_logprobs(self, logprobs: list[TokenLogprob]) -> ChatLogprobs | None:
        if self.job.logprobs is None:
            return None
        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    token=self.token_text.text(lp.token_id),
                    logprob=lp.logprob,
                    bytes=self.token_text.bytes(lp.token_id),
                    top_logprobs=[
                        TopLogprob(token=self.token_text.text(t), logprob=v, bytes=self.token_text.bytes(t))
                        for t, v in lp.top
                    ],
                )
                for lp in logprobs
            ]
        )


def _tool_finish_reason(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's `tool_calls` for an answer that ended with calls (a cut one stays `length`)."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def _decoder_type(tokenizer: Tokenizer) -> str | None:
    try:
        decoder = json.loads(tokenizer.backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return None
    return decoder.get("type")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte <-> printable character table of byte-level BPE."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


_BYTE_OF_CHAR = {char: byte for byte, char in _bytes_to_unicode().items()}
