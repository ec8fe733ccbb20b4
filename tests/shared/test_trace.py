"""Hop lines: none unless asked for; when asked, one JSON line per hop that counts the process's
Redis round trips (a pipeline is one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from shared.bus import RedisSettings
from shared.trace import TRACE_ENV

REPO = Path(__file__).resolve().parents[2]
TRACED = """
import asyncio, logging, sys
from services.runtime import setup_logging
from shared import trace
from shared.bus import RedisSettings, connect

async def main():
    setup_logging("WARNING", "test")
    client = await connect(RedisSettings(port=int(sys.argv[1])))  # one PING
    trace.hop("first", "r1")
    await client.set("k", "v")
    async with client.pipeline(transaction=False) as pipe:
        pipe.get("k")
        pipe.get("k")
        await pipe.execute()
    trace.hop("second", "r1", pos=3)
    await client.aclose()

asyncio.run(main())
"""


def traced_lines(port: int, enabled: bool) -> list[dict[str, object]]:
    env = {k: v for k, v in os.environ.items() if k != TRACE_ENV}
    if enabled:
        env[TRACE_ENV] = "1"
    done = subprocess.run(
        [sys.executable, "-c", TRACED, str(port)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stderr.splitlines() if '"hop"' in line]


def test_hops_are_logged_only_when_asked_for(redis_settings: RedisSettings) -> None:
    assert traced_lines(redis_settings.port, enabled=False) == []
    first, second = traced_lines(redis_settings.port, enabled=True)
    assert (first["hop"], first["request_id"], first["pos"]) == ("first", "r1", 0)
    assert (second["hop"], second["pos"]) == ("second", 3)
    assert int(second["rtt"]) - int(first["rtt"]) == 2  # the SET, and the pipeline of two GETs
    assert float(second["t"]) >= float(first["t"])
    assert first["pid"] == second["pid"]
