"""Drafter exports an engine can load, and the checks that catch a broken one before it is served.

vLLM's native EAGLE-3 form (`vllm/model_executor/models/llama_eagle3.py`; SpecForge's `to_sglang` writes
the same, and SGLang reads it):

    config.json         LlamaConfig-style fields for the single draft layer, plus the EAGLE-3 fields
    model.safetensors   the drafter state dict as is: fc.weight, midlayer.*, norm.weight, lm_head.weight,
                        d2t [Vd] int64, t2d [V] bool; no embed_tokens (vLLM then shares the target's)

What vLLM reads from config.json (checked against its loader):
- `num_aux_hidden_states` (else len(eagle_config.eagle_aux_hidden_state_layer_ids), else 3) sizes fc; the
  target runner captures the layers named by top-level `eagle_aux_hidden_state_layer_ids`, else the
  eagle_config ones. Both are written, so neither path can fall back to a default.
- `draft_vocab_size` != `vocab_size` (the target's) makes it allocate and load `d2t` as
  `draft_id_to_target_id`; it skips `t2d`. A missing d2t or fc.weight loads *silently* (research
  vllm-on-cpu.md step 6), hence `check_export`.
- `norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output` change the layer; draftsmith trains
  with all four off and writes them explicitly so no engine default can differ.

The `draftsmith` block records what the engine fields do not: the layer-id convention of the ids written,
the input-convention ids, the target path and the full `DrafterConfig`, so `load_drafter` rebuilds the
exact module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftsmith.drafter import DrafterConfig, Eagle3Drafter, split_rope
from draftsmith.layers import convert_layer_ids

EXPORT_FORMAT_VERSION = 1
ARCHITECTURE = "LlamaForCausalLMEagle3"
ACCEPTED_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# the layer-id convention each engine applies to eagle_aux_hidden_state_layer_ids (research anchors §0)
ENGINE_CONVENTIONS = {"vllm": "input", "sglang": "output"}
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported export dtype {dtype}")


def export_config(
    cfg: DrafterConfig,
    aux_layer_ids: list[int],
    target_path: str,
    convention_engine: str = "vllm",
    dtype: torch.dtype = torch.bfloat16,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """config.json for a drafter; `aux_layer_ids` are in draftsmith's "input" convention."""
    if convention_engine not in ENGINE_CONVENTIONS:
        raise ValueError(
            f"unknown engine {convention_engine!r}; expected one of {sorted(ENGINE_CONVENTIONS)}"
        )
    input_ids = [int(i) for i in aux_layer_ids]
    if len(input_ids) != cfg.num_aux:
        raise ValueError(
            f"{len(input_ids)} aux layer ids {input_ids} for a drafter fusing {cfg.num_aux} states"
        )
    convention = ENGINE_CONVENTIONS[convention_engine]
    ids = convert_layer_ids(input_ids, "input", convention)
    dtype_name = _dtype_name(dtype)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": cfg.rope_parameters(),  # transformers >= 5 and vLLM read this
        # transformers 4.x (SGLang's) reads the scaling here; null = plain RoPE
        "rope_scaling": (
            {**cfg.rope_scaling, "type": cfg.rope_scaling["rope_type"]} if cfg.rope_scaling else None
        ),
        "attention_bias": False,
        "mlp_bias": False,
        "num_hidden_layers": 1,  # number of draft decoder layers
        "vocab_size": cfg.target_vocab_size,  # the TARGET vocabulary; d2t maps draft ids into it
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "num_aux_hidden_states": cfg.num_aux,  # what vLLM sizes fc from
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": ids,  # what vLLM's target runner captures
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "draftsmith": {
            "format_version": EXPORT_FORMAT_VERSION,
            "engine": convention_engine,
            "aux_layer_convention": convention,  # of the ids above
            "aux_layer_ids_input": input_ids,
            "target": str(target_path),
            "drafter_config": cfg.to_dict(),
            **(extra or {}),
        },
    }


