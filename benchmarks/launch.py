"""A local mesh for one benchmark cell, started and stopped the way `specmesh serve` does it.

The processes and their flags come from `services/serve.py` (its `Supervisor`, Redis lookup,
free ports, engine flags and readiness wait); what differs is that the decoding worker's metrics
port is chosen here, so the benchmark can read its per-position acceptance counters, and that the
context manager hands the mesh back to the caller instead of serving until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.runtime import PASSWORD_ENV
from services.serve import (
    _engine_flags,
    _wait_ready,
    find_redis_server,
    free_port,
    place_workers,
    visible_gpus,
)
from services.supervisor import Supervisor

TOPIC = "bench"
WORKER_STATS_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LaunchedMesh:
    url: str
    worker_metrics_url: str
    log_dir: Path
    pids: dict[str, int]
    """Each launched process's pid by role name (redis, scheduler, suffix-cache, mixed or prefill and
    decode, gateway)."""

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system, every thread) each mesh process has used so far — the launched
        ones, and their children as "role/name" (a worker's engine core, the gateway's workers) —
        and this benchmark process's own as "client" (it drives the requests and parses every SSE
        chunk)."""
        used = {}
        for name, pid in self.pids.items():
            used[name] = process_cpu_seconds(pid)
            for child, child_pid in child_processes(pid).items():
                used[f"{name}/{child}"] = process_cpu_seconds(child_pid)
        return {**used, "client": time.process_time()}

    def worker_spec_counts(self, num_finished: int) -> dict[str, list[int]]:
        """Drafted / accepted per draft position, summed over every request the worker finished
        (the gateway's usage carries totals only), once it has counted `num_finished` requests: it
        counts a request just after sending its last event, so a client can be a moment ahead."""
        deadline = time.monotonic() + WORKER_STATS_TIMEOUT_S
        text = self._worker_metrics()
        while _total(text, "specmesh_worker_requests_finished_total") < num_finished:
            if time.monotonic() > deadline:
                print(
                    f"warning: the worker counted fewer than {num_finished} finished requests",
                    file=sys.stderr,
                )
                break
            time.sleep(0.1)
            text = self._worker_metrics()
        return {
            "drafted_per_position": _per_position(text, "specmesh_worker_drafted_per_position_total"),
            "accepted_per_position": _per_position(text, "specmesh_worker_accepted_per_position_total"),
        }

    def _worker_metrics(self) -> str:
        with urllib.request.urlopen(self.worker_metrics_url, timeout=5) as response:
            return str(response.read().decode())


@contextmanager
def launch_mesh(
    engine_args: argparse.Namespace,
    model: str,
    speculative_config: dict[str, Any],
    log_dir: Path | None = None,
    torch_threads: int | None = None,
    pd: bool = False,
    gateway_workers: int = 1,
) -> Iterator[LaunchedMesh]:
    """Redis, scheduler, suffix-cache, one mixed worker (`pd`: one prefill and one decode worker,
    each on GPUs of its own where the host has enough, as `specmesh serve --pd` places them)
    and the gateway (`gateway_workers` processes on its port), each its own process, with the
    engine flags of `engine_args` (as `specmesh serve` takes them); stopped on exit.
    `torch_threads`: OMP_NUM_THREADS of the processes (the workers' torch threads)."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="specmesh-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    mesh = Supervisor(log_dir)
    redis_port, password = free_port(), secrets.token_hex(16)
    env = {**os.environ, PASSWORD_ENV: password}  # the children's password, off every command line
    if torch_threads:
        env["OMP_NUM_THREADS"] = str(torch_threads)
    bus = ["--scheduler-host", "127.0.0.1", "--scheduler-port", str(redis_port), "--scheduler-topic", TOPIC]
    me = [sys.executable, "-m", "services.cli"]
    gateway_port, metrics_port = free_port(), free_port()
    try:
        mesh.start("redis", [find_redis_server(), str(_redis_conf(log_dir, redis_port, password))])
        mesh.start("scheduler", [*me, "scheduler", *bus], env)
        mesh.start("suffix-cache", [*me, "suffix-cache", *bus], env)
        engine = _engine_flags(engine_args, model, json.dumps(speculative_config))
        roles = ["prefill", "decode"] if pd else ["mixed"]
        gpus = visible_gpus(engine_args.device)
        placement = place_workers(
            roles, gpus, engine_args.tensor_parallel_size, see_peers=engine_args.kv_transport == "ipc"
        )  # as `specmesh serve --pd` places them: one role per GPU where there are GPUs enough
        for role in roles:
            worker = ["--instance-id", f"bench-{role}"]
            if role != "prefill":  # the one that drafts: its counters are the acceptance
                worker += ["--metrics-port", str(metrics_port)]
            mesh.start(role, [*me, role, *engine, *bus, *worker], {**env, **placement[role]})
        gateway = ["--model", model, "--port", str(gateway_port), "--workers", str(gateway_workers)]
        mesh.start("gateway", [*me, "gateway", *gateway, *bus], env)
        url = f"http://127.0.0.1:{gateway_port}"
        _wait_ready(mesh, f"{url}/health", lambda: False)
        pids = {name: process.pid for name, process in mesh.processes}
        yield LaunchedMesh(url, f"http://127.0.0.1:{metrics_port}/metrics", log_dir, pids)
    finally:
        mesh.stop()


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a live process from /proc (Linux); NaN where that cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return float("nan")
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14, 15


def child_processes(pid: int) -> dict[str, int]:
    """A live process's children by name (/proc/<pid>/comm, numbered where names repeat); Linux."""
    children: dict[str, int] = {}
    for stat in sorted(Path("/proc").glob("[0-9]*/stat"), key=lambda path: int(path.parent.name)):
        try:
            text = stat.read_text()
            comm = (stat.parent / "comm").read_text().strip()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2 :].split()[1]) == pid:  # field 4: the parent's pid
            name = comm if comm not in children else f"{comm}.{len(children)}"
            children[name] = int(stat.parent.name)
    return children


def cores_busy(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Per process, the CPU it used over a wall-clock window in cores (1.0: one core all the time)."""
    return {name: (after[name] - before.get(name, 0.0)) / wall_s for name in after if wall_s > 0}


def _redis_conf(log_dir: Path, port: int, password: str) -> Path:
    """The password goes in a file only we can read, as `specmesh serve` keeps it."""
    conf = log_dir / "redis.conf"
    conf.write_text(f'port {port}\nbind 127.0.0.1\nrequirepass {password}\nsave ""\nappendonly no\n')
    conf.chmod(0o600)
    return conf


def _total(text: str, metric: str) -> float:
    """The sum of every sample of `metric` (all label sets)."""
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith(metric + "{") or line.startswith(metric + " ")
    )


def _per_position(text: str, metric: str) -> list[int]:
    """Samples `metric{...,position="i"} value` of a Prometheus page, as a list indexed by i."""
    counts: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith(metric + "{"):
            continue
        labels, _, value = line.rpartition(" ")
        position = labels.partition('position="')[2].partition('"')[0]
        if position.isdigit():
            counts[int(position)] = counts.get(int(position), 0.0) + float(value)
    return [int(counts.get(i, 0.0)) for i in range(max(counts, default=-1) + 1)]
