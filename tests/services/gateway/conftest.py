"""Fixtures of the gateway tests: a served tiny model, a scripted in-process mesh, an HTTP client
(the redis-server ones are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from gateway_fake_backend import MODEL_NAME, ClientFactory, InProcessBackend, reply_script

from services.gateway.app import GatewaySettings, create_app
from services.gateway.limits import LINGERING_TIME_S
from services.gateway.prepare import ServedModel


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
        server = TestServer(app)
        await server.start_server(lingering_time=LINGERING_TIME_S)  # as `specmesh gateway` serves
        client: TestClient[Any, Any] = TestClient(server)
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


@pytest.fixture
async def client(make_client: ClientFactory) -> TestClient[Any, Any]:
    return await make_client()
