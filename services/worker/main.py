"""`specmesh worker --splitwise-role mixed|prefill|decode` (and the shorthands `specmesh mixed` etc.)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import uuid
from pathlib import Path
from typing import Any

from services.engine.args import add_engine_args, engine_config
from services.engine.engine import LLMEngine
from services.runtime import (
    add_redis_args,
    redis_settings,
    setup_logging,
    start_status_server,
    stop_event_on_signals,
)
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
        group.add_argument("--kv-transport", default="tcp", help="how KV moves between prefill and decode")
        group.add_argument("--kv-host", default="127.0.0.1", help="address the decode role listens on for KV")
        group.add_argument("--kv-port", type=int, default=0, help="0 picks a free port")
        group.add_argument(
            "--kv-advertise-host", help="address prefill workers connect to (default: --kv-host)"
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
    import uvloop

    uvloop.run(run_worker(args, role, instance_id))
    return 0


async def run_worker(args: argparse.Namespace, role: str, instance_id: str) -> None:
    stop = stop_event_on_signals()
    settings = redis_settings(args)
    client = await connect(settings)
    bus = Bus(client, settings.keys)
    config = engine_config(args)
    suffix_index = await _suffix_index(args, bus, instance_id, config.speculative_config.method)
    engine = await asyncio.to_thread(LLMEngine, config, suffix_index)
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
        drain_timeout_s=args.drain_timeout_s,
    )
    worker = Worker(engine, bus, options, metrics)
    status = await start_status_server(args.metrics_host, args.metrics_port, metrics.registry, worker.health)
    try:
        await worker.run(stop)
    finally:
        if suffix_index is not None:
            await suffix_index.close()
        await status.cleanup()
        await client.aclose()


async def _suffix_index(args: argparse.Namespace, bus: Bus, instance_id: str, method: str) -> Any:
    """The shared suffix-cache client, for workers that decode (unless --no-suffix-cache)."""
    role = args.splitwise_role or "mixed"
    if args.no_suffix_cache or role == "prefill":
        return None
    from services.suffix_cache.client import RemoteSuffixIndex

    client = RemoteSuffixIndex(
        asyncio.get_running_loop(), bus, instance_id, deadline_s=args.suffix_cache_deadline_ms / 1000
    )
    await client.start()
    return client
