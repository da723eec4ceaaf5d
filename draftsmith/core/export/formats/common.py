"""What every export form shares: file names, the one-layer Llama fields, the draftsmith block, the tensors
as written, and an export's trained draft length. The engines and their conventions: draftsmith.core.evaluation.engines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from draftsmith.core.evaluation.engines import (
    ENGINE_CONVENTIONS,
    ENGINES,
    draft_positions_warning,
    trained_ttt_steps,
)
from draftsmith.core.model.drafter import DrafterConfig, DraftHead
from draftsmith.core.model.layers import aux_order_problem

EXPORT_FORMAT_VERSION = 1
ARCHITECTURE = "LlamaForCausalLMEagle3"
ACCEPTED_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
SGLANG_NUM_AUX = 3  # SGLang's LlamaForCausalLMEagle3 builds fc as 3 x target_hidden_size
SPECULATORS_VERSION = "0.9.0"
SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"  # what speculators 0.9.0's save_pretrained writes
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
VOCAB_TENSORS = ("d2t", "t2d")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported export dtype {dtype}")


def needs_vocab_map(cfg: DrafterConfig) -> bool:
    """Engines allocate d2t only for a draft vocabulary smaller than the target's."""
    return cfg.draft_vocab_size != cfg.target_vocab_size


def rope_fields(cfg: DrafterConfig) -> dict[str, Any]:
    """The drafter's RoPE as engines read it: `rope_parameters` (transformers >= 5, vLLM) and, for
    transformers 4.x readers (SGLang), `rope_theta` + `rope_scaling` (null = plain RoPE)."""
    scaling = {**cfg.rope_scaling, "type": cfg.rope_scaling["rope_type"]} if cfg.rope_scaling else None
    return {"rope_theta": cfg.rope_theta, "rope_parameters": cfg.rope_parameters(), "rope_scaling": scaling}


def validate_for_export(cfg: DrafterConfig, input_ids: list[int], engine: str) -> None:
    if engine not in ENGINE_CONVENTIONS:
        raise ValueError(f"unknown engine {engine!r}; expected one of {list(ENGINES)}")
    if len(input_ids) != cfg.num_aux:
        raise ValueError(
            f"{len(input_ids)} aux layer ids {input_ids} for a drafter fusing {cfg.num_aux} states"
        )
    problem = aux_order_problem(input_ids)
    if problem:
        raise ValueError(problem)
    if cfg.draft_vocab_size > cfg.target_vocab_size:
        raise ValueError(
            f"draft vocabulary {cfg.draft_vocab_size} exceeds the target vocabulary {cfg.target_vocab_size}"
        )
    if engine == "sglang" and cfg.num_aux != SGLANG_NUM_AUX:
        raise ValueError(
            f"SGLang's EAGLE-3 drafter fuses exactly {SGLANG_NUM_AUX} aux states, not {cfg.num_aux}"
        )
    if engine == "speculators" and cfg.target_hidden_size != cfg.hidden_size:
        raise ValueError(
            f"speculators sizes fc from the drafter hidden size {cfg.hidden_size}; the target's is "
            f"{cfg.target_hidden_size}"
        )


def norm_flags(cfg: DrafterConfig) -> dict[str, bool]:
    """Every norm flag, written out (engines default them differently): EAGLE 3.1 sets fc_norm and
    norm_output, the other kinds none."""
    return {flag: bool(getattr(cfg, flag, False)) for flag in NORM_FLAGS}


def parallel_fields(cfg: DrafterConfig) -> dict[str, Any]:
    """P-EAGLE: the mask slots' token id, which vLLM's parallel drafting reads from `mask_token_id`."""
    return {"mask_token_id": cfg.mask_token_id} if cfg.parallel else {}


def layer_fields(cfg: DrafterConfig, dtype_name: str) -> dict[str, Any]:
    """The one-layer Llama config both forms share (the draft layer, the target's vocabulary)."""
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        **rope_fields(cfg),
        "attention_bias": False,
        "mlp_bias": False,
        "num_hidden_layers": 1,  # number of draft decoder layers
        "vocab_size": cfg.target_vocab_size,  # the TARGET vocabulary; d2t maps draft ids into it
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


def draftsmith_block(
    cfg: DrafterConfig, engine: str, input_ids: list[int], target_path: str, extra: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        **(extra or {}),
        "format_version": EXPORT_FORMAT_VERSION,
        "engine": engine,
        "aux_layer_convention": ENGINE_CONVENTIONS[engine],  # of the ids written
        "aux_layer_ids_input": input_ids,
        "target": str(target_path),
        "drafter_config": cfg.to_dict(),
    }


def state_tensors(model: DraftHead, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's state dict for an engine: floats in `dtype`, d2t int64 / t2d bool, and no vocab map
    at all for a full-size draft vocabulary (which must then be the identity)."""
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous().clone()
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    if not needs_vocab_map(model.cfg):
        if bool(tensors["d2t"].any()) or not bool(tensors["t2d"].all()):
            raise ValueError("a full-size draft vocabulary must map every id to itself (d2t all zero)")
        for name in VOCAB_TENSORS:
            del tensors[name]
    return tensors


def write_files(out_dir: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for name in (WEIGHTS_NAME, CONFIG_NAME):
        (out_dir / name).chmod(0o644)
    return out_dir


def export_draft_positions_warning(export_dir: str | Path, num_draft_tokens: int) -> str | None:
    """`draft_positions_warning` for the drafter of an export folder (None for a foreign export)."""
    config = json.loads((Path(export_dir) / CONFIG_NAME).read_text(encoding="utf-8"))
    return draft_positions_warning(num_draft_tokens, trained_ttt_steps(config))
