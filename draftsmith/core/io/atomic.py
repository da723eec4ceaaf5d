"""Atomic writes: a crash leaves either the complete file or none (temp file + fsync + rename).

Every committed file gets the mode a plain `open(path, "w")` would give it (0666 minus the umask:
0644 under the usual 022), whatever made the temp file: mkstemp and safetensors create theirs 0600,
which a serving process running as another user could not read.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def process_umask() -> int:
    """The process's umask, read without changing it (Linux: /proc; elsewhere set and restored)."""
    with (
        contextlib.suppress(OSError, ValueError, StopIteration),
        open("/proc/self/status", encoding="ascii") as fh,
    ):
        return int(next(line for line in fh if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def shared_mode(directory: bool = False) -> int:
    """Mode of a result file (0666) or folder (0777) under the umask: 0644 / 0755 with umask 022."""
    return (0o777 if directory else 0o666) & ~process_umask()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is fsynced and renamed onto `path`."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        commit_file(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def commit_file(tmp: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Make a finished temporary file (beside target, same filesystem) the target: fsync, rename, and
    fsync the folder, so after a crash the target is either the old file or the whole new one. The
    file gets shared_mode(): the writer may have created it 0600."""
    with open(tmp, "rb+") as fh:
        os.fchmod(fh.fileno(), shared_mode())
        os.fsync(fh.fileno())
    os.replace(tmp, target)
    _fsync_dir(Path(target).parent)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary directory beside `path`; on success it replaces `path` whole."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        tmp.chmod(shared_mode(directory=True))  # mkdtemp makes 0700
        for child in tmp.rglob("*"):
            if child.is_symlink():
                continue
            if child.is_dir():
                child.chmod(shared_mode(directory=True))
            elif child.is_file():
                with open(child, "rb+") as fh:
                    os.fchmod(fh.fileno(), shared_mode())  # save_file and mkstemp make 0600
                    os.fsync(fh.fileno())
        old = None
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def write_text(path: str | os.PathLike[str], text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_jsonl(path: str | os.PathLike[str], rows: Any) -> int:
    """Write an iterable of JSON-serialisable rows, one per line; returns the row count."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def disk_full(err: BaseException | None) -> bool:
    """Whether an error (or what caused it, e.g. a writer thread's) is a full disk or quota."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        err = err.__cause__ or err.__context__
    return False
