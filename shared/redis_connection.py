"""The connection every Redis client of the mesh uses: redis-py's, with a broken connection failing
as a ConnectionError under uvloop too.

Writing to a connection whose transport the event loop has closed (the server went away, or reset
the connection) fails in asyncio's own loop with an OSError, which redis-py turns into a
ConnectionError: a pooled client then retries on a new connection, and every loop that waits an
outage out (`shared.bus.TRANSIENT_ERRORS`) retries too. uvloop, which every service runs on,
refuses the write with a RuntimeError instead ("unable to perform operation on <TCPTransport
closed=True ...>; the handler is closed"), which gets past all of those: after a Redis restart a
scheduler's request loop died of it and the scheduler stopped admitting requests while it stayed
alive.
"""

from __future__ import annotations

from collections.abc import Iterable

from redis.asyncio.connection import Connection as RedisPyConnection
from redis.exceptions import ConnectionError as RedisConnectionError

CLOSED_TRANSPORT = "the handler is closed"
"""How uvloop's refusal to write to a closed transport ends."""


class Connection(RedisPyConnection):
    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        try:
            await super().send_packed_command(command, check_health)
        except RuntimeError as exc:  # redis-py has disconnected the connection already
            if CLOSED_TRANSPORT not in str(exc):
                raise
            raise RedisConnectionError(
                f"Error while writing to socket: the connection is closed ({exc})"
            ) from None
