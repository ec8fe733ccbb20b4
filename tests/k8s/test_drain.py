"""Scale-in as Kubernetes does it, on CPU with real processes: a decode worker under load is stopped
the way the kubelet stops a pod (its preStop, then SIGTERM, then SIGKILL once the grace period is
over); it drains, and every request still completes, on the other decode worker where the drain
could not finish it, with all its tokens once. The drain's bound is shortened so that some requests
must move; the grace period keeps the manifests' margin over it."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections import defaultdict
from typing import Any

import pytest

from shared.bus import Bus
from shared.protocol import OutputBatch, TokenEvent
from shared.sampling_params import SamplingParams
from tests.k8s.conftest import Manifest, find, flag
from tests.mesh.harness import LocalMesh, Process, metric_value
from tests.mesh.test_bus_recovery import GATEWAY, WORKER_FLAGS, bus_of, request

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NUM_REQUESTS = 6
MAX_TOKENS = 48
DRAIN_TIMEOUT_S = 0.0
"""The drain ends at once, with the requests still in the worker: they must move elsewhere (a
drain of a second lets the tiny model finish them on an idle machine, and nothing moves)."""


def kubelet_stop(process: Process, pre_stop: list[str], grace_s: float) -> tuple[bool, int]:
    """The kubelet's pod stop: preStop, then SIGTERM; SIGKILL when the grace period (counted from
    the start, preStop included) is over. (exited by itself, exit code)."""
    started = time.monotonic()
    if pre_stop:
        subprocess.run(pre_stop, check=True, timeout=grace_s)
    process.popen.send_signal(signal.SIGTERM)
    try:
        return True, process.popen.wait(timeout=max(0.0, grace_s - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        process.popen.kill()
        return False, process.popen.wait()


def decode_pod(rendered: dict[str, list[Manifest]]) -> tuple[list[str], float]:
    """The decode pod's preStop command and the grace period with the manifest's margin over its
    drain, around this test's shorter drain."""
    pod = find(rendered["cpu-demo"], "Deployment", "decode")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    margin_s = pod["terminationGracePeriodSeconds"] - float(flag(container["args"], "--drain-timeout-s"))
    return pre_stop, DRAIN_TIMEOUT_S + margin_s


async def most_loaded_decode(bus: Bus) -> str:
    counts = {d: await bus.client.scard(bus.keys.assignments(d)) for d in ("d1", "d2")}
    return max(counts, key=lambda d: counts[d])


def test_a_decode_pod_stopped_under_load_loses_no_request(
    mesh_factory: Any, mesh_model: str, rendered: dict[str, list[Manifest]]
) -> None:
    pre_stop, grace_s = decode_pod(rendered)
    mesh: LocalMesh = mesh_factory("k8s-drain")
    mesh.start_role("scheduler", "scheduler")
    drain = ("--drain-timeout-s", str(DRAIN_TIMEOUT_S))
    for name, role in (("p1", "prefill"), ("d1", "decode"), ("d2", "decode")):  # start together
        flags = ("--model", mesh_model, "--instance-id", name, *drain, *WORKER_FLAGS)
        mesh.start_role(name, role, *flags, wait_for_status=False)
    for name in ("p1", "d1", "d2"):
        mesh._wait(
            lambda n=name: (
                (mesh.workdir / f"{n}.port").is_file()
                and (mesh.workdir / f"{n}.port").read_text().strip() != ""
            ),
            name,
        )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [f"r{i}" for i in range(NUM_REQUESTS)]

    async def scenario() -> tuple[dict[str, list[int]], dict[str, TokenEvent], str, tuple[bool, int]]:
        bus = await bus_of(mesh)
        await asyncio.sleep(1.5)  # every heartbeat registered
        for i, request_id in enumerate(ids):
            await bus.publish(bus.keys.requests, request(request_id, [5, 6, 7 + i], params))
        tokens: dict[str, list[int]] = defaultdict(list)
        ends: dict[str, TokenEvent] = {}
        stopping: asyncio.Task[tuple[bool, int]] | None = None
        victim, last_id, deadline = "", "0-0", time.monotonic() + 120
        while len(ends) < NUM_REQUESTS:
            assert time.monotonic() < deadline, f"{len(ends)} of {NUM_REQUESTS} requests ended"
            deliveries, last_id = await bus.read_stream(bus.keys.outputs(GATEWAY), last_id, block_ms=200)
            for delivery in deliveries:
                assert isinstance(delivery.message, OutputBatch)
                for event in delivery.message.events():
                    tokens[event.request_id] += event.token_ids
                    if event.finished:
                        ends[event.request_id] = event
            if stopping is None and all(len(tokens[r]) >= 4 for r in ids):  # all decoding
                victim = await most_loaded_decode(bus)
                stopping = asyncio.create_task(
                    asyncio.to_thread(kubelet_stop, mesh.processes[victim], pre_stop, grace_s)
                )
        assert stopping is not None
        stopped = await stopping
        await bus.client.aclose()
        return tokens, ends, victim, stopped

    tokens, ends, victim, (exited_by_itself, exit_code) = asyncio.run(scenario())
    mesh.processes[victim].killed = True
    assert exited_by_itself and exit_code == 0, mesh.processes[victim].tail()
    for request_id in ids:
        end = ends[request_id]
        assert end.error is None and end.finish_reason == "length", (request_id, end)
        assert len(tokens[request_id]) == MAX_TOKENS, request_id  # every token, none twice
    moved = metric_value(mesh.metrics("scheduler"), "specmesh_scheduler_redispatched_total", default=0.0)
    assert moved >= 1  # the drain ended with requests left: they finished on the other decode worker
