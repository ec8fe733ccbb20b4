"""Fixtures for tests that run real deployments (redis-server + specmesh processes)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from shared.reference import default_model
from tests.mesh.harness import LocalMesh

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


@pytest.fixture(scope="module")
def mesh_model() -> str:
    """The shipped reference model: trained logits have real margins, so greedy output does not
    flip between batch shapes the way a random model's near-ties can."""
    return default_model()


def new_mesh(tmp_path_factory: pytest.TempPathFactory, name: str) -> LocalMesh:
    mesh = LocalMesh(tmp_path_factory.mktemp(name))
    mesh.start_redis()
    return mesh


@pytest.fixture
def mesh_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    made: list[LocalMesh] = []

    def make(name: str = "mesh") -> LocalMesh:
        mesh = new_mesh(tmp_path_factory, name)
        made.append(mesh)
        return mesh

    yield make
    for mesh in made:
        mesh.stop()
