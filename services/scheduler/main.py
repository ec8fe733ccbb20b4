"""`specmesh scheduler`: the splitwise scheduler process."""

from __future__ import annotations

import argparse
import logging
import socket
import uuid
from typing import Any

from services.runtime import (
    add_redis_args,
    freeze_start_up,
    redis_settings,
    setup_logging,
    start_status_server,
    stop_event_on_signals,
)
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.scheduler import SchedulerOptions, SplitwiseScheduler
from shared.bus import Bus, LoopDied, connect

logger = logging.getLogger(__name__)


def add_scheduler_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("scheduler", help="admit requests and place them on workers by load")
    add_redis_args(parser)
    parser.add_argument(
        "--max-queue-len", type=int, default=1024, help="admitted requests beyond which new ones get 429"
    )
    parser.add_argument("--reserve-timeout-s", type=float, default=10.0)
    parser.add_argument("--kv-timeout-s", type=float, default=60.0)
    parser.add_argument("--dispatch-timeout-s", type=float, default=30.0)
    parser.add_argument(
        "--scheduler-id",
        help="this replica's name in the consumer group, unique among live replicas "
        "(default: host-random); its lease lasts --scheduler-ttl",
    )
    parser.add_argument("--metrics-host", default="127.0.0.1")
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--log-level", dest="scheduler_log_level", default="INFO")
    parser.set_defaults(handler=cmd_scheduler)


def cmd_scheduler(args: argparse.Namespace) -> int:
    import uvloop

    setup_logging(args.scheduler_log_level, "scheduler")
    try:
        uvloop.run(run_scheduler(args))
    except LoopDied as exc:  # its supervisor (serve, Kubernetes) starts it again
        logger.error("%s: exiting", exc)
        return 1
    return 0


async def run_scheduler(args: argparse.Namespace) -> None:
    stop = stop_event_on_signals()
    settings = redis_settings(args)
    client = await connect(settings)
    metrics = SchedulerMetrics()
    options = SchedulerOptions(
        consumer=args.scheduler_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}",
        ttl_s=args.scheduler_ttl,
        max_queue_len=args.max_queue_len,
        reserve_timeout_s=args.reserve_timeout_s,
        kv_timeout_s=args.kv_timeout_s,
        dispatch_timeout_s=args.dispatch_timeout_s,
    )
    scheduler = SplitwiseScheduler(Bus(client, settings.keys), options, metrics)
    status = await start_status_server(
        args.metrics_host, args.metrics_port, metrics.registry, scheduler.health
    )
    freeze_start_up()
    try:
        await scheduler.run(stop)
    finally:
        await status.cleanup()
        await client.aclose()
