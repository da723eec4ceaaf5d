"""A vLLM OpenAI server owned by the workflow: started for one job, always stopped when it ends.

In the motivating run the server was stopped by hand to free the GPUs, and GPU 0 still held 81 GB
afterwards.
`VllmServer` starts `python -m vllm.entrypoints.openai.api_server` (on CUDA: `vllm serve`, one API front end
per data-parallel engine) on 127.0.0.1 (a free port, the job's
devices), waits for /health, and on exit stops the whole process group (SIGTERM, then SIGKILL after a
grace period) and waits until every process of it is gone, so the next GPU job starts on free devices.
Each start draws a random API key, handed to vLLM in its environment (VLLM_API_KEY: other users can read
a command line, not an environment) and sent by the back-end: another local user cannot use the server.
vLLM itself checks the key only under /v1 and a few other prefixes; the workflow's own middleware
(backends/server_auth.py, passed with --middleware) requires it on every route, /health included. The
server listens on loopback only (generate.server_host; config.server_host_error).

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
import secrets
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

from draftsmith.backends.common import (
    attention_backend_for,
    log_cause,
    note_engine_start,
    one_process_worker,
    vllm_child_env,
    vllm_on_cpu,
)
from draftsmith.backends.openai import OpenAIChatBackend, OpenAIClient
from draftsmith.backends.vllm_api import API_SERVER_MODULE
from draftsmith.core.config.config import server_args_error, server_host_error
from draftsmith.core.io.devices import parse_visible, server_arg

log = logging.getLogger(__name__)

SERVED_NAME = "target"
# vLLM adds this ASGI class outermost (its --middleware flag): the run's key on every route
AUTH_MIDDLEWARE = "draftsmith.backends.server_auth.RequireKey"
PR_SET_PDEATHSIG = 1
# `vllm serve` through its module (the console script needs no PATH): on CUDA it runs one API front end per
# data-parallel engine (--api-server-count), where api_server runs one process for all of them.
VLLM_CLI_MODULE = "vllm.entrypoints.cli.main"


class ServerError(RuntimeError):
    """The server did not come up (the message carries the tail of its log)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def server_gpus(gpus: int, devices: list[str] | None, visible: str | None) -> int:
    """How many GPUs one server spans (its engines together): the devices given, else the job's GPU
    count (`draftsmith run --gpus N` made exactly N visible). Raises ValueError when the job has fewer
    visible devices than GPUs (CUDA_VISIBLE_DEVICES, when set, lists them)."""
    if devices:
        return len(devices)
    shown = parse_visible(visible)
    if gpus > 0 and shown is not None and len(shown) < gpus:
        raise ValueError(
            f"resources.generate.gpus is {gpus} but only {len(shown)} GPU(s) are visible "
            f"(CUDA_VISIBLE_DEVICES={visible!r}); run the stage through `draftsmith run --gpus {gpus} --`"
        )
    return max(1, gpus)


def server_layout(settings: Any, target: str | Path, gpus: int) -> tuple[int, int]:
    """(GPUs per engine, engines) for a server on `gpus` GPUs, as `draftsmith plan` lays it out
    (memory.engine_layout): --tensor-parallel-size in server_args, else resources.generate.tensor_parallel,
    else the fewest GPUs that hold the target and each engine's share of the requests in flight at
    --max-model-len (default: the target's context)."""
    from draftsmith.core.config.config import text_config_json
    from draftsmith.core.planning.memory import (
        GIB,
        device_memory,
        generate_layout,
        generate_need,
        refusal,
        target_size,
    )

    size = target_size(text_config_json(Path(target)), target, settings.dtype)
    memory, device = (
        (settings.gpu_memory_gib * GIB, f"gpu_memory_gib {settings.gpu_memory_gib:g}")
        if settings.gpu_memory_gib
        else device_memory({})
    )
    resources = {
        key: getattr(settings, key) for key in ("gpu_memory_utilization", "tensor_parallel", "concurrency")
    }
    resources["gpus"] = gpus
    # the plan's line again, on the job's own device, before the server loads the target
    if stop := refusal([generate_need(settings.server_args or [], resources, size, memory)], device):
        raise ValueError(f"{stop} (the memory plan, checked again by the job)")
    tp, engines = generate_layout(settings.server_args or [], resources, size, memory)
    log.info("generate: %d GPU(s) as %d engine(s) of %d (data parallel x tensor parallel)", gpus, engines, tp)
    return tp, engines


def expert_parallel_args(target: str | Path, dtype: str | None, tp: int, engines: int) -> list[str]:
    """--enable-expert-parallel where the layout is data-parallel attention over an MLA MoE target
    (memory.uses_expert_parallel): the plan counted its experts split over every GPU."""
    from draftsmith.core.config.config import text_config_json
    from draftsmith.core.planning.memory import target_size, uses_expert_parallel

    size = target_size(text_config_json(Path(target)), None, dtype)
    return ["--enable-expert-parallel"] if uses_expert_parallel(size, tp, engines) else []


