"""The Kubernetes manifests, offline: they build with kustomize; each role reads its own Redis
password from the Secret (and nothing shared); the workers prove the KV secret; the gateway reads
its API keys from a Secret; Redis's init container turns the Secret into ACL users that a real
redis-server accepts, one password per user, the default user off."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import redis
import yaml

from services.serve import free_port
from shared import acl

K8S = Path(__file__).resolve().parents[2] / "k8s"
ACL_ROLE_OF = {
    "gateway": "gateway",
    "scheduler": "scheduler",
    "suffix-cache": "suffix-cache",
    "prefill": "worker",
    "decode": "worker",
}
"""Each Deployment's ACL role."""


def manifests() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [
        doc for name in kustomization["resources"] for doc in yaml.safe_load_all((K8S / name).read_text())
    ]


def workload(name: str) -> dict[str, Any]:
    (found,) = [
        m for m in manifests() if m["kind"] in ("Deployment", "StatefulSet") and m["metadata"]["name"] == name
    ]
    return found["spec"]["template"]["spec"]


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} in {args}"
    return args[args.index(name) + 1]


def secret_file(pod: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret, key) that the file at `path` in the pod's first container comes from."""
    directory, file_name = str(PurePosixPath(path).parent), PurePosixPath(path).name
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == directory]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]
    (item,) = secret["items"]  # one key of the Secret, nothing else, in the pod
    assert item["path"] == file_name and secret["defaultMode"] == 0o400
    return secret["secretName"], item["key"]


def test_the_manifests_build_with_kustomize() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    built = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    kinds = [doc["kind"] for doc in yaml.safe_load_all(built.stdout)]
    assert kinds.count("Deployment") == len(ACL_ROLE_OF) and "ConfigMap" in kinds


@pytest.mark.parametrize("name", ACL_ROLE_OF)
def test_each_role_reads_its_own_redis_password_from_the_secret(name: str) -> None:
    pod = workload(name)
    (container,) = pod["containers"]
    args = container["args"]
    assert flag(args, "--redis-user") == acl.user_name(ACL_ROLE_OF[name])
    assert secret_file(pod, flag(args, "--redis-password-file")) == ("specmesh-redis", ACL_ROLE_OF[name])
    assert "--scheduler-password" not in args
    for env in container.get("env", []):  # no shared password, and no secret in the environment
        assert "secretKeyRef" not in env.get("valueFrom", {}), env


def test_every_acl_role_runs_somewhere() -> None:
    assert set(ACL_ROLE_OF.values()) == set(acl.ROLES)


@pytest.mark.parametrize("name", ["prefill", "decode"])
def test_the_workers_prove_the_kv_secret(name: str) -> None:
    pod = workload(name)
    assert secret_file(pod, flag(pod["containers"][0]["args"], "--kv-secret-file")) == (
        "specmesh-kv",
        "secret",
    )


def test_the_gateway_reads_its_api_keys_from_a_secret() -> None:
    pod = workload("gateway")
    args = pod["containers"][0]["args"]
    assert secret_file(pod, flag(args, "--api-key-file")) == ("specmesh-api-keys", "keys")
    assert "--api-key" not in args


def test_the_redis_users_file_is_the_codes_for_the_configured_topic() -> None:
    (config,) = [m for m in manifests() if m["kind"] == "ConfigMap" and m["metadata"]["name"] == "specmesh"]
    topic = config["data"]["SPECMESH_TOPIC"]
    assert (K8S / "redis-users.acl").read_text() == acl.acl_template(topic), (
        f"regenerate it: specmesh redis-acl --scheduler-topic {topic} > k8s/redis-users.acl"
    )
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    assert generator["files"] == ["users.acl=redis-users.acl"]


def test_redis_init_container_makes_one_user_per_secret_password(tmp_path: Path) -> None:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    pod = workload("redis")
    (init,) = pod["initContainers"]
    env = {e["name"]: e["value"] for e in init["env"]}
    (server,) = pod["containers"]
    assert flag(server["args"], "--aclfile") == env["ACL_FILE"]
    (passwords,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "specmesh-redis"]
    mounted = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert mounted[passwords["name"]] == env["PASSWORD_DIR"]

    secret_dir, shims = tmp_path / "secret", tmp_path / "bin"
    secret_dir.mkdir()
    shims.mkdir()
    passwords_by_user = {user: f"pw-{user}-{os.getpid()}" for user in (*acl.ROLES, acl.ADMIN)}
    for user, password in passwords_by_user.items():
        (secret_dir / user).write_text(password + "\n")  # as `kubectl create secret --from-file` keeps it
    (shims / "chown").write_text("#!/bin/sh\n")  # the image's redis user does not exist here
    (shims / "chown").chmod(0o755)
    users = tmp_path / "users.acl"
    run_env = {
        **os.environ,
        "PATH": f"{shims}:{os.environ['PATH']}",
        "ACL_TEMPLATE": str(K8S / "redis-users.acl"),
        "PASSWORD_DIR": str(secret_dir),
        "ACL_FILE": str(users),
    }
    made = subprocess.run(init["command"], env=run_env, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert users.stat().st_mode & 0o077 == 0
    assert not any(password in users.read_text() for password in passwords_by_user.values())

    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--aclfile", str(users)]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    try:
        for user, password in passwords_by_user.items():
            assert _ping(port, acl.user_name(user), password)
            assert not _ping(
                port, acl.user_name(user), passwords_by_user["admin" if user != "admin" else "worker"]
            )
        assert not _ping(port, None, None)
    finally:
        process.terminate()
        process.wait(timeout=10)


def _ping(port: int, user: str | None, password: str | None) -> bool:
    """Whether `user` gets a PONG (waiting for the server to come up)."""
    client = redis.Redis(port=port, username=user, password=password)
    deadline = time.monotonic() + 10
    try:
        while True:
            try:
                return bool(client.ping())
            except redis.AuthenticationError:
                return False
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    finally:
        client.close()
