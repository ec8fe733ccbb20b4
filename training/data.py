"""The Python-source corpus of the reference models, split by package.

Terms: a *root* is a directory of importable code (the interpreter's stdlib, a site-packages); a
file's *package* is its top-level name under its root (`email/mime/text.py` -> `email`,
`textwrap.py` -> `textwrap`). Splits are made of whole packages, never of random files: files of
one package share names, idioms and copied blocks, so a file-level split would leak them and
flatter every held-out number.

- *held-out*: the packages named in `HELD_OUT_PACKAGES` (in any root), plus the stdlib's own tests
  of them (`test/test_email/...`); never seen by the tokenizer or any model during training.
- *validation*: a few % of the remaining packages' bytes, whole packages drawn with a seeded
  shuffle; watched during training.
- *train*: everything else.

Files are deduplicated by content; a file that occurs in several splits is kept only in the most
protected one (held-out, then validation, then train), so no held-out text is ever trained on.
"""

from __future__ import annotations

import hashlib
import os
import random
import site
import sysconfig
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HELD_OUT_PACKAGES = ("asyncio", "email", "http", "json", "logging", "xml")
"""Stdlib packages (present in CPython 3.10 - 3.13) kept out of training, in every root."""
MAX_FILE_BYTES = 1 << 20
"""Larger files are mostly generated tables, not code people write; they are skipped."""
SKIPPED_DIR_NAMES = frozenset({"__pycache__", "site-packages", "dist-packages", ".git"})
"""Directories never walked into (site-packages are roots of their own, not part of the stdlib)."""
TEST_DIR_NAMES = ("test", "tests")
SPLITS = ("train", "validation", "held_out")


@dataclass(frozen=True)
class SourceFile:
    path: Path
    relpath: str
    """Path under its root, with forward slashes."""
    package: str
    """Top-level name under the root; for the stdlib's tests of a held-out package, that package."""
    num_bytes: int
    sha1: str

    def read(self) -> str:
        return self.path.read_text(encoding="utf-8")


@dataclass
class SplitStats:
    num_files: int
    num_bytes: int
    packages: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {"files": self.num_files, "bytes": self.num_bytes, "num_packages": len(self.packages)}


@dataclass
class DataSplit:
    """Files of each split, in a seeded-shuffled order (the order they are tokenized in)."""

    train: list[SourceFile]
    validation: list[SourceFile]
    held_out: list[SourceFile]
    roots: list[Path]
    num_skipped: dict[str, int] = field(default_factory=dict)
    """Files skipped per reason: too_large, not_utf8, empty, duplicate."""

    def files(self, split: str) -> list[SourceFile]:
        return {"train": self.train, "validation": self.validation, "held_out": self.held_out}[split]

    def stats(self, split: str) -> SplitStats:
        files = self.files(split)
        packages = sorted({f.package for f in files})
        return SplitStats(len(files), sum(f.num_bytes for f in files), packages)

    def summary(self) -> dict[str, Any]:
        """Counts per split, the held-out and validation package names, and the skipped files."""
        return {
            "roots": [str(r) for r in self.roots],
            **{split: self.stats(split).as_dict() for split in SPLITS},
            "held_out_packages": self.stats("held_out").packages,
            "validation_packages": self.stats("validation").packages,
            "skipped": dict(self.num_skipped),
        }

    def file_lists(self) -> dict[str, list[str]]:
        return {split: [f"{f.package}:{f.relpath}" for f in self.files(split)] for split in SPLITS}


def default_roots() -> list[Path]:
    """The running interpreter's stdlib and site-packages directories that exist, without repeats."""
    paths = sysconfig.get_paths()
    candidates = [paths["stdlib"], paths["purelib"], paths["platlib"], *site.getsitepackages()]
    user_site = site.getusersitepackages()
    if isinstance(user_site, str):
        candidates.append(user_site)
    roots: list[Path] = []
    for candidate in candidates:
        root = Path(candidate).resolve()
        if root.is_dir() and root not in roots:
            roots.append(root)
    return roots