def serve_entry(
    python: str, module: str, model: str, on_gpu: bool, data_parallel: int, extra: list[str]
) -> list[str]:
    """The command's head: on GPUs `vllm serve MODEL` with one API front end per data-parallel engine (one
    process would parse and detokenize for all eight); the CPU build keeps the api_server module (its
    console script is broken there; vllm_on_cpu), as does a stand-in module given by a test."""
    if not on_gpu or module != API_SERVER_MODULE or vllm_on_cpu():
        return [python, "-m", module, "--model", model]
    cmd = [python, "-m", VLLM_CLI_MODULE, "serve", model]
    if data_parallel > 1 and not _has_flag(extra, "--api-server-count"):
        cmd += ["--api-server-count", str(data_parallel)]
    return cmd


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
    host: str = "127.0.0.1",
    attention_backend: str | None = None,
    tensor_parallel: int | None = None,
    gpu_memory_utilization: float | None = None,
    data_parallel: int = 1,
) -> list[str]:
    """The server's command line (serve_entry: `vllm serve` on GPUs). Settings given in `extra_args` win over the derived ones; they may
    set only what generation needs (config.SERVER_FLAGS), never what the workflow owns
    (config.RESERVED_SERVER_ARGS: model, address, API key, the middleware that requires the key).

    tensor_parallel: GPUs the model is split over (default: one per device given); with
    --enable-expert-parallel in extra_args vLLM's MoE layers then use EP = TP x DP.
    data_parallel: engines of `tensor_parallel` GPUs each behind the one server (vLLM balances requests).
    gpu_memory_utilization: passed on GPUs only (tensor_parallel or devices given)."""
    extra = list(extra_args)
    if reason := server_args_error(extra):
        raise ServerError(f"generate.server_args: {reason}")
    on_gpu = bool(tensor_parallel or devices)
    cmd = serve_entry(python, module, str(model), on_gpu, data_parallel, extra)
    cmd += ["--host", host, "--port", str(port)]
    cmd += ["--served-model-name", served_name, "--middleware", AUTH_MIDDLEWARE]
    if dtype and not _has_flag(extra, "--dtype"):
        cmd += ["--dtype", dtype]
    if seed is not None and not _has_flag(extra, "--seed"):
        cmd += ["--seed", str(seed)]
    if attention_backend and not _has_flag(extra, "--attention-backend"):
        cmd += ["--attention-backend", attention_backend]
    # One job's GPUs serve one model: split it over all of them unless told otherwise.
    tp = tensor_parallel or (len(devices) if devices else 1)
    if tp > 1 and not (_has_flag(extra, "--tensor-parallel-size") or _has_flag(extra, "-tp")):
        cmd += ["--tensor-parallel-size", str(tp)]
    if data_parallel > 1 and not (_has_flag(extra, "--data-parallel-size") or _has_flag(extra, "-dp")):
        cmd += ["--data-parallel-size", str(data_parallel)]
    if on_gpu and gpu_memory_utilization is not None and not _has_flag(extra, "--gpu-memory-utilization"):
        cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    # one worker process on a CPU: its torch.distributed groups open no TCP listener (vllm_one_process.py)
    if not on_gpu and (worker := one_process_worker(_processes(extra, tp, data_parallel))):
        cmd += ["--worker-cls", worker]
    return cmd + extra


def _processes(extra: list[str], tp: int, data_parallel: int) -> int:
    """The engine's worker processes: tensor x pipeline x data parallel, from `extra` or derived."""

    def size(flag: str, short: str, derived: int) -> int:
        return int(server_arg(extra, flag) or server_arg(extra, short) or derived)

    pp = size("--pipeline-parallel-size", "-pp", 1)
    return size("--tensor-parallel-size", "-tp", tp) * pp * size("--data-parallel-size", "-dp", data_parallel)


