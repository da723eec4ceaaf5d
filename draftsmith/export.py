"""Drafter exports, one per engine, and the checks that catch a broken one before it is served.

Three forms of the same trained weights:

    results/drafter/              vLLM's native EAGLE-3 form (`vllm/model_executor/models/llama_eagle3.py`)
    results/drafter-sglang/       the same files with SGLang's aux-id convention
    results/drafter-speculators/  speculators' own format (`Eagle3SpeculatorConfig`), which `vllm serve`
                                  also reads (vllm/transformers_utils/configs/speculators/)

The native form (vLLM, SGLang):

    config.json         LlamaConfig-style fields for the single draft layer, plus the EAGLE-3 fields
    model.safetensors   the drafter state dict as is: fc.weight, midlayer.*, norm.weight, lm_head.weight,
                        d2t [Vd] int64, t2d [V] bool; no embed_tokens (the engine shares the target's)

What the engines read from config.json (checked against their loaders):
- vLLM sizes fc from `num_aux_hidden_states` (else len(eagle_config ids), else 3) and captures the layers
  named by top-level `eagle_aux_hidden_state_layer_ids` ("input to layer k"), as `sorted(set(ids))`.
- SGLang reads only `eagle_config.eagle_aux_hidden_state_layer_ids` and captures id + 1 of each
  (`set_eagle3_layers_to_capture`: it counts "output of layer k"); its fc is always 3 aux states wide;
  it silently skips weight names it does not know (so `midlayer.*`, never `layers.0.*`).
- Both allocate a draft-to-target map only when `draft_vocab_size` != the target's vocabulary; vLLM
  then fails on a `d2t` it has no parameter for, so a full-size draft vocabulary is written without
  d2t/t2d. A missing d2t or fc.weight otherwise loads *silently*, hence `check_export`.
- `norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output` change the layer; draftsmith trains
  with all four off and writes them explicitly (vLLM defaults `norm_before_residual` to True for
  speculators-format configs).

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

from draftsmith.atomic import atomic_dir
from draftsmith.drafter import DrafterConfig, Eagle3Drafter, split_rope
from draftsmith.layers import aux_order_problem, convert_layer_ids

EXPORT_FORMAT_VERSION = 1
ARCHITECTURE = "LlamaForCausalLMEagle3"
ACCEPTED_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
ENGINES = ("vllm", "sglang", "speculators")
# the layer-id convention each engine applies to the aux ids it reads
ENGINE_CONVENTIONS = {"vllm": "input", "sglang": "output", "speculators": "input"}
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
SGLANG_NUM_AUX = 3  # SGLang's LlamaForCausalLMEagle3 builds fc as 3 x target_hidden_size
SPECULATORS_VERSION = "0.9.0"
SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"  # what speculators 0.9.0's save_pretrained writes
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
VOCAB_TENSORS = ("d2t", "t2d")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
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


def _validate_for_export(cfg: DrafterConfig, input_ids: list[int], engine: str) -> None:
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


def _layer_fields(cfg: DrafterConfig, dtype_name: str) -> dict[str, Any]:
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


def _draftsmith_block(
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
    _validate_for_export(cfg, input_ids, convention_engine)
    ids = convert_layer_ids(input_ids, "input", ENGINE_CONVENTIONS[convention_engine])
    return {
        "architectures": [ARCHITECTURE],
        **_layer_fields(cfg, _dtype_name(dtype)),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "num_aux_hidden_states": cfg.num_aux,  # what vLLM sizes fc from
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": ids,  # what vLLM's target runner captures
        **dict.fromkeys(NORM_FLAGS, False),
        "draftsmith": _draftsmith_block(cfg, convention_engine, input_ids, target_path, extra),
    }


def speculators_export_config(
    cfg: DrafterConfig,
    aux_layer_ids: list[int],
    target_path: str,
    speculative_tokens: int,
    verifier_architectures: list[str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """config.json in speculators' format (`Eagle3SpeculatorConfig`); the verifier is the target.

    `transformer_layer_config` is what vLLM builds the draft layer from; it carries
    `num_aux_hidden_states` because vLLM otherwise assumes 3 for this format."""
    input_ids = [int(i) for i in aux_layer_ids]
    _validate_for_export(cfg, input_ids, "speculators")
    if speculative_tokens < 1:
        raise ValueError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    dtype_name = _dtype_name(dtype)
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": {**_layer_fields(cfg, dtype_name), "num_aux_hidden_states": cfg.num_aux},
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": input_ids,
        **dict.fromkeys(NORM_FLAGS, False),
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": dtype_name,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {
                "name_or_path": str(target_path),
                "architectures": list(verifier_architectures or []),
            },
        },
        "draftsmith": _draftsmith_block(cfg, "speculators", input_ids, target_path, extra),
    }


def _state_tensors(model: Eagle3Drafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
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


def _write(out_dir: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for name in (WEIGHTS_NAME, CONFIG_NAME):
        (out_dir / name).chmod(0o644)
    return out_dir


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
    config = export_config(model.cfg, aux_layer_ids, target_path, convention_engine, dtype, extra)
    return _write(Path(out_dir), config, _state_tensors(model, dtype))


def speculators_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Native names -> speculators' (`midlayer.` -> `layers.0.`; the rest are the same)."""
    return {
        ("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v
        for k, v in tensors.items()
    }


def native_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """speculators' names -> native ones; drops what a speculators model keeps of its verifier."""
    skip = ("verifier_lm_head.", "verifier_norm.")
    return {
        ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
        for k, v in tensors.items()
        if not k.startswith(skip)
    }


def trained_ttt_steps(config: dict[str, Any]) -> int | None:
    """The TTT steps the drafter of an export was trained with (None for a foreign export)."""
    settings = ((config.get("draftsmith") or {}).get("training") or {}).get("settings") or {}
    steps = settings.get("ttt_steps")
    return int(steps) if steps is not None else None


def untrained_positions_warning(num_draft_tokens: int, ttt_steps: int | None) -> str | None:
    """Why drafting `num_draft_tokens` per step with a drafter trained for `ttt_steps` wastes positions."""
    if ttt_steps is None or num_draft_tokens <= ttt_steps:
        return None
    return (
        f"num_draft_tokens {num_draft_tokens} exceeds the {ttt_steps} TTT steps the drafter was trained "
        f"with: draft positions {ttt_steps + 1}..{num_draft_tokens} were never trained (raise "
        f"train.ttt_steps or lower evaluate.num_draft_tokens)"
    )


def export_engines(
    drafter_dir: str | Path,
    sglang_dir: str | Path,
    speculators_dir: str | Path,
    target_embedding: torch.Tensor,
    speculative_tokens: int | None = None,
    verifier_architectures: list[str] | None = None,
) -> dict[str, Path]:
    """From the trained vLLM export, write the SGLang and speculators forms (the same tensors, bit for
    bit; only names and config differ), each atomically and each passing its engine's checks.

    The speculators form also carries the target's input embedding [V, Ht] as `embed_tokens.weight`,
    as speculators' own checkpoints do: its loader fills a missing one with zeros, not the verifier's."""
    drafter_dir = Path(drafter_dir)
    problems = check_export(drafter_dir, engine="vllm")
    if problems:
        raise ValueError(f"{drafter_dir} is not a valid vLLM export: " + "; ".join(problems))
    config = json.loads((drafter_dir / CONFIG_NAME).read_text(encoding="utf-8"))
    block = config["draftsmith"] if "drafter_config" in (config.get("draftsmith") or {}) else None
    if block is None:
        raise ValueError(f"{drafter_dir / CONFIG_NAME} has no draftsmith block: not a draftsmith export")
    cfg = DrafterConfig(**block["drafter_config"])
    input_ids = [int(i) for i in block["aux_layer_ids_input"]]
    target = block["target"]
    dtype = _DTYPES[config.get("torch_dtype", "bfloat16")]
    extra = {k: v for k, v in block.items() if k not in _draftsmith_block(cfg, "vllm", [], "", None)}
    tensors = load_file(str(drafter_dir / WEIGHTS_NAME))
    if speculative_tokens is None:
        speculative_tokens = trained_ttt_steps(config) or 3
    if tuple(target_embedding.shape) != (cfg.target_vocab_size, cfg.hidden_size):
        raise ValueError(
            f"the target's embedding has shape {list(target_embedding.shape)}, the drafter needs "
            f"[{cfg.target_vocab_size}, {cfg.hidden_size}]"
        )
    outs = {"sglang": Path(sglang_dir), "speculators": Path(speculators_dir)}
    forms = {
        "sglang": (export_config(cfg, input_ids, target, "sglang", dtype, extra), tensors),
        "speculators": (
            speculators_export_config(
                cfg, input_ids, target, speculative_tokens, verifier_architectures, dtype, extra
            ),
            {**speculators_names(tensors), "embed_tokens.weight": target_embedding.to(dtype).contiguous()},
        ),
    }
    for engine, (engine_config, engine_tensors) in forms.items():
        with atomic_dir(outs[engine]) as tmp:
            _write(tmp, engine_config, engine_tensors)
            problems = check_export(tmp, engine=engine)
            if problems:
                raise RuntimeError(f"the {engine} export failed its own checks: {problems}")
    return outs


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
        return DrafterConfig(**block["drafter_config"])
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
    )


