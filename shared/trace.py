"""Hop timestamps of requests through the mesh, to find where their latency goes.

Off unless `SPECMESH_TRACE_HOPS=1` is in the environment (`benchmarks.overhead --trace-hops` sets it
for the mesh it launches). Then every process logs, on the `specmesh.hops` logger at DEBUG level
(whatever the process's own level), one line per *hop*: a named point a request's row passed,

    {"hop": "worker.published", "request_id": "...", "pos": 12, "t": <time.time()>, "rtt": 57, "pid": 9}

`pos` is the request's output tokens after the row (0 before its first), `t` the wall clock (the
processes share one host, so their clocks agree), `rtt` the Redis round trips this process had made
so far (every connection of `shared.bus.connect` counts the commands or pipelines it sends), or
null in a line logged for another process (a worker logs its engine core's step hops): its count
is not known there.
`benchmarks/hops.py` joins the lines of every process's log into the time and the round trips
between consecutive hops.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable

from shared.redis_connection import Connection

TRACE_ENV = "SPECMESH_TRACE_HOPS"
ENABLED = os.environ.get(TRACE_ENV) == "1"
logger = logging.getLogger("specmesh.hops")
if ENABLED:
    logger.setLevel(logging.DEBUG)


class RoundTrips:
    """Redis round trips this process has made (counted only while tracing)."""

    count = 0


class CountingConnection(Connection):
    """A Redis connection that counts each send: one command, or one pipeline, is one round trip."""

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        RoundTrips.count += 1
        await super().send_packed_command(command, check_health)


def hop(name: str, request_id: str, pos: int = 0, at: float | None = None, pid: int | None = None) -> None:
    """Logs that `request_id`'s row of `pos` output tokens reached `name` (at `at`, else now).
    `pid`: the process it happened in, where another logs it for that one (a worker for its engine
    core: its round trips are not counted here, so they are logged as null)."""
    if ENABLED:
        t = time.time() if at is None else at
        rtt = RoundTrips.count if pid is None else None
        fields = {"hop": name, "request_id": request_id, "pos": pos, "t": t, "rtt": rtt}
        logger.debug(name, extra={**fields, "pid": os.getpid() if pid is None else pid})
