"""Where `specmesh serve` logs when no `--log-dir` is given: a new folder per run under one root in
the temporary directory, which each start prunes of folders no live serve owns and nothing has
written to for a day."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

KEEP_IDLE_S = 24 * 3600.0
"""A run's folder is removed once nothing in it has changed for this long and its serve is gone."""
OWNER_FILE = "serve.pid"
"""The pid of the serve that owns a folder: a live owner's folder is never removed."""


def log_root() -> Path:
    """This user's root of serve's log folders (one per user: folders of others are not ours to prune)."""
    return Path(tempfile.gettempdir()) / f"specmesh-serve-{os.getuid()}"


def new_log_dir(root: Path | None = None) -> Path:
    """A fresh folder for this run's logs, after pruning the root of stale ones."""
    root = root or log_root()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    if root.stat().st_uid != os.getuid():
        raise ValueError(f"{root} belongs to another user; pass --log-dir")
    prune_log_dirs(root)
    path = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=root))
    (path / OWNER_FILE).write_text(f"{os.getpid()}\n")
    return path


def prune_log_dirs(root: Path, keep_idle_s: float = KEEP_IDLE_S) -> list[Path]:
    """Removes the folders under `root` whose serve is gone and that were idle `keep_idle_s`; returns them."""
    now = time.time()
    stale = [
        path
        for path in sorted(root.iterdir())
        if path.is_dir() and not _owner_alive(path) and now - _last_change(path) > keep_idle_s
    ]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _last_change(path: Path) -> float:
    """The newest modification time in the folder (logs are appended to, not re-created)."""
    times = [path.stat().st_mtime]
    for child in path.rglob("*"):
        try:
            times.append(child.stat().st_mtime)
        except OSError:  # removed while we looked
            continue
    return max(times)


def _owner_alive(path: Path) -> bool:
    try:
        pid = int((path / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
