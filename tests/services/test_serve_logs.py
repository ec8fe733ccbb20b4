"""`specmesh serve`'s own log folders: one per run under one root, stale ones pruned at each start,
a running serve's never."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from services.serve_logs import KEEP_IDLE_S, OWNER_FILE, new_log_dir, prune_log_dirs


def run_folder(root: Path, name: str, owner: int | None, age_s: float) -> Path:
    """A run's folder with a log and Redis data, last written `age_s` ago."""
    path = root / name
    (path / "redis-data").mkdir(parents=True)
    (path / "gateway.log").write_text("x\n")
    (path / "redis-data" / "appendonly.aof").write_text("x\n")
    if owner is not None:
        (path / OWNER_FILE).write_text(f"{owner}\n")
    then = time.time() - age_s
    for item in [*path.rglob("*"), path]:
        os.utime(item, (then, then))
    return path


def a_dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_folders_go_and_live_or_recent_ones_stay(tmp_path: Path) -> None:
    day = KEEP_IDLE_S
    gone = run_folder(tmp_path, "old-dead", a_dead_pid(), 2 * day)
    ownerless = run_folder(tmp_path, "old-ownerless", None, 2 * day)
    running = run_folder(tmp_path, "old-running", os.getpid(), 2 * day)
    recent = run_folder(tmp_path, "recent-dead", a_dead_pid(), day / 2)
    written_lately = run_folder(tmp_path, "old-but-a-fresh-log", None, 2 * day)
    (written_lately / "gateway.log").write_text("appended\n")
    assert prune_log_dirs(tmp_path) == [gone, ownerless]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (running, recent, written_lately)
    )


def test_a_new_folder_is_owned_by_this_process_and_prunes_first(tmp_path: Path) -> None:
    stale = run_folder(tmp_path, "stale", a_dead_pid(), 2 * KEEP_IDLE_S)
    path = new_log_dir(tmp_path)
    assert path.parent == tmp_path and not stale.exists()
    assert int((path / OWNER_FILE).read_text()) == os.getpid()
    assert new_log_dir(tmp_path) != path
