"""A worker's Prometheus metrics: requests, latency, queue, KV usage, speculation."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.worker.core_messages import EngineLoad, RowEnd

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class WorkerMetrics:
    def __init__(self, instance_id: str, role: str):
        self.registry = CollectorRegistry()
        labels = {"instance": instance_id, "role": role}
        r = self.registry

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=r)

        def gauge(name: str, doc: str, *extra: str) -> Gauge:
            return Gauge(name, doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=LATENCY_BUCKETS_S, registry=r)

        self.requests_received = counter(
            "specmesh_worker_requests_received_total", "Requests dispatched here"
        ).labels(**labels)
        self.requests_fenced = counter(
            "specmesh_worker_requests_fenced_total",
            "Requests stopped here because they were placed elsewhere since (their epoch is stale)",
        ).labels(**labels)
        self._finished = counter(
            "specmesh_worker_requests_finished_total", "Requests finished here", "reason"
        )
        self.ttft = histogram(
            "specmesh_worker_ttft_seconds", "Arrival to first token (this instance)"
        ).labels(**labels)
        self.tpot = histogram(
            "specmesh_worker_tpot_seconds", "Mean time per output token after the first"
        ).labels(**labels)
        self.step_seconds = histogram("specmesh_worker_step_seconds", "Engine step time").labels(**labels)
        self.running = gauge("specmesh_worker_running_requests", "Requests in the running batch").labels(
            **labels
        )
        self.waiting = gauge("specmesh_worker_waiting_requests", "Requests queued for prefill").labels(
            **labels
        )
        self.queued_tokens = gauge("specmesh_worker_queued_prompt_tokens", "Prompt tokens waiting").labels(
            **labels
        )
        self.kv_free_blocks = gauge("specmesh_worker_kv_free_blocks", "Free KV-cache blocks").labels(**labels)
        self.kv_usage = gauge("specmesh_worker_kv_usage_ratio", "Fraction of KV-cache blocks in use").labels(
            **labels
        )
        self.preemptions = gauge("specmesh_worker_preemptions", "Preemptions since start").labels(**labels)
        self.draft_tokens = counter("specmesh_worker_draft_tokens_total", "Draft tokens verified").labels(
            **labels
        )
        self.accepted_tokens = counter(
            "specmesh_worker_accepted_tokens_total", "Draft tokens accepted"
        ).labels(**labels)
        self._position_drafted = counter(
            "specmesh_worker_drafted_per_position_total", "Drafts verified at each position", "position"
        )
        self._position_accepted = counter(
            "specmesh_worker_accepted_per_position_total", "Drafts accepted at each position", "position"
        )
        self.kv_sent_bytes = counter(
            "specmesh_worker_kv_sent_bytes_total", "KV bytes handed to decode instances"
        ).labels(**labels)
        self.kv_received_bytes = counter(
            "specmesh_worker_kv_received_bytes_total", "KV bytes received from prefill instances"
        ).labels(**labels)
        self.kv_handoffs = counter(
            "specmesh_worker_kv_handoffs_total",
            "Requests' KV handed to decode instances, by path: shared (device memory, by handle), bytes (whole "
            "after the prefill step) or streamed (layer by layer as the prefill runs)",
            "path",
        )
        self.kv_transfer_seconds = histogram(
            "specmesh_worker_kv_transfer_seconds", "Time to send one request's KV"
        ).labels(**labels)
        self._suffix_cache = gauge(
            "specmesh_worker_suffix_cache",
            "Shared suffix-cache client: look-ups answered / late / skipped, "
            "round-trip p50 / p99 seconds, service up",
            "stat",
        )
        self.labels = labels

    def observe_suffix_cache(self, stats: dict[str, object]) -> None:
        """Exports the suffix-cache client's counters and latency (a decode step never waits longer
        than its deadline: late look-ups count here instead)."""
        for name, value in stats.items():
            if isinstance(value, bool | int | float):
                self._suffix_cache.labels(**self.labels, stat=name).set(float(value))

    def observe_step(self, step_s: list[float], load: EngineLoad) -> None:
        """A batch's steps (each step's time) and the load after them."""
        for seconds in step_s:
            self.step_seconds.observe(seconds)
        self.running.set(load.num_running)
        self.waiting.set(load.num_waiting)
        self.queued_tokens.set(load.queued_tokens)
        self.kv_free_blocks.set(load.free_kv_blocks)
        self.kv_usage.set(1 - load.free_kv_blocks / max(load.total_kv_blocks, 1))
        self.preemptions.set(load.num_preemptions)

    def observe_finished(self, end: RowEnd, num_output_tokens: int) -> None:
        self._finished.labels(**self.labels, reason=end.finish_reason or "unknown").inc()
        if end.ttft_s is not None:
            self.ttft.observe(end.ttft_s)
            num_after_first = num_output_tokens - 1
            if num_after_first > 0 and end.e2e_s is not None:
                self.tpot.observe((end.e2e_s - end.ttft_s) / num_after_first)
        stats = end.spec_stats
        self.draft_tokens.inc(float(stats.get("num_draft_tokens", 0)))
        self.accepted_tokens.inc(float(stats.get("num_accepted_tokens", 0)))
        drafted = stats.get("drafted_per_position") or []
        accepted = stats.get("accepted_per_position") or []
        for position, (d, a) in enumerate(zip(drafted, accepted)):
            self._position_drafted.labels(**self.labels, position=str(position)).inc(d)
            self._position_accepted.labels(**self.labels, position=str(position)).inc(a)
