"""Fixtures of the gateway tests: a served tiny model, a scripted in-process mesh, an HTTP client."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient, TestServer
from gateway_fake_backend import MODEL_NAME, ClientFactory, InProcessBackend, free_port, reply_script

from services.gateway.app import GatewaySettings, create_app
from services.gateway.prepare import ServedModel
from shared.bus import RedisSettings


@pytest.fixture(scope="session")
def served(make_checkpoint: Callable[..., Any]) -> ServedModel:
    return ServedModel.load(make_checkpoint("llama"), name=MODEL_NAME)


@pytest.fixture
def backend(served: ServedModel) -> InProcessBackend:
    """Answers with `REPLY`; tests swap `backend.script` for other behaviour."""
    return InProcessBackend(reply_script(served.tokenizer))


@pytest.fixture
async def make_client(served: ServedModel, backend: InProcessBackend) -> AsyncIterator[ClientFactory]:
    clients: list[TestClient[Any, Any]] = []

    async def make(**settings: Any) -> TestClient[Any, Any]:
        app = create_app(served, backend, GatewaySettings(**settings))
        client: TestClient[Any, Any] = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


@pytest.fixture
async def client(make_client: ClientFactory) -> TestClient[Any, Any]:
    return await make_client()


# ---- a real redis-server ------------------------------------------------------------------------------


def start_redis_server(binary: str) -> tuple[subprocess.Popen[bytes], int]:
    """A redis-server on a free loopback port, without persistence, answering PING."""
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    probe = redis.Redis(port=port)
    try:
        for _ in range(100):
            try:
                probe.ping()
                return server, port
            except redis.ConnectionError:
                time.sleep(0.05)
        server.terminate()
        pytest.fail(f"redis-server did not start on port {port}")
    finally:
        probe.close()


def _redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    return binary


@pytest.fixture(scope="session")
def redis_port() -> Iterator[int]:
    """One throwaway redis-server for the session."""
    server, port = start_redis_server(_redis_binary())
    yield port
    server.terminate()
    server.wait(timeout=10)


@pytest.fixture
def redis_server() -> Iterator[Callable[[], tuple[subprocess.Popen[bytes], RedisSettings]]]:
    """Starts private redis-servers a test may kill; stops those still running at the end."""
    binary = _redis_binary()
    servers: list[subprocess.Popen[bytes]] = []

    def start() -> tuple[subprocess.Popen[bytes], RedisSettings]:
        server, port = start_redis_server(binary)
        servers.append(server)
        return server, RedisSettings(port=port)

    yield start
    for server in servers:
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=10)


@pytest.fixture
def redis_settings(redis_port: int) -> RedisSettings:
    """Each test its own topic: no keys shared between tests."""
    return RedisSettings(port=redis_port, topic=f"gw{uuid.uuid4().hex[:12]}")
