"""Tokenizer of a Hugging Face model directory: `tokenizers` for the work, Jinja2 for chat templates."""

from __future__ import annotations

import json
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from shared.errors import ModelConfigError

DEFAULT_TEMPLATE = "default"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""Where current transformers saves the default chat template (beside tokenizer_config.json)."""


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
        self.chat_templates = _chat_templates(model_dir, self.config.get("chat_template"))
        """Named chat templates: `default`, and others a tokenizer may carry (`tool_use`, `rag`)."""
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self._templates: dict[str, Template] = {}
        self._compile_lock = threading.Lock()
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

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get(DEFAULT_TEMPLATE)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Renders messages with the model's own chat template, as transformers does: `tools` and
        `documents` pick the `tool_use` / `rag` template where the tokenizer has one, and
        `continue_final_message` leaves the last message open for the model to go on with."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        if continue_final_message and not (messages and isinstance(messages[-1].get("content"), str)):
            raise ValueError("continue_final_message needs a last message with text content")
        name = _template_name(self.chat_templates, tools, documents)
        special = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        rendered = self._compiled(name).render(
            **{**special, **(template_kwargs or {})},
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
        )
        if continue_final_message:
            return _cut_after_final_message(rendered, messages[-1]["content"])
        return rendered

    def _compiled(self, name: str) -> Template:
        """Compiled once per template (milliseconds each time otherwise); rendering is thread-safe."""
        with self._compile_lock:
            if name not in self._templates:
                self._templates[name] = _template_environment().from_string(self.chat_templates[name])
            return self._templates[name]

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


def _chat_templates(model_dir: Path, configured: object) -> dict[str, str]:
    """The tokenizer's templates by name: `chat_template.jinja` wins over tokenizer_config.json's
    `chat_template`, a string or a list of `{"name", "template"}` (transformers' two layouts)."""
    templates: dict[str, str] = {}
    if isinstance(configured, str):
        templates[DEFAULT_TEMPLATE] = configured
    elif isinstance(configured, list):
        for entry in configured:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)):
                raise ModelConfigError(
                    f"{model_dir / 'tokenizer_config.json'}: chat_template entries must be "
                    f'{{"name": ..., "template": ...}}, got {entry!r}'
                )
            templates[entry["name"]] = str(entry.get("template", ""))
    elif configured is not None:
        raise ModelConfigError(
            f"{model_dir / 'tokenizer_config.json'}: chat_template must be a string or a list, "
            f"not {type(configured).__name__}"
        )
    path = model_dir / CHAT_TEMPLATE_FILE
    if path.is_file():
        templates[DEFAULT_TEMPLATE] = path.read_text()
    return {name: text for name, text in templates.items() if text}


def _template_name(
    templates: dict[str, str], tools: list[dict[str, Any]] | None, documents: list[dict[str, Any]] | None
) -> str:
    if not templates:
        raise NoChatTemplateError(
            f"this model has no chat template (neither {CHAT_TEMPLATE_FILE} nor a chat_template in "
            "tokenizer_config.json); use /v1/completions"
        )
    for wanted, name in ((tools, "tool_use"), (documents, "rag")):
        if wanted and name in templates:
            return name
    if DEFAULT_TEMPLATE in templates:
        return DEFAULT_TEMPLATE
    names = ", ".join(sorted(templates))
    raise NoChatTemplateError(f"this model has no default chat template (it has: {names})")


def _template_environment() -> ImmutableSandboxedEnvironment:
    """Jinja as transformers sets it up for chat templates: trimmed blocks, loop controls,
    `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII characters."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


def _cut_after_final_message(rendered: str, final_message: str) -> str:
    """The rendering up to the end of the last message's content, so the model continues it (what
    the template adds after it, an end-of-turn marker, is dropped)."""
    stripped = final_message.strip()
    at = rendered.rfind(stripped) if stripped else -1
    if at < 0:
        raise ValueError(
            "continue_final_message: the chat template does not render the last message's content"
        )
    if rendered[at : at + len(final_message.lstrip())] == final_message.lstrip():
        return rendered[: at + len(final_message.lstrip())]
    return rendered[: at + len(stripped)]


def _tojson(
    value: object, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class NoChatTemplateError(ValueError):
    """The model has no chat template to render messages with."""


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template error: {message}")
