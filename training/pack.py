"""Packs a built reference family into a few bounded files, and restores it byte for byte.

The GPU machine hands back at most `MAX_PACK_FILES` files of at most `MAX_PACK_FILE_BYTES` each
(`MAX_PACK_BYTES` in all). A *pack* is therefore every safetensors file copied as-is, renamed
`<model dir>.<file name>`, plus one `small-files.tar.gz` holding every other file and `pack.json`,
the list of the big files with their destination and SHA-256. Unpacking checks every digest.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path, PurePosixPath

MAX_PACK_FILES = 8
MAX_PACK_FILE_BYTES = 16 << 20
MAX_PACK_BYTES = 64 << 20
SMALL_FILES = "small-files.tar.gz"
PACK_INDEX = "pack.json"
"""Inside the tarball: {"big_files": {pack name: {"path", "bytes", "sha256"}}, "small_files": {path: sha256}}."""
BIG_FILE_SUFFIX = ".safetensors"


def pack_reference(build_dir: Path, pack_dir: Path, paths: list[str]) -> list[Path]:
    """Packs the files and directories `paths` (relative to `build_dir`) into `pack_dir`; raises
    before writing anything when the pack would break the limits."""
    files = sorted(_expand(build_dir, paths))
    big = [f for f in files if f.endswith(BIG_FILE_SUFFIX)]
    small = [f for f in files if not f.endswith(BIG_FILE_SUFFIX)]
    big_names = {pack_name(f): f for f in big}
    index = {
        "big_files": {
            name: {"path": f, "bytes": (build_dir / f).stat().st_size, "sha256": sha256_of(build_dir / f)}
            for name, f in big_names.items()
        },
        "small_files": {f: sha256_of(build_dir / f) for f in small},
    }
    tarball = small_files_tarball(build_dir, small, json.dumps(index, indent=2).encode())
    check_pack_limits({n: build_dir / f for n, f in big_names.items()}, len(tarball))
    pack_dir.mkdir(parents=True, exist_ok=True)
    written = [pack_dir / SMALL_FILES]
    written[0].write_bytes(tarball)
    for name, f in big_names.items():
        shutil.copyfile(build_dir / f, pack_dir / name)
        written.append(pack_dir / name)
    return written


def unpack_reference(pack_dir: Path, out_dir: Path) -> list[Path]:
    """Restores a pack into `out_dir`; raises when a file is missing or its SHA-256 differs."""
    with tarfile.open(pack_dir / SMALL_FILES, "r:gz") as tar:
        index = json.loads(_read_member(tar, PACK_INDEX))
        restored = [_extract(tar, path, out_dir) for path in index["small_files"]]
    for path, digest in index["small_files"].items():
        _check_digest(out_dir / path, digest)
    for name, entry in index["big_files"].items():
        destination = out_dir / _safe_relpath(entry["path"])
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pack_dir / name, destination)
        _check_digest(destination, entry["sha256"])
        restored.append(destination)
    return restored


def pack_name(relpath: str) -> str:
    """`specmesh-code-15m/model-00001-of-00002.safetensors` -> `specmesh-code-15m.model-00001-of-00002.safetensors`."""
    return relpath.replace("/", ".")


def check_pack_limits(big_files: dict[str, Path], tarball_bytes: int) -> None:
    sizes = {name: path.stat().st_size for name, path in big_files.items()}
    sizes[SMALL_FILES] = tarball_bytes
    problems = [f"{n} is {b / 2**20:.2f} MiB" for n, b in sizes.items() if b > MAX_PACK_FILE_BYTES]
    if len(sizes) > MAX_PACK_FILES:
        problems.append(f"{len(sizes)} files (at most {MAX_PACK_FILES})")
    if sum(sizes.values()) > MAX_PACK_BYTES:
        problems.append(f"{sum(sizes.values()) / 2**20:.2f} MiB in all (at most {MAX_PACK_BYTES >> 20})")
    if problems:
        raise ValueError(
            f"the pack breaks its limits ({MAX_PACK_FILES} files of {MAX_PACK_FILE_BYTES >> 20} MiB): "
            + "; ".join(problems)
        )


def small_files_tarball(build_dir: Path, files: list[str], index: bytes) -> bytes:
    """A gzipped tar of `files` and the pack index, byte-identical for identical inputs
    (sorted members, zeroed times and owners)."""
    buffer = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as zipped,
        tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        _add_member(tar, PACK_INDEX, index)
        for f in files:
            _add_member(tar, f, (build_dir / f).read_bytes())
    return buffer.getvalue()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _expand(build_dir: Path, paths: list[str]) -> list[str]:
    files: list[str] = []
    for path in paths:
        full = build_dir / path
        if full.is_dir():
            files += [p.relative_to(build_dir).as_posix() for p in full.rglob("*") if p.is_file()]
        elif full.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"nothing to pack at {full}")
    return files


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def _read_member(tar: tarfile.TarFile, name: str) -> bytes:
    member = tar.extractfile(name)
    if member is None:
        raise ValueError(f"{SMALL_FILES} has no regular file {name}")
    return member.read()


def _extract(tar: tarfile.TarFile, relpath: str, out_dir: Path) -> Path:
    destination = out_dir / _safe_relpath(relpath)
    destination.parent.mkdir(parents=True, exist_ok=True)
    destination.write_bytes(_read_member(tar, relpath))
    return destination


def _safe_relpath(relpath: str) -> Path:
    """Refuses absolute paths and `..` so a pack can only write inside the output directory."""
    path = PurePosixPath(relpath)
    if path.is_absolute() or ".." in path.parts:
        raise ValueError(f"unsafe path in pack: {relpath!r}")
    return Path(*path.parts)


def _check_digest(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise ValueError(f"{path}: SHA-256 {actual} does not match the pack's {expected}")
