"""Where the shipped reference model family lives (trained by `training/build_reference.py`)."""

from __future__ import annotations

import os
from pathlib import Path

MODELS_DIR = Path(os.environ.get("SPECMESH_MODELS_DIR", Path(__file__).resolve().parents[1] / "models"))
BASE_MODEL = "specmesh-code-15m"
DRAFT_MODEL = "specmesh-code-draft"
MTP_HEAD = "specmesh-code-15m-mtp"
EAGLE3_HEAD = "specmesh-code-15m-eagle3"


def reference_dir(name: str = BASE_MODEL) -> Path:
    """The directory of a shipped model; a clear error if this checkout does not have it."""
    path = MODELS_DIR / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the reference model {name!r} is not at {path}; pass --model DIR, or set SPECMESH_MODELS_DIR"
        )
    return path


def default_model() -> str:
    return str(reference_dir(BASE_MODEL))
