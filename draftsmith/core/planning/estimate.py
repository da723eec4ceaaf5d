"""Exact size and time estimates for extraction, before any work is done.

Bytes are exact for raw storage, for both storage dtypes: tokens x (aux layers + final) x hidden x 2
(bfloat16), or x (hidden x 1 + 4) (float8_e4m3fn: a byte a value and a float32 scale per row).
Compressed bytes and time come from a probe: after a warm-up, the target runs a few real batches of
the job's own plan (short, middle and long rows), which are then encoded with the chosen codec in both
storage dtypes, so the ratios and the time are measured on this machine and this data, not guessed;
the time is extrapolated batch by batch over the plan's shapes, with the interval its fastest and
slowest probe give. The extract stage probes its own shard and checks the disk with these; the
`draftsmith estimate` command (stages/estimate.py) runs them before any job.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from draftsmith.core.data.batch_plan import token_batches
from draftsmith.core.data.shards import STORAGE_DTYPES, Sample, write_shard
from draftsmith.core.io.units import human_bytes, human_seconds
from draftsmith.core.planning.hidden_plan import raw_state_bytes

STORAGE_NOTES = {
    "bfloat16": "2 bytes a value",
    "float8_e4m3fn": "1 byte a value + a 4-byte scale per token and layer",
}
WARMUP_TOKENS = 32  # per row of the warm-up batch


def codec_ratios(samples: list[Sample], codec: str, level: int, workdir: Path) -> dict[str, float]:
    """Per storage dtype, the state bytes `codec` writes for these samples / their raw bytes in that
    dtype: measured by writing them (and removing the file)."""
    tokens = sum(s.num_tokens for s in samples)
    stored_layers, hidden = samples[0].aux.shape[1] + 1, samples[0].final.shape[-1]
    path = workdir / ".estimate-probe.safetensors"
    ratios = {}
    for dtype in STORAGE_DTYPES:
        state_bytes = write_shard(path, samples, {"probe": True}, codec, level, dtype)
        path.unlink()
        ratios[dtype] = state_bytes / raw_state_bytes(tokens, stored_layers, hidden, dtype)
    return ratios


def padded_tokens(lengths: list[int]) -> int:
    """Tokens a right-padded batch computes: rows x its longest row."""
    return len(lengths) * max(lengths) if lengths else 0


def probe_batches(plan: list[list[int]], budget_tokens: float, count: int = 3) -> list[int]:
    """Indices of up to `count` batches of a length-sorted plan to time: spread over the plan (short,
    middle, long rows) so that the estimate sees its shape mix, within a budget of padded tokens."""
    lengths = [padded_tokens(b) for b in plan]
    picks = sorted({round(q * (len(plan) - 1)) for q in np.linspace(0.25, 0.75, count)} if plan else set())
    chosen: list[int] = []
    spent = 0
    for i in sorted(picks, key=lambda i: abs(i - (len(plan) - 1) / 2)):  # the middle one first
        if chosen and spent + lengths[i] > budget_tokens:
            continue
        chosen.append(i)
        spent += lengths[i]
    return sorted(chosen)


def predict_seconds(plan_lengths: list[list[int]], timed: list[dict[str, float]]) -> dict[str, float]:
    """Time for a whole plan from timed batches: seconds per padded token, interpolated by row length
    (longer rows cost more per token: attention), applied batch by batch; the interval uses the slowest
    and fastest measured rate for every batch."""
    order = sorted(timed, key=lambda t: t["length"])
    xs = [t["length"] for t in order]
    rates = [t["seconds"] / t["padded"] for t in order]  # seconds per padded token
    padded = np.array([padded_tokens(b) for b in plan_lengths], dtype=np.float64)
    longest = np.array([max(b) for b in plan_lengths], dtype=np.float64)
    low, high = float(padded.sum() * min(rates)), float(padded.sum() * max(rates))
    point = float((padded * np.interp(longest, xs, rates)).sum())
    return {
        "seconds": min(max(point, low), high),  # within by construction, up to rounding
        "seconds_low": low,
        "seconds_high": high,
        "padded_tokens": int(padded.sum()),
    }


def probe(
    batches: list[list[tuple[torch.Tensor, torch.Tensor]]],
    capture: Callable[[list[torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]],
    plan_lengths: list[list[int]],
    codec: str,
    level: int,
    workdir: Path,
) -> tuple[dict[str, Any], list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Time the capture on a few real batches of the plan, after a short warm-up, and encode what they
    captured: measured time for the whole plan (with an interval) and the codec's ratio for each storage
    dtype, and the captured states of each probed batch (the job reuses them: the probe costs only its
    warm-up and the encoding).

    batches: the probed batches, each a list of (ids [T], loss_mask [T]); capture(list of ids [T]) ->
    [(aux [T, A, H], final [T, H])]; plan_lengths: the sample lengths of every batch the job will run."""
    # warm-up: the first calls allocate and pick kernels; as many rows as the first probe, short ones
    capture([ids[:WARMUP_TOKENS] for ids, _ in batches[0]])
    captured, timed, outputs = [], [], []
    for batch in batches:
        start, cpu = time.perf_counter(), time.process_time()
        states = capture([ids for ids, _ in batch])
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        outputs.append(states)
        lengths = [int(ids.numel()) for ids, _ in batch]
        timed.append(
            {"length": max(lengths), "padded": padded_tokens(lengths), "seconds": seconds, "cpu_seconds": cpu}
        )
        for (ids, mask), (aux, final) in zip(batch, states, strict=True):
            captured.append(Sample("probe", ids, mask.bool(), aux.bfloat16(), final.bfloat16()))
    tokens = sum(s.num_tokens for s in captured)
    measured = {
        "tokens": tokens,
        "tokens_per_second": tokens / sum(t["seconds"] for t in timed),
        "codec": codec,
        "codec_ratio": codec_ratios(captured, codec, level, workdir),
        "batches": timed,
        **predict_seconds(plan_lengths, timed),
    }
    return measured, outputs


