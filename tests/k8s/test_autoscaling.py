"""The autoscalers, simulated over load series against the thresholds the overlays ship.

KEDA runs each ScaledObject through an HPA: every sync (15 s) a trigger asks for ceil(value / threshold)
replicas (an AverageValue metric; no change while value / (threshold * replicas) is within 10% of 1),
the largest ask wins, within min..max; scale-down takes the largest ask of the last stabilization
window, and each direction moves at most its policy's pods per period. KEDA itself takes a
deployment from zero to one when a trigger's value passes its activation threshold, and back to zero
after cooldownPeriod without one (only where minReplicaCount is 0)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from tests.k8s.conftest import K8S, Manifest, find, flag

HPA_SYNC_S = 15
TOLERANCE = 0.1
TICK_S = 5
Load = Callable[[float], dict[str, float]]
"""Seconds since the start -> each trigger's query value."""


@dataclass
class Policy:
    stabilization_s: int
    max_pods: int
    period_s: int

    @classmethod
    def of(cls, rules: dict[str, Any]) -> Policy:
        (policy,) = rules["policies"]
        assert policy["type"] == "Pods"
        return cls(rules["stabilizationWindowSeconds"], policy["value"], policy["periodSeconds"])


@dataclass
class Scaler:
    min_replicas: int
    max_replicas: int
    polling_s: int
    cooldown_s: int
    thresholds: dict[str, float]
    activations: dict[str, float]
    up: Policy
    down: Policy

    @classmethod
    def of(cls, scaled_object: Manifest) -> Scaler:
        spec = scaled_object["spec"]
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        triggers = {t["name"]: t["metadata"] for t in spec["triggers"]}
        return cls(
            spec["minReplicaCount"],
            spec["maxReplicaCount"],
            spec["pollingInterval"],
            spec["cooldownPeriod"],
            {name: float(m["threshold"]) for name, m in triggers.items()},
            {name: float(m.get("activationThreshold", 0)) for name, m in triggers.items()},
            Policy.of(behavior["scaleUp"]),
            Policy.of(behavior["scaleDown"]),
        )

    def ask(self, values: dict[str, float], replicas: int) -> int:
        """The HPA's recommendation before stabilization and rate limits."""
        asks = []
        for name, threshold in self.thresholds.items():
            ratio = values[name] / (threshold * replicas)
            asks.append(replicas if abs(ratio - 1) <= TOLERANCE else math.ceil(values[name] / threshold))
        return min(max(max(asks), max(self.min_replicas, 1)), self.max_replicas)

    def run(self, load: Load, duration_s: int, replicas: int) -> list[tuple[int, int]]:
        """(second, replicas) at every tick."""
        history, asks, last_active = [(0, replicas)], [(0, replicas)], 0
        for now in range(TICK_S, duration_s + 1, TICK_S):
            values = load(now)
            if now % self.polling_s == 0:
                if any(values[n] > self.activations[n] for n in self.thresholds):
                    last_active = now
                    replicas = max(replicas, 1)
                elif self.min_replicas == 0 and now - last_active >= self.cooldown_s:
                    replicas = 0
            if replicas > 0 and now % HPA_SYNC_S == 0:
                asks.append((now, self.ask(values, replicas)))
                replicas = self._limited(asks, history, now, replicas)
            history.append((now, replicas))
        return history

    def _limited(
        self, asks: list[tuple[int, int]], history: list[tuple[int, int]], now: int, replicas: int
    ) -> int:
        wanted = asks[-1][1]
        if wanted < replicas:
            wanted = min(replicas, max(a for t, a in asks if t > now - self.down.stabilization_s))
            floor = _at(history, now - self.down.period_s) - self.down.max_pods
            return max(wanted, floor)
        ceiling = _at(history, now - self.up.period_s) + self.up.max_pods
        return min(wanted, ceiling)


def _at(history: list[tuple[int, int]], second: int) -> int:
    return [r for t, r in history if t <= max(second, 0)][-1]


def scaler(rendered: dict[str, list[Manifest]], overlay: str, name: str) -> Scaler:
    return Scaler.of(find(rendered[overlay], "ScaledObject", name))


def first(history: list[tuple[int, int]], predicate: Callable[[int], bool], after_s: int = 0) -> int:
    return next(t for t, r in history if t >= after_s and predicate(r))


def burst(start_s: int, end_s: int, busy: dict[str, float], idle: dict[str, float]) -> Load:
    return lambda now: busy if start_s <= now < end_s else idle


