"""The native form vLLM reads (`vllm/model_executor/models/llama_eagle3.py`), written by training into
results/drafter/: config.json with LlamaConfig-style fields for the single draft layer plus the EAGLE-3
fields, and model.safetensors with the drafter state dict as is. SGLang reads the same form with its own
aux-id convention (`draftsmith.core.export.formats.sglang`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.core.evaluation.engines import ENGINE_CONVENTIONS
from draftsmith.core.export.formats.common import (
    ARCHITECTURE,
    draftsmith_block,
    dtype_name,
    layer_fields,
    norm_flags,
    parallel_fields,
    state_tensors,
    validate_for_export,
    write_files,
)
from draftsmith.core.model.drafter import DrafterConfig, DraftHead, Eagle3Drafter
from draftsmith.core.model.kinds import kind
from draftsmith.core.model.layers import convert_layer_ids


def export_config(
    cfg: DrafterConfig,
    aux_layer_ids: list[int],
    target_path: str,
    convention_engine: str = "vllm",
    dtype: torch.dtype = torch.bfloat16,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """config.json of the native form for vLLM or SGLang; `aux_layer_ids` are in the "input" convention."""
    if convention_engine not in ("vllm", "sglang"):
        raise ValueError(f"the native form is for 'vllm' or 'sglang', not {convention_engine!r}")
    input_ids = [int(i) for i in aux_layer_ids]
    validate_for_export(cfg, input_ids, convention_engine)
    ids = convert_layer_ids(input_ids, "input", ENGINE_CONVENTIONS[convention_engine])
    return {
        "architectures": [ARCHITECTURE],
        **layer_fields(cfg, dtype_name(dtype)),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "num_aux_hidden_states": cfg.num_aux,  # what vLLM sizes fc from
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": ids,  # what vLLM's target runner captures
        **norm_flags(cfg),
        **parallel_fields(cfg),
        "draftsmith": draftsmith_block(cfg, convention_engine, input_ids, target_path, extra),
    }


def save_drafter(
    model: DraftHead,
    out_dir: str | Path,
    aux_layer_ids: list[int],
    target_path: str,
    convention_engine: str = "vllm",
    extra: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write config.json + model.safetensors into out_dir (float tensors in `dtype`; d2t int64, t2d bool)
    by the writer of the drafter's kind (core/model/kinds.py: `save_eagle3` below, DFlash's
    `vllm_dflash.save_dflash`).

    out_dir is written in place: wrap the call in `atomic_dir` for an all-or-nothing export.
    """
    writer = kind(model.cfg.kind).load("writer")
    return writer(model, out_dir, aux_layer_ids, target_path, convention_engine, extra, dtype)


def save_eagle3(
    model: Eagle3Drafter,
    out_dir: str | Path,
    aux_layer_ids: list[int],
    target_path: str,
    convention_engine: str = "vllm",
    extra: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """The EAGLE-3 family's writer (eagle3, eagle3.1, peagle): the native form for vLLM or SGLang."""
    config = export_config(model.cfg, aux_layer_ids, target_path, convention_engine, dtype, extra)
    return write_files(Path(out_dir), config, state_tensors(model, dtype))
