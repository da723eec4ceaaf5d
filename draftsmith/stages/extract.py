"""Extract stage: one prefill per sample batch, capturing aux-layer inputs and the final normed state.

No lm_head runs in the capture pass. The teacher-agreement check (does argmax(lm_head(final[t]))
equal the trace's next token?) runs afterwards on the masked positions only: it is the check that
catches wrong layers, a missing final norm or a template mismatch before anyone trains.

Two back-ends produce the same samples: `transformers` (backends/hf.py: in-process, hooks, length-bucketed
right-padded batches, optionally compiled) and `vllm` (backends/vllm_extract.py: vLLM's
extract_hidden_states, tensor parallel). The shard streams out through a background writer; until it is
complete only hidden `.shard-k.safetensors.*` files exist, and the next run of the shard removes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import queue as queue_module
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from draftsmith.backends.common import VllmStartError
from draftsmith.backends.extraction import make_extractor, transformers_device  # noqa: F401 (re-exported)
from draftsmith.core.config.settings import compile_mode_of
from draftsmith.core.config.stage_args import BAD_INPUT, FAILED, arg
from draftsmith.core.config.stage_settings import ExtractSettings
from draftsmith.core.data.shards import Sample, ShardWriter, as_stored, remove_stale_temp_files
from draftsmith.core.data.teacher import checked_positions, count_agreeing, teacher_agreement  # noqa: F401
from draftsmith.core.data.tokens import load_tokens
from draftsmith.core.evaluation.run_cache import target_identity
from draftsmith.core.io.atomic import atomic_path, disk_full
from draftsmith.core.io.devices import parse_visible, process_tree
from draftsmith.core.io.digests import file_sha256, intact, retouch, seal, seal_as, sidecar
from draftsmith.core.model.layers import resolve_aux_layers
from draftsmith.core.model.precision import compute_dtype
from draftsmith.core.model.target import text_config_dict
from draftsmith.core.planning.estimate import (
    NotEnoughDisk,
    check_free_disk,
    disk_advice,
    estimate_lines,
    human_bytes,
    human_seconds,
    probe_plan,
    raw_state_bytes,
)
from draftsmith.core.training.distributed import rank_threads, usable_threads

log = logging.getLogger(__name__)


COMPILE_MIN_SECONDS = 300.0  # "auto" compiles when eager compute would take longer than this


SCRATCH_PREFIX = ".draftsmith-extract-"  # + the job's pid: leftovers of a killed job are recognised


def scratch_root(setting: str | None) -> Path:
    """resources.extract.scratch, else $TMPDIR, else the system's temporary folder (tempfile's choice):
    node-local storage, not the results file system (no flock on Lustre, a network round trip on NFS)."""
    return Path(setting) if setting else Path(tempfile.gettempdir())


def make_scratch(root: Path) -> Path:
    """A fresh folder for one job's vLLM states files under `root`, named after this process; folders of
    earlier jobs on this node whose process is gone are removed first (/dev/shm outlives a killed job)."""
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob(f"{SCRATCH_PREFIX}*"):
        pid = old.name[len(SCRATCH_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=root))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's: not ours to remove
    return True


def in_flight_states(
    batch_tokens: int, longest: int, engines: int, stored_layers: int, hidden: int, dtype: str
) -> tuple[int, int]:
    """(tokens, bytes) of the raw states files vLLM may hold in the scratch folder at once: per engine the
    batch being captured and the one being read back (extraction overlaps them), a batch being at most
    batch_tokens tokens or one longer sample; every value in the compute dtype."""
    tokens = 2 * max(batch_tokens, longest) * engines
    value = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return tokens, tokens * stored_layers * hidden * value


def check_scratch_room(folder: Path, tokens: int, need: int) -> None:
    """NotEnoughDisk in one line naming the folder and both figures when `folder` cannot hold `need`."""
    free = shutil.disk_usage(folder).free
    if free < need:
        raise NotEnoughDisk(
            f"resources.extract.scratch: {folder} has {free / 1e9:.2f} GB free, but vLLM's states of the "
            f"{tokens:,} tokens in flight need {need / 1e9:.2f} GB: name a larger node-local folder"
        )


def states_folder(
    settings: ExtractSettings, stored_layers: int, hidden: int, dtype: str, longest: int, engines: int
) -> Path:
    """The scratch folder's room checked for `engines` engines' in-flight states, then a fresh folder in
    it for this job (the vllm back-end's storage_dir)."""
    root = scratch_root(settings.scratch)
    root.mkdir(parents=True, exist_ok=True)
    check_scratch_room(
        root, *in_flight_states(settings.batch_tokens, longest, engines, stored_layers, hidden, dtype)
    )
    return make_scratch(root)


def should_compile(mode: str, backend: str, eager_seconds: float) -> bool:
    """torch.compile pays off on CPU (fused elementwise kernels) once a shard outlasts its one-off
    compile time (minutes on 2 cores); "auto" compiles only then, and only the transformers back-end."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"compile must be auto, on or off, not {mode!r}")
    if backend != "transformers":
        return False
    return mode == "on" or (mode == "auto" and eager_seconds >= COMPILE_MIN_SECONDS)


def temp_prefix(out_path: str | Path) -> str:
    """Every temporary file or folder of one shard's job starts with this (hidden, never a shard)."""
    return f".{Path(out_path).name}."


def extract_shard(
    target: str,
    tokens_path: str,
    shard: int,
    out_path: str | None,
    settings: ExtractSettings,
    extractor=None,
    pipeline: bool = True,
) -> dict[str, Any]:
    """Extract one shard. `out_path=None` computes everything but writes nothing, and `extractor` is a
    back-end to reuse (left open), both for benchmarks. `pipeline`: overlap each batch's CPU-side work
    with the next forward (_extract_loop); the shard is the same either way."""
    s = settings
    aux_layers, dtype, batch_tokens, threads, gpus = s.aux_layers, s.dtype, s.batch_tokens, s.threads, s.gpus
    codec, zstd_level, storage_dtype, backend = s.codec, s.zstd_level, s.storage_dtype, s.backend
    compile = compile_mode_of(s.compile)
    if threads:
        torch.set_num_threads(usable_threads(threads))
    dtype = compute_dtype(dtype, "cuda" if gpus else "cpu")
    tensors, meta = load_tokens(tokens_path)
    if shard >= len(meta["shards"]):
        raise ValueError(f"shard {shard} does not exist: {tokens_path} plans {len(meta['shards'])} shards")
    start, end = meta["shards"][shard]
    offsets = tensors["offsets"].tolist()
    config = text_config_dict(target)  # a wrapper's (Kimi-K2.5) language-model settings
    layer_ids = resolve_aux_layers(aux_layers, config["num_hidden_layers"])
    hidden = config["hidden_size"]
    lengths = [offsets[i + 1] - offsets[i] for i in range(start, end)]
    total_tokens = sum(lengths)

    def sample_tokens(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = offsets[start + i], offsets[start + i + 1]
        return tensors["input_ids"][a:b], tensors["loss_mask"][a:b]

    workdir = Path(out_path).parent if out_path else Path(tempfile.gettempdir())
    workdir.mkdir(parents=True, exist_ok=True)
    if out_path:
        # A killed earlier run of this shard may have left its hidden temporary files behind.
        remove_stale_temp_files(out_path)
    scratch = Path(tempfile.mkdtemp(prefix=temp_prefix(out_path or f"shard-{shard}") + "job-", dir=workdir))
    log.info(
        "extract shard %d: samples %d..%d, aux layers %s (input convention) + final normed state, %s back-end, "
        "%s compute, %s storage, codec %s", shard, start, end - 1, layer_ids, backend, dtype, storage_dtype, codec,
    )  # fmt: skip
    own_backend = extractor is None
    states = None  # vLLM's per-request states files: node-local scratch, not beside the outputs
    if own_backend:
        if backend == "vllm":
            states = states_folder(s, len(layer_ids) + 1, hidden, dtype, max(lengths), 1)
        try:
            extractor = make_extractor(
                backend, target, layer_ids, dtype, gpus, max(lengths) + 1, states, s.vllm_eager,
                s.gpu_memory_utilization,
            )  # fmt: skip
        except BaseException:
            if states is not None:
                shutil.rmtree(states, ignore_errors=True)
            raise
    writer: ShardWriter | None = None
    estimate: dict[str, Any] = {}
    try:
        plan, picks, measured, probed = probe_plan(
            lengths, batch_tokens, sample_tokens, extractor.capture, codec, zstd_level, scratch
        )
        lines, estimate = estimate_lines(total_tokens, len(layer_ids) + 1, hidden, measured, storage_dtype)
        for line in lines:
            log.info("extract shard %d: estimate: %s", shard, line)
        if out_path:
            check_free_disk(Path(out_path).parent, estimate["compressed_bytes"], codec, storage_dtype)
        compile_seconds = None
        if should_compile(compile, backend, estimate["seconds"]) and not extractor.compiled:
            log.info("extract shard %d: compiling the forward (torch.compile, one-off)...", shard)
            compile_seconds = extractor.compile()
            log.info("extract shard %d: compiled in %.0fs", shard, compile_seconds)
        sources = meta.get("sample_sources") or ["regenerated"] * len(meta["sample_ids"])
        if out_path:
            writer = ShardWriter(
                out_path,
                # sources known up front: the header's room is sized for them (no rewrite at close)
                {
                    "aux_layer_ids": layer_ids,
                    "layer_convention": "input",
                    "sample_sources": sources[start:end],
                },
                codec,
                zstd_level,
                storage_dtype,
                sample_ids=meta["sample_ids"][start:end],
                # the engine's share of the job's threads compresses (niced: a CPU forward goes first)
                threads=threads or 1,
            )
        t0, cpu0 = time.perf_counter(), time.process_time()
        stats = _extract_loop(
            extractor,
            writer,
            shard,
            lengths,
            sample_tokens,
            meta["sample_ids"][start:end],
            plan,
            dict(zip(picks, probed, strict=True)),
            sources[start:end],
            storage_dtype,
            pipeline,
        )
        # the probed batches were computed before the loop: their time belongs to the shard's compute
        probe_seconds = sum(b["seconds"] for b in measured["batches"])
        probe_cpu = sum(b["cpu_seconds"] for b in measured["batches"])
        stats["probe_seconds"] = round(probe_seconds, 6)  # a tiny probe can take milliseconds
        stats["seconds"] = round(stats["seconds"] + probe_seconds, 2)
        stats["cpu_seconds"] = round(stats["cpu_seconds"] + probe_cpu, 2)
        stats["tokens_per_second"] = (
            round(total_tokens / stats["seconds"], 1) if stats["seconds"] > 0 else None
        )
        stats |= {
            "backend": backend,
            "compute_dtype": dtype,
            "compile_seconds": compile_seconds,
            "estimate": estimate,
        }
        if writer:
            closing = time.perf_counter()
            writer.close(
                {
                    "final": "post_final_norm",
                    "template": meta["template"],
                    "stats": stats,
                }
            )
            stats["writer_cpu_seconds"] = round(writer.cpu_seconds, 3)
            stats["close_seconds"] = round(time.perf_counter() - closing, 3)
    except BaseException as err:
        if writer:
            writer.abort()
        if out_path and disk_full(err):  # the disk filled up after the check (other jobs write too)
            free = human_bytes(shutil.disk_usage(Path(out_path).parent).free)
            if "compressed_bytes" in estimate:
                needed = f"about {human_bytes(estimate['compressed_bytes'])}"
            else:  # full while probing (the probe writes beside the shard): its codec ratio is not known
                raw = raw_state_bytes(total_tokens, len(layer_ids) + 1, hidden, storage_dtype)
                needed = f"up to {human_bytes(raw)}, its states uncompressed"
            raise NotEnoughDisk(
                f"{Path(out_path).parent}: disk full while writing shard {shard} ({free} free after removing its "
                f"partial file; the shard needs {needed}); {disk_advice(codec, storage_dtype)}"
            ) from None
        raise
    finally:
        if own_backend:
            extractor.close()
        shutil.rmtree(scratch, ignore_errors=True)
        if states is not None:
            shutil.rmtree(states, ignore_errors=True)
    stats["wall_seconds_with_write"] = round(time.perf_counter() - t0 + probe_seconds, 2)
    stats["cpu_seconds_with_write"] = round(time.process_time() - cpu0 + probe_cpu, 2)
    size = ""
    if out_path:
        file_bytes = Path(out_path).stat().st_size
        assert writer is not None  # out_path: the states went through it
        stats["file_bytes"] = file_bytes
        size = (
            f", {human_bytes(file_bytes)} written ({human_bytes(writer.bytes_written)} states + "
            f"{human_bytes(file_bytes - writer.bytes_written)} tokens, index and header; estimate "
            f"{human_bytes(estimate['compressed_bytes'])})"
        )
    agreement = stats["teacher_agreement"]
    log.info(
        f"extract shard {shard}: {total_tokens:,} tokens in {human_seconds(stats['seconds'])} "
        f"(estimate {human_seconds(estimate['seconds'])}{', eager' if compile_seconds else ''}; "
        f"{stats['tokens_per_second']} tok/s), teacher agreement "
        f"{'n/a' if agreement is None else f'{agreement:.4f}'} over {stats['teacher_checked']:,} positions{size}"
    )
    return stats


def forward_batch(extractor, sequences: list[torch.Tensor]) -> Any:
    """The accelerator's part of a capture (the whole capture for a back-end without forward/collect)."""
    forward = getattr(extractor, "forward", None)
    return forward(sequences) if forward else extractor.capture(sequences)


def collect_batch(
    extractor, sequences: list[torch.Tensor], raw: Any
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """forward_batch's result as capture returns it: the CPU-side rest (vLLM: read back, final norm)."""
    collect = getattr(extractor, "collect", None)
    return collect(sequences, raw) if collect else raw


def _extract_loop(
    extractor,
    writer,
    shard: int,
    lengths: list[int],
    sample_tokens,
    sample_ids: list[str],
    plan: list[list[int]],
    done: dict[int, list[tuple[torch.Tensor, torch.Tensor]]],
    sample_sources: list[str] | None = None,
    storage_dtype: str = "bfloat16",
    pipeline: bool = True,
) -> dict[str, Any]:
    """Capture every batch of the plan (taking those in `done` from the probe: the same batch gives the
    same states), check teacher agreement, hand samples to the writer in plan order; returns the stats.

    Agreement is counted per sample source; `teacher_agreement` (the gated figure) is over regenerated
    samples only: on a dataset's original answers the target's argmax need not match the text. It is
    checked on the final states as stored (float8: dequantized), the teacher training will read.

    `pipeline`: one worker thread does batch k's CPU-side part (collect, bf16 conversion, teacher check,
    handing samples to the writer) while this thread runs batch k+1's forward, so the accelerator does
    not wait on the CPU. One batch at most waits beside the one in the worker (memory stays bounded);
    the worker handles batches in order, so the shard is byte for byte the sequential loop's. A worker
    error is raised here as it was raised there, before the next forward starts or after it ends."""
    total_tokens = sum(lengths)
    sources = sample_sources or ["regenerated"] * len(lengths)
    by_source: dict[str, list[int]] = {}  # source -> [agreeing, checked]
    masked = 0
    timing = {"forward": 0.0, "post": 0.0}  # wall seconds of each part, summed over batches
    t0, cpu0 = time.perf_counter(), time.process_time()
    bar = tqdm(
        total=total_tokens, desc=f"extract shard {shard}", unit="tok", unit_scale=True, dynamic_ncols=True
    )

    def post(batch: list[int], sequences: list[torch.Tensor], captured, raw) -> None:
        nonlocal masked
        start = time.perf_counter()
        if captured is None:
            captured = collect_batch(extractor, sequences, raw)
        states: dict[str, list] = {}
        next_ids: dict[str, list] = {}
        for i, (aux, final) in zip(batch, captured, strict=True):
            input_ids, loss_mask = sample_tokens(i)
            sample = Sample(
                sample_ids[i],
                input_ids,
                loss_mask.bool(),
                aux.to(torch.bfloat16),
                final.to(torch.bfloat16),
            )
            final = as_stored(sample.final, storage_dtype)
            rows, ids = checked_positions(final, sample.input_ids, sample.loss_mask)
            states.setdefault(sources[i], []).append(rows)
            next_ids.setdefault(sources[i], []).append(ids)
            masked += int(sample.loss_mask.sum())
            if writer:
                writer.add(sample)
        # the teacher check of the whole batch at once (per source): one large matmul, not one per sample
        for source, parts in states.items():
            next_batch = torch.cat(next_ids[source])
            counts = by_source.setdefault(source, [0, 0])
            counts[0] += count_agreeing(extractor.lm_head_weight, torch.cat(parts), next_batch)
            counts[1] += int(next_batch.numel())
        bar.update(sum(lengths[i] for i in batch))
        if writer and writer.tokens_written:  # states encoded so far (the queue holds the rest)
            bar.set_postfix(
                states=human_bytes(writer.bytes_written),
                projected=human_bytes(writer.bytes_written * total_tokens / writer.tokens_written),
            )
        timing["post"] += time.perf_counter() - start

    worker = ThreadPoolExecutor(1, thread_name_prefix=f"extract-{shard}") if pipeline else None
    pending: Future | None = None  # the worker's batch
    try:
        for k, batch in enumerate(plan):
            if pending is not None and pending.done():
                pending.result()  # a failed batch stops the loop before another forward
            sequences = [sample_tokens(i)[0] for i in batch]
            captured, raw = done.pop(k, None), None
            if captured is None:
                start = time.perf_counter()
                raw = forward_batch(extractor, sequences)
                timing["forward"] += time.perf_counter() - start
            if worker is None:
                post(batch, sequences, captured, raw)
                continue
            if pending is not None:
                pending.result()  # batch k-1 done (or its error raised) before batch k is handed over
            pending = worker.submit(post, batch, sequences, captured, raw)
        if pending is not None:
            pending.result()
    finally:
        if worker is not None:  # on an error here, the worker's batch finishes before the writer aborts
            worker.shutdown(wait=True, cancel_futures=True)
        bar.close()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    agree, checked = by_source.get("regenerated", [0, 0])
    return {
        "shard": shard,
        "num_samples": len(lengths),
        "num_tokens": total_tokens,
        "num_masked_tokens": masked,
        "teacher_agree": agree,  # regenerated samples only
        "teacher_checked": checked,
        "teacher_agreement": agree / checked if checked else None,
        "teacher_by_source": {k: {"agree": a, "checked": c} for k, (a, c) in sorted(by_source.items())},
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu_seconds, 2),  # all threads: cpu / seconds = cores kept busy
        "tokens_per_second": round(total_tokens / seconds, 1) if seconds > 0 else None,
        "pipeline": pipeline,
        # forwards (the probed batches' excluded) and CPU-side parts; pipelined, they overlap in `seconds`
        "forward_seconds": round(timing["forward"], 3),
        "post_seconds": round(timing["post"], 3),
    }


# ---- the extraction job: every shard, one engine load per engine, finished shards stashed ---------------

STASH = ".done"  # beside the shards: results/hidden/.done/<key>/shard-k.safetensors (hidden: no shard glob)
RESULT_KEYS = (
    "aux_layers",
    "batch_tokens",
    "storage_dtype",
    "codec",
    "zstd_level",
    "backend",
    "compile",
    "vllm_eager",
)


class EngineFailed(RuntimeError):
    """An engine process of the extraction job failed (the message names it, its GPUs and its shard)."""


def stash_key(tokens_path: str | Path, target: str | Path, dtype: str, settings: dict[str, Any]) -> str:
    """A digest of what decides a shard's bytes: the tokens file's content, the result settings
    (RESULT_KEYS of `settings`), the compute dtype and the target by content (run_cache.target_identity:
    its config.json and the name and size of each weight file), never its path or mtimes: a copied or
    moved run, or target, reuses its stashed shards. 16 hex digits."""
    record = {
        "tokens_sha256": file_sha256(tokens_path),
        "settings": {key: settings[key] for key in RESULT_KEYS},
        "dtype": dtype,
        "target": target_identity(Path(target).resolve()),
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def stashed_path(stash: Path, shard: int) -> Path:
    return stash / f"shard-{shard}.safetensors"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def prepare_stash(root: Path, key: str, num_shards: int) -> tuple[Path, list[int]]:
    """(the stash folder of `key`, the shards in it that can be reused): stashes of other keys are removed
    (settings no longer asked for), and in this one everything but intact sealed shards (a killed
    writer's temporary files, an engine's scratch, a shard that died before its seal)."""
    stash = root / key
    stash.mkdir(parents=True, exist_ok=True)
    for other in root.iterdir():
        if other != stash:
            log.info("extract: removing %s (a stash of other settings)", other)
            _remove(other)
    keep = {stashed_path(stash, k) for k in range(num_shards) if intact(stashed_path(stash, k))}
    keep |= {sidecar(p) for p in keep}
    for entry in stash.iterdir():
        if entry not in keep:
            _remove(entry)
    return stash, sorted(k for k in range(num_shards) if stashed_path(stash, k) in keep)


def queue_order(shard_tokens: list[int], todo: list[int]) -> list[int]:
    """The shards still to do, largest first (ties in shard order): engines taking from one queue then
    finish close together (longest processing time first)."""
    return sorted(todo, key=lambda k: (-shard_tokens[k], k))


def engine_devices(visible: list[str] | None, gpus: int, tp: int, engines: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each engine: consecutive groups of `tp` of the job's visible devices
    (0..gpus-1 when nothing set it)."""
    devices = visible if visible is not None else [str(i) for i in range(gpus)]
    if len(devices) < tp * engines:
        raise ValueError(
            f"resources.extract.gpus: {engines} engines of {tp} GPUs need {tp * engines} devices, "
            f"but CUDA_VISIBLE_DEVICES shows {len(devices)}"
        )
    return [",".join(devices[i * tp : (i + 1) * tp]) for i in range(engines)]


class ShardQueue:
    """The shards to extract in queue_order, taken by whichever engine is free next. The position is
    a shared integer (multiprocessing), so engines in spawned processes take from the same queue."""

    def __init__(self, order: list[int], context: Any = None) -> None:
        self.order = list(order)
        self.position = (context or multiprocessing.get_context("spawn")).Value("i", 0)

    def take(self) -> int | None:
        with self.position.get_lock():
            i = self.position.value
            if i >= len(self.order):
                return None
            self.position.value = i + 1
        return self.order[i]


def job_layout(
    target: str,
    dtype: str,
    backend: str,
    gpus: int,
    max_seq_len: int,
    gpu_memory_utilization: float | None,
    tensor_parallel: int,
    device: dict[str, Any],
) -> tuple[int, int]:
    """(GPUs per engine, engines): memory.extract_layout on the inputs the memory plan gives it (the
    target's size from its folder, the device's memory from resources.gpu_model / gpu_memory_gib or
    nvidia-smi), so the job runs the layout `draftsmith plan` printed."""
    if backend != "vllm" or gpus <= 0:
        return 1, 1
    from draftsmith.core.config.config import section_defaults, text_config_json
    from draftsmith.core.planning.memory import (
        device_memory,
        extract_layout,
        extract_need,
        refusal,
        target_size,
    )

    if gpu_memory_utilization is None:
        gpu_memory_utilization = section_defaults("resources.extract")["gpu_memory_utilization"]

    memory, where = device_memory(device)
    size = target_size(text_config_json(target), target, dtype)
    extract = {"backend": backend, "max_seq_len": max_seq_len}
    res = {"gpus": gpus, "gpu_memory_utilization": gpu_memory_utilization, "tensor_parallel": tensor_parallel}
    # the plan's line again, now that the weights are on disk, before any engine loads them
    if stop := refusal([extract_need(extract, res, size, memory)], where):
        raise ValueError(f"{stop} (the memory plan, checked again by the job)")
    return extract_layout(extract, res, size, memory)


def publish(stashed: Path, out_path: Path) -> None:
    """The stashed shard as the job's output: a hard link (no copy of hundreds of GB), a copy across
    file systems; atomic either way. Both get the time of now (outputs newer than the job's inputs). The
    output is sealed with the stash's digest: a start checks the shard at the path the user knows."""
    retouch(stashed)
    with atomic_path(out_path) as tmp:
        tmp.unlink()
        try:
            os.link(stashed, tmp)
        except OSError:
            shutil.copyfile(stashed, tmp)
    seal_as(out_path, stashed)


def run_engine(
    queue: ShardQueue,
    target: str,
    tokens_path: str,
    stash: Path,
    settings: ExtractSettings,
    max_model_len: int,
    starting: Callable[[int], None] | None = None,
    finished: Callable[[int], None] | None = None,
) -> None:
    """One engine: load the target once (when the queue has a shard for it), then extract shards from
    the queue into the stash, each sealed once complete, until the queue is empty. `settings.gpus`: the
    engine's (tensor parallel), `settings.threads` its share; `starting(k)` is called as shard k starts,
    `finished(k)` once it is sealed."""
    s = settings
    layer_ids = resolve_aux_layers(s.aux_layers, text_config_dict(target)["num_hidden_layers"])
    scratch = make_scratch(scratch_root(s.scratch))  # vLLM's states files (room checked by extract_shards)
    extractor = None
    try:
        while (shard := queue.take()) is not None:
            if starting:
                starting(shard)
            if extractor is None:
                extractor = make_extractor(
                    s.backend, target, layer_ids, compute_dtype(s.dtype, "cuda" if s.gpus else "cpu"),
                    s.gpus, max_model_len, scratch, s.vllm_eager, s.gpu_memory_utilization,
                )  # fmt: skip
            path = stashed_path(stash, shard)
            extract_shard(target, tokens_path, shard, str(path), settings, extractor=extractor)
            seal([path], "extract")
            if finished:
                finished(shard)
    finally:
        if extractor is not None:
            extractor.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _engine_process(
    index: int,
    devices: str,
    queue: ShardQueue,
    results: Any,
    kw: dict[str, Any],
    runner: Callable[..., None] = run_engine,
) -> None:
    """A spawned engine: its own GPUs, its log lines named, its progress and a failure told to the parent (the failure in one line with the
    shard it was on), SIGTERM when the parent dies (no orphan holding GPUs). `runner`: run_engine (a
    stand-in in tests)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = devices  # before anything initialises CUDA
    from draftsmith.backends.server import _set_parent_death_signal

    _set_parent_death_signal()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s engine {index}: %(message)s", "%H:%M:%S")
    )
    logging.getLogger("draftsmith").addHandler(handler)
    logging.getLogger("draftsmith").setLevel(logging.INFO)
    current: list[int] = []  # the shard being extracted

    def starting(shard: int) -> None:
        current.append(shard)
        results.put((index, "start", shard))

    try:
        runner(queue, starting=starting, finished=lambda k: results.put((index, "done", k)), **kw)
    except BaseException as err:
        where = f"shard {current[-1]}: " if current else ""
        results.put((index, "error", f"{where}{type(err).__name__}: {' '.join(str(err).split())}"))
        sys.exit(1)


def idle_engines(last: dict[int, float], alive: set[int], now: float, timeout: float) -> list[int]:
    """The live engines whose last progress (start, shard started or finished) is `timeout` seconds old."""
    return sorted(i for i in alive if now - last[i] >= timeout)


def kill_tree(pid: int) -> None:
    """SIGKILL an engine and the processes it started (vLLM's workers), listed before any dies: an orphan
    would leave the tree."""
    for p in process_tree(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def extract_shards(
    target: str,
    tokens_path: str,
    out_paths: list[str],
    settings: ExtractSettings,
    device: dict[str, Any] | None = None,
) -> list[int]:
    """Every shard of the tokens file's plan, shard k into out_paths[k]; returns the shards reused.

    The job's GPUs are split into engines (job_layout), each loaded once and fed shards from one queue;
    one engine runs in this process, more in spawned processes of their own GPUs. Each finished shard is
    sealed in a stash (results/hidden/.done/<stash_key>/), which outlives Snakemake deleting a failed
    job's outputs: a rerun of the same settings reuses every intact stashed shard and extracts the rest.
    At the end every output is a hard link of its stashed shard."""
    _, meta = load_tokens(tokens_path)
    plan = meta["shards"]
    if len(out_paths) != len(plan):
        raise ValueError(
            f"extract.num_shards: {len(out_paths)} shard files asked for, but {tokens_path} plans {len(plan)} "
            "shards (rerun tokenize)"
        )
    s = settings
    compile_mode = compile_mode_of(s.compile)
    result = {
        "aux_layers": s.aux_layers, "batch_tokens": s.batch_tokens, "storage_dtype": s.storage_dtype,
        "codec": s.codec, "zstd_level": s.zstd_level, "backend": s.backend, "compile": compile_mode,
        "vllm_eager": s.vllm_eager,
    }  # fmt: skip
    key = stash_key(tokens_path, target, s.dtype, result)
    for out in out_paths:
        remove_stale_temp_files(out)  # an earlier job's leftovers beside the outputs
    stash, reused = prepare_stash(Path(out_paths[0]).parent / STASH, key, len(plan))
    if reused:
        log.info(
            "extract: reusing shards %s, finished by an earlier run (%s)", ", ".join(map(str, reused)), stash
        )
    todo = [k for k in range(len(plan)) if k not in reused]
    if todo:
        tensors, _ = load_tokens(tokens_path)
        offsets = tensors["offsets"]
        lengths = (offsets[1:] - offsets[:-1]).tolist()
        shard_tokens = [int(offsets[end] - offsets[start]) for start, end in plan]
        gpus = s.gpus
        tp, engines = job_layout(
            target, s.dtype, s.backend, gpus, meta["max_seq_len"], s.gpu_memory_utilization, s.tensor_parallel,
            device or {},
        )  # fmt: skip
        engines = min(engines, len(todo))  # an engine with no shard to take is not loaded
        queue = ShardQueue(queue_order(shard_tokens, todo))
        log.info(
            "extract: %d shards to extract (%s) by %d engine(s) of %s", len(todo), ", ".join(map(str, queue.order)),
            engines, f"{tp} GPU(s)" if gpus else "the CPU",
        )  # fmt: skip
        engine = replace(
            s, compile=compile_mode, gpus=tp if gpus else 0,
            threads=rank_threads(s.threads, engines) if s.threads else None,
        )  # fmt: skip
        if s.backend == "vllm":  # the engines of this job share the node's scratch: room for all, at start
            config = text_config_dict(target)
            stored = len(resolve_aux_layers(s.aux_layers, config["num_hidden_layers"])) + 1
            root = scratch_root(s.scratch)
            root.mkdir(parents=True, exist_ok=True)
            dtype = compute_dtype(s.dtype, "cuda" if gpus else "cpu")
            need = in_flight_states(
                s.batch_tokens, max(lengths), engines, stored, config["hidden_size"], dtype
            )
            check_scratch_room(root, *need)
        kw = {
            "target": target, "tokens_path": tokens_path, "stash": stash, "settings": engine,
            "max_model_len": max(lengths) + 1,
        }  # fmt: skip
        # vLLM on GPUs runs in engine processes even alone: a hung one (a stuck collective) can be killed
        if engines == 1 and not (gpus and s.backend == "vllm"):
            run_engine(queue, **kw)
        else:
            devices = engine_devices(parse_visible(os.environ.get("CUDA_VISIBLE_DEVICES")), gpus, tp, engines)
            run_engine_processes(queue, devices, kw)
    for k, out in enumerate(out_paths):
        publish(stashed_path(stash, k), Path(out))
    return reused


def run_engine_processes(
    queue: ShardQueue,
    devices: list[str],
    kw: dict[str, Any],
    runner: Callable[..., None] = run_engine,
) -> None:
    """One spawned process per engine (CUDA_VISIBLE_DEVICES = devices[i]), all taking from `queue`;
    waits for every one (the others go on when one fails: their shards are stashed), then raises
    EngineFailed naming the first failure. An engine that neither starts nor finishes a shard for
    kw["settings"].idle_timeout_s (resources.extract.idle_timeout_s: a stuck collective never returns) is
    killed with the processes it started, named with the shard it was on."""
    idle_timeout_s = kw["settings"].idle_timeout_s
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    procs = [
        context.Process(
            target=_engine_process, args=(i, d, queue, results, kw, runner), name=f"extract-engine-{i}"
        )
        for i, d in enumerate(devices)
    ]
    for proc in procs:
        proc.start()
    errors: dict[int, str] = {}  # engine -> its failure, one line
    last = dict.fromkeys(range(len(procs)), time.monotonic())  # engine -> its last progress
    shard_of: dict[int, int] = {}  # engine -> the shard it is on

    def drain(timeout: float) -> None:
        with contextlib.suppress(queue_module.Empty):
            index, kind, value = results.get(timeout=timeout)
            last[index] = time.monotonic()
            if kind == "start":
                shard_of[index] = value
            elif kind == "done":
                shard_of.pop(index, None)
            else:
                errors.setdefault(index, value)

    while any(p.is_alive() for p in procs):
        drain(1.0)
        alive = {i for i, p in enumerate(procs) if p.is_alive()}
        for i in idle_engines(last, alive, time.monotonic(), idle_timeout_s):
            on = f"shard {shard_of[i]}" if i in shard_of else "its load, before any shard"
            errors.setdefault(
                i,
                f"{on}: no shard started or finished in {idle_timeout_s:g} s "
                "(resources.extract.idle_timeout_s): hung, killed with its processes",
            )
            pid = procs[i].pid
            if pid is not None:  # started
                kill_tree(pid)
            last[i] = float("inf")  # killed once
    while not results.empty():
        drain(0.1)
    for i, proc in enumerate(procs):
        proc.join()
        if proc.exitcode and i not in errors:
            errors[i] = f"exited with code {proc.exitcode}"
    if errors:
        i = min(errors)
        raise EngineFailed(
            f"extraction engine {i} of {len(procs)} (CUDA devices {devices[i] or 'none'}) failed: {errors[i]}"
            f"{f' ({len(errors) - 1} more engines failed)' if len(errors) > 1 else ''}; the shards finished are "
            "stashed and a rerun reuses them"
        )


@dataclass
class ExtractPaths:
    target: str = arg("--target", "Target model folder.", kind="dir", required=True, exists=True)
    tokens: str = arg(
        "--tokens", "tokens.safetensors from tokenize (holds the shard plan).", required=True, exists=True
    )
    shard: int | None = arg(
        "--shard", "Extract only this shard of the plan (0-based), into --out.", kind="int", minimum=0
    )
    out: str | None = arg("--out", "With --shard: the shard file, e.g. results/hidden/shard-0.safetensors.")
    shard_files: tuple[str, ...] = arg("[SHARD_FILE]...", "", multiple=True)
    gpu_memory_gib: float | None = arg(
        "--gpu-memory-gib",
        "Memory of each GPU for the engine layout [resources.gpu_memory_gib, else resources.gpu_model's; "
        "0: nvidia-smi's].",
        kind="float",
        minimum=0,
    )


Settings, Paths = ExtractSettings, ExtractPaths
EXITS = {ValueError: BAD_INPUT, NotEnoughDisk: FAILED, VllmStartError: FAILED, EngineFailed: FAILED}


def run(paths: ExtractPaths, settings: ExtractSettings) -> list[str]:
    """Capture aux-layer inputs and the final normed state of the samples of every shard of the plan,
    shard k into the k-th SHARD_FILE (or of one shard, with --shard and --out); no lm_head.

    The job's GPUs are split into vLLM engines of --tensor-parallel GPUs (the memory plan's layout),
    each loaded once and fed shards from one queue. Each finished shard is sealed in a hidden stash
    (.done/ beside the shard files): a rerun of the same settings after a crash reuses it and extracts
    only the rest. Every file is written atomically: until a shard is complete only hidden temporary
    files (.NAME.*) exist, and a rerun removes them.
    """
    one = paths.shard is not None
    if one != (paths.out is not None) or one == bool(paths.shard_files):
        raise ValueError("extract: give SHARD_FILE... (every shard), or --shard K with --out FILE (one)")
    if paths.shard is not None:  # `one`
        extract_shard(paths.target, paths.tokens, paths.shard, paths.out, settings)
    else:
        device = {"gpu_memory_gib": paths.gpu_memory_gib or None}
        extract_shards(paths.target, paths.tokens, list(paths.shard_files), settings, device=device)
    return []