def server_env(
    devices: list[str] | None, base: dict[str, str] | None = None, api_key: str | None = None
) -> dict[str, str]:
    """The server's environment: the job's devices only (Snakemake counts GPUs but assigns none), the
    API key it requires on every route (VLLM_API_KEY, read by vLLM and server_auth), and torch.distributed's
    gloo sockets on loopback (GLOO_SOCKET_IFNAME): an engine of several processes (GPUs; tensor parallel on
    a CPU) listens on the address the host name resolves to otherwise, a network address on most machines;
    one server spans one machine. An engine of one process on a CPU opens none (server_command's
    --worker-cls)."""
    env = vllm_child_env(dict(os.environ if base is None else base))
    if sys.platform == "linux":
        env["GLOO_SOCKET_IFNAME"] = "lo"
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    env.pop("VLLM_API_KEY", None)
    if api_key:
        env["VLLM_API_KEY"] = api_key
    return env


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


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
        host: str = "127.0.0.1",  # generate.server_host
        tensor_parallel: int | None = None,
        gpu_memory_utilization: float | None = None,
        data_parallel: int = 1,
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
        self.host = host
        self.api_key: str | None = None  # drawn at each start
        self.tensor_parallel = tensor_parallel
        self.gpu_memory_utilization = gpu_memory_utilization
        self.data_parallel = data_parallel
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None
        self._old_handlers: dict[int, Any] = {}

    @property
    def base_url(self) -> str:
        # a wildcard address listens on loopback too
        connect = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        connect = f"[{connect}]" if ":" in connect else connect
        return f"http://{connect}:{self.port}/v1"

    @property
    def served_name(self) -> str:
        return SERVED_NAME

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    # ------------------------------------------------------------------------- start

    def command(self) -> list[str]:
        """The server's command line (on the port given, else 0 until start() picks a free one)."""
        return server_command(
            self.model,
            self.port or 0,
            SERVED_NAME,
            self.devices,
            self.dtype,
            self.seed,
            self.extra_args,
            module=self.module,
            host=self.host,
            attention_backend=attention_backend_for(self.model, self.dtype or "auto"),
            tensor_parallel=self.tensor_parallel,
            gpu_memory_utilization=self.gpu_memory_utilization,
            data_parallel=self.data_parallel,
        )

    def start(self) -> VllmServer:
        if self.proc is not None:
            raise RuntimeError("server already started")
        if reason := server_host_error(self.host):  # the start-up checks refuse it first; this holds too
            raise ServerError(f"generate.server_host: {reason}")
        self.port = self.port or free_port()
        self.api_key = secrets.token_urlsafe(32)
        cmd = self.command()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps writing after we return
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        self._install_handlers()
        if self.module == API_SERVER_MODULE:  # a test's stand-in server loads no engine
            note_engine_start("generation server")
        started = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=server_env(self.devices, self.env, self.api_key),
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
        # /health needs the key too (server_auth): an unauthorised answer is no sign of health
        health = urllib.request.Request(
            self.base_url.removesuffix("/v1") + "/health", headers={"Authorization": f"Bearer {self.api_key}"}
        )
        assert self.proc is not None  # start() launched it
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(
                    startup_failure(f"exited with code {code} before it was healthy", self.log_path)
                )
            with contextlib.suppress(OSError), urllib.request.urlopen(health, timeout=5) as resp:
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


class VllmServerBackend(OpenAIChatBackend):
    """The openai back-end against a vLLM server started for this stage and stopped by close()."""

    def __init__(
        self, server: VllmServer, client: OpenAIClient, settings: Any, render: Callable, fingerprint: str
    ):
        super().__init__(client, settings, render, fingerprint)
        self.vllm_server = server  # not `server`: that is the static method building one
        self.model = str(server.model)  # the target folder, not the served alias
        self.startup_seconds = server.startup_seconds

    @staticmethod
    def server(settings: Any, target: str, log_path: str) -> VllmServer:
        """The (not yet started) server for the generate settings: tensor parallel over the job's GPUs
        (settings.gpus, or the devices given), its dtype, seed, memory share, address and server_args."""
        from draftsmith.core.model.precision import compute_dtype

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            gpus = server_gpus(settings.gpus, settings.devices, visible)
            tp, engines = (
                server_layout(settings, target, gpus) if settings.gpus or settings.devices else (1, 1)
            )
            extra = list(settings.server_args or [])
            if engines > 1 and not any(a in ("--enable-expert-parallel", "-ep") for a in extra):
                extra += expert_parallel_args(target, settings.dtype, tp, engines)
        except ValueError as err:
            raise ServerError(str(err)) from None
        return VllmServer(
            target,
            devices=settings.devices,
            extra_args=extra,
            log_path=log_path,
            dtype=compute_dtype(settings.dtype),
            seed=settings.seed,
            startup_timeout_s=settings.server_startup_timeout_s,
            host=settings.server_host,
            tensor_parallel=tp if settings.gpus or settings.devices else None,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            data_parallel=engines,
        )

    @classmethod
    def open(  # type: ignore[override]
        cls, settings: Any, target: str, render: Callable, fingerprint: str, log_path: str
    ) -> VllmServerBackend:
        server = cls.server(settings, target, log_path).start()
        try:
            client = OpenAIClient(
                server.base_url,
                model=server.served_name,
                api_key=server.api_key,
                timeout_s=settings.timeout_s,
                max_retries=settings.max_retries,
                backoff_base_s=settings.backoff_s,
                sampling=settings.sampling(),
                request_token_ids=settings.request_token_ids,
            )
            client.check()
        except BaseException:
            server.stop()
            raise
        return cls(server, client, settings, render, fingerprint)

    def close(self) -> None:
        self.client.close()
        self.vllm_server.stop()
