"""What every specmesh process shares: logging, Redis flags, signals, the /health + /metrics server."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from shared.bus import RedisSettings

HealthCheck = Callable[[], Awaitable[tuple[bool, str]]]
PASSWORD_ENV = "SPECMESH_SCHEDULER_PASSWORD"
REDIS_USER_ENV = "SPECMESH_REDIS_USER"
API_KEY_ENV = "SPECMESH_API_KEY"  # the gateway's API keys, comma-separated
KV_SECRET_ENV = "SPECMESH_KV_SECRET"  # the KV transport's shared secret
STATUS_PORT_FILE_ENV = "SPECMESH_STATUS_PORT_FILE"

logger = logging.getLogger(__name__)


def freeze_start_up() -> None:
    """What start-up made (modules, CUDA graphs, tokenizer, tables) lives as long as the process:
    full garbage collections skip it from now on instead of walking all of it, which paused an
    engine step for ~150 ms at a time at 256 requests."""
    gc.collect()
    gc.freeze()


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any `extra=` fields."""

    _STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in record.__dict__.items() if k not in self._STANDARD})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str, role: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger(__name__).debug("logging ready", extra={"role": role})


def add_redis_args(parser: argparse.ArgumentParser) -> None:
    """The bus flags, named as FastDeploy names them."""
    group = parser.add_argument_group("bus (Redis)")
    group.add_argument("--scheduler-host", default="127.0.0.1")
    group.add_argument("--scheduler-port", type=int, default=6379)
    group.add_argument(
        "--redis-user",
        default=os.environ.get(REDIS_USER_ENV),
        help=f"Redis ACL user (or set {REDIS_USER_ENV}; default: Redis's default user)",
    )
    group.add_argument(
        "--redis-password-file",
        type=Path,
        help=f"file holding the Redis password (its first line); else {PASSWORD_ENV}",
    )
    group.add_argument(
        "--scheduler-password",
        help=f"Redis password; shows in `ps`: prefer --redis-password-file or {PASSWORD_ENV}",
    )
    group.add_argument(
        "--scheduler-topic", default="default", help="namespace of every key: deployments can share a Redis"
    )
    group.add_argument(
        "--scheduler-ttl", type=float, default=5.0, help="seconds before a silent instance counts as dead"
    )


def redis_settings(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> RedisSettings:
    return RedisSettings(
        host=args.scheduler_host,
        port=args.scheduler_port,
        password=redis_password(args, environ),
        topic=args.scheduler_topic,
        username=args.redis_user or None,
    )


def redis_password(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """From --redis-password-file, else --scheduler-password, else the environment; None: no AUTH."""
    if args.redis_password_file is not None:
        if args.scheduler_password:
            raise ValueError("give the Redis password once: --redis-password-file or --scheduler-password")
        return read_secret_file(args.redis_password_file, "--redis-password-file")
    return args.scheduler_password or environ.get(PASSWORD_ENV) or None


def read_secret_file(path: Path, flag: str) -> str:
    """The first line of a secret's file (a trailing newline is not part of the secret); an error
    for a missing or empty file, a warning for one every user may read."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    secret = lines[0].strip() if lines else ""
    if not secret:
        raise ValueError(f"{flag} {path} is empty")
    if path.stat().st_mode & 0o004:
        logging.getLogger(__name__).warning("%s is readable by every user; chmod o-r it", path)
    return secret


def stop_event_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT: the process drains and exits."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def start_status_server(
    host: str, port: int, registry: CollectorRegistry, health: HealthCheck
) -> web.AppRunner:
    """`/health` (200 or 503 with the reason) and `/metrics` (Prometheus text) on host:port."""

    async def health_handler(_: web.Request) -> web.Response:
        ok, reason = await health()
        return web.json_response(
            {"status": "ok" if ok else "unavailable", "reason": reason}, status=200 if ok else 503
        )

    async def metrics_handler(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/health", health_handler)
    app.router.add_get("/metrics", metrics_handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    port_file = os.environ.get(STATUS_PORT_FILE_ENV)
    if port_file:  # lets a supervisor (tests, `specmesh serve`) find a port picked by the OS
        Path(port_file).write_text(str(bound_port(runner)))
    logger.info(
        "/health and /metrics on http://%s:%d",
        host,
        bound_port(runner),
        extra={"metrics_port": bound_port(runner)},
    )
    return runner


def bound_port(runner: web.AppRunner) -> int:
    """The port a status server listens on (useful when started on port 0)."""
    for site in runner.sites:
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            return int(server.sockets[0].getsockname()[1])
    raise RuntimeError("status server is not listening")


class Stopwatch:
    def __init__(self) -> None:
        self.started = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started
