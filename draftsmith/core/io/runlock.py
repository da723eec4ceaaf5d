"""What a leftover Snakemake lock means, said at start.

Snakemake locks the files a run will write (`.snakemake/locks/*.lock`) and removes the locks when it ends;
a kill -9 leaves them, and the next run stops with "Directory cannot be locked". The lock names no
process or machine, so whether its Snakemake is gone cannot be known for certain (one on another machine
may share the folder): the lock is not removed here. What can be seen is this machine's processes: where
none but this run works in the folder, the lock is stale and `snakemake --unlock` is safe; where a job
of the killed run still writes (`draftsmith run` ends those within ORPHAN_GRACE_SECONDS), it is not yet.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from draftsmith.core.io.devices import ORPHAN_GRACE_SECONDS, is_snakemake, proc_stat

PROC = Path("/proc")


def _ancestors(pid: int, proc: Path) -> set[int]:
    found = {pid}
    while (stat := proc_stat(pid, proc)) is not None and stat[1] > 1 and stat[1] not in found:
        pid = stat[1]
        found.add(pid)
    return found


def _argv(pid: int, proc: Path) -> list[str]:
    try:
        return [
            a.decode(errors="replace") for a in (proc / str(pid) / "cmdline").read_bytes().split(b"\0") if a
        ]
    except OSError:
        return []


def workers_in(folder: Path, me: int, proc: Path = PROC) -> list[tuple[int, str]]:
    """(pid, command) of every process of this machine but `me` and its ancestors that works in `folder`
    and runs Snakemake or draftsmith (a job of a run, orphaned or not)."""
    mine = _ancestors(me, proc)
    found = []
    for entry in sorted(proc.glob("[0-9]*"), key=lambda p: int(p.name)):
        pid = int(entry.name)
        try:
            cwd = Path(os.readlink(entry / "cwd"))
        except OSError:  # gone, or another user's
            continue
        argv = _argv(pid, proc)
        runs = is_snakemake(pid, proc) or any(os.path.basename(a) == "draftsmith" for a in argv[:2])
        stat = proc_stat(pid, proc)
        if pid in mine or cwd != folder or not runs or stat is None or stat[0] == "Z":
            continue
        found.append((pid, " ".join(argv)[:120]))
    return found


def lock_advice(folder: Path, me: int, argv: Iterable[str], proc: Path = PROC) -> str | None:
    """One line on a leftover lock in `folder` (None when there is none, or this run is the unlock)."""
    locks = list((folder / ".snakemake" / "locks").glob("*.lock"))
    if not locks or "--unlock" in argv:
        return None
    workers = workers_in(folder.resolve(), me, proc)
    if workers:
        pid, command = workers[0]
        return (
            f"{folder} is locked and process {pid} ({command}) still works in it: wait until it ends (a job "
            f"whose Snakemake was killed ends within {ORPHAN_GRACE_SECONDS:.0f} s), then run again"
        )
    return (
        f"{folder} holds the lock of a Snakemake that no longer runs on this machine (no Snakemake or "
        "draftsmith process works in it): `snakemake --unlock`, then run again (first make sure no other "
        "machine runs Snakemake in this folder)"
    )
