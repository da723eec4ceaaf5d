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

import errno
import logging
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from draftsmith.estimate import (
    NotEnoughDisk,
    check_free_disk,
    disk_advice,
    estimate_lines,
    human_bytes,
    human_seconds,
    probe_plan,
)
from draftsmith.layers import resolve_aux_layers
from draftsmith.precision import compute_dtype
from draftsmith.shards import Sample, ShardWriter, as_stored, remove_stale_temp_files
from draftsmith.target import text_config_dict
from draftsmith.tokenize import load_tokens

log = logging.getLogger(__name__)


def disk_full(err: BaseException | None) -> bool:
    """Whether an error (or what caused it, e.g. the shard writer's) is a full disk."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        err = err.__cause__ or err.__context__
    return False


def checked_positions(
    final: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(final states [P, H], next tokens [P]) at the positions t whose next token t+1 is loss-masked:
    from final[t] the target predicts token t+1, which the trace says it produced."""
    positions = torch.nonzero(loss_mask[1:]).squeeze(-1)
    return final[positions], input_ids[positions + 1]


def count_agreeing(lm_head_weight: torch.Tensor, states: torch.Tensor, next_ids: torch.Tensor) -> int:
    """How many rows have argmax(lm_head(state)) == next id, in chunks that bound the [rows, V] logits,
    on lm_head's device (the job's GPU when it has one)."""
    device, dtype = lm_head_weight.device, lm_head_weight.dtype
    agree = torch.zeros((), dtype=torch.int64, device=device)  # summed there, read once (one host sync)
    for i in range(0, states.shape[0], 512):
        logits = states[i : i + 512].to(device, dtype) @ lm_head_weight.T
        # max().indices is argmax (the first maximum); in bf16 on CPU it runs ~5x faster than argmax()
        agree += (logits.max(-1).indices == next_ids[i : i + 512].to(device)).sum()
    return int(agree)


def teacher_agreement(
    lm_head_weight: torch.Tensor, final: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[int, int]:
    """(agreeing, checked) over positions t whose next token t+1 is loss-masked.

    final [T, H] is the stored post-norm state; the target predicts token t+1 from it."""
    states, next_ids = checked_positions(final, input_ids, loss_mask)
    return count_agreeing(lm_head_weight, states, next_ids), int(next_ids.numel())


COMPILE_MIN_SECONDS = 300.0  # "auto" compiles when eager compute would take longer than this


def should_compile(mode: str, backend: str, eager_seconds: float) -> bool:
    """torch.compile pays off on CPU (fused elementwise kernels) once a shard outlasts its one-off
    compile time (minutes on 2 cores); "auto" compiles only then, and only the transformers back-end."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"compile must be auto, on or off, not {mode!r}")
    if backend != "transformers":
        return False
    return mode == "on" or (mode == "auto" and eager_seconds >= COMPILE_MIN_SECONDS)


def make_extractor(
    backend: str,
    target: str,
    layer_ids: list[int],
    dtype: str,
    gpus: int = 0,
    max_model_len: int = 2048,
    workdir: Path | None = None,
    vllm_eager: bool = True,
    gpu_memory_utilization: float | None = None,
):
    """An extraction back-end: `.capture(list of [T] ids) -> [(aux [T, A, H], final [T, H])]`,
    `.lm_head_weight`, `.close()`."""
    if backend == "transformers":
        from draftsmith.backends.hf import HfExtractor

        return HfExtractor.from_target(target, layer_ids, dtype)
    if backend == "vllm":
        from draftsmith.backends.vllm_extract import VllmExtractor

        return VllmExtractor(
            target,
            layer_ids,
            dtype,
            tensor_parallel_size=max(1, gpus),
            max_model_len=max_model_len,
            storage_dir=workdir,
            enforce_eager=vllm_eager,
            gpu_memory_utilization=gpu_memory_utilization if gpus else None,  # GPUs only
        )
    raise ValueError(f"unknown extraction back-end {backend!r}; expected transformers or vllm")


def temp_prefix(out_path: str | Path) -> str:
    """Every temporary file or folder of one shard's job starts with this (hidden, never a shard)."""
    return f".{Path(out_path).name}."


def extract_shard(
    target: str,
    tokens_path: str,
    shard: int,
    out_path: str | None,
    aux_layers: list[int] | None,
    dtype: str,
    batch_tokens: int,
    codec: str = "zstd-planes",
    zstd_level: int = 1,
    threads: int | None = None,
    storage_dtype: str = "bfloat16",
    backend: str = "transformers",
    compile: str = "auto",
    gpus: int = 0,
    vllm_eager: bool = True,
    extractor=None,
    gpu_memory_utilization: float | None = None,
    pipeline: bool = True,
) -> dict[str, Any]:
    """Extract one shard. `out_path=None` computes everything but writes nothing, and `extractor` is a
    back-end to reuse (left open), both for benchmarks. `pipeline`: overlap each batch's CPU-side work
    with the next forward (_extract_loop); the shard is the same either way."""
    if threads:
        torch.set_num_threads(threads)
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
    if own_backend:
        extractor = make_extractor(
            backend, target, layer_ids, dtype, gpus, max(lengths) + 1, scratch, vllm_eager=vllm_eager,
            gpu_memory_utilization=gpu_memory_utilization,
        )  # fmt: skip
    writer, estimate = None, {}
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
                sample_ids=meta["sample_ids"][start:end],
                dtype=storage_dtype,
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
            needed = human_bytes(estimate.get("compressed_bytes", 0))
            raise NotEnoughDisk(
                f"{Path(out_path).parent}: disk full while writing shard {shard} ({free} free after removing its "
                f"partial file; the shard needs about {needed}); {disk_advice(codec, storage_dtype)}"
            ) from None
        raise
    finally:
        if own_backend:
            extractor.close()
        shutil.rmtree(scratch, ignore_errors=True)
    stats["wall_seconds_with_write"] = round(time.perf_counter() - t0 + probe_seconds, 2)
    stats["cpu_seconds_with_write"] = round(time.process_time() - cpu0 + probe_cpu, 2)
    size = ""
    if out_path:
        file_bytes = Path(out_path).stat().st_size
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
