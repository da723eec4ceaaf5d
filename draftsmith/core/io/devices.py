"""GPU slots per job: each running job gets its own devices, so two jobs never share a card.

Snakemake counts `resources: gpu=N` but assigns no devices (snakemake#281): without help, two local GPU
jobs both see every card and both start on GPU 0. `draftsmith run --gpus N -- CMD` hands CMD its own:

- The pool is what this process may use: the ids in CUDA_VISIBLE_DEVICES when something set it (SLURM
  does for `--gpus`; so does a user restricting a run), else devices 0..count-1 of the machine
  (DRAFTSMITH_NUM_GPUS, else `nvidia-smi -L`, else torch).
- N free devices of the pool are taken, one lock file per device, with flock. Choosing is done under
  one more lock, so two jobs never pick the same free device at once; with too few free, it waits.
- CMD is exec'd with CUDA_VISIBLE_DEVICES set to them and the lock files still open: the job process
  itself holds its devices, the kernel releases them when it exits however it exits (SIGKILL
  included), and there is nothing to clean up. Signals and the exit code are the job's own.
- Locks live in DRAFTSMITH_GPU_LOCK_DIR, by default `.snakemake/draftsmith-gpus` beside the workflow;
  inside a SLURM allocation in the node's temp folder instead (devices belong to a node, and cluster
  file systems such as Lustre may refuse flock). They are named by host and, inside an allocation, by its
  job id: the devices of one allocation are shared only by the jobs running inside it (a local Snakemake
  inside `salloc`), never across allocations, even where a cgroup renumbers every job's devices from 0.
- N=0 runs CMD with CUDA_VISIBLE_DEVICES="": a job that declared no GPU cannot quietly take one.
- CMD dies with its run: it gets SIGTERM when its parent (the rule's shell) dies (Linux's parent-death
  signal), and a small watcher sends it SIGTERM, then SIGKILL after ORPHAN_GRACE_SECONDS, once the
  Snakemake it runs under is gone. A kill -9 of Snakemake leaves the rule's shell alive, so the signal
  alone would leave the job (and its vLLM server) running as an orphan, writing while a rerun starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

DEFAULT_LOCK_DIR = ".snakemake/draftsmith-gpus"
POLL_SECONDS = 0.5
WAIT_REPORT_SECONDS = 300.0  # repeat the "waiting" line this often, so a stuck job shows in its log
PR_SET_PDEATHSIG = 1  # linux/prctl.h
ORPHAN_POLL_SECONDS = 0.5
ORPHAN_GRACE_SECONDS = 30.0  # a job told to stop (SIGTERM) stops its server first; then SIGKILL


class DeviceError(Exception):
    """The job cannot get the devices it asked for (named in the message)."""


# ---- pure helpers (tests pin these) ------------------------------------------------------------------


def parse_visible(value: str | None) -> list[str] | None:
    """Device ids in a CUDA_VISIBLE_DEVICES value; None when unset (then the machine's devices count)."""
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def engine_visible_devices(value: str | None, engine_gpus: int, trainer_index: int) -> list[str]:
    """The GPUs a streamed train job's extraction engine sees (resources.train.engine_gpus), from the job's
    CUDA_VISIBLE_DEVICES `value` (unset: 0..n): 0 = the trainer rank's own GPU (`trainer_index`, its
    cuda index), N = the first N GPUs (the trainer then runs on GPU N)."""
    needed = max(engine_gpus, trainer_index + 1)
    ids = parse_visible(value)
    if ids is None:
        ids = [str(i) for i in range(needed)]
    if len(ids) < needed:
        raise DeviceError(
            f"the streamed extraction engine needs GPU {needed - 1}, but the job sees {len(ids)} "
            f"(CUDA_VISIBLE_DEVICES={value!r}, resources.train.engine_gpus = {engine_gpus})"
        )
    if engine_gpus:
        return ids[:engine_gpus]
    return [ids[trainer_index]]


def trainer_index(engine_gpus: int, local_rank: int) -> int:
    """The cuda index a training rank runs on: its local rank, after the engine's GPUs when the engine
    has GPUs of its own (resources.train.engine_gpus)."""
    return engine_gpus + local_rank


@contextlib.contextmanager
def visible_devices(ids: Sequence[str] | None) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES set to `ids` inside the block (for the child processes started in it, such
    as vLLM's engine core; this process's CUDA keeps the GPUs it already saw); None changes nothing."""
    if ids is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def process_tree(pid: int) -> list[int]:
    """`pid` and every live descendant of it (zombies left out), from /proc (Linux; just `pid` elsewhere):
    what to signal so that no process an engine or a job started outlives it."""
    children: dict[int, list[int]] = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat_file.read_text()
        except OSError:  # exited while we looked
            continue
        fields = text[text.rfind(")") + 2 :].split()  # after "pid (comm) ": state ppid ...
        if len(fields) > 1 and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(text.split(" ", 1)[0]))
    found, todo = [pid], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def choose_slots(busy: Collection[int], total: int, n: int) -> list[int] | None:
    """The n lowest free slots of 0..total-1, or None while fewer than n are free."""
    if n > total:
        raise DeviceError(f"{n} GPUs asked for, but only {total} exist here")
    free = [i for i in range(total) if i not in busy]
    return free[:n] if len(free) >= n else None


def lock_namespace(env: Mapping[str, str], host: str) -> str:
    """Lock-file prefix: per host, and per SLURM allocation inside one (a file-system-safe name)."""
    name = host + (f"-slurm{env['SLURM_JOB_ID']}" if env.get("SLURM_JOB_ID") else "")
    return _safe(name)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def default_lock_dir(env: Mapping[str, str]) -> Path:
    """DRAFTSMITH_GPU_LOCK_DIR; else node-local temp inside a SLURM job; else beside the workflow."""
    if env.get("DRAFTSMITH_GPU_LOCK_DIR"):
        return Path(env["DRAFTSMITH_GPU_LOCK_DIR"])
    if env.get("SLURM_JOB_ID"):
        return Path(env.get("TMPDIR") or "/tmp") / f"draftsmith-gpus-{os.getuid()}"
    return Path(DEFAULT_LOCK_DIR)


def nvidia_smi_count(listing: str) -> int:
    """GPUs in `nvidia-smi -L` output (its MIG lines are indented and belong to the GPU above them)."""
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


# ---- the machine ---------------------------------------------------------------------------------------


def device_count(env: Mapping[str, str] = os.environ) -> int:
    """GPUs on this machine: DRAFTSMITH_NUM_GPUS, else `nvidia-smi -L`, else torch; 0 on a CPU box."""
    if env.get("DRAFTSMITH_NUM_GPUS", "").strip():
        try:
            return int(env["DRAFTSMITH_NUM_GPUS"])
        except ValueError:
            raise DeviceError(
                f"DRAFTSMITH_NUM_GPUS={env['DRAFTSMITH_NUM_GPUS']!r} is not an integer"
            ) from None
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                return nvidia_smi_count(out.stdout)
    import torch  # only when asked for GPUs on a machine without nvidia-smi (ROCm, or none)

    return torch.cuda.device_count()


def device_pool(env: Mapping[str, str], count: Callable[[], int] = device_count) -> tuple[list[str], str]:
    """The ids this process may use and where they come from (for the log line)."""
    visible = parse_visible(env.get("CUDA_VISIBLE_DEVICES"))
    if visible is not None:
        who = f"SLURM job {env['SLURM_JOB_ID']}" if env.get("SLURM_JOB_ID") else "CUDA_VISIBLE_DEVICES"
        return visible, f"given by {who}"
    n = count()
    return [str(i) for i in range(n)], f"on {socket.gethostname()}"


# ---- taking devices --------------------------------------------------------------------------------------


@dataclass
class Assignment:
    """Devices held by this process; the open lock files are what holds them."""

    devices: list[str]
    pool: list[str]
    source: str
    lock_fds: list[int] = field(default_factory=list)

    @property
    def visible(self) -> str:
        return ",".join(self.devices)

    def describe(self) -> str:
        if not self.devices:
            return "CUDA_VISIBLE_DEVICES= (no GPU for this job)"
        return f"CUDA_VISIBLE_DEVICES={self.visible} ({len(self.devices)} of {len(self.pool)} GPUs {self.source})"

    def release(self) -> None:
        for fd in self.lock_fds:
            os.close(fd)
        self.lock_fds = []


def _open_lock(path: Path) -> int:
    """A lock file opened for flock, never through a symbolic link: in a shared temporary folder another
    user could plant one pointing at a file of ours (O_CREAT would follow it)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as err:
        if os.path.islink(path):
            raise DeviceError(f"{path} is a symbolic link, not a lock file: remove it") from None
        raise DeviceError(f"cannot open the GPU lock file {path}: {err.strerror}") from None


def _lock_dir(directory: Path, shared: bool) -> Path:
    """The lock folder, created if missing. Unless it is meant to be shared (DRAFTSMITH_GPU_LOCK_DIR),
    it must be ours and no link: inside a SLURM job it lies in the node's shared temporary folder."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(directory)
    if not shared and (stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid()):
        raise DeviceError(
            f"{directory} is a link or another user's folder; set DRAFTSMITH_GPU_LOCK_DIR to a folder of yours"
        )
    return directory


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _try_locks(paths: Sequence[Path]) -> tuple[dict[int, int], set[int]]:
    """Try every slot once without blocking: ({slot: fd} taken now, busy slots)."""
    held, busy = {}, set()
    for i, path in enumerate(paths):
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            busy.add(i)
        else:
            held[i] = fd
    return held, busy


def acquire(
    n: int,
    env: Mapping[str, str] = os.environ,
    lock_dir: str | os.PathLike[str] | None = None,
    count: Callable[[], int] = device_count,
    poll: float = POLL_SECONDS,
    say: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
) -> Assignment:
    """Take n devices of the pool, waiting while fewer are free. n=0 takes none and touches nothing."""
    if n < 0:
        raise DeviceError(f"--gpus must be 0 or more, not {n}")
    if n == 0:
        return Assignment([], [], "")
    pool, source = device_pool(env, count)
    if n > len(pool):
        where = "CUDA_VISIBLE_DEVICES=" + ",".join(pool) if "CUDA_VISIBLE_DEVICES" in env else source
        raise DeviceError(
            f"this job asks for {n} GPUs but only {len(pool)} are available ({where}); "
            "lower the rule's gpus in the config, or set DRAFTSMITH_NUM_GPUS if the count is wrong"
        )
    directory = _lock_dir(
        Path(lock_dir) if lock_dir else default_lock_dir(env), "DRAFTSMITH_GPU_LOCK_DIR" in env
    )
    prefix = lock_namespace(env, socket.gethostname())
    slots = [directory / f"{prefix}-gpu{_safe(dev)}.lock" for dev in pool]
    waited_since = last_report = None
    while True:
        with _flock(directory / f"{prefix}.choose.lock"):
            held, busy = _try_locks(slots)
            chosen = choose_slots(busy, len(pool), n)
            keep = set(chosen or [])
            for slot, fd in held.items():
                if slot not in keep:
                    os.close(fd)
        if chosen is not None:
            if waited_since is not None:
                say(f"draftsmith run: got {n} GPUs after waiting {time.monotonic() - waited_since:.0f} s")
            return Assignment([pool[i] for i in chosen], pool, source, [held[i] for i in chosen])
        now = time.monotonic()
        if last_report is None or now - last_report >= WAIT_REPORT_SECONDS:
            taken = ",".join(pool[i] for i in sorted(busy))
            say(
                f"draftsmith run: waiting for {n} free GPUs of {len(pool)} {source} (in use: {taken}); locks in {directory}"
            )
            last_report = now
            waited_since = waited_since or now
        time.sleep(poll)


# ---- a job dies with its run --------------------------------------------------------------------------


def proc_stat(pid: int, proc: Path = Path("/proc")) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a process from /proc (Linux), None when it is gone."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after "pid (comm) ": state ppid ... starttime (22nd)
    return fields[0], int(fields[1]), int(fields[19])


def is_snakemake(pid: int, proc: Path = Path("/proc")) -> bool:
    """Whether a process runs Snakemake (`snakemake ...`, `python .../snakemake ...`, `python -m snakemake`)."""
    try:
        argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")[:3]
    except OSError:
        return False
    return any(os.path.basename(arg.decode(errors="replace")).startswith("snakemake") for arg in argv)


def snakemake_owner(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The nearest ancestor of `pid` that runs Snakemake, None when it runs under none."""
    seen: set[int] = set()
    while (stat := proc_stat(pid, proc)) is not None and stat[1] > 1 and pid not in seen:
        seen.add(pid)
        pid = stat[1]
        if is_snakemake(pid, proc):
            return pid
    return None


def alive(pid: int, started: int, proc: Path = Path("/proc")) -> bool:
    """Whether the process that started at `started` still runs as `pid` (not a zombie, not a reused pid)."""
    stat = proc_stat(pid, proc)
    return stat is not None and stat[0] not in ("Z", "X") and stat[2] == started


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """The kernel sends `sig` to this process when its parent dies (kept across exec; Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def _watch(job: int, job_started: int, owner: int, owner_started: int, grace: float) -> None:
    """The watcher's loop: when the owner is gone and the job is not, SIGTERM, then SIGKILL after `grace`."""
    while alive(job, job_started):
        if not alive(owner, owner_started):
            with contextlib.suppress(ProcessLookupError):
                os.kill(job, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while alive(job, job_started) and time.monotonic() < deadline:
                time.sleep(ORPHAN_POLL_SECONDS)
            if alive(job, job_started):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(job, signal.SIGKILL)
            return
        time.sleep(ORPHAN_POLL_SECONDS)


def start_orphan_watcher(keep_fds: Collection[int], grace: float = ORPHAN_GRACE_SECONDS) -> None:
    """Before this process execs its job: when it runs under Snakemake, a detached watcher (double fork:
    no child of the job, which may wait for its own) ends the job once that Snakemake is gone. The
    watcher holds none of the job's files: not its GPU locks (`keep_fds` are closed), not its output pipe."""
    job = os.getpid()
    owner = snakemake_owner(job)
    job_stat, owner_stat = proc_stat(job), proc_stat(owner) if owner else None
    if owner is None or job_stat is None or owner_stat is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    first = os.fork()
    if first:
        os.waitpid(first, 0)
        return
    try:
        if os.fork():
            os._exit(0)
        for fd in keep_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the job; the watcher ends with it
        _watch(job, job_stat[2], owner, owner_stat[2], grace)
    finally:
        os._exit(0)


def exec_with_devices(assignment: Assignment, command: Sequence[str], env: Mapping[str, str]) -> NoReturn:
    """Replace this process by `command` with CUDA_VISIBLE_DEVICES set; the lock files stay open in it.
    The job dies with its parent (the rule's shell) and with the Snakemake it runs under."""
    child_env = {**env, "CUDA_VISIBLE_DEVICES": assignment.visible}
    for fd in assignment.lock_fds:
        os.set_inheritable(fd, True)
    parent = os.getppid()
    start_orphan_watcher(assignment.lock_fds)
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the signal was set: it would never come
        sys.exit("draftsmith run: its parent is gone; not starting the job")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(command[0], list(command), child_env)


# ------------------------------------------------------------- what vLLM accepts of a layout


def server_arg(args: list[Any], name: str) -> str | None:
    """The value of flag `name` in vLLM server arguments (`--name V` or `--name=V`); None if absent."""
    args = [str(a) for a in args or []]
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def heads_error(tp: int, heads: int, kv_heads: int) -> str | None:
    """Why vLLM refuses `tp` tensor-parallel GPUs for a target of `heads` query heads and `kv_heads` key-value
    heads (0: latent attention or unknown), else None: vLLM's attention layers split the query heads evenly
    and the kv heads evenly, or replicate them evenly where fewer than the GPUs."""
    if tp <= 1 or heads <= 0:
        return None
    if heads % tp:
        return f"{tp} does not divide the target's {heads} attention heads"
    if kv_heads and (kv_heads % tp if kv_heads >= tp else tp % kv_heads):
        return f"{tp} neither divides nor is a multiple of the target's {kv_heads} key-value heads"
    return None
