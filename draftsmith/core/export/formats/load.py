"""Reading an export back: which engine it is written for, the fields that engine builds the drafter
from, and the drafter itself (native or speculators format, draftsmith's or foreign)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from draftsmith.core.export.formats.common import (
    CONFIG_NAME,
    NORM_FLAGS,
    WEIGHTS_NAME,
    needs_vocab_map,
    norm_flags,
)
from draftsmith.core.export.formats.speculators import native_names
from draftsmith.core.model.drafter import DrafterConfig, Eagle3Drafter, split_rope
from draftsmith.core.model.kinds import kind, kind_of_export


def engine_of(config: dict[str, Any]) -> str:
    """Which engine an export's config.json is written for: speculators' format, else the convention the
    draftsmith block declares, else vLLM's."""
    if "speculators_model_type" in config:
        return "speculators"
    convention = (config.get("draftsmith") or {}).get("aux_layer_convention", "input")
    return "sglang" if convention == "output" else "vllm"


def engine_view(config: dict[str, Any]) -> dict[str, Any]:
    """The flat, native-form fields an engine builds the drafter from. For speculators' format that is
    `transformer_layer_config` plus the EAGLE-3 fields beside it (what vLLM's `update_eagle3` does)."""
    if "speculators_model_type" not in config:
        return config
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError("speculators config has no transformer_layer_config object")
    flat = dict(layer)
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", *NORM_FLAGS):
        if key in config:
            flat[key] = config[key]
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if "num_aux_hidden_states" not in flat:
        flat["num_aux_hidden_states"] = 3  # vLLM's assumption for this format
    if ids is not None:
        flat["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    if "draftsmith" in config:
        flat["draftsmith"] = config["draftsmith"]
    return flat


def drafter_config_from_export(config: dict[str, Any], engine_fields: bool = False) -> DrafterConfig:
    """DrafterConfig from the draftsmith block or, when it is absent (a foreign EAGLE-3 export) or
    `engine_fields` is set, from the fields an engine reads (either format)."""
    block = config.get("draftsmith") or {}
    if "drafter_config" in block and not engine_fields:
        return DrafterConfig.from_dict(block["drafter_config"])
    config = engine_view(config)
    # transformers >= 5 writes rope_parameters; older exports rope_theta + rope_scaling
    rope = config.get("rope_parameters") or {
        **(config.get("rope_scaling") or {}),
        "rope_theta": config.get("rope_theta", 10000.0),
    }
    rope_theta, rope_scaling = split_rope(rope)
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or config.get("eagle_aux_hidden_state_layer_ids")
    heads = config["num_attention_heads"]
    return DrafterConfig(
        hidden_size=config["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=config["intermediate_size"],
        rms_norm_eps=float(config["rms_norm_eps"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(config["max_position_embeddings"]),
        target_hidden_size=config.get("target_hidden_size") or config["hidden_size"],
        target_vocab_size=config["vocab_size"],
        draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
        num_aux=config.get("num_aux_hidden_states") or (len(ids) if ids else 3),
        kind=kind_of_export(config),
        mask_token_id=config.get("mask_token_id", config.get("pard_token")),
    )


def load_drafter(
    export_dir: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the drafter of an export (native or speculators format, draftsmith's or foreign) and load
    its weights strictly -> (model in eval mode, config), by the reader of its kind (`kind_of_export`)."""
    config = json.loads((Path(export_dir) / CONFIG_NAME).read_text(encoding="utf-8"))
    return kind(kind_of_export(engine_view(config))).load("reader")(export_dir, dtype)


def load_eagle3(
    export_dir: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, dict[str, Any]]:
    """The reader of the EAGLE-3 family's exports (eagle3, eagle3.1, peagle; `load_drafter` picks it)."""
    export_dir = Path(export_dir)
    config = json.loads((export_dir / CONFIG_NAME).read_text(encoding="utf-8"))
    cfg = drafter_config_from_export(config)
    view = engine_view(config)
    on = sorted(k for k in NORM_FLAGS if view.get(k))
    if on != sorted(k for k, v in norm_flags(cfg).items() if v):  # a layer draftsmith does not implement
        raise ValueError(
            f"{export_dir / CONFIG_NAME}: norm flags {on} set; draftsmith's {cfg.kind} drafter has "
            f"{sorted(k for k, v in norm_flags(cfg).items() if v) or 'none'}"
        )
    model = Eagle3Drafter(cfg)
    state = native_names(load_file(str(export_dir / WEIGHTS_NAME)))
    state.pop("embed_tokens.weight", None)  # the target's embedding (speculators' format carries it)
    if not needs_vocab_map(cfg):  # a full-size draft vocabulary: the identity map
        state.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        state.setdefault("t2d", torch.ones(cfg.target_vocab_size, dtype=torch.bool))
    model.load_state_dict(state, strict=True)
    model.to(dtype)  # floating-point tensors only: d2t/t2d keep their dtypes
    model.eval()
    return model, config
