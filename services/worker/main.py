"""`specmesh worker --splitwise-role mixed|prefill|decode` (and the shorthands `specmesh mixed` etc.)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.engine.args import add_engine_args, engine_config
from services.kv_transport.auth import check_secret
from services.kv_transport.tls import TlsFiles
from services.runtime import (
    KV_SECRET_ENV,
    add_redis_args,
    freeze_start_up,
    read_secret_file,
    redis_settings,
    setup_logging,
    start_status_server,
    stop_event_on_signals,
)
from services.worker.core_client import EngineCoreClient, EngineCoreDied
from services.worker.core_messages import CoreOptions, SuffixCacheOptions
from services.worker.cpus import bus_side_cpus, pin_process, set_thread_policy
from services.worker.metrics import WorkerMetrics
from services.worker.worker import Worker, WorkerOptions
from shared.bus import Bus, connect

logger = logging.getLogger(__name__)

ROLES = ("mixed", "prefill", "decode")


def add_worker_parsers(subparsers: Any) -> None:
    for name in ("worker", *ROLES):
        help_text = (
            "an engine worker on the bus"
            if name == "worker"
            else f"shorthand for `worker --splitwise-role {name}`"
        )
        parser = subparsers.add_parser(name, help=help_text)
        add_engine_args(parser)
        add_redis_args(parser)
        if name == "worker":
            parser.add_argument("--splitwise-role", choices=ROLES, default="mixed")
        parser.set_defaults(handler=cmd_worker, splitwise_role=None if name == "worker" else name)
        group = parser.add_argument_group("worker")
        group.add_argument("--instance-id", help="unique name on the bus (default: host-role-random)")
        group.add_argument("--kv-host", default="127.0.0.1", help="address the decode role listens on for KV")
        group.add_argument("--kv-port", type=int, default=0, help="0 picks a free port")
        group.add_argument(
            "--kv-advertise-host", help="address prefill workers connect to (default: --kv-host)"
        )
        group.add_argument(
            "--kv-secret-file",
            type=Path,
            help=f"file holding the KV transport's shared secret (else {KV_SECRET_ENV}; none: no check)",
        )
        group.add_argument(
            "--kv-tls-cert", type=Path, help="this worker's certificate (PEM): mutual TLS for KV"
        )
        group.add_argument("--kv-tls-key", type=Path, help="its private key (PEM)")
        group.add_argument(
            "--kv-tls-ca", type=Path, help="the CA a peer's certificate must be signed by (PEM)"
        )
        group.add_argument("--metrics-host", default="127.0.0.1")
        group.add_argument(
            "--metrics-port", type=int, default=0, help="/health and /metrics (0 picks a free port)"
        )
        group.add_argument("--drain-timeout-s", type=float, default=60.0)
        group.add_argument(
            "--suffix-cache-deadline-ms",
            type=float,
            default=2.0,
            help="longest a decode step waits for the shared suffix cache",
        )
        group.add_argument(
            "--no-suffix-cache", action="store_true", help="keep the global suffix tree in-process"
        )
        group.add_argument("--log-level", dest="worker_log_level", default="INFO")


def cmd_worker(args: argparse.Namespace) -> int:
    role = args.splitwise_role or "mixed"
    setup_logging(args.worker_log_level, role)
    instance_id = args.instance_id or f"{socket.gethostname()}-{role}-{uuid.uuid4().hex[:6]}"
    args.kv_secret = kv_secret(args, os.environ)  # bad KV files fail here, before anything starts
    args.kv_tls = TlsFiles.from_flags(args.kv_tls_cert, args.kv_tls_key, args.kv_tls_ca)
    if args.kv_secret is not None:
        check_secret(args.kv_secret)
    import uvloop

    return uvloop.run(run_worker(args, role, instance_id))


def kv_secret(args: argparse.Namespace, environ: Mapping[str, str]) -> bytes | None:
    """The KV transport's shared secret: from --kv-secret-file, else the environment."""
    if args.kv_secret_file is not None:
        return read_secret_file(args.kv_secret_file, "--kv-secret-file").encode()
    secret = environ.get(KV_SECRET_ENV, "")
    return secret.encode() if secret else None


def kv_export_options(role: str, kv_transport: str, stream_layers: bool) -> dict[str, bool]:
    """How a prefill core exports KV (`CoreOptions`): shared by handle (ipc), streamed layer by layer
    as the prefill runs (tcp with --kv-stream-layers), else whole after it."""
    prefill = role == "prefill"
    return {
        "share_kv": prefill and kv_transport == "ipc",
        "stream_kv": prefill and kv_transport == "tcp" and stream_layers,
    }


async def run_worker(args: argparse.Namespace, role: str, instance_id: str) -> int:
    """Starts the engine core, then serves the bus until SIGTERM (0) or the core's death (1)."""
    stop = stop_event_on_signals()
    settings = redis_settings(args)
    client = await connect(settings)
    bus = Bus(client, settings.keys)
    config = engine_config(args)
    suffix_cache = None
    if not args.no_suffix_cache and role != "prefill":  # the shared suffix cache serves decoding
        suffix_cache = SuffixCacheOptions(settings, instance_id, args.suffix_cache_deadline_ms / 1000)
    try:
        export = kv_export_options(role, args.kv_transport, args.kv_stream_layers)
        core = await EngineCoreClient.start(
            CoreOptions(config, suffix_cache, **export), args.worker_log_level
        )
    except EngineCoreDied as exc:
        logger.error("the engine could not start: %s", exc)
        await client.aclose()
        return 1
    bus_cpus = bus_side_cpus(core.info.cpus)
    pin_process(bus_cpus)
    if config.bus_side_policy == "batch":
        set_thread_policy("batch")  # after the core started: it keeps its own policy
    logger.info(
        "CPUs",
        extra={
            "engine_core": core.info.cpus or "any",
            "bus_side": bus_cpus or "any",
            "bus_side_policy": config.bus_side_policy,
        },
    )
    metrics = WorkerMetrics(instance_id, role)
    options = WorkerOptions(
        instance_id=instance_id,
        role=role,  # type: ignore[arg-type]
        model_name=Path(config.model).name,
        ttl_s=args.scheduler_ttl,
        kv_transport=args.kv_transport,
        kv_host=args.kv_host,
        kv_port=args.kv_port,
        kv_advertise_host=args.kv_advertise_host,
        kv_secret=args.kv_secret,
        kv_tls=args.kv_tls,
        drain_timeout_s=args.drain_timeout_s,
    )
    worker = Worker(core, bus, options, metrics)
    status = await start_status_server(args.metrics_host, args.metrics_port, metrics.registry, worker.health)
    freeze_start_up()  # the bus side imports torch: a full collection would walk all of it mid-publish
    try:
        return await worker.run(stop)
    finally:
        await status.cleanup()
        await client.aclose()
