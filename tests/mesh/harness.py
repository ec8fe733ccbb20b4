"""Real deployments for the mesh tests: redis-server plus specmesh roles as separate processes."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import aiohttp
import redis

from services.runtime import KV_SECRET_ENV, PASSWORD_ENV
from services.serve import ACL_ROLE_OF, free_port, write_private
from shared import acl
from shared.bus import RedisSettings

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    handle: BinaryIO
    status_port: int | None = None
    killed: bool = False
    """Stopped on purpose by the test (its exit is not a failure)."""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


@dataclass
class LocalMesh:
    """One deployment. `start_role` launches `python -m services.cli <role> ...` with the bus flags.
    With `acl_users`, Redis has a user per role (`shared/acl.py`) and the default user off, and each role
    runs as its own user; with `kv_secret`, the workers authenticate their KV connections."""

    workdir: Path
    topic: str = "test"
    redis_port: int = field(default_factory=free_port)
    processes: dict[str, Process] = field(default_factory=dict)
    acl_users: bool = False
    kv_secret: str | None = None
    passwords: dict[str, str] = field(
        default_factory=lambda: {role: secrets.token_hex(16) for role in (*acl.ROLES, acl.ADMIN)}
    )

    def settings(self, acl_role: str = acl.ADMIN) -> RedisSettings:
        """The bus as `acl_role` sees it (the tests' own clients: the admin)."""
        if not self.acl_users:
            return RedisSettings(port=self.redis_port, topic=self.topic)
        return RedisSettings(
            port=self.redis_port,
            topic=self.topic,
            username=acl.user_name(acl_role),
            password=self.passwords[acl_role],
        )

    @property
    def bus_flags(self) -> list[str]:
        return [
            "--scheduler-port",
            str(self.redis_port),
            "--scheduler-topic",
            self.topic,
            "--scheduler-ttl",
            "2",
        ]

    def start_redis(self, appendonly: bool = False) -> None:
        """redis-server on `redis_port`; with `appendonly`, an append-only file (fsync every second)
        in the work directory, so a restarted server has its streams and records back (all but
        the last writes, possibly)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/test.sh installs it)")
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "everysec"] if appendonly else ["--appendonly", "no"]
        )
        if self.acl_users:
            hashes = {role: acl.password_hash(password) for role, password in self.passwords.items()}
            users = write_private(self.workdir / "users.acl", acl.acl_file(hashes, self.topic))
            persistence += ["--aclfile", str(users)]
        self._spawn(
            "redis",
            [
                binary,
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--dir",
                str(self.workdir),
            ]
            + persistence,
        )
        self._wait(lambda: _redis_answers(self.settings()), "redis")

    def restart_redis(self, down_s: float) -> None:
        """SIGKILLs redis-server, and starts it again on the same port `down_s` later (from its
        append-only file, if it kept one)."""
        argv = list(self.processes["redis"].popen.args)  # type: ignore[arg-type]
        self.kill("redis")
        time.sleep(down_s)
        self._spawn("redis", argv)
        self._wait(lambda: _redis_answers(self.settings()), "redis")

    def start_role(self, name: str, role: str, *flags: str, wait_for_status: bool = True) -> Process:
        port_file = self.workdir / f"{name}.port"
        port_file.unlink(missing_ok=True)
        env = {**os.environ, "SPECMESH_STATUS_PORT_FILE": str(port_file), "PYTHONUNBUFFERED": "1"}
        acl_role = ACL_ROLE_OF.get(role, "worker")
        bus_flags = [*self.bus_flags]
        if self.acl_users:
            bus_flags += ["--redis-user", acl.user_name(acl_role)]
            env[PASSWORD_ENV] = self.passwords[acl_role]
        if self.kv_secret is not None and acl_role == "worker":
            env[KV_SECRET_ENV] = self.kv_secret
        process = self._spawn(name, [sys.executable, "-m", "services.cli", role, *flags, *bus_flags], env=env)
        if wait_for_status and role != "gateway":
            self._wait(lambda: port_file.is_file() and port_file.read_text().strip() != "", name)
            process.status_port = int(port_file.read_text())
        return process

    def start_gateway(self, model: str, *flags: str, name: str = "gateway") -> int:
        port = free_port()
        self.start_role(name, "gateway", "--model", model, "--port", str(port), *flags, wait_for_status=False)
        self._wait(lambda: _http_ok(f"http://127.0.0.1:{port}/health"), name)
        return port

    def metrics(self, name: str) -> str:
        process = self.processes[name]
        with urllib.request.urlopen(f"http://127.0.0.1:{process.status_port}/metrics", timeout=5) as response:
            return response.read().decode()

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        process = self.processes[name]
        process.killed = True
        process.popen.send_signal(sig)
        process.popen.wait(timeout=30)
        process.handle.close()

    def stop(self) -> None:
        for process in reversed(list(self.processes.values())):
            if process.alive():
                process.popen.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait()
            process.handle.close()

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Process:
        log = self.workdir / f"{name}.log"
        handle = open(log, "wb")  # noqa: SIM115 - owned by the child
        popen = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        process = Process(name, popen, log, handle)
        self.processes[name] = process
        return process

    def _wait(self, ready, name: str, timeout_s: float = 120.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for process in self.processes.values():
                if not process.alive() and not process.killed:
                    raise RuntimeError(
                        f"{process.name} exited ({process.popen.returncode}):\n{process.tail()}"
                    )
            if ready():
                return
            time.sleep(0.1)
        raise RuntimeError(f"{name} not ready after {timeout_s} s:\n{self.processes[name].tail()}")


@dataclass
class Outcome:
    """What a client of a streamed completion saw."""

    text: str = ""
    done: bool = False
    """`[DONE]` came: the gateway said the text is whole."""
    error: str | None = None
    """An error event, or an HTTP status other than 200."""


async def stream_completion(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, outcome: Outcome
) -> None:
    """A greedy streamed completion of `max_tokens` tokens (EOS ignored), recorded in `outcome`."""
    body = {
        "prompt": prompt,
        "stream": True,
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            outcome.error = f"HTTP {response.status}: {await response.text()}"
            return
        async for line in response.content:
            data = line.decode().removeprefix("data: ").strip()
            if not line.startswith(b"data: "):
                continue
            if data == "[DONE]":
                outcome.done = True
            elif "error" in (chunk := json.loads(data)):
                outcome.error = chunk["error"]["message"]
            elif chunk["choices"]:
                outcome.text += chunk["choices"][0]["text"]


def metric_value(text: str, name: str, default: float | None = None, **labels: str) -> float:
    """The value of one Prometheus sample (labels must match those given; others are ignored);
    `default` when there is no such sample yet, else KeyError."""
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        found = dict(part.split("=", 1) for part in label_text.rstrip("}").split(",") if "=" in part)
        if all(json.loads(found.get(k, "null")) == v for k, v in labels.items()):
            return float(value)
    if default is not None:
        return default
    raise KeyError(f"no sample {name} {labels}")


def pid_alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def child_pid(pid: int, name: str, timeout_s: float = 30.0) -> int:
    """The pid of `pid`'s child process called `name` (/proc/<pid>/comm), once it exists."""
    from benchmarks.launch import child_processes

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        children = child_processes(pid)
        if name in children:
            return children[name]
        time.sleep(0.1)
    raise AssertionError(f"no child {name!r} of {pid}: {child_processes(pid)}")


def _redis_answers(settings: RedisSettings) -> bool:
    """PING answered (a server loading its append-only file answers LOADING)."""
    client = redis.Redis(
        port=settings.port,
        username=settings.username,
        password=settings.password,
        socket_timeout=0.5,
        socket_connect_timeout=0.5,
    )
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except Exception:
        return False