def split_corpus(
    roots: list[Path],
    seed: int = 0,
    validation_fraction: float = 0.03,
    held_out_packages: tuple[str, ...] = HELD_OUT_PACKAGES,
) -> DataSplit:
    """Collects, deduplicates and splits the `.py` files under `roots` (see the module docstring)."""
    skipped: dict[str, int] = defaultdict(int)
    files = collect_source_files(roots, held_out_packages, skipped)
    held_out = [f for f in files if f.package in held_out_packages]
    candidates = [f for f in files if f.package not in held_out_packages]
    validation_names = pick_validation_packages(candidates, validation_fraction, seed)
    validation = [f for f in candidates if f.package in validation_names]
    train = [f for f in candidates if f.package not in validation_names]
    held_out, validation, train = dedupe_by_priority([held_out, validation, train], skipped)
    if not train or not validation:
        raise ValueError(
            f"the roots {', '.join(map(str, roots))} give {len(train)} train and {len(validation)} "
            "validation files; need at least two packages outside HELD_OUT_PACKAGES"
        )
    rng = random.Random(seed)
    for split_files in (train, validation, held_out):
        rng.shuffle(split_files)
    return DataSplit(train, validation, held_out, list(roots), dict(skipped))


def collect_source_files(
    roots: list[Path], held_out_packages: tuple[str, ...], skipped: dict[str, int]
) -> list[SourceFile]:
    """Every readable `.py` file under the roots, sorted by (root, relative path)."""
    other_roots = {r.resolve() for r in roots}
    files: list[SourceFile] = []
    for root in roots:
        for path in sorted(walk_python_files(root.resolve(), other_roots)):
            source = read_source_file(root.resolve(), path, held_out_packages, skipped)
            if source is not None:
                files.append(source)
    return files


def walk_python_files(root: Path, other_roots: set[Path]) -> list[Path]:
    """`.py` files under `root`, not entering other roots, skipped directories or symlinked ones."""
    found: list[Path] = []
    for directory, dir_names, file_names in os.walk(root):
        dir_names[:] = sorted(
            d
            for d in dir_names
            if d not in SKIPPED_DIR_NAMES and (Path(directory) / d).resolve() not in other_roots
        )
        found.extend(Path(directory) / name for name in file_names if name.endswith(".py"))
    return found


def read_source_file(
    root: Path, path: Path, held_out_packages: tuple[str, ...], skipped: dict[str, int]
) -> SourceFile | None:
    """The file as a SourceFile, or None (counted in `skipped`) when too large, empty or not UTF-8."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            skipped["too_large"] += 1
            return None
        data = path.read_bytes()
    except OSError:
        skipped["unreadable"] += 1
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        skipped["not_utf8"] += 1
        return None
    if not text.strip():
        skipped["empty"] += 1
        return None
    relpath = path.relative_to(root).as_posix()
    package = package_of(relpath, held_out_packages)
    return SourceFile(path, relpath, package, len(data), hashlib.sha1(data).hexdigest())


def package_of(relpath: str, held_out_packages: tuple[str, ...] = HELD_OUT_PACKAGES) -> str:
    """Top-level name of `relpath`; a test directory or module of a held-out package
    (`test/test_email/...`, `test/test_json.py`, `test/test_xml_etree.py`) counts as that package,
    so its fixtures don't leak."""
    parts = relpath.split("/")
    top = parts[0].removesuffix(".py")
    if top in TEST_DIR_NAMES and len(parts) > 1:
        tested = parts[1].removesuffix(".py").removeprefix("test_")
        for package in held_out_packages:
            if tested == package or tested.startswith(f"{package}_"):
                return package
    return top


def pick_validation_packages(candidates: list[SourceFile], fraction: float, seed: int) -> set[str]:
    """Whole packages, in seeded random order, until they hold `fraction` of the bytes; a package
    that alone would overshoot the target by half is passed over (so one huge package such as
    torch never becomes the validation set). Falls back to the smallest package."""
    sizes: dict[str, int] = defaultdict(int)
    for f in candidates:
        sizes[f.package] += f.num_bytes
    if len(sizes) < 2:
        return set()
    names = sorted(sizes)
    random.Random(seed).shuffle(names)
    target = fraction * sum(sizes.values())
    chosen: set[str] = set()
    chosen_bytes = 0
    for name in names:
        if chosen_bytes >= target:
            break
        if chosen_bytes + sizes[name] <= 1.5 * target:
            chosen.add(name)
            chosen_bytes += sizes[name]
    return chosen or {min(names, key=lambda n: (sizes[n], n))}


def dedupe_by_priority(splits: list[list[SourceFile]], skipped: dict[str, int]) -> list[list[SourceFile]]:
    """Keeps the first occurrence of each content, scanning `splits` in order (most protected first)."""
    seen: set[str] = set()
    kept: list[list[SourceFile]] = []
    for files in splits:
        unique = []
        for f in files:
            if f.sha1 in seen:
                skipped["duplicate"] += 1
                continue
            seen.add(f.sha1)
            unique.append(f)
        kept.append(unique)
    return kept
