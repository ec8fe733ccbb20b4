"""schemathesis over the gateway's own /openapi.json: for every operation, generated valid and invalid
requests against a live gateway (a real HTTP server on a port, the scripted in-process mesh behind
it) get no 5xx, answer within a timeout, and answer what the document says, streamed chunks included.
Seeded and deterministic: the same requests every run."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from xml.etree import ElementTree

import pytest
from aiohttp import web
from gateway_fake_backend import InProcessBackend, reply_script

from services.gateway.app import GatewaySettings, create_app
from services.gateway.openapi import OPERATIONS
from services.gateway.prepare import ServedModel

API_KEY = "fuzz-key"
MAX_EXAMPLES = 50
"""Generated requests per operation and phase (boundary values first, then random ones)."""
SEED = 14
RESPONSE_TIMEOUT_S = 20.0
"""A request not answered this long after it was sent is a hang (answers take milliseconds)."""
MAX_STREAM_EVENTS = 100_000
"""More than any stream sends (128 choices of the scripted reply): schemathesis stops reading a
stream after this many events, or at the request timeout."""
RUN_TIMEOUT_S = 240.0
HOOKS = Path(__file__).with_name("schemathesis_hooks.py")
"""The check of every streamed chunk against the document."""
EXCLUDED_CHECKS = ("positive_data_acceptance",)
"""A request the document admits may still get a 400 for what JSON Schema cannot say: a prompt too
long for the context, token ids past the vocabulary, fields that conflict (`best_of` != `n`)."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class LiveGateway:
    """The gateway app on 127.0.0.1, served by an event loop of its own in a thread (as `specmesh
    gateway` serves it), so a process of schemathesis can reach it while the test waits."""

    def __init__(self, served: ServedModel):
        self.served = served
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="gateway", daemon=True)
        self.runner: web.AppRunner | None = None
        self.base_url = ""

    def __enter__(self) -> LiveGateway:
        self.thread.start()
        self.base_url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()

    async def _start(self) -> str:
        backend = InProcessBackend(reply_script(self.served.tokenizer))
        app = create_app(self.served, backend, GatewaySettings(api_keys=frozenset({API_KEY})))
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        return f"http://{host}:{port}"


@pytest.fixture
def live_gateway(served: ServedModel) -> Iterator[LiveGateway]:
    with LiveGateway(served) as gateway:
        yield gateway


def test_schemathesis_finds_no_failure(live_gateway: LiveGateway, tmp_path: Path) -> None:
    """Every check schemathesis has (server errors, status codes, content types, headers, response
    schemas, invalid requests accepted, methods not allowed, auth ignored), plus the streamed
    chunks', over every operation; a request unanswered within its timeout is a failure too."""
    report, config = tmp_path / "junit.xml", tmp_path / "schemathesis.toml"
    config.write_text(f"max-stream-events = {MAX_STREAM_EVENTS}\n")
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "--config-file", str(config)),
        *("run", f"{live_gateway.base_url}/openapi.json"),
        *("--header", f"Authorization: Bearer {API_KEY}"),
        *("--checks", "all", "--exclude-checks", ",".join(EXCLUDED_CHECKS)),
        *("--phases", "examples,coverage,fuzzing", "--max-examples", str(MAX_EXAMPLES)),
        *("--seed", str(SEED), "--generation-deterministic"),
        *("--request-timeout", str(RESPONSE_TIMEOUT_S), "--workers", "1"),
        *("--report", "junit", "--report-junit-path", str(report)),
        *("--suppress-health-check", "all", "--no-color", "--output-sanitize", "false"),
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)}
    run = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    assert _tested(report) == EXPECTED_TESTED


def _tested(report: Path) -> set[str]:
    """The operations the run tested, as `METHOD /path`."""
    return {case.attrib["name"] for case in ElementTree.parse(report).getroot().iter("testcase")}


EXPECTED_TESTED = {
    f"{method} {operation.path}"
    for operation in OPERATIONS
    for method in ((operation.method, "HEAD") if operation.method == "GET" else (operation.method,))
} - {"GET /openapi.json"}
"""Every operation but the document itself, which schemathesis reads rather than tests."""
