"""What the gateway measures: per-request stats (one log line each) and their Prometheus metrics.

Three layers, as vLLM: a `RequestStats` per HTTP request, filled in while it runs → one structured
log line when it ends → `GatewayMetrics` counters and histograms, scraped at /metrics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.gateway.render import ChoiceState

request_log = logging.getLogger("services.gateway.requests")

TTFT_BUCKETS_S = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
)
TPOT_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class RequestStats:
    """One HTTP request, as measured by the gateway (times from time.perf_counter)."""

    endpoint: str
    started_at: float = field(default_factory=time.perf_counter)
    request_id: str | None = None
    status: int | None = None
    """HTTP status, or the outcome of a stream that failed after its 200 (499: the client left)."""
    num_prompt_tokens: int = 0
    finished_at: float | None = None
    choices: list[ChoiceState] = field(default_factory=list)

    @property
    def first_token_at(self) -> float | None:
        times = [c.first_token_at for c in self.choices if c.first_token_at is not None]
        return min(times) if times else None

    def tpot_s(self) -> list[float]:
        """Per finished choice of more than one token: time per output token after its first."""
        return [
            (c.finished_at - c.first_token_at) / (c.num_output_tokens - 1)
            for c in self.choices
            if c.first_token_at is not None and c.finished_at is not None and c.num_output_tokens > 1
        ]

    @property
    def num_completion_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.choices)

    def spec_totals(self) -> tuple[int, int]:
        """(draft tokens, accepted tokens) over the choices."""
        stats = [c.spec_stats for c in self.choices]
        return (
            sum(int(s.get("num_draft_tokens", 0)) for s in stats),
            sum(int(s.get("num_accepted_tokens", 0)) for s in stats),
        )

    def log_fields(self) -> dict[str, object]:
        """The request's log line, as fields (JSON logs print each one)."""
        end = self.finished_at or time.perf_counter()
        first_token_at = self.first_token_at
        num_drafts, num_accepted = self.spec_totals()
        return {
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "status": self.status,
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "draft_tokens": num_drafts,
            "accepted_tokens": num_accepted,
            "ttft_ms": round((first_token_at - self.started_at) * 1000, 1)
            if first_token_at is not None
            else None,
            "e2e_ms": round((end - self.started_at) * 1000, 1),
        }


class GatewayMetrics:
    """The gateway's Prometheus metrics, in a registry of their own (one per app)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "specmesh_gateway_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "specmesh_gateway_requests_in_flight", "Generation requests being served", registry=r
        )
        self.rate_limited = Counter(
            "specmesh_gateway_rate_limited", "Requests answered 429 (the mesh was busy)", registry=r
        )
        self.ttft = Histogram(
            "specmesh_gateway_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            "specmesh_gateway_time_per_output_token_seconds",
            "Per choice: time per output token after the first",
            buckets=TPOT_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "specmesh_gateway_e2e_request_latency_seconds",
            "Arrival to last byte",
            buckets=E2E_BUCKETS_S,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "specmesh_gateway_prompt_tokens", "Prompt tokens of served requests", registry=r
        )
        self.completion_tokens = Counter(
            "specmesh_gateway_completion_tokens", "Generated tokens of served requests", registry=r
        )
        self.draft_tokens = Counter(
            "specmesh_gateway_spec_draft_tokens", "Draft tokens proposed for served requests", registry=r
        )
        self.accepted_tokens = Counter(
            "specmesh_gateway_spec_accepted_tokens", "Draft tokens the target accepted", registry=r
        )

    def observe(self, stats: RequestStats) -> None:
        end = stats.finished_at or time.perf_counter()
        self.requests.labels(stats.endpoint, str(stats.status)).inc()
        if stats.status == 429:
            self.rate_limited.inc()
        if stats.request_id is None:  # not a generation request (or refused before it became one)
            return
        self.e2e.observe(end - stats.started_at)
        first_token_at = stats.first_token_at
        if first_token_at is not None:
            self.ttft.observe(first_token_at - stats.started_at)
        for tpot_s in stats.tpot_s():
            self.tpot.observe(tpot_s)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.completion_tokens.inc(stats.num_completion_tokens)
        num_drafts, num_accepted = stats.spec_totals()
        self.draft_tokens.inc(num_drafts)
        self.accepted_tokens.inc(num_accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
