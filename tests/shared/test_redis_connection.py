"""Under uvloop (every service's event loop), a Redis connection whose transport the loop has closed
(the server went away or reset it) fails as a Redis ConnectionError, as under asyncio's own loop:
a pooled client retries the command on a new connection, and the loops that wait an outage out
retry it. uvloop itself raises a RuntimeError there, which once killed the scheduler's request
loop after a Redis restart."""

from __future__ import annotations

import asyncio

import pytest
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.bus import RedisSettings, connect


async def closed_under_the_pool(settings: RedisSettings) -> tuple[object, object]:
    """(a direct command's outcome, the client's answer) on connections whose transports were closed
    under them while they sat in the pool."""
    client = await connect(settings)
    try:
        pool = client.connection_pool
        connection = await pool.get_connection()
        connection._writer.transport.abort()  # what the loop does to a connection the server reset
        await asyncio.sleep(0.05)
        try:
            await connection.send_command("PING")
            direct: object = await connection.read_response()
        except Exception as exc:
            direct = exc
        await pool.release(connection)
        connection = await pool.get_connection()
        connection._writer.transport.abort()
        await pool.release(connection)
        return direct, await client.ping()
    finally:
        await client.aclose()


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_closed_transport_is_a_connection_error_and_the_client_retries(redis_port: int, loop: str) -> None:
    run = uvloop.run if loop == "uvloop" else asyncio.run
    direct, answer = run(closed_under_the_pool(RedisSettings(port=redis_port)))
    assert isinstance(direct, RedisConnectionError), repr(direct)
    assert answer is True
