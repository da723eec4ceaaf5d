"""Content digests of the workflow's intermediates, so that a damaged one is found at start.

Snakemake reruns a job whose input is newer than its outputs, and deletes those outputs before the job
runs: a corrupt `results/vocab_map.pt` with a new mtime cost `results/drafter/` before torch even said
why. So each stage that writes an intermediate seals it: a hidden sidecar beside the file
(`.vocab_map.pt.sha256`, written atomically after the file) holds its sha256, size, mtime and the stage
that wrote it. At parse time (rules/common.smk) every sealed file is checked before any job runs: the
same size and mtime is trusted (a stat), otherwise the file is hashed (up to a size) and a different
digest stops the run naming the file and the stage to rerun.

A stage removes its sidecars when it starts, so a job that dies between writing a file and sealing it
leaves no stale digest behind (Snakemake reruns that incomplete job anyway).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from draftsmith.core.atomic import write_json

SUFFIX = ".sha256"
# Files up to this size are hashed at start when their mtime changed (~0.5 s); a larger one is left to
# the job that reads it, with a warning.
CHECK_MAX_BYTES = 256 * 2**20


def sidecar(path: str | os.PathLike[str]) -> Path:
    """Where the digest of `path` lives: a hidden file beside it (push and the engines skip those)."""
    path = Path(path)
    return path.with_name(f".{path.name}{SUFFIX}")


def file_sha256(path: str | os.PathLike[str], chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The files of `paths`: a folder stands for the visible regular files directly in it."""
    files = []
    for path in map(Path, paths):
        if path.is_dir() and not path.is_symlink():
            files += sorted(p for p in path.iterdir() if not p.name.startswith(".") and not p.is_symlink())
        else:
            files.append(path)
    return files


def unseal(paths: Iterable[str | os.PathLike[str]]) -> None:
    for path in map(Path, paths):
        for side in path.glob(f".*{SUFFIX}") if path.is_dir() else [sidecar(path)]:
            side.unlink(missing_ok=True)


def seal(paths: Iterable[str | os.PathLike[str]], stage: str) -> None:
    """Record the digest of each file in `paths` (a folder: the files in it; missing ones are skipped)
    as written by `stage`."""
    for path in _files(paths):
        if not path.is_file() or path.is_symlink():
            continue
        stat = path.stat()
        record = {"sha256": file_sha256(path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        write_json(sidecar(path), {**record, "stage": stage})


def sealed(stage: str, *options: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator of a stage command: the files named by its keyword arguments `options` are unsealed
    when it starts and sealed when it returns (not when it fails)."""

    def wrap(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def run(*args: Any, **kw: Any) -> Any:
            # under torchrun only rank 0 writes the results, and only it seals them
            paths = (
                [kw[name] for name in options if kw.get(name)] if os.environ.get("RANK", "0") == "0" else []
            )
            unseal(paths)
            result = command(*args, **kw)
            seal(paths, stage)
            return result

        return run

    return wrap


def _record(side: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    keys = {"sha256": str, "bytes": int, "mtime_ns": int, "stage": str}
    ok = isinstance(record, dict) and all(isinstance(record.get(k), t) for k, t in keys.items())
    return record if ok else None


def damage(path: str | os.PathLike[str], max_bytes: int = CHECK_MAX_BYTES) -> tuple[str | None, str | None]:
    """(error, warning) for one file against its sidecar; both None when it is intact, unsealed or gone."""
    path = Path(path)
    record = _record(sidecar(path))
    if record is None or not path.is_file():
        return None, None
    stat = path.stat()
    # deleted, the file is made again by its rule, and what reads it reruns (a run that still finds it
    # here, --forcerun included, stops at this check)
    rerun = f"delete it and Snakemake reruns rule {record['stage']}"
    if stat.st_size != record["bytes"]:
        why = f"{stat.st_size:,} bytes where rule {record['stage']} wrote {record['bytes']:,}"
        return f"{path}: damaged ({why}); {rerun}", None
    if stat.st_mtime_ns == record["mtime_ns"]:
        return None, None
    if stat.st_size > max_bytes:
        return None, f"{path} changed since rule {record['stage']} wrote it; too large to check at start"
    if file_sha256(path) != record["sha256"]:
        return f"{path}: damaged (its sha256 differs from what rule {record['stage']} wrote); {rerun}", None
    return None, None


def intact(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is sealed and still what was sealed: the same size, and the same mtime or else the
    same sha256 (hashed whatever its size). An unsealed or missing file is not."""
    path = Path(path)
    record = _record(sidecar(path))
    if record is None or not path.is_file():
        return False
    stat = path.stat()
    if stat.st_size != record["bytes"]:
        return False
    return stat.st_mtime_ns == record["mtime_ns"] or file_sha256(path) == record["sha256"]


def retouch(path: str | os.PathLike[str]) -> None:
    """Set an intact sealed file's mtime to now and its seal's with it (no rehash): a file reused as a
    new job's output must not look older than that job's inputs."""
    path = Path(path)
    record = _record(sidecar(path))
    if record is None:
        raise ValueError(f"{path} is not sealed")
    os.utime(path)
    write_json(sidecar(path), {**record, "mtime_ns": path.stat().st_mtime_ns})


def damage_under(
    root: str | os.PathLike[str], max_bytes: int = CHECK_MAX_BYTES
) -> tuple[list[str], list[str]]:
    """(errors, warnings) of every sealed file under `root` (see `damage`)."""
    errors, warnings = [], []
    root = Path(root)
    if not root.is_dir():
        return errors, warnings
    for side in sorted(root.rglob(f".*{SUFFIX}")):
        path = side.with_name(side.name[1 : -len(SUFFIX)])
        error, warning = damage(path, max_bytes)
        errors += [error] if error else []
        warnings += [warning] if warning else []
    return errors, warnings
