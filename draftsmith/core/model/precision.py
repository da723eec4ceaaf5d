"""Which floating-point type to compute in, where `auto` is asked for.

bf16 is the reference's choice (EAGLE-3, SpecForge) and halves memory traffic, but only where the
hardware multiplies bf16 natively: GPUs that support it, CPUs with AVX512-BF16 or AMX. Elsewhere torch
emulates it: on an AVX2-only 2-core EPYC a 2048x576x8192 bf16 matmul ran at 0.4 GFLOPS against 85 in
fp32, which made every bf16 stage 10-200x slower than fp32 (bench/train.py compares both).
"""

from __future__ import annotations

import torch

COMPUTE_DTYPES = ("auto", "bfloat16", "float32")  # target.dtype: generation and extraction
TRAIN_PRECISIONS = ("auto", "bf16", "fp32")  # train.precision: bf16 autocast or none


def bf16_is_native(device: torch.device | str | None = None) -> bool:
    """True where bf16 matmuls run in hardware on `device` (default: CUDA when available, else CPU)."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return True  # other accelerators (xpu, hpu, mps) are built around bf16


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def compute_dtype(requested: str, device: torch.device | str | None = None) -> str:
    """target.dtype -> "bfloat16" or "float32"; `auto` is bfloat16 where it is native on `device`."""
    if requested not in COMPUTE_DTYPES:
        raise ValueError(f"dtype {requested!r}: expected one of {', '.join(COMPUTE_DTYPES)}")
    if requested != "auto":
        return requested
    return "bfloat16" if bf16_is_native(device) else "float32"


def train_precision(requested: str, device: torch.device | str | None = None) -> str:
    """train.precision -> "bf16" or "fp32"; `auto` is bf16 where it is native on `device`."""
    if requested not in TRAIN_PRECISIONS:
        raise ValueError(f"precision {requested!r}: expected one of {', '.join(TRAIN_PRECISIONS)}")
    names = {"bf16": "bfloat16", "fp32": "float32", "auto": "auto"}
    return {"bfloat16": "bf16", "float32": "fp32"}[compute_dtype(names[requested], device)]
