"""JSON values as request bodies take them, strict otherwise."""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator


def _integral(value: object) -> object:
    """JSON has one number type, and JSON Schema's `integer` is any number without a fraction: a
    client that sends `3.0` means 3. `2.5` and `"3"` are still refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


INTEGRAL = BeforeValidator(_integral)
"""Annotates an integer field of a request body to take `3.0` as 3; last in its `Annotated`, after
the field's range, so that the range stays in the field's JSON Schema."""
JsonInt = Annotated[int, INTEGRAL]
