"""Exact size and time estimates for extraction, before any work is done.

Bytes are exact for raw storage: tokens x (aux layers + final) x hidden x 2 (bf16). Compressed bytes
and time come from a probe: the target runs on a few real samples, which are then encoded with the
chosen codec, so the ratio and tokens/s are measured on this machine and this data, not guessed.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from draftsmith.shards import Sample, write_shard

BF16_BYTES = 2


def raw_state_bytes(
    num_tokens: int, stored_layers: int, hidden_size: int, dtype_bytes: int = BF16_BYTES
) -> int:
    """Bytes of hidden states for `stored_layers` (aux + final) per token."""
    return int(num_tokens) * stored_layers * hidden_size * dtype_bytes


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    raise AssertionError


def human_seconds(s: float) -> str:
    h, rem = divmod(int(round(s)), 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def probe(
    model,
    samples: list[tuple[torch.Tensor, torch.Tensor]],
    aux_layer_ids: list[int],
    codec: str,
    level: int,
    workdir: Path,
    capture: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, float]:
    """Run the capture on a few real samples and encode them: measured tokens/s and codec ratio.

    `capture(ids [T]) -> (aux [T, A, H], final [T, H])` replaces the transformers capture of `model`
    (how extraction engines probe themselves)."""
    if capture is None:
        from draftsmith.engines.hf import capture_states

        def capture(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            aux, final = capture_states(model, ids[None], aux_layer_ids)
            return aux[0], final[0]

    tokens = sum(ids.numel() for ids, _ in samples)
    captured = []
    capture(samples[0][0][:16])  # warm-up: first calls are slow
    start = time.perf_counter()
    for ids, mask in samples:
        aux, final = capture(ids)
        captured.append(Sample("probe", ids, mask.bool(), aux.bfloat16(), final.bfloat16()))
    seconds = time.perf_counter() - start
    path = workdir / ".estimate-probe.safetensors"
    state_bytes = write_shard(path, captured, {"probe": True}, codec=codec, level=level)
    path.unlink()
    ratio = state_bytes / raw_state_bytes(tokens, len(aux_layer_ids) + 1, captured[0].final.shape[-1])
    return {"tokens": tokens, "tokens_per_second": tokens / seconds, "codec_ratio": ratio}


def estimate_lines(
    num_tokens: int, stored_layers: int, hidden_size: int, measured: dict[str, float] | None
) -> tuple[list[str], dict[str, Any]]:
    raw = raw_state_bytes(num_tokens, stored_layers, hidden_size)
    result: dict[str, Any] = {
        "tokens": int(num_tokens),
        "stored_layers": stored_layers,
        "hidden_size": hidden_size,
        "raw_bytes": raw,
    }
    lines = [
        f"{num_tokens:,} tokens x {stored_layers} layers (aux + final) x {hidden_size} x 2 bytes (bf16) = {human_bytes(raw)} raw",
    ]
    if measured:
        compressed = raw * measured["codec_ratio"]
        seconds = num_tokens / measured["tokens_per_second"]
        result |= {
            "compressed_bytes": int(compressed),
            "seconds": seconds,
            **{f"probe_{k}": v for k, v in measured.items()},
        }
        lines.append(
            f"codec ratio {measured['codec_ratio']:.3f} (measured on {measured['tokens']:,} tokens) -> about {human_bytes(compressed)} on disk"
        )
        lines.append(
            f"capture at {measured['tokens_per_second']:,.0f} tok/s (measured) -> about {human_seconds(seconds)} of compute"
        )
    return lines, result


def check_free_disk(directory: str | Path, needed_bytes: float, margin: float = 1.1) -> None:
    """Refuse to start when the disk cannot hold the output (with a 10% margin)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < needed_bytes * margin:
        raise OSError(
            f"not enough free disk in {directory}: {human_bytes(free)} free, extraction needs about "
            f"{human_bytes(needed_bytes)} (+10% margin). Free space, choose another results folder, or use "
            "extract.codec: zstd-planes."
        )
