"""The Kubernetes manifests, offline: every overlay builds with kustomize; each role reads its own
Redis password from the generated Secret (and nothing shared); the workers prove the KV secret; the
gateway reads its API keys from a Secret; Redis's init container turns the Secret into ACL users that
a real redis-server accepts, one password per user, the default user off. And what Kubernetes does
with the pods: probes, grace periods that cover each role's drain, disruption budgets, image tags."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import redis

from services.serve import free_port
from shared import acl
from tests.k8s.conftest import K8S, OVERLAYS, Manifest, find, flag

ACL_ROLE_OF = {
    "gateway": "gateway",
    "scheduler": "scheduler",
    "suffix-cache": "suffix-cache",
    "prefill": "worker",
    "decode": "worker",
}
"""Each Deployment's ACL role."""
WORKERS = ("prefill", "decode")
SHUTDOWN_FLAG = {
    "gateway": "--shutdown-timeout-s",
    "prefill": "--drain-timeout-s",
    "decode": "--drain-timeout-s",
}
"""The flag that bounds how long a role finishes its work after SIGTERM."""
EXIT_MARGIN_S = 20
"""What a process needs after its drain to exit (a worker stops its engine core and leaves the bus)."""


def pod_spec(objects: list[Manifest], name: str) -> dict[str, Any]:
    kind = "StatefulSet" if name == "redis" else "Deployment"
    return find(objects, kind, name)["spec"]["template"]["spec"]


def secret_file(objects: list[Manifest], pod: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret, key) that the file at `path` in the pod's first container comes from; the Secret is
    one the overlay generates (name plus kustomize's hash) and holds the key."""
    directory, file_name = str(PurePosixPath(path).parent), PurePosixPath(path).name
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == directory]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]
    (item,) = secret["items"]  # one key of the Secret, nothing else, in the pod
    assert item["path"] == file_name and secret["defaultMode"] == 0o400
    assert item["key"] in find(objects, "Secret", secret["secretName"])["data"]
    return secret["secretName"].rsplit("-", 1)[0], item["key"]


def specmesh_containers(objects: list[Manifest]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (o["metadata"]["name"], c)
        for o in objects
        if o["kind"] == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
    ]


def test_every_overlay_runs_each_role_once(rendered: dict[str, list[Manifest]]) -> None:
    assert {"cpu-demo", "gpu", "gpu-hpa"} <= set(OVERLAYS)
    for objects in rendered.values():
        deployments = sorted(o["metadata"]["name"] for o in objects if o["kind"] == "Deployment")
        assert deployments == sorted(ACL_ROLE_OF)
        assert {o["metadata"].get("namespace", "specmesh") for o in objects} == {"specmesh"}


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("name", ACL_ROLE_OF)
def test_each_role_reads_its_own_redis_password_from_the_secret(
    rendered: dict[str, list[Manifest]], overlay: str, name: str
) -> None:
    objects = rendered[overlay]
    pod = pod_spec(objects, name)
    (container,) = pod["containers"]
    args = container["args"]
    assert flag(args, "--redis-user") == acl.user_name(ACL_ROLE_OF[name])
    assert secret_file(objects, pod, flag(args, "--redis-password-file")) == (
        "specmesh-redis",
        ACL_ROLE_OF[name],
    )
    assert "--scheduler-password" not in args
    for env in container.get("env", []):  # no shared password, and no secret in the environment
        assert "secretKeyRef" not in env.get("valueFrom", {}), env


def test_every_acl_role_runs_somewhere() -> None:
    assert set(ACL_ROLE_OF.values()) == set(acl.ROLES)


@pytest.mark.parametrize("name", WORKERS)
def test_the_workers_prove_the_kv_secret(rendered: dict[str, list[Manifest]], name: str) -> None:
    objects = rendered["gpu"]
    pod = pod_spec(objects, name)
    assert secret_file(objects, pod, flag(pod["containers"][0]["args"], "--kv-secret-file")) == (
        "specmesh-kv",
        "secret",
    )


def test_the_gateway_reads_its_api_keys_from_a_secret(rendered: dict[str, list[Manifest]]) -> None:
    objects = rendered["gpu"]
    pod = pod_spec(objects, "gateway")
    args = pod["containers"][0]["args"]
    assert secret_file(objects, pod, flag(args, "--api-key-file")) == ("specmesh-api-keys", "keys")
    assert "--api-key" not in args


def test_the_redis_users_file_is_the_codes_for_the_configured_topic(
    rendered: dict[str, list[Manifest]],
) -> None:
    for objects in rendered.values():
        topic = find(objects, "ConfigMap", "specmesh")["data"]["SPECMESH_TOPIC"]
        (users,) = [o for o in objects if o["metadata"]["name"].startswith("specmesh-redis-acl-")]
        assert users["data"]["users.acl"] == acl.acl_template(topic), (
            f"regenerate it: specmesh redis-acl --scheduler-topic {topic} > k8s/base/redis-users.acl"
        )


