"""Cores leased to a job's CPU engine, so that two engines on one machine never share one.

vLLM-CPU binds an engine's threads to the first cores the process may use, whatever the job runner gave
the job: two jobs' engines (the pre-flight beside generation, on 2 cores) both land on core 0, decode
~10x slower, and leave core 1 idle. A job that may use fewer cores than the machine has takes its count
of free ones here: one lock file per core (`flock`), held while the engine runs and released by the
kernel when the holder exits, a kill -9 included, so no lease outlives its job.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path


def lease_dir() -> Path:
    """Where this user's leases live: one folder a machine, shared by every job of every run on it."""
    return Path(tempfile.gettempdir()) / f"draftsmith-cores-{os.getuid()}"


def allowed_cores() -> list[int]:
    """The cores this process may run on (its affinity: a cpuset, taskset, a test worker's share)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


@contextlib.contextmanager
def lease_cores(
    wanted: int, allowed: Iterable[int] | None = None, folder: Path | None = None
) -> Iterator[list[int]]:
    """Up to `wanted` of the `allowed` cores (default: allowed_cores()) that no other lease holds, lowest
    first, held until the block ends. Empty where there is nothing to share (`wanted` covers every
    allowed core) or no core is free: the engine then binds as vLLM would."""
    cores = sorted(allowed_cores() if allowed is None else allowed)
    if wanted <= 0 or wanted >= len(cores):
        yield []
        return
    folder = lease_dir() if folder is None else folder
    folder.mkdir(parents=True, exist_ok=True)
    held: list[tuple[int, int]] = []  # (core, fd of its lock file)
    try:
        for core in cores:
            if len(held) == wanted:
                break
            fd = os.open(folder / f"cpu{core}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another job's engine runs there
                os.close(fd)
                continue
            held.append((core, fd))
        yield [core for core, _ in held]
    finally:
        for _, fd in held:
            os.close(fd)  # closing the file releases its lock
