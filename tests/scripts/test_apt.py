"""scripts/apt.sh: apt-get waits out another process's dpkg lock and retries; other failures fail at once."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCKED = "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242 (unattended-upgr)"

# A stand-in apt-get: logs its arguments, answers with the next scripted (exit code, message).
FAKE_APT_GET = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
n=$(wc -l < "$CALLS")
line=$(sed -n "${n}p" "$ANSWERS")
echo "${line#* }" >&2
exit "${line%% *}"
"""


def run_apt_get(
    tmp_path: Path, answers: list[tuple[int, str]], timeout_s: int = 600
) -> tuple[int, str, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "apt-get"
    fake.write_text(FAKE_APT_GET)
    fake.chmod(0o755)
    (tmp_path / "answers").write_text("".join(f"{code} {message}\n" for code, message in answers))
    calls = tmp_path / "calls"
    calls.touch()
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "CALLS": str(calls),
        "ANSWERS": str(tmp_path / "answers"),
        "APT_RETRY_SLEEP_S": "0",
        "APT_LOCK_TIMEOUT_S": str(timeout_s),
    }
    script = f"set -euo pipefail; source {REPO_ROOT / 'scripts' / 'apt.sh'}; apt_get install -y redis-server"
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stderr, calls.read_text().splitlines()


def test_a_held_lock_is_waited_for(tmp_path: Path) -> None:
    code, stderr, calls = run_apt_get(tmp_path, [(100, LOCKED), (100, LOCKED), (0, "done")])
    assert code == 0
    assert len(calls) == 3 and all(c.endswith("install -y redis-server") for c in calls)
    assert "DPkg::Lock::Timeout" in calls[0]
    assert stderr.count("another process holds the dpkg lock") == 2


def test_other_failures_are_not_retried(tmp_path: Path) -> None:
    code, stderr, calls = run_apt_get(tmp_path, [(100, "E: Unable to locate package redis-server"), (0, "")])
    assert code == 100 and len(calls) == 1
    assert "Unable to locate package" in stderr


def test_a_lock_held_past_the_timeout_fails_with_the_reason(tmp_path: Path) -> None:
    code, stderr, calls = run_apt_get(tmp_path, [(100, LOCKED), (0, "")], timeout_s=0)
    assert code == 100 and len(calls) == 1
    assert LOCKED in stderr and "still held after 0 s" in stderr
