"""The speculative methods a benchmark compares, by name, as `--speculative-config` objects.

`naive` (the speculative path with no drafts) is the baseline of every comparison and always runs.
Model-free methods work on any model; `mtp`, `hybrid` (MTP drafts topped up with n-gram drafts) and
`draft_model` use the heads trained for the shipped reference model, so they are offered only for
it. Any other configuration can be named on the command line as `label={json}`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shared.reference import DRAFT_MODEL, MTP_HEAD, reference_dir
from shared.speculative_config import (
    MAX_MODEL_BASED_TOKENS,
    MAX_MODEL_FREE_TOKENS,
    MODEL_BASED_METHODS,
    SpeculativeConfig,
    SpeculativeOverride,
)

BASELINE = "naive"
MODEL_FREE: dict[str, dict[str, Any]] = {
    "naive": {"method": "naive"},
    "ngram": {"method": "ngram", "num_speculative_tokens": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}
REFERENCE_ONLY = ("mtp", "hybrid", "draft_model")


def reference_methods() -> dict[str, dict[str, Any]]:
    """The model-based methods of the reference family (paths resolved in this checkout)."""
    mtp, draft = str(reference_dir(MTP_HEAD)), str(reference_dir(DRAFT_MODEL))
    return {
        "mtp": {"method": "mtp", "model": mtp, "num_speculative_tokens": 1},
        "hybrid": {
            "method": "mtp",
            "model": mtp,
            "num_speculative_tokens": 3,
            "num_model_steps": 1,
            "mtp_strategy": "with_ngram",
        },
        "draft_model": {"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
    }


def is_reference_model(model: str) -> bool:
    try:
        return Path(model).resolve() == reference_dir().resolve()
    except FileNotFoundError:
        return False


def known_methods(model: str) -> dict[str, dict[str, Any]]:
    return {**MODEL_FREE, **(reference_methods() if is_reference_model(model) else {})}


def resolve_methods(names: list[str] | None, model: str) -> dict[str, dict[str, Any]]:
    """label -> speculative config, `naive` first; every config validated before anything runs.
    None: every method this model supports."""
    known = known_methods(model)
    chosen: dict[str, dict[str, Any]] = {}
    for name in names or list(known):
        label, config = _parse(name, known, model)
        chosen[label] = config
    ordered = {BASELINE: MODEL_FREE[BASELINE], **{k: v for k, v in chosen.items() if k != BASELINE}}
    for label, config in ordered.items():
        try:
            SpeculativeConfig.model_validate(config)
        except ValueError as exc:
            raise ValueError(f"method {label!r}: {exc}") from None
    return ordered


def with_k(config: dict[str, Any], k: int) -> dict[str, Any]:
    """The same method drafting `k` tokens a step (MTP chains at most k steps)."""
    updated = {**config, "num_speculative_tokens": k}
    if "num_model_steps" in config:
        updated["num_model_steps"] = min(int(config["num_model_steps"]), k)
    return updated


def max_k(config: dict[str, Any]) -> int:
    return MAX_MODEL_BASED_TOKENS if config["method"] in MODEL_BASED_METHODS else MAX_MODEL_FREE_TOKENS


def request_override(config: dict[str, Any]) -> dict[str, Any]:
    """The per-request `speculative` field that asks a running server for this method (it must have
    the method loaded; model-free methods always are)."""
    if config["method"] == BASELINE:
        override = SpeculativeOverride(enabled=False)
    else:
        override = SpeculativeOverride(
            method=config["method"], num_speculative_tokens=config.get("num_speculative_tokens")
        )
    return override.model_dump(exclude_none=True)


def _parse(name: str, known: dict[str, dict[str, Any]], model: str) -> tuple[str, dict[str, Any]]:
    label, sep, raw = name.partition("=")
    if sep:
        config = json.loads(raw)
        if not isinstance(config, dict):
            raise ValueError(f"method {label!r}: the configuration must be a JSON object")
        return label, config
    if name in known:
        return name, known[name]
    if name in REFERENCE_ONLY:
        raise ValueError(
            f"method {name!r} uses the reference model's trained heads; {model} is not the reference "
            f"model, so pass it as '{name}={{json}}' with your own head / draft model"
        )
    raise ValueError(f"unknown method {name!r}; known: {', '.join(known)} (or label={{json}})")