def save_drafter(
    model: Eagle3Drafter,
    out_dir: str | Path,
    aux_layer_ids: list[int],
    target_path: str,
    convention_engine: str = "vllm",
    extra: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write config.json + model.safetensors into out_dir (float tensors in `dtype`; d2t int64, t2d bool).

    out_dir is written in place: wrap the call in `atomic_dir` for an all-or-nothing export.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = export_config(model.cfg, aux_layer_ids, target_path, convention_engine, dtype, extra)
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous().clone()
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    save_file(tensors, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out_dir


def drafter_config_from_export(config: dict[str, Any], engine_fields: bool = False) -> DrafterConfig:
    """DrafterConfig from the draftsmith block or, when it is absent (a foreign EAGLE-3 export) or
    `engine_fields` is set, from the fields an engine reads."""
    block = config.get("draftsmith") or {}
    if "drafter_config" in block and not engine_fields:
        return DrafterConfig(**block["drafter_config"])
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
        target_hidden_size=config.get("target_hidden_size", config["hidden_size"]),
        target_vocab_size=config["vocab_size"],
        draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
        num_aux=config.get("num_aux_hidden_states") or (len(ids) if ids else 3),
    )


def load_drafter(
    export_dir: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[Eagle3Drafter, dict[str, Any]]:
    """Rebuild the drafter of an export and load its weights strictly -> (model in eval mode, config)."""
    export_dir = Path(export_dir)
    config = json.loads((export_dir / CONFIG_NAME).read_text(encoding="utf-8"))
    model = Eagle3Drafter(drafter_config_from_export(config))
    state = load_file(str(export_dir / WEIGHTS_NAME))
    # speculators-format files name the layer layers.0.* (vLLM maps both onto the same module)
    state = {
        k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v
        for k, v in state.items()
    }
    model.load_state_dict(state, strict=True)
    model.to(dtype)  # floating-point tensors only: d2t/t2d keep their dtypes
    model.eval()
    return model, config


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """name -> (shape, required dtype or None for any float) of every tensor an export must hold."""
    H, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    m = "midlayer."
    return {
        "fc.weight": ((H, cfg.num_aux * cfg.target_hidden_size), None),
        f"{m}input_layernorm.weight": ((H,), None),
        f"{m}hidden_norm.weight": ((H,), None),
        f"{m}self_attn.q_proj.weight": ((q, 2 * H), None),
        f"{m}self_attn.k_proj.weight": ((kv, 2 * H), None),
        f"{m}self_attn.v_proj.weight": ((kv, 2 * H), None),
        f"{m}self_attn.o_proj.weight": ((H, q), None),
        f"{m}post_attention_layernorm.weight": ((H,), None),
        f"{m}mlp.gate_proj.weight": ((inter, H), None),
        f"{m}mlp.up_proj.weight": ((inter, H), None),
        f"{m}mlp.down_proj.weight": ((H, inter), None),
        "norm.weight": ((H,), None),
        "lm_head.weight": ((cfg.draft_vocab_size, H), None),
        "d2t": ((cfg.draft_vocab_size,), torch.int64),
        "t2d": ((cfg.target_vocab_size,), torch.bool),
    }


def _check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor) -> list[str]:
    ids = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.to(torch.int64)
    problems = []
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t2d.numel()):
        problems.append(f"d2t maps draft ids outside the target vocabulary [0, {t2d.numel()})")
        return problems
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        problems.append("d2t: target ids arange(Vd)+d2t are not strictly increasing")
    marked = torch.nonzero(t2d.bool()).flatten()
    if marked.numel() != ids.numel() or not bool(torch.equal(torch.sort(ids).values, marked)):
        problems.append(
            f"d2t and t2d disagree: t2d marks {marked.numel()} target ids, which are not exactly the "
            f"{ids.numel()} ids arange(Vd)+d2t"
        )
    return problems


def _check_aux_ids(config: dict[str, Any], num_aux: int | None, target_num_layers: int | None) -> list[str]:
    problems = []
    eagle = config.get("eagle_config")
    nested = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if nested is None:
        problems.append("eagle_config.eagle_aux_hidden_state_layer_ids is missing")
    if top is None:
        problems.append("eagle_aux_hidden_state_layer_ids is missing (vLLM's target runner reads it)")
    ids = top if top is not None else nested
    if ids is None:
        return problems
    if nested is not None and top is not None and list(nested) != list(top):
        problems.append(f"aux layer ids differ: top-level {top} vs eagle_config {nested}")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return [*problems, f"aux layer ids {ids} are not all integers"]
    if num_aux is not None and len(ids) != num_aux:
        problems.append(f"{len(ids)} aux layer ids {ids} but num_aux_hidden_states = {num_aux}")
    if len(set(ids)) != len(ids):
        problems.append(f"aux layer ids {ids} repeat a layer")
    convention = (config.get("draftsmith") or {}).get("aux_layer_convention", "input")
    # "input": id k is the input of layer k, 1..L-1; "output": the output of layer k, 0..L-2
    lo, hi = (1, None) if convention == "input" else (0, None)
    if target_num_layers is not None:
        hi = target_num_layers - 1 if convention == "input" else target_num_layers - 2
    named = list(dict.fromkeys([*(top or []), *(nested or [])]))  # both lists: either may be used
    bad = [i for i in named if isinstance(i, int) and (i < lo or (hi is not None and i > hi))]
    if bad:
        span = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        problems.append(f"aux layer ids {bad} out of range ({convention} convention: {span})")
    return problems