PROBE_SHARE = 0.25  # the probe times up to this share of a shard (reused: costs only its warm-up)


def probe_plan(
    lengths: list[int],
    batch_tokens: int,
    sample_tokens: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    capture: Callable[[list[torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]],
    codec: str,
    zstd_level: int,
    workdir: Path,
) -> tuple[list[list[int]], list[int], dict[str, Any], list[Any]]:
    """A shard's batch plan (token_batches) and the probe of a few of its batches (estimate.probe):
    (plan, the probed batches' indices, measured, their captured states). sample_tokens(i) -> (ids [T],
    loss_mask [T]) of the shard's i-th sample."""
    plan = token_batches(lengths, batch_tokens)
    plan_lengths = [[lengths[i] for i in b] for b in plan]
    picks = probe_batches(plan_lengths, PROBE_SHARE * sum(lengths))
    batches = [[sample_tokens(i) for i in plan[k]] for k in picks]
    measured, probed = probe(batches, capture, plan_lengths, codec, zstd_level, workdir)
    return plan, picks, measured, probed


def estimate_lines(
    num_tokens: int,
    stored_layers: int,
    hidden_size: int,
    measured: dict[str, Any] | None,
    storage_dtype: str,
    ratios_source: str | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """The estimate as printed lines and as a record, for both storage dtypes; `storage_dtype` is the
    one the job stores (its `raw_bytes` and `compressed_bytes`). `measured` holds a probe's codec
    ratios (and, from a real probe, times); `ratios_source` says where ratios were measured when not
    on this data."""
    raw = {dtype: raw_state_bytes(num_tokens, stored_layers, hidden_size, dtype) for dtype in STORAGE_DTYPES}
    result: dict[str, Any] = {
        "tokens": int(num_tokens),
        "stored_layers": stored_layers,
        "hidden_size": hidden_size,
        "storage_dtype": storage_dtype,
        "raw_bytes": raw[storage_dtype],
        "raw_bytes_by_dtype": raw,
    }
    measured = measured or {}
    ratios = measured.get("codec_ratio") or {}
    compressed = {dtype: int(raw[dtype] * ratio) for dtype, ratio in ratios.items()}
    lines = [f"{int(num_tokens):,} tokens x {stored_layers} layers (aux + final) x {hidden_size:,} values:"]
    for dtype in STORAGE_DTYPES:
        line = f"  {dtype + ':':15s}{human_bytes(raw[dtype]):>10s} raw ({STORAGE_NOTES[dtype]})"
        if dtype in compressed:
            line += (
                f", x {ratios[dtype]:.3f} -> about {human_bytes(compressed[dtype])} with {measured['codec']}"
            )
        lines.append(line + ("  <- extract.storage_dtype" if dtype == storage_dtype else ""))
    if compressed:
        result |= {"compressed_bytes": compressed[storage_dtype], "compressed_bytes_by_dtype": compressed}
        where = ratios_source or "this data"
        lines.append(f"codec ratios measured on {measured['tokens']:,} tokens of {where}")
    if measured and "tokens_per_second" in measured:
        seconds = measured.get("seconds", num_tokens / measured["tokens_per_second"])
        low, high = measured.get("seconds_low", seconds), measured.get("seconds_high", seconds)
        result |= {
            "seconds": seconds,
            "seconds_low": low,
            "seconds_high": high,
            **{
                f"probe_{k}": v
                for k, v in measured.items()
                if k not in ("seconds", "seconds_low", "seconds_high")
            },
        }
        shapes = len(measured.get("batches", [])) or 1
        spread = (
            f"range {human_seconds(low)} to {human_seconds(high)}"
            if shapes > 1
            else "one batch shape measured: no range"
        )
        lines.append(
            f"capture measured on {shapes} batch shape(s) after a warm-up, {measured['tokens_per_second']:,.0f} tok/s "
            f"-> about {human_seconds(seconds)} of compute ({spread})"
        )
    return lines, result


def mode_lines(result: dict[str, Any], epochs: int) -> list[str]:
    """What each train.hidden_states mode costs for this data, from estimate_lines' record: the disk
    for the states and how many prefills of the data (and their compute, when measured) it runs."""
    size = result.get("compressed_bytes", result["raw_bytes"])
    disk = human_bytes(size) + ("" if "compressed_bytes" in result else " (uncompressed)")
    seconds = result.get("seconds")

    def prefills(n: int) -> str:
        return f"{n} prefill{'s' * (n != 1)}" + (f" (about {human_seconds(n * seconds)})" if seconds else "")

    return [
        f"train.hidden_states over {epochs} epoch(s):",
        f"  files:  {disk} of shards on disk, {prefills(1)}",
        f"  hybrid: {disk} of cache shards while training (removed after), {prefills(1)}",
        f"  stream: 0 B on disk, {prefills(epochs)}: one per epoch",
    ]


class NotEnoughDisk(OSError):
    """The results disk cannot hold what a job is about to write; the message has the numbers."""


def disk_advice(codec: str, storage_dtype: str) -> str:
    """What to do when a shard does not fit: only suggest a codec or storage dtype not already in use."""
    advice = "free space on that disk or point the workflow at a larger one (snakemake --directory)"
    if codec == "none":
        advice += ", or store less with extract.codec: zstd-planes"
    if storage_dtype == "bfloat16":
        advice += (
            ", or store half with extract.storage_dtype: float8_e4m3fn (lossy: within e4m3's rounding, "
            "see draftsmith/core/data/shards.py)"
        )
    # the same states without shards on the results disk (docs/workflow.md)
    advice += (
        ", or train without shards: train.hidden_states: stream (0 B on disk, one prefill of the data per "
        "epoch) or hybrid (the same shards as a cache in the checkpoint folder while training, one prefill)"
    )
    return advice


def check_free_disk(
    directory: str | Path,
    needed_bytes: float,
    codec: str,
    storage_dtype: str,
    margin: float = 1.1,
) -> None:
    """Refuse to start when the disk cannot hold the output (with a 10% margin)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < needed_bytes * margin:
        raise NotEnoughDisk(
            f"not enough free disk in {directory}: {human_bytes(free)} free, this shard needs about "
            f"{human_bytes(needed_bytes)} with codec {codec}, {storage_dtype} (+10% margin: "
            f"{human_bytes(needed_bytes * margin)}); {disk_advice(codec, storage_dtype)}"
        )
