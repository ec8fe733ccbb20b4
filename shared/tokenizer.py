"""Tokenizer of a Hugging Face model directory: `tokenizers` for the work, Jinja2 for chat templates."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from shared.errors import ModelConfigError


class Tokenizer:
    """Encodes prompts, renders chat templates, and knows the model's end-of-sequence ids."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelConfigError(f"{model_dir} has no tokenizer.json")
        self.backend = HFTokenizer.from_file(str(path))
        self.config = _read_json(model_dir / "tokenizer_config.json")
        generation = _read_json(model_dir / "generation_config.json")
        model_config = _read_json(model_dir / "config.json")
        self.chat_template: str | None = self.config.get("chat_template")
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.eos_token_ids = frozenset(
            _ids(generation.get("eos_token_id"))
            | _ids(model_config.get("eos_token_id"))
            | self._ids_of([self.eos_token])
        )

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. The batch call lets go of the interpreter lock while it works (a long
        prompt encoded on a thread does not stall the others) and computes no offsets."""
        [encoding] = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def token_to_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def decode_stream(self, prefix_ids: list[int], skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, prefix_ids, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Renders messages with the model's own chat template (from tokenizer_config.json)."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer_config.json has no chat_template; use /v1/completions")
        return self._chat_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    @cached_property
    def _chat_template(self) -> Template:
        """Compiled once (milliseconds each time otherwise); rendering it is thread-safe."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        return env.from_string(self.chat_template or "")

    def _ids_of(self, tokens: list[str | None]) -> set[int]:
        ids = (self.backend.token_to_id(t) for t in tokens if t)
        return {i for i in ids if i is not None}


class IncrementalDecoder:
    """Turns a growing list of output ids into text deltas, never splitting a UTF-8 character.

    The stream is primed with the last prompt tokens so tokenizers that strip a leading space
    (SentencePiece-style) decode the first output token as it reads in context.
    """

    PRIME_TOKENS = 6

    def __init__(self, tokenizer: Tokenizer, prefix_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.stream = DecodeStream(
            ids=prefix_ids[-self.PRIME_TOKENS :], skip_special_tokens=skip_special_tokens
        )

    def step(self, token_ids: list[int]) -> str:
        """Feeds new ids; returns the text they complete ('' while a character is still partial)."""
        chunk = self.stream.step(self.tokenizer.backend, token_ids)
        return chunk or ""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as a dict
        return str(value.get("content"))
    return value if isinstance(value, str) else None


def _ids(value: object) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list | tuple):
        return {int(v) for v in value}
    raise ModelConfigError(f"eos_token_id must be an int or a list of ints, not {value!r}")


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template error: {message}")