def check_export(
    export_dir: str | Path, target_num_layers: int | None = None, target_vocab_size: int | None = None
) -> list[str]:
    """Problems that would make an engine load the drafter wrongly or silently (empty list = OK)."""
    export_dir = Path(export_dir)
    cfg_path, weights_path = export_dir / CONFIG_NAME, export_dir / WEIGHTS_NAME
    problems: list[str] = []
    if not cfg_path.is_file():
        return [f"{cfg_path} is missing"]
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        return [f"{cfg_path} is not valid JSON: {e}"]
    if not weights_path.is_file():
        problems.append(f"{weights_path} is missing")

    archs = config.get("architectures") or []
    if not any(a in ACCEPTED_ARCHITECTURES for a in archs):
        problems.append(f"architectures {archs} names none of {list(ACCEPTED_ARCHITECTURES)}")
    if config.get("model_type") != "llama":
        problems.append(f"model_type is {config.get('model_type')!r}, expected 'llama'")
    if config.get("num_hidden_layers") != 1:
        problems.append(
            f"num_hidden_layers is {config.get('num_hidden_layers')!r}; draftsmith drafters have 1"
        )
    for flag in NORM_FLAGS:
        if flag not in config:
            problems.append(f"norm flag {flag!r} is missing (engines default it differently)")
        elif config[flag] is not False:
            problems.append(f"norm flag {flag!r} is {config[flag]!r}; the drafter was trained with it off")
    required = ("hidden_size", "num_attention_heads", "intermediate_size", "rms_norm_eps", "vocab_size")
    missing = [
        k
        for k in (*required, "draft_vocab_size", "target_hidden_size", "num_aux_hidden_states")
        if k not in config
    ]
    if missing:
        problems.append(f"config fields missing: {missing}")
    if any(k not in config for k in required):
        return problems
    try:
        cfg = drafter_config_from_export(config, engine_fields=True)  # what vLLM will build
        block_cfg = drafter_config_from_export(config)  # what draftsmith trained
    except (KeyError, TypeError, ValueError) as e:
        return [*problems, f"cannot build the drafter config: {e!r}"]
    differ = [
        f"{k}: {v} vs {block_cfg.to_dict()[k]}"
        for k, v in cfg.to_dict().items()
        if block_cfg.to_dict()[k] != v
    ]
    if differ:
        problems.append(f"engine fields disagree with the draftsmith block (engine vs block): {differ}")
    if target_vocab_size is not None and cfg.target_vocab_size != target_vocab_size:
        problems.append(f"vocab_size {cfg.target_vocab_size} != the target's vocabulary {target_vocab_size}")
    if cfg.draft_vocab_size > cfg.target_vocab_size:
        problems.append(f"draft_vocab_size {cfg.draft_vocab_size} exceeds vocab_size {cfg.target_vocab_size}")
    problems += _check_aux_ids(config, config.get("num_aux_hidden_states"), target_num_layers)

    if not weights_path.is_file():
        return problems
    with safe_open(str(weights_path), framework="pt") as f:
        names = set(f.keys())
        tensors = {}
        for name in names:
            key = name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name
            tensors[key] = f.get_tensor(name)
    for name, (shape, dtype) in expected_shapes(cfg).items():
        t = tensors.get(name)
        if t is None:
            problems.append(f"tensor {name} is missing")
            continue
        if tuple(t.shape) != shape:
            problems.append(f"tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
        if dtype is not None and t.dtype != dtype:
            problems.append(f"tensor {name} has dtype {t.dtype}, expected {dtype}")
        if dtype is None and (not t.is_floating_point() or not bool(torch.isfinite(t.float()).all())):
            problems.append(f"tensor {name} is not finite floating point ({t.dtype})")
    known = set(expected_shapes(cfg)) | {"embed_tokens.weight"}
    unexpected = sorted(set(tensors) - known)
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if (
        d2t is not None
        and t2d is not None
        and d2t.dim() == 1
        and t2d.dim() == 1
        and d2t.numel() == cfg.draft_vocab_size
        and not d2t.is_floating_point()
    ):
        problems += _check_vocab_map(d2t, t2d)
    return problems
