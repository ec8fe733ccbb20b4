"""KV transports by name: `make_transport("tcp")`, `make_transport("ipc")` (shared device memory on one
host, TCP otherwise); a GPU-to-GPU (NCCL) transport registers here later."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.kv_transport.base import KVTransport
from services.kv_transport.ipc import IpcKVTransport
from services.kv_transport.tcp import TcpKVTransport

TRANSPORTS: dict[str, Callable[..., KVTransport]] = {"tcp": TcpKVTransport, "ipc": IpcKVTransport}


def register_transport(name: str, factory: Callable[..., KVTransport]) -> None:
    if name in TRANSPORTS:
        raise ValueError(f"KV transport {name!r} is already registered")
    TRANSPORTS[name] = factory


def make_transport(name: str, **options: Any) -> KVTransport:
    """A new transport of kind `name`, built with `options` (e.g. `connect_timeout_s` for "tcp")."""
    factory = TRANSPORTS.get(name)
    if factory is None:
        raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(sorted(TRANSPORTS))}")
    return factory(**options)