@pytest.mark.parametrize("overlay", ["cpu-demo", "gpu"])
def test_prefill_scales_out_on_a_prompt_backlog_and_back_in_slowly(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    prefill = scaler(rendered, overlay, "prefill")
    tokens = prefill.thresholds["queued-prompt-tokens"]
    busy = {"queued-prompt-tokens": 40 * tokens, "requests-in-mesh": 1.0}
    idle = {"queued-prompt-tokens": 0.0, "requests-in-mesh": 0.0}
    history = prefill.run(burst(60, 360, busy, idle), 1800, replicas=max(prefill.min_replicas, 1))

    out_at = first(history, lambda r: r == prefill.max_replicas)
    assert 60 <= out_at <= 60 + 2 * prefill.polling_s + 2 * prefill.up.period_s  # out within about a minute
    assert all(r == prefill.max_replicas for t, r in history if out_at <= t < 360)
    # no scale-in inside the stabilization window after the last busy sync, then one pod a period;
    # where zero is allowed, an empty mesh goes to zero after the cool-down (KEDA, not the HPA)
    last_busy_s = 360 - HPA_SYNC_S
    hold_s = prefill.down.stabilization_s
    if prefill.min_replicas == 0:
        hold_s = min(hold_s, prefill.cooldown_s)
    assert all(r == prefill.max_replicas for t, r in history if out_at <= t < last_busy_s + hold_s)
    steps = [(t, a - b) for (t, a), (_, b) in zip(history, history[1:]) if 0 < b < a]
    assert all(size <= prefill.down.max_pods for _, size in steps)
    assert all(b - a >= prefill.down.period_s for (a, _), (b, _) in zip(steps, steps[1:]))
    assert history[-1][1] == prefill.min_replicas


def test_demo_prefill_wakes_from_zero_before_the_scheduler_gives_up(
    rendered: dict[str, list[Manifest]],
) -> None:
    """At zero prefill pods the scheduler holds a request for --dispatch-timeout-s: KEDA must notice it,
    and the pod start and load its model (the startup probe's budget), within that time."""
    objects = rendered["cpu-demo"]
    prefill = scaler(rendered, "cpu-demo", "prefill")
    assert prefill.min_replicas == 0
    waiting = {"queued-prompt-tokens": 0.0, "requests-in-mesh": 1.0}
    idle = {"queued-prompt-tokens": 0.0, "requests-in-mesh": 0.0}
    history = prefill.run(burst(100, 130, waiting, idle), 600, replicas=0)
    woke_after_s = first(history, lambda r: r == 1) - 100
    assert woke_after_s <= prefill.polling_s
    assert first(history, lambda r: r == 0, after_s=130) - 130 <= prefill.cooldown_s + prefill.polling_s

    probe = find(objects, "Deployment", "prefill")["spec"]["template"]["spec"]["containers"][0][
        "startupProbe"
    ]
    startup_budget_s = probe["periodSeconds"] * probe["failureThreshold"]
    scheduler_args = find(objects, "Deployment", "scheduler")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    timeout_ref = flag(scheduler_args, "--dispatch-timeout-s")
    config = find(objects, "ConfigMap", "specmesh")["data"]
    dispatch_timeout_s = float(config[timeout_ref.removeprefix("$(").removesuffix(")")])
    pod_start_s = 30  # scheduling and container start, the image already on the node
    assert dispatch_timeout_s >= woke_after_s + pod_start_s + startup_budget_s


def test_prefill_scales_to_zero_only_where_the_overlay_says(rendered: dict[str, list[Manifest]]) -> None:
    assert scaler(rendered, "gpu", "prefill").min_replicas == 1  # a GPU pod's cold start outlasts the hold
    for overlay in ("cpu-demo", "gpu"):
        assert scaler(rendered, overlay, "decode").min_replicas == 1  # reservations need a decode pod


@pytest.mark.parametrize("overlay", ["cpu-demo", "gpu"])
def test_decode_follows_kv_usage_and_waiting_requests(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    decode = scaler(rendered, overlay, "decode")
    kv_per_pod = decode.thresholds["kv-usage"]

    def load(now: float) -> dict[str, float]:
        if now < 300:  # one pod, its cache 0.8 full: within the tolerance of 0.75, no change
            return {"kv-usage": kv_per_pod * 1.06, "waiting-requests": 0.0}
        if now < 900:  # caches full everywhere and requests queueing
            return {"kv-usage": 0.98 * decode.max_replicas, "waiting-requests": 50.0}
        return {"kv-usage": 0.1, "waiting-requests": 0.0}

    history = decode.run(load, 2400, replicas=1)
    assert all(r == 1 for t, r in history if t < 300)
    assert first(history, lambda r: r == decode.max_replicas, after_s=300) < 300 + 4 * decode.up.period_s
    assert all(
        r == decode.max_replicas
        for t, r in history
        if 600 <= t < 900 - HPA_SYNC_S + decode.down.stabilization_s
    )
    assert history[-1][1] == 1


def test_hpa_variant_uses_the_same_signals_and_thresholds(rendered: dict[str, list[Manifest]]) -> None:
    adapter = yaml.safe_load((K8S / "components" / "hpa" / "prometheus-adapter-values.yaml").read_text())
    rules = {r["name"]["as"]: r for r in adapter["rules"]["external"]}
    for name in ("prefill", "decode"):
        scaled = find(rendered["gpu"], "ScaledObject", name)["spec"]
        hpa = find(rendered["gpu-hpa"], "HorizontalPodAutoscaler", name)["spec"]
        assert hpa["scaleTargetRef"]["name"] == scaled["scaleTargetRef"]["name"] == name
        assert (hpa["minReplicas"], hpa["maxReplicas"]) == (
            scaled["minReplicaCount"],
            scaled["maxReplicaCount"],
        )
        assert hpa["behavior"] == scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        queries = {
            _series_and_role(t["metadata"]["query"]): float(t["metadata"]["threshold"])
            for t in scaled["triggers"]
        }
        for metric in hpa["metrics"]:
            rule = rules[metric["external"]["metric"]["name"]]
            series = rule["seriesQuery"].split("{")[0]
            role = rule["metricsQuery"].split('role="')[1].split('"')[0]
            assert queries[(series, role)] == _quantity(metric["external"]["target"]["averageValue"])


def _series_and_role(query: str) -> tuple[str, str]:
    series = re.search(r"(specmesh_\w+)\{", query)
    role = re.search(r'role="(\w+)"', query)
    assert series is not None, query
    return series[1], role[1] if role else ""


def _quantity(text: str) -> float:
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)
