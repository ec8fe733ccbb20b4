"""Structured output: the grammar a request's tokens must follow, and its check where it enters.

A request may constrain its output to a JSON Schema, to any JSON object, to a regular expression
or to one of a list of strings. The grammar engine is xgrammar (picked by its per-step mask cost:
BENCHMARKS.md "Structured output"); this module checks a grammar without a tokenizer (the gateway's
400), services/engine/grammar.py compiles it for the model's vocabulary and follows it per request.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

StructuredKind = Literal["json_schema", "json_object", "regex", "choice"]
JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""`response_format: json_object`: any JSON object."""
REGEX_METACHARACTERS = frozenset("\\.^$|?*+()[]{}/-")


class StructuredOutputError(ValueError):
    """A schema, regex or choice list the grammar engine cannot follow, with the reason."""


class StructuredOutput(BaseModel):
    """What a request's output must match. Hashable: the engine compiles each distinct one once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: StructuredKind
    spec: str = ""
    """json_schema: the schema as JSON text; regex: the pattern; choice: a JSON array of the strings;
    json_object: empty."""
    strict: bool = False
    """json_schema only: objects take no properties beyond those listed, whatever the schema says of
    `additionalProperties` (OpenAI's `strict: true`); false follows JSON Schema (extra properties
    allowed unless the schema forbids them)."""

    @model_validator(mode="after")
    def _spec_for_kind(self) -> StructuredOutput:
        if self.kind == "json_object" and self.spec:
            raise ValueError("json_object takes no spec")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"{self.kind} needs a spec")
        return self

    @classmethod
    def json_schema(cls, schema: Any, strict: bool = False) -> StructuredOutput:
        """From a schema given as a JSON object (a dict) or as its JSON text (vLLM's `guided_json`)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise StructuredOutputError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls(kind="json_schema", spec=json.dumps(schema), strict=strict)

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise StructuredOutputError("guided_choice must be a non-empty list of non-empty strings")
        return cls(kind="choice", spec=json.dumps(choices))

    @property
    def choices(self) -> list[str]:
        return list(json.loads(self.spec)) if self.kind == "choice" else []

    def regex(self) -> str:
        """The pattern of a regex or choice grammar: the choices as literal alternatives."""
        if self.kind == "choice":
            return "(" + "|".join(_regex_literal(c) for c in self.choices) + ")"
        return self.spec

    def check(self) -> None:
        """Builds the grammar without a vocabulary: raises StructuredOutputError when the engine
        cannot follow it (bad regex, malformed or unsupported schema)."""
        import xgrammar

        try:
            if self.kind in ("regex", "choice"):
                xgrammar.Grammar.from_regex(self.regex())
            else:
                xgrammar.Grammar.from_json_schema(self.schema_text(), **self.json_options())
        except (RuntimeError, ValueError, TypeError) as exc:
            what = "regex" if self.kind in ("regex", "choice") else "JSON schema"
            raise StructuredOutputError(f"unsupported or invalid {what}: {_first_line(exc)}") from None

    def schema_text(self) -> str:
        return JSON_OBJECT_SCHEMA if self.kind == "json_object" else self.spec

    def json_options(self) -> dict[str, Any]:
        """xgrammar's JSON settings: compact separators (a small model otherwise may loop on
        whitespace), strict mode as the request asks."""
        return {"any_whitespace": False, "strict_mode": self.strict}


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in REGEX_METACHARACTERS else c for c in text)


def _first_line(exc: BaseException) -> str:
    """The engine's message without its source location (`[12:00:00] /path/file.cc:83: `)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return _SOURCE_LOCATION.sub("", lines[-1]) if lines else type(exc).__name__


_SOURCE_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
