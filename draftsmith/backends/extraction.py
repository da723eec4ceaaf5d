"""The extraction back-ends behind one constructor: `transformers` (backends/hf.py: in-process, hooks)
and `vllm` (backends/vllm_extract.py: vLLM's extract_hidden_states). The extract stage and a streamed
train job (train.hidden_states stream or hybrid) build theirs here, so both capture the same states.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def transformers_device(gpus: int) -> str:
    """Where the transformers back-end runs: the job's first GPU when it holds any (`draftsmith run`
    made them visible), else the CPU; a job given GPUs CUDA cannot see (fake ones in tests) runs on the
    CPU as before, with a warning."""
    if gpus <= 0:
        return "cpu"
    if not torch.cuda.is_available():
        log.warning(
            "extract: resources.extract.gpus is %d but CUDA sees no GPU: the transformers back-end runs on the CPU",
            gpus,
        )
        return "cpu"
    if gpus > 1:
        log.warning(
            "extract: the transformers back-end runs on one of the job's %d GPUs (extract.backend vllm uses all)",
            gpus,
        )
    return "cuda"


def make_extractor(
    backend: str,
    target: str,
    layer_ids: list[int],
    dtype: str,
    gpus: int,
    max_model_len: int,
    workdir: Path | None,
    vllm_eager: bool,
    gpu_memory_utilization: float | None,
):
    """An extraction back-end: `.capture(list of [T] ids) -> [(aux [T, A, H], final [T, H])]`,
    `.lm_head_weight`, `.close()`."""
    if backend == "transformers":
        from draftsmith.backends.hf import HfExtractor

        return HfExtractor.from_target(target, layer_ids, dtype, transformers_device(gpus))
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
