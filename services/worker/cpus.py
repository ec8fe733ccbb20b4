"""The CPUs of a worker's two processes: the engine core's own, the bus side's the rest.

The bus side wakes for every step batch the core sends. Free to run anywhere, it is often woken
on the core's CPU (the kernel prefers the waker's CPU, and on a busy host no other is idle) and
preempts the step there until its publish is done. So the core takes CPUs of its own
(`EngineConfig.core_cpus`) and the bus side keeps off them. A core holds each CPU it took by an
exclusive lock on a file per CPU (`LOCK_DIR`), which the kernel drops when the core exits however
it exits; `auto` takes the highest-numbered CPUs the process may use that no other core holds,
and only on a host of at least `AUTO_MIN_CPUS`: on a smaller one the core's CPU is also the one
the rest of the mesh and any other tenant fall back on, and a pinned core cannot step aside from
a CPU another process is busy on, so it loses more to them than the bus side took from it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from shared.config import parse_cpu_list

LOCK_DIR = Path(tempfile.gettempdir()) / f"specmesh-cpus-{os.getuid()}"
AUTO_MIN_CPUS = 4
"""`auto` pins nothing where the process may use fewer CPUs than this."""


@dataclass
class CpuClaim:
    """The CPUs an engine core runs on (empty: not pinned) and the locks that hold them."""

    cpus: list[int] = field(default_factory=list)
    locks: list[int] = field(default_factory=list)
    """Open file descriptors, each holding one CPU's lock."""

    def release(self) -> None:
        for fd in self.locks:
            os.close(fd)
        self.locks = []


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (empty where the platform does not say)."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))


def claim_core_cpus(setting: str, num_threads: int, lock_dir: Path = LOCK_DIR) -> CpuClaim:
    """The CPUs for an engine core of `num_threads` torch threads, by `setting` (auto, off, a list).
    A list must leave the bus side a CPU; `auto` takes none on fewer than `AUTO_MIN_CPUS` usable
    CPUs, nor unless it finds `num_threads` free ones (at most all usable CPUs but one)."""
    usable = usable_cpus()
    if setting == "off" or len(usable) < 2:
        return CpuClaim()
    if setting != "auto":
        return _claim_named(parse_cpu_list(setting), usable, lock_dir)
    if len(usable) < AUTO_MIN_CPUS:
        return CpuClaim()
    claim = CpuClaim()
    wanted = min(num_threads, len(usable) - 1)
    for cpu in reversed(usable):
        fd = _lock(lock_dir, cpu)
        if fd is not None:
            claim.cpus.insert(0, cpu)
            claim.locks.append(fd)
        if len(claim.cpus) == wanted:
            return claim
    claim.release()  # other cores hold the rest: better unpinned than crowded
    return CpuClaim()


def _claim_named(cpus: list[int], usable: list[int], lock_dir: Path) -> CpuClaim:
    missing = sorted(set(cpus) - set(usable))
    if missing:
        raise ValueError(f"core_cpus: CPUs {missing} are not among those this process may use ({usable})")
    if len(cpus) == len(usable):
        raise ValueError(
            f"core_cpus: {cpus} are all the CPUs this process may use: none left for the bus side"
        )
    locks = [fd for fd in (_lock(lock_dir, cpu) for cpu in cpus) if fd is not None]
    return CpuClaim(cpus, locks)


def _lock(lock_dir: Path, cpu: int) -> int | None:
    """An open descriptor holding the lock of `cpu`, or None if another process holds it."""
    lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(lock_dir / f"cpu{cpu}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def set_thread_policy(policy: str) -> None:
    """The calling thread's Linux scheduling policy (threads it starts later inherit it): `batch`
    (SCHED_BATCH: its wake-ups preempt no running task) or `normal` (SCHED_OTHER)."""
    if policy not in ("normal", "batch"):
        raise ValueError(f"scheduling policy must be normal or batch, not {policy!r}")
    if not hasattr(os, "SCHED_BATCH"):
        return  # not Linux: every thread stays as it is
    os.sched_setscheduler(0, os.SCHED_BATCH if policy == "batch" else os.SCHED_OTHER, os.sched_param(0))


def bus_side_cpus(core_cpus: list[int]) -> list[int]:
    """The CPUs left to the bus side by a core on `core_cpus` (empty: the core is not pinned)."""
    if not core_cpus:
        return []
    return [cpu for cpu in usable_cpus() if cpu not in core_cpus]


def pin_process(cpus: list[int]) -> None:
    """Every thread of this process (and those it starts later) on `cpus`; nothing if empty."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cpus)
