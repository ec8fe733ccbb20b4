"""Turning validation failures into one-line messages a user can act on."""

from __future__ import annotations

from pydantic import ValidationError


class ModelConfigError(ValueError):
    """A checkpoint specmesh cannot serve, with the reason (defined here, not in shared.model, so
    torch-free processes such as the gateway can raise and catch it)."""


def describe_validation_error(exc: ValidationError) -> str:
    """`field: what is wrong (got value)` for each problem, joined by '; '."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or exc.title
        message = error["msg"].removeprefix("Value error, ")
        got = (
            f" (got {error['input']!r})"
            if error["type"] != "missing" and "input" in error and not isinstance(error["input"], dict)
            else ""
        )
        parts.append(f"{where}: {message}{got}")
    return "; ".join(parts)
