"""CPU cores per job: a job without GPUs that may use fewer threads than the machine has cores runs on
cores of its own, so two jobs never share one while another idles.

Snakemake counts a job's `threads` but pins it nowhere, and a vLLM-CPU engine spreads its threads over
every core its process may use: one that shares a core with another job waits for it at every step
(6.3x slower beside a one-thread job on 2 cores, bench/engine_cores.py), and two engines side by side
both bound core 0 (the pre-flight's plain decoding 3.5x slower than alone). `draftsmith run`
leases the job's count of free cores (one lock file per core, flock, as core.io.devices does for GPUs)
and confines the job to them (its CPU affinity, which every process it starts inherits and within which
vLLM binds). The lock files stay open in the job: the kernel releases them when it exits, a kill -9
included, so no lease outlives its job.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path


def lease_dir() -> Path:
    """Where this user's leases live: one folder a machine, shared by every job of every run on it."""
    return Path(tempfile.gettempdir()) / f"draftsmith-cores-{os.getuid()}"


def allowed_cores() -> list[int]:
    """The cores this process may run on (its affinity: a cpuset, taskset, a test worker's share)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


@dataclass
class CoreLease:
    """Cores held by this process; the open lock files are what holds them."""

    cores: list[int]
    lock_fds: list[int] = field(default_factory=list)

    def release(self) -> None:
        for fd in self.lock_fds:
            os.close(fd)  # closing the file releases its lock
        self.lock_fds = []


def lease_cores(wanted: int, allowed: Iterable[int] | None = None, folder: Path | None = None) -> CoreLease:
    """Up to `wanted` of the `allowed` cores (default: allowed_cores()) that no other lease holds, lowest
    first. None leased where there is nothing to share (`wanted` covers every allowed core), none is
    free or the folder is another user's: the job then runs where the system puts it, as without a lease."""
    cores = sorted(allowed_cores() if allowed is None else allowed)
    if wanted <= 0 or wanted >= len(cores):
        return CoreLease([])
    folder = lease_dir() if folder is None else folder
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.lstat(folder).st_uid != os.getuid():  # another user's folder in a shared temp: not ours to trust
        return CoreLease([])
    lease = CoreLease([])
    try:
        for core in cores:
            if len(lease.cores) == wanted:
                break
            fd = os.open(folder / f"cpu{core}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another job runs there
                os.close(fd)
                continue
            lease.cores.append(core)
            lease.lock_fds.append(fd)
    except BaseException:
        lease.release()  # no core stays held by a job that will not run on it
        raise
    return lease


def job_threads(env: Mapping[str, str]) -> int | None:
    """The job's threads as its runner told it (Snakemake sets OMP_NUM_THREADS to the rule's threads);
    None when nothing set it (a command run by hand)."""
    value = env.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def confine_to_own_cores(env: Mapping[str, str], folder: Path | None = None) -> CoreLease:
    """Lease the job's threads' count of free cores and confine this process (and all it will start, an
    exec included: the lock files are made inheritable) to them. An empty lease changes nothing."""
    threads = job_threads(env)
    if threads is None or not hasattr(os, "sched_setaffinity"):
        return CoreLease([])
    try:
        lease = lease_cores(threads, folder=folder)
    except OSError:  # no lease folder (a read-only temp folder): run unconfined rather than not at all
        return CoreLease([])
    if lease.cores:
        for fd in lease.lock_fds:
            os.set_inheritable(fd, True)
        os.sched_setaffinity(0, lease.cores)
    return lease
