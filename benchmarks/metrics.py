"""Per-request latency records and their summary, measured the way serving benchmarks measure them.

Terms (as vLLM's `benchmark_serving` and DistServe use them):
- *TTFT*: from the request's arrival (sent by the client; scheduled arrival offline) to its first
  output token.
- *TPOT*: time per output token after the first, `(e2e - TTFT) / (output tokens - 1)`.
- *ITL*: the gaps between consecutive token-bearing stream chunks (one engine step offline). A
  speculative step delivers several tokens in one chunk, so ITL counts steps, TPOT counts tokens.
- *goodput*: requests per second that met every SLO given (TTFT and / or TPOT).
- *mean accepted length*: tokens produced per verify step, the bonus token included; *acceptance
  rate*: accepted drafts / drafted tokens; per position `i`: accepted / drafted at draft index `i`.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class SpecCounts:
    """Speculation counters, summed over requests (sums, never means, so they add up)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    num_refused_draft_tokens: int = 0
    """Drafts a grammar refused on the host, never verified (not among num_draft_tokens)."""
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    @classmethod
    def from_stats(cls, stats: dict[str, Any] | None) -> SpecCounts:
        """From an engine's `spec_stats` or the gateway's `usage.speculative`."""
        stats = stats or {}
        return cls(
            num_draft_tokens=int(stats.get("num_draft_tokens") or 0),
            num_accepted_tokens=int(stats.get("num_accepted_tokens") or 0),
            num_verify_steps=int(stats.get("num_verify_steps") or 0),
            num_refused_draft_tokens=int(stats.get("num_refused_draft_tokens") or 0),
            drafted_per_position=[int(n) for n in stats.get("drafted_per_position") or []],
            accepted_per_position=[int(n) for n in stats.get("accepted_per_position") or []],
        )

    def add(self, other: SpecCounts) -> None:
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_verify_steps += other.num_verify_steps
        self.num_refused_draft_tokens += other.num_refused_draft_tokens
        self.drafted_per_position = _add_lists(self.drafted_per_position, other.drafted_per_position)
        self.accepted_per_position = _add_lists(self.accepted_per_position, other.accepted_per_position)

    def summary(self) -> dict[str, Any]:
        steps, drafted = self.num_verify_steps, self.num_draft_tokens
        return {
            **asdict(self),
            "mean_accepted_length": (self.num_accepted_tokens + steps) / steps if steps else 1.0,
            "acceptance_rate": self.num_accepted_tokens / drafted if drafted else 0.0,
            "acceptance_per_position": [
                a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)
            ],
        }


def token_digest(token_ids: list[int]) -> str:
    """A short hash of a token sequence (`RequestRecord.output_digest`)."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:16]


@dataclass
class RequestRecord:
    """One request as the client saw it; times are `time.perf_counter()` seconds."""

    request_id: str
    workload: str
    arrived_at: float
    token_times: list[float] = field(default_factory=list)
    """When each token-bearing chunk (offline: step output) arrived."""
    finished_at: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    spec: SpecCounts = field(default_factory=SpecCounts)
    error: str | None = None
    output_digest: str | None = None
    """A hash of the output's token ids (offline): greedy runs of different methods, or of one method
    on different GPU counts, compare their outputs by it (`benchmarks.compare.same_outputs`)."""

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times) and self.finished_at is not None

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.arrived_at

    @property
    def e2e_s(self) -> float:
        assert self.finished_at is not None
        return self.finished_at - self.arrived_at

    @property
    def tpot_s(self) -> float | None:
        """None for a one-token output (no time per token after the first)."""
        if self.num_output_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.num_output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def compact(self) -> dict[str, Any]:
        """What the result file keeps per request (enough to redraw the CDFs)."""
        return {
            "id": self.request_id,
            "workload": self.workload,
            "ok": self.ok,
            "error": self.error,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "ttft_ms": _ms(self.ttft_s) if self.ok else None,
            "tpot_ms": _ms(self.tpot_s) if self.ok and self.tpot_s is not None else None,
            "e2e_ms": _ms(self.e2e_s) if self.ok else None,
            "itl_ms": [round(_ms(g), 3) for g in self.itls_s] if self.ok else [],
            "output_digest": self.output_digest,
        }


@dataclass(frozen=True)
class SLO:
    """Latency objectives a request must meet to count toward goodput (None: no objective)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.ttft_ms is not None and _ms(record.ttft_s) > self.ttft_ms:
            return False
        tpot = record.tpot_s
        return self.tpot_ms is None or tpot is None or _ms(tpot) <= self.tpot_ms


def distribution_ms(values_s: list[float]) -> dict[str, float]:
    """Mean and p50 / p90 / p99 in milliseconds (linear interpolation, so p50 <= p90 <= p99)."""
    if not values_s:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    array = np.asarray(values_s, dtype=np.float64) * 1000.0
    points = np.percentile(array, PERCENTILES)
    return {"mean": float(array.mean()), **{f"p{p}": float(v) for p, v in zip(PERCENTILES, points)}}


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO) -> dict[str, Any]:
    """Throughput, latency distributions, goodput and summed acceptance of one measured run."""
    done = [r for r in records if r.ok]
    spec = SpecCounts()
    for record in done:
        spec.add(record.spec)
    num_output = sum(r.num_output_tokens for r in done)
    num_good = sum(slo.met(r) for r in done)
    duration_s = max(duration_s, 1e-9)
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration_s,
        "prompt_tokens": sum(r.num_prompt_tokens for r in done),
        "output_tokens": num_output,
        "requests_per_s": len(done) / duration_s,
        "output_tok_per_s": num_output / duration_s,
        "goodput_requests_per_s": num_good / duration_s,
        "slo_attainment": num_good / len(records) if records else 0.0,
        "ttft_ms": distribution_ms([r.ttft_s for r in done]),
        "tpot_ms": distribution_ms([t for r in done if (t := r.tpot_s) is not None]),
        "itl_ms": distribution_ms([g for r in done for g in r.itls_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in done]),
        "speculative": spec.summary(),
    }


def run_duration_s(records: list[RequestRecord]) -> float:
    """From the first arrival to the last finish."""
    finished = [r.finished_at for r in records if r.finished_at is not None]
    if not finished:
        return 0.0
    return max(finished) - min(r.arrived_at for r in records)


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
    return [x + (shorter[i] if i < len(shorter) else 0) for i, x in enumerate(longer)]


def _ms(seconds: float) -> float:
    return seconds * 1000.0
