"""The scheduler's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.scheduler.registry import Registry


class SchedulerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge(
            "specmesh_scheduler_queue_depth", "Admitted requests not yet finished", registry=r
        )
        self.instances = Gauge(
            "specmesh_scheduler_live_instances", "Live instances by role", ["role"], registry=r
        )
        self.dispatched = Counter(
            "specmesh_scheduler_dispatched_total", "Requests placed", ["role"], registry=r
        )
        self.redispatched = Counter(
            "specmesh_scheduler_redispatched_total", "Requests placed again after a failure", registry=r
        )
        self.rejected = Counter(
            "specmesh_scheduler_rejected_total", "Requests refused with 429 (queue full)", registry=r
        )
        self.orphans_aborted = Counter(
            "specmesh_scheduler_orphans_aborted_total",
            "Requests aborted because the gateway incarnation that submitted them stopped renewing its liveness",
            registry=r,
        )
        self.reserve_timeouts = Counter(
            "specmesh_scheduler_reserve_timeouts_total", "Decode reservations that timed out", registry=r
        )
        self.placement_seconds = Histogram(
            "specmesh_scheduler_placement_seconds",
            "Admission to dispatch",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
            registry=r,
        )

    def observe_registry(self, registry: Registry) -> None:
        for role in ("mixed", "prefill", "decode"):
            self.instances.labels(role=role).set(registry.count(role))