def test_make_secrets_keeps_what_exists_and_refuses_a_wrong_directory(tmp_path: Path) -> None:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text("resources: []\n")
    script = ["sh", str(K8S / "make-secrets.sh")]
    assert subprocess.run([*script, str(overlay)], capture_output=True, timeout=60).returncode == 0
    files = {p.name: p.read_text() for p in (overlay / "secrets").iterdir()}
    assert set(files) == {"redis-passwords.env", "kv.env", "api-keys"}
    passwords = dict(line.split("=", 1) for line in files["redis-passwords.env"].splitlines())
    assert set(passwords) == {*acl.ROLES, acl.ADMIN} and len(set(passwords.values())) == len(passwords)
    assert all((overlay / "secrets" / name).stat().st_mode & 0o077 == 0 for name in files)
    assert subprocess.run([*script, str(overlay)], capture_output=True, timeout=60).returncode == 0
    assert {p.name: p.read_text() for p in (overlay / "secrets").iterdir()} == files  # kept
    wrong = subprocess.run([*script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert wrong.returncode != 0 and "no kustomization.yaml" in wrong.stderr


def test_images_are_tagged_and_pulled_only_if_absent(rendered: dict[str, list[Manifest]]) -> None:
    tags = {"cpu-demo": "cpu", "gpu": "cuda", "gpu-hpa": "cuda"}
    for overlay, objects in rendered.items():
        for name, container in specmesh_containers(objects):
            image, _, tag = container["image"].rpartition(":")
            assert image.endswith("specmesh") and tags[overlay] in tag and tag != "latest", (
                name,
                container["image"],
            )
            assert container["imagePullPolicy"] == "IfNotPresent"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ready_on_health_alive_while_draining(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    """Readiness is /health (503 while draining or without Redis); liveness must not be, or a drain or
    a Redis outage would restart the pod and lose its requests."""
    for name, container in specmesh_containers(rendered[overlay]):
        port_names = {p["name"] for p in container["ports"]}
        ready, alive = container["readinessProbe"]["httpGet"], container["livenessProbe"]["httpGet"]
        assert ready["path"] == "/health" and ready["port"] in port_names, name
        assert alive["path"] == "/metrics" and alive["port"] in port_names, name
        if name in WORKERS:  # the status server starts after the model is loaded
            assert container["startupProbe"]["httpGet"] == alive


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_grace_period_covers_each_roles_drain(rendered: dict[str, list[Manifest]], overlay: str) -> None:
    for name, flag_name in SHUTDOWN_FLAG.items():
        pod = pod_spec(rendered[overlay], name)
        (container,) = pod["containers"]
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        pre_stop_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        assert pre_stop == [] or pre_stop[:1] == ["sleep"], pre_stop
        drain_s = float(flag(container["args"], flag_name))
        assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + drain_s + EXIT_MARGIN_S, name
    gateway = pod_spec(rendered[overlay], "gateway")["containers"][0]
    assert gateway["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"  # the Service lets it go first


def test_every_role_has_a_disruption_budget(rendered: dict[str, list[Manifest]]) -> None:
    for objects in rendered.values():
        budgets = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "PodDisruptionBudget"}
        for name in ACL_ROLE_OF:
            assert budgets[name] == {"maxUnavailable": 1, "selector": {"matchLabels": {"app": name}}}


def test_decode_pods_spread_over_nodes(rendered: dict[str, list[Manifest]]) -> None:
    for objects in rendered.values():
        (term,) = pod_spec(objects, "decode")["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == {"app": "decode"}


def test_only_the_gpu_overlays_ask_for_gpus(rendered: dict[str, list[Manifest]]) -> None:
    for overlay, objects in rendered.items():
        for name, container in specmesh_containers(objects):
            gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
            assert gpus == (1 if overlay.startswith("gpu") and name in WORKERS else None), (overlay, name)
            assert "memory" in container["resources"]["limits"], (overlay, name)


def test_every_metrics_port_is_scraped(rendered: dict[str, list[Manifest]]) -> None:
    for objects in rendered.values():
        (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
        scraped_ports = {e["port"] for e in monitor["spec"]["endpoints"]}
        selector = monitor["spec"]["selector"]["matchLabels"]
        services = [
            o
            for o in objects
            if o["kind"] == "Service" and selector.items() <= o["metadata"].get("labels", {}).items()
        ]
        apps = {
            s["spec"]["selector"]["app"]
            for s in services
            if {p["name"] for p in s["spec"]["ports"]} & scraped_ports
        }
        assert apps == set(ACL_ROLE_OF)


def test_redis_init_container_makes_one_user_per_secret_password(
    rendered: dict[str, list[Manifest]], tmp_path: Path
) -> None:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    pod = pod_spec(rendered["gpu"], "redis")
    (init,) = pod["initContainers"]
    env = {e["name"]: e["value"] for e in init["env"]}
    (server,) = pod["containers"]
    assert flag(server["args"], "--aclfile") == env["ACL_FILE"]
    (passwords,) = [
        v for v in pod["volumes"] if v.get("secret", {}).get("secretName", "").startswith("specmesh-redis-")
    ]
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
        "ACL_TEMPLATE": str(K8S / "base" / "redis-users.acl"),
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