def load_drafter(
    export_dir: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[Eagle3Drafter, dict[str, Any]]:
    """Rebuild the drafter of an export (native or speculators format, draftsmith's or foreign) and load
    its weights strictly -> (model in eval mode, config)."""
    export_dir = Path(export_dir)
    config = json.loads((export_dir / CONFIG_NAME).read_text(encoding="utf-8"))
    on = [k for k in NORM_FLAGS if engine_view(config).get(k)]
    if on:  # a layer variant draftsmith's module does not implement
        raise ValueError(
            f"{export_dir / CONFIG_NAME}: {on} set; draftsmith drafters have every norm flag off"
        )
    cfg = drafter_config_from_export(config)
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


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """name -> (shape, required dtype or None for any float) of every tensor a native export must hold."""
    H, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    m = "midlayer."
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {
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
    }
    if needs_vocab_map(cfg):
        shapes["d2t"] = ((cfg.draft_vocab_size,), torch.int64)
        shapes["t2d"] = ((cfg.target_vocab_size,), torch.bool)
    return shapes


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


def _read_ids(config: dict[str, Any], engine: str) -> tuple[list[str], list[int] | None, list[list[int]]]:
    """(problems, the ids the engine captures from, every id list written) for one engine's reader."""
    problems: list[str] = []
    eagle = config.get("eagle_config")
    nested = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if engine == "speculators":
        if top is None:
            problems.append("eagle_aux_hidden_state_layer_ids is missing (speculators and vLLM read it)")
        return problems, top, [top] if top is not None else []
    if nested is None:
        reader = "SGLang reads only it" if engine == "sglang" else "vLLM sizes fc from it when needed"
        problems.append(f"eagle_config.eagle_aux_hidden_state_layer_ids is missing ({reader})")
    if top is None and engine == "vllm":
        problems.append("eagle_aux_hidden_state_layer_ids is missing (vLLM's target runner reads it)")
    if nested is not None and top is not None and list(nested) != list(top):
        problems.append(f"aux layer ids differ: top-level {top} vs eagle_config {nested}")
    used = nested if engine == "sglang" else (top if top is not None else nested)
    return problems, used, [ids for ids in (top, nested) if ids is not None]


def _check_aux_ids(
    config: dict[str, Any], engine: str, num_aux: int | None, target_num_layers: int | None
) -> list[str]:
    problems, ids, written = _read_ids(config, engine)
    if ids is None:
        return problems
    if not all(isinstance(i, int) and not isinstance(i, bool) for lst in written for i in lst):
        return [*problems, f"aux layer ids {written} are not all integers"]
    if num_aux is not None and len(ids) != num_aux:
        problems.append(f"{len(ids)} aux layer ids {ids} but num_aux_hidden_states = {num_aux}")
    order = aux_order_problem(ids)
    if order:
        problems.append(order)
    expected = ENGINE_CONVENTIONS[engine]
    block = config.get("draftsmith") or {}
    convention = block.get("aux_layer_convention", "input")
    if convention != expected:
        problems.append(
            f"aux layer ids are written in the {convention!r} convention; {engine} reads them as {expected!r} "
            f"(use the {engine} export)"
        )
    if block.get("aux_layer_ids_input") is not None and list(
        convert_layer_ids(ids, expected, "input")
    ) != list(block["aux_layer_ids_input"]):
        problems.append(
            f"{engine} captures the inputs of layers {convert_layer_ids(ids, expected, 'input')}, but the "
            f"drafter was trained on {block['aux_layer_ids_input']}"
        )
    # "input": id k is the input of layer k, 1..L-1; "output": the output of layer k, 0..L-2
    lo, hi = (1, None) if expected == "input" else (0, None)
    if target_num_layers is not None:
        hi = target_num_layers - 1 if expected == "input" else target_num_layers - 2
    named = list(dict.fromkeys(i for lst in written for i in lst))  # any list may be read
    bad = [i for i in named if i < lo or (hi is not None and i > hi)]
    if bad:
        span = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        problems.append(f"aux layer ids {bad} out of range ({expected} convention: {span})")
    return problems


def _check_speculators_fields(config: dict[str, Any]) -> list[str]:
    """What speculators' `Eagle3SpeculatorConfig` and vLLM's speculators reader require."""
    problems = []
    if config.get("speculators_model_type") != "eagle3":
        problems.append(
            f"speculators_model_type is {config.get('speculators_model_type')!r}, expected 'eagle3'"
        )
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return [*problems, "transformer_layer_config is missing or not an object"]
    if layer.get("model_type") != "llama":
        problems.append(
            f"transformer_layer_config.model_type is {layer.get('model_type')!r}, expected 'llama'"
        )
    spec = config.get("speculators_config")
    try:
        tokens = spec["proposal_methods"][0]["speculative_tokens"]
        verifier = spec["verifier"]["name_or_path"]
    except (KeyError, IndexError, TypeError):
        return [
            *problems,
            "speculators_config needs proposal_methods[0].speculative_tokens and verifier.name_or_path "
            "(vLLM refuses the config otherwise)",
        ]
    if not isinstance(tokens, int) or tokens < 1:
        problems.append(f"speculators_config speculative_tokens is {tokens!r}, expected an integer >= 1")
    if not verifier:
        problems.append(
            "speculators_config.verifier.name_or_path is empty: `vllm serve` would not know the target"
        )
    hidden, target_hidden = (
        layer.get("hidden_size"),
        config.get("target_hidden_size") or layer.get("hidden_size"),
    )
    if hidden != target_hidden:
        problems.append(
            f"target_hidden_size {target_hidden} != hidden_size {hidden}: speculators sizes fc from hidden_size"
        )
    return problems


def check_export(
    export_dir: str | Path,
    target_num_layers: int | None = None,
    target_vocab_size: int | None = None,
    engine: str | None = None,
) -> list[str]:
    """Problems that would make `engine` load the drafter wrongly or silently (empty list = OK).

    `engine` None checks the form for the engine the export declares (speculators' format, else the
    convention in its draftsmith block)."""
    export_dir = Path(export_dir)
    cfg_path, weights_path = export_dir / CONFIG_NAME, export_dir / WEIGHTS_NAME
    problems: list[str] = []
    if not cfg_path.is_file():
        return [f"{cfg_path} is missing"]
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        return [f"{cfg_path} is not valid JSON: {e}"]
    engine = engine or engine_of(raw)
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {list(ENGINES)}")
    if not weights_path.is_file():
        problems.append(f"{weights_path} is missing")
    if engine == "speculators":
        if "speculators_model_type" not in raw:
            return [*problems, f"{cfg_path} is not in speculators' format (no speculators_model_type)"]
        problems += _check_speculators_fields(raw)
        try:
            config = engine_view(raw)
        except ValueError as e:
            return [*problems, str(e)]
        if "num_aux_hidden_states" not in (raw.get("transformer_layer_config") or {}):
            config.pop("num_aux_hidden_states", None)  # checked below against the ids: vLLM assumes 3
    else:
        if "speculators_model_type" in raw:
            return [*problems, f"{cfg_path} is in speculators' format; {engine} reads the native form"]
        config = raw
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
    if config.get("tie_word_embeddings", False) is not False and engine == "sglang":
        problems.append("tie_word_embeddings is set: SGLang would use the embedding as lm_head")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_theta", config.get("rope_theta")) is None:
        problems.append("rope_theta is missing (rope_parameters.rope_theta or rope_theta)")
    required = ("hidden_size", "num_attention_heads", "intermediate_size", "rms_norm_eps", "vocab_size")
    engine_keys = ("draft_vocab_size", "target_hidden_size")
    if engine != "speculators":
        engine_keys += ("num_aux_hidden_states",)
    missing = [k for k in (*required, *engine_keys) if k not in config]
    if missing:
        problems.append(f"config fields missing: {missing}")
    if any(k not in config for k in required):
        return problems
    try:
        cfg = drafter_config_from_export(config, engine_fields=True)  # what the engine will build
        block_cfg = drafter_config_from_export(config)  # what draftsmith trained
    except (KeyError, TypeError, ValueError) as e:
        return [*problems, f"cannot build the drafter config: {e!r}"]
    block_dict = block_cfg.to_dict()
    differ = [f"{k}: {v} vs {block_dict[k]}" for k, v in cfg.to_dict().items() if block_dict.get(k, v) != v]
    if differ:
        problems.append(f"engine fields disagree with the draftsmith block (engine vs block): {differ}")
    if target_vocab_size is not None and cfg.target_vocab_size != target_vocab_size:
        problems.append(f"vocab_size {cfg.target_vocab_size} != the target's vocabulary {target_vocab_size}")
    if cfg.draft_vocab_size > cfg.target_vocab_size:
        problems.append(f"draft_vocab_size {cfg.draft_vocab_size} exceeds vocab_size {cfg.target_vocab_size}")
    if engine == "sglang" and cfg.num_aux != SGLANG_NUM_AUX:
        problems.append(f"{cfg.num_aux} aux states: SGLang's fc always fuses {SGLANG_NUM_AUX}")
    num_aux = config.get("num_aux_hidden_states", 3 if engine == "speculators" else None)
    problems += _check_aux_ids(config, engine, num_aux, target_num_layers)

    if not weights_path.is_file():
        return problems
    with safe_open(str(weights_path), framework="pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    prefix_wrong, prefix_right = (
        ("midlayer.", "layers.0.") if engine == "speculators" else ("layers.0.", "midlayer.")
    )
    wrong = sorted(k for k in stored if k.startswith(prefix_wrong))
    if wrong:
        reader = (
            "speculators names the layer layers.0.*"
            if engine == "speculators"
            else (
                "SGLang silently skips names it does not know"
                if engine == "sglang"
                else "draftsmith writes midlayer.*"
            )
        )
        problems.append(f"tensors {wrong[:3]}... use {prefix_wrong}* names; {reader} ({prefix_right}*)")
    tensors = native_names(stored) if engine == "speculators" else stored
    shapes = expected_shapes(cfg)
    for name, (shape, dtype) in shapes.items():
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
    embed = tensors.get("embed_tokens.weight")
    if engine == "speculators" and embed is None:
        problems.append(
            "tensor embed_tokens.weight is missing: speculators' loader would leave it at zeros (it fills "
            "only NaN from the verifier)"
        )
    elif embed is not None and tuple(embed.shape) != (cfg.target_vocab_size, cfg.hidden_size):
        problems.append(
            f"tensor embed_tokens.weight has shape {list(embed.shape)}, expected "
            f"{[cfg.target_vocab_size, cfg.hidden_size]}"
        )
    if not needs_vocab_map(cfg):
        present = [n for n in VOCAB_TENSORS if n in tensors]
        if present:
            problems.append(
                f"tensors {present} present, but draft_vocab_size = vocab_size {cfg.target_vocab_size}: the engine "
                f"allocates no draft-to-target map and fails to load them"
            )
    known = set(shapes) | {"embed_tokens.weight", *VOCAB_TENSORS}
    unexpected = sorted(set(tensors) - known)
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if (
        needs_vocab_map(cfg)
        and d2t is not None
        and t2d is not None
        and d2t.dim() == 1
        and t2d.dim() == 1
        and d2t.numel() == cfg.draft_vocab_size
        and not d2t.is_floating_point()
    ):
        problems += _check_vocab_map(d2t, t2d)
    return problems
