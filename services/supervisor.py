"""The roles of a one-machine mesh as child processes: each dies with its supervisor, and one that
dies is started again after a bounded exponential backoff.

A child is a *role* (redis, scheduler, mixed, gateway, ...); each start of it is an *incarnation*
(0 for the first). Each incarnation runs in a session and process group of its own (Ctrl-C in the
terminal reaches only the supervisor, which stops the roles in order), and on Linux gets a
parent-death signal, so a supervisor killed by SIGKILL leaves nothing running. Elsewhere there is no
parent-death signal: a supervisor that exits normally still stops every group.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 30.0
LOG_TAIL_CHARS = 3000

Argv = Callable[[int], list[str]]
"""A role's command line for one incarnation (a worker takes a fresh instance id per start)."""


class RoleFailed(RuntimeError):
    """A role died when it may not be restarted (before the mesh was up, or too often)."""


@dataclass(frozen=True)
class RestartPolicy:
    """Backoff: `first_delay_s`, doubling per restart within `window_s`, at most `max_delay_s`
    (or `first_delay_s`, where longer)."""

    max_restarts: int = 5
    """Restarts of one role within `window_s` past which the supervisor gives up."""
    window_s: float = 60.0
    first_delay_s: float = 0.5
    max_delay_s: float = 8.0

    def delay_s(self, num_recent: int) -> float:
        """The wait before restart number `num_recent` (1-based) of the window."""
        ceiling_s = max(self.first_delay_s, self.max_delay_s)
        return float(min(self.first_delay_s * 2 ** (num_recent - 1), ceiling_s))


@dataclass
class Role:
    name: str
    argv: Argv
    env: dict[str, str] | None
    on_exit: Callable[[int], None] | None
    """Called with the incarnation that died, before the next starts."""
    process: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    restarts: list[float] = field(default_factory=list)
    """monotonic() of each restart within the policy's window."""
    restart_at: float | None = None


@dataclass
class Supervisor:
    log_dir: Path
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    report: Callable[[str], None] = lambda line: print(f"specmesh serve: {line}", file=sys.stderr, flush=True)
    roles: dict[str, Role] = field(default_factory=dict)

    @property
    def processes(self) -> list[tuple[str, subprocess.Popen[bytes]]]:
        """The current incarnation of every role, in start order."""
        return [(role.name, role.process) for role in self.roles.values() if role.process is not None]

    def start(
        self,
        name: str,
        argv: list[str] | Argv,
        env: dict[str, str] | None = None,
        on_exit: Callable[[int], None] | None = None,
    ) -> subprocess.Popen[bytes]:
        role = Role(name, argv if callable(argv) else lambda _: list(argv), env, on_exit)
        self.roles[name] = role
        return self._spawn(role)

    def check_alive(self) -> None:
        """Raises RoleFailed, with the end of its log, for the first role found dead."""
        for role in self.roles.values():
            if role.process is not None and role.process.poll() is not None:
                raise RoleFailed(
                    f"{role.name} exited with code {role.process.returncode}; "
                    f"the end of its log:\n{self.log_tail(role.name)}"
                )

    def supervise(self) -> None:
        """One look at every role: a dead one is scheduled for restart, a due one started. Raises
        RoleFailed once a role has died more than `max_restarts` times within `window_s`."""
        now = time.monotonic()
        for role in self.roles.values():
            if role.restart_at is None and role.process is not None and role.process.poll() is not None:
                self._schedule_restart(role, now)
            elif role.restart_at is not None and now >= role.restart_at:
                role.restart_at = None
                role.incarnation += 1
                self._spawn(role)

    def stop(self) -> None:
        """SIGTERM in reverse start order (the gateway first, Redis last), SIGKILL where one does not
        exit within STOP_TIMEOUT_S, then SIGKILL whatever is left in each role's process group."""
        for role in reversed(self.roles.values()):
            process = role.process
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            if process is not None:
                _kill_group(process.pid)

    def log_tail(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")[-LOG_TAIL_CHARS:]

    def _schedule_restart(self, role: Role, now: float) -> None:
        assert role.process is not None
        code = role.process.returncode
        _kill_group(role.process.pid)  # what it leaves behind (a gateway's workers, an engine core)
        role.restarts = [t for t in role.restarts if now - t < self.policy.window_s] + [now]
        if len(role.restarts) > self.policy.max_restarts:
            raise RoleFailed(
                f"{role.name} died {len(role.restarts)} times within {self.policy.window_s:g} s "
                f"(last exit code {code}); giving up. The end of its log:\n{self.log_tail(role.name)}"
            )
        if role.on_exit is not None:
            role.on_exit(role.incarnation)
        delay_s = self.policy.delay_s(len(role.restarts))
        role.restart_at = now + delay_s
        self.report(
            f"{role.name} exited with code {code}; restarting it in {delay_s:g} s "
            f"(restart {len(role.restarts)} of at most {self.policy.max_restarts} "
            f"within {self.policy.window_s:g} s)"
        )

    def _spawn(self, role: Role) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{role.name}.log", "ab")  # noqa: SIM115 - the child's for its lifetime
        with log:
            role.process = subprocess.Popen(
                role.argv(role.incarnation),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=role.env,
                start_new_session=True,
                preexec_fn=_die_with(os.getpid()),
            )
        return role.process


def _die_with(parent_pid: int) -> Callable[[], None] | None:
    """A preexec_fn that has the child SIGKILLed when `parent_pid` dies (Linux PR_SET_PDEATHSIG;
    the signal follows the parent *thread*, so children are started from the main thread only);
    None where there is no such signal."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGKILL)

    return arm


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
