"""Every overlay of k8s/, rendered once per session with `kubectl kustomize` from a copy of k8s/ whose
secret files `k8s/make-secrets.sh` wrote (as a user does before deploying)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.mesh.conftest import mesh_factory, mesh_model  # noqa: F401 - the drain test's mesh

K8S = Path(__file__).resolve().parents[2] / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))

Manifest = dict[str, Any]


def render(tree: Path, overlay: str) -> list[Manifest]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (for kustomize) is not installed")
    built = subprocess.run(
        [kubectl, "kustomize", str(tree / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert built.returncode == 0, built.stderr
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


@pytest.fixture(scope="session")
def k8s_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of k8s/ with fresh secret files in every overlay."""
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("secrets"))
    for overlay in OVERLAYS:
        made = subprocess.run(
            ["sh", str(tree / "make-secrets.sh"), str(tree / "overlays" / overlay)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert made.returncode == 0, made.stderr
    return tree


@pytest.fixture(scope="session")
def rendered(k8s_tree: Path) -> dict[str, list[Manifest]]:
    """Overlay name -> its objects."""
    return {overlay: render(k8s_tree, overlay) for overlay in OVERLAYS}


def find(objects: list[Manifest], kind: str, name: str) -> Manifest:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} in {args}"
    return args[args.index(name) + 1]
