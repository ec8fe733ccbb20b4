"""`specmesh gateway`: the OpenAI-compatible HTTP front of the mesh.

    specmesh gateway --model DIR --port 8000 --scheduler-host 127.0.0.1 --scheduler-port 6379

SIGTERM / SIGINT: the listener closes, in-flight requests and streams get `--shutdown-timeout-s`
to finish, then the bus connection closes and the process exits.

API keys come from `SPECMESH_API_KEY` (several: separated by commas), `--api-key-file` (one per
line) or `--api-key` (repeatable, but visible to every user in `ps`); a request may use any of them.

`--workers N` forks N gateway processes that share the port (SO_REUSEPORT: the kernel spreads
connections over them), each with its own output stream, so many streams are not one process's
event loop; the first process only supervises them (signals go on to them; if one dies, all stop).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import re
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from services.cli import CliParser
from services.gateway.app import GatewaySettings, create_app
from services.gateway.backend import DEFAULT_REQUEST_TIMEOUT_S, RedisBackend
from services.gateway.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_KEEPALIVE_TIMEOUT_S, LINGERING_TIME_S
from services.gateway.prepare import ServedModel
from services.gateway.tool_calls import TOOL_CALL_PARSERS
from services.runtime import API_KEY_ENV, add_redis_args, freeze_start_up, redis_settings, setup_logging
from shared.bus import RedisSettings
from shared.reference import default_model

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
GATEWAY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def add_gateway_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds the `gateway` subcommand to `specmesh`'s subparsers."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "gateway", help="OpenAI-compatible HTTP gateway in front of the mesh"
    )
    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument(
        "--api-key",
        action="append",
        dest="api_keys",
        default=[],
        help="accepted 'Authorization: Bearer' key on /v1/* (repeatable; visible to every user in ps: "
        f"prefer --api-key-file or {API_KEY_ENV}); no key from any source: no auth",
    )
    http.add_argument(
        "--api-key-file",
        type=Path,
        help="file of accepted API keys, one per line (blank lines and # comments skipped)",
    )
    http.add_argument(
        "--request-timeout-s",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="end a request with 504 after this long without an event from the mesh",
    )
    http.add_argument(
        "--max-body-bytes",
        type=int,
        default=0,
        help="largest request body, refused with 413 before it is parsed "
        "(default 0: 16 bytes per token of --max-model-len + 1 MiB)",
    )
    http.add_argument(
        "--body-timeout-s",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="a request body not received within this long gets 408 and its connection closed",
    )
    http.add_argument(
        "--keepalive-timeout-s",
        type=float,
        default=DEFAULT_KEEPALIVE_TIMEOUT_S,
        help="close a connection idle this long (also one whose request headers never finish)",
    )
    http.add_argument(
        "--max-concurrent-per-key",
        type=int,
        default=0,
        help="generation requests one API key may have in flight (429 past it; without keys: all "
        "clients together; per gateway process); 0: no limit",
    )
    http.add_argument(
        "--workers",
        type=int,
        default=1,
        help="gateway processes sharing the port (SO_REUSEPORT); 1: this process serves",
    )
    http.add_argument(
        "--gateway-id",
        help="this gateway's id on the bus, unique among live gateways (default: random per start; "
        "with --workers N, process i is ID-i); its liveness lasts --scheduler-ttl, then the "
        "scheduler aborts its requests, and a restart with the same id aborts those of the one before",
    )
    http.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM, how long in-flight requests may still run",
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        help="Hugging Face model directory: tokenizer, config.json (default: the shipped reference model)",
    )
    model.add_argument(
        "--served-model-name", help="name clients use in 'model' (default: the directory name)"
    )
    model.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="how tool_choice 'auto' finds tool calls in the text: hermes (<tool_call>{...}</tool_call>, "
        "Qwen2.5/Qwen3) or llama3_json (default: none; 'auto' is then refused)",
    )
    model.add_argument(
        "--max-model-len",
        type=int,
        help="longest prompt + output in tokens (default: config.json max_position_embeddings)",
    )
    add_redis_args(parser)  # --scheduler-host/-port/-password/-topic (and -ttl, unused here)
    parser.add_argument(
        "--log-level", dest="gateway_log_level", default="INFO", help="INFO: one line per request"
    )
    parser.set_defaults(handler=cmd_gateway)
    return parser


def cmd_gateway(args: argparse.Namespace) -> int:
    setup_logging(args.gateway_log_level, "gateway")
    if args.request_timeout_s <= 0:
        raise ValueError("--request-timeout-s must be positive")
    if args.workers < 1:
        raise ValueError("--workers must be at least 1")
    for flag in ("max_body_bytes", "max_concurrent_per_key"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must not be negative")
    for flag in ("body_timeout_s", "keepalive_timeout_s"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive")
    if args.gateway_id is not None and not GATEWAY_ID.fullmatch(args.gateway_id):
        raise ValueError(f"--gateway-id {args.gateway_id!r}: use 1 to 64 letters, digits, '.', '_' or '-'")
    args.api_keys = sorted(load_api_keys(args, os.environ))  # read before forking: a bad file fails once
    args.bus = redis_settings(args)
    if args.workers > 1:
        return supervise(args)
    return serve(args)


def serve(args: argparse.Namespace, reuse_port: bool = False) -> int:
    served = ServedModel.load(
        args.model or default_model(), args.served_model_name, args.max_model_len, args.tool_call_parser
    )
    settings: RedisSettings = args.bus
    backend = RedisBackend(
        settings,
        request_timeout_s=args.request_timeout_s,
        gateway_id=args.gateway_id,
        liveness_ttl_s=args.scheduler_ttl,
    )
    app = create_app(served, backend, gateway_settings(args))
    freeze_start_up()
    logger.info(
        "gateway serving %r (max_model_len %d) on http://%s:%d, bus %s",
        served.name,
        served.max_model_len,
        args.host,
        args.port,
        settings.describe(),
    )
    try:
        web.run_app(
            app,
            host=args.host,
            port=args.port,
            shutdown_timeout=args.shutdown_timeout_s,
            handler_cancellation=True,  # a client that goes away cancels its handler: the mesh hears Cancel
            access_log=None,  # one structured line per request comes from the app itself
            print=None,
            loop=_new_event_loop(),
            reuse_port=reuse_port or None,
            keepalive_timeout=args.keepalive_timeout_s,
            lingering_time=LINGERING_TIME_S,
        )
    except ConnectionError as exc:  # Redis unreachable at start: the message says which flags to check
        print(f"specmesh gateway: error: {exc}", file=sys.stderr)
        return 1
    return 0


def gateway_settings(args: argparse.Namespace) -> GatewaySettings:
    return GatewaySettings(
        api_keys=frozenset(args.api_keys),
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout_s,
        max_concurrent_per_key=args.max_concurrent_per_key,
    )


def load_api_keys(args: argparse.Namespace, environ: Mapping[str, str]) -> frozenset[str]:
    """Every accepted key: `--api-key`s, the `--api-key-file`'s lines and `SPECMESH_API_KEY`'s
    comma-separated keys. A key file that holds no key is an error, not a gateway without auth."""
    keys = {key.strip() for key in args.api_keys}
    keys |= {key.strip() for key in environ.get(API_KEY_ENV, "").split(",")}
    if args.api_key_file is not None:
        from_file = _read_key_file(args.api_key_file)
        if not from_file:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key")
        keys |= from_file
    keys.discard("")
    return frozenset(keys)


def _read_key_file(path: Path) -> set[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    if path.stat().st_mode & 0o004:
        logger.warning("%s is readable by every user; chmod o-r it", path)
    return {line for line in lines if line and not line.startswith("#")}


def supervise(args: argparse.Namespace) -> int:
    """Forks `--workers` gateways on the same port and waits for them. Forked before any event
    loop, thread or tokenizer exists here, so each child starts clean."""
    children = [_fork_gateway(args, index) for index in range(args.workers)]
    stopping = False

    def forward(signum: int, _: object) -> None:
        nonlocal stopping
        stopping = True
        for pid in children:
            _signal(pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    logger.info("gateway supervising %d workers on port %d", args.workers, args.port)
    exit_code = 0
    for _ in children:
        pid, status = os.wait()
        code = os.waitstatus_to_exitcode(status)
        if not stopping:  # a gateway died on its own: stop the others (the orchestrator restarts us)
            logger.error("gateway worker %d exited with %d; stopping the others", pid, code)
            stopping = True
            for other in children:
                _signal(other, signal.SIGTERM)
        exit_code = exit_code or (code if code > 0 else 0)
    return exit_code


def _fork_gateway(args: argparse.Namespace, index: int) -> int:
    supervisor = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    if args.gateway_id is not None:
        args.gateway_id = f"{args.gateway_id}-{index}"
    try:
        _die_with_parent(supervisor, f"gateway-{index}".encode())
        code = serve(args, reuse_port=True)
    except Exception:  # os._exit skips the interpreter's own report: the log must say why
        logger.exception("gateway worker %d failed", index)
    finally:
        os._exit(code)


def _die_with_parent(supervisor: int, name: bytes) -> None:
    """Linux: SIGTERM this process when the supervisor dies; name it for `ps` and /proc."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        libc.prctl(15, name)  # PR_SET_NAME
    if os.getppid() != supervisor:  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m services.gateway.main --model DIR ...`)."""
    parser = CliParser(prog="specmesh")
    add_gateway_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["gateway", *(sys.argv[1:] if argv is None else argv)])
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
