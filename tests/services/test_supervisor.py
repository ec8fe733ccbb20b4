"""The supervisor's restart policy: backoff, a fresh incarnation per start, giving up."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from services.supervisor import RestartPolicy, RoleFailed, Supervisor


def test_backoff_doubles_up_to_its_bound() -> None:
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=4.0)
    assert [policy.delay_s(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 4.0]


def test_a_first_delay_past_the_bound_is_kept_not_cut() -> None:
    """An operator's `--restart-delay-s` longer than the usual ceiling is the wait they asked for."""
    policy = RestartPolicy(first_delay_s=10.0, max_delay_s=8.0)
    assert [policy.delay_s(n) for n in range(1, 3)] == [10.0, 10.0]


def test_a_dying_role_is_restarted_as_a_new_incarnation_then_given_up_on(tmp_path: Path) -> None:
    lines: list[str] = []
    exits: list[int] = []
    policy = RestartPolicy(max_restarts=2, window_s=60.0, first_delay_s=0.01, max_delay_s=0.01)
    supervisor = Supervisor(tmp_path, policy, report=lines.append)

    def argv(incarnation: int) -> list[str]:
        return [sys.executable, "-c", f"print('incarnation {incarnation}'); raise SystemExit(3)"]

    supervisor.start("flaky", argv, on_exit=exits.append)
    deadline = time.monotonic() + 30.0
    with pytest.raises(RoleFailed, match="flaky died 3 times within 60 s") as failed:
        while time.monotonic() < deadline:
            supervisor.supervise()
            time.sleep(0.01)
    assert exits == [0, 1]
    assert [line.split(";")[0] for line in lines] == ["flaky exited with code 3"] * 2
    assert "incarnation 2" in str(failed.value)  # the end of its log
    supervisor.stop()
