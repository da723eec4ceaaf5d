"""The checks that catch a broken export before it is served: every field and tensor the engine reads,
the aux ids in its convention, the vocabulary map. A missing d2t or fc.weight otherwise loads silently."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from draftsmith.core.evaluation.engines import ENGINE_CONVENTIONS, ENGINES
from draftsmith.core.export.formats.common import (
    ACCEPTED_ARCHITECTURES,
    CONFIG_NAME,
    NORM_FLAGS,
    SGLANG_NUM_AUX,
    VOCAB_TENSORS,
    WEIGHTS_NAME,
    needs_vocab_map,
    norm_flags,
)
from draftsmith.core.export.formats.load import drafter_config_from_export, engine_of, engine_view
from draftsmith.core.export.formats.speculators import native_names
from draftsmith.core.export.formats.vllm_dflash import load_dflash
from draftsmith.core.model.drafter import DrafterConfig
from draftsmith.core.model.kinds import kind, kind_of_export, resolve
from draftsmith.core.model.layers import aux_order_problem, convert_layer_ids


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
    if cfg.fc_norm:  # EAGLE 3.1: one norm per aux state
        shapes.update({f"fc_norm.{i}.weight": ((cfg.target_hidden_size,), None) for i in range(cfg.num_aux)})
    if cfg.parallel:  # P-EAGLE; vLLM refuses parallel drafting without it
        shapes["mask_hidden"] = ((1, cfg.num_aux * cfg.target_hidden_size), None)
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
    spec: Any = config.get("speculators_config")  # anything: a wrong shape is caught below
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


# Config fields an engine sizes the drafter by: a string or float there ("48") would be compared, and
# printed, as if it were the number.
INTEGER_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "num_aux_hidden_states",
    "num_hidden_layers",
    "max_position_embeddings",
)


def _wrong_types(fields: Any, where: str) -> list[str]:
    if not isinstance(fields, dict):
        return []
    return [
        f"{where}{key} is {fields[key]!r} ({type(fields[key]).__name__}), expected an integer"
        for key in INTEGER_FIELDS
        if fields.get(key) is not None and (not isinstance(fields[key], int) or isinstance(fields[key], bool))
    ]


def unreadable(export_dir: str | Path) -> list[str]:
    """Why an export's files cannot be read as an export at all, one line each naming the file:
    config.json not a JSON object or a sizing field not an integer, model.safetensors not a safetensors
    file (truncated, say). Empty when they can be read (a missing file is check_export's finding): then
    check_export judges what they hold. `draftsmith check-export` exits 2 on these."""
    export_dir = Path(export_dir)
    cfg_path, weights_path = export_dir / CONFIG_NAME, export_dir / WEIGHTS_NAME
    problems = []
    if cfg_path.is_file():
        try:
            raw = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raw = None
            problems.append(f"{cfg_path} is not valid JSON: {e}")
        except RecursionError:
            raw = None
            problems.append(f"{cfg_path} is not readable JSON: nested too deeply")
        else:
            if not isinstance(raw, dict):
                problems.append(f"{cfg_path} is not a JSON object of settings (a {type(raw).__name__})")
            else:
                problems += _wrong_types(raw, f"{cfg_path}: ")
                problems += _wrong_types(
                    raw.get("transformer_layer_config"), f"{cfg_path}: transformer_layer_config."
                )
                block = raw.get("draftsmith")
                drafter = block.get("drafter_config") if isinstance(block, dict) else None
                problems += _wrong_types(drafter, f"{cfg_path}: draftsmith.drafter_config.")
    if weights_path.is_file():
        try:
            with safe_open(str(weights_path), framework="pt") as f:
                list(f.keys())  # noqa: SIM118 (opening checks the header against the file's length)
        except (SafetensorError, OSError) as e:
            problems.append(f"{weights_path} is not a readable safetensors file ({str(e).splitlines()[0]})")
    return problems


def _trained_norm_flags(raw: dict[str, Any]) -> dict[str, bool]:
    """The norm flags the drafter was trained with: its kind's (draftsmith block), else for a foreign
    export EAGLE 3.1's pair when both are set (the layer draftsmith implements), else all off."""
    block = raw.get("draftsmith") or {}
    if isinstance(block.get("drafter_config"), dict):
        return norm_flags(DrafterConfig.from_dict(block["drafter_config"]))
    try:
        view = engine_view(raw)
    except ValueError:
        view = raw
    eagle31 = view.get("fc_norm") is True and view.get("norm_output") is True
    return {flag: eagle31 and flag in ("fc_norm", "norm_output") for flag in NORM_FLAGS}


def check_dflash_export(
    export_dir: Path,
    raw: dict[str, Any],
    target_num_layers: int | None,
    target_vocab_size: int | None,
    engine: str,
) -> list[str]:
    """A DFlash export's problems: it is for vLLM; its weights load strictly into the drafter its block
    describes; `dflash_config.target_layer_ids` are the aux ids one lower (vLLM's output convention) and
    no `eagle_aux_hidden_state_layer_ids` disagrees (vLLM prefers that key); its mask token is the
    trained one; its blocks are causal, as trained."""
    if engine != "vllm":
        return [f"{export_dir}: a DFlash export is served by vLLM only, not {engine}"]
    try:
        model, _ = load_dflash(export_dir)
    except (ValueError, RuntimeError, KeyError, TypeError, OSError) as err:
        return [f"{export_dir}: the DFlash weights do not load into its drafter ({str(err).splitlines()[0]})"]
    cfg, problems = model.cfg, []
    dflash = raw.get("dflash_config") or {}
    ids = [int(i) for i in (raw.get("draftsmith") or {}).get("aux_layer_ids_input") or []]
    if dflash.get("target_layer_ids") != convert_layer_ids(ids, "input", "output"):
        problems.append(
            f"dflash_config.target_layer_ids {dflash.get('target_layer_ids')} are not the aux ids {ids} one lower"
        )
    eagle_ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if eagle_ids is not None and list(eagle_ids) != ids:
        problems.append(f"eagle_aux_hidden_state_layer_ids {eagle_ids} (which vLLM prefers) are not {ids}")
    if dflash.get("mask_token_id") != cfg.mask_token_id:
        problems.append(
            f"dflash_config.mask_token_id {dflash.get('mask_token_id')} is not the trained {cfg.mask_token_id}"
        )
    if dflash.get("causal") is not True:
        problems.append("dflash_config.causal is not true: the drafter was trained with causal blocks")
    if target_num_layers is not None and any(not 1 <= i <= target_num_layers - 1 for i in ids):
        problems.append(f"aux layer ids {ids} out of range for a target of {target_num_layers} layers")
    if target_vocab_size is not None and cfg.target_vocab_size != target_vocab_size:
        problems.append(f"drafter vocabulary {cfg.target_vocab_size} is not the target's {target_vocab_size}")
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
    damaged = unreadable(export_dir)
    if damaged:
        return damaged
    raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    own = kind(kind_of_export(raw)).checker  # a kind with its own form checks it itself (DFlash)
    if own:
        return resolve(own)(export_dir, raw, target_num_layers, target_vocab_size, engine or "vllm")
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
    trained = _trained_norm_flags(raw)
    for flag in NORM_FLAGS:
        if flag not in config:
            problems.append(f"norm flag {flag!r} is missing (engines default it differently)")
        elif config[flag] is not trained[flag]:
            problems.append(
                f"norm flag {flag!r} is {config[flag]!r}; the drafter was trained with {trained[flag]}"
            )
    if config.get("tie_word_embeddings", False) is not False and engine == "sglang":
        problems.append("tie_word_embeddings is set: SGLang would use the embedding as lm_head")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_theta", config.get("rope_theta")) is None:
        problems.append("rope_theta is missing (rope_parameters.rope_theta or rope_theta)")
    required = ("hidden_size", "num_attention_heads", "intermediate_size", "rms_norm_eps", "vocab_size")
    engine_keys: tuple[str, ...] = ("draft_vocab_size", "target_hidden_size")
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
    differ = [
        f"{k}: {v!r} vs {block_dict[k]!r}" for k, v in cfg.to_dict().items() if block_dict.get(k, v) != v
    ]
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


def check_against_target(
    export_dir: str | Path, target_path: str | Path | None = None, engine: str | None = None
) -> list[str]:
    """`check_export` with the layer count and vocabulary of the target (its text config: wrappers keep
    them under `text_config`), when a target is given. A target without them is a ValueError naming its
    config.json: nothing could be checked against it."""
    layers = vocab_size = None
    if target_path is not None:
        from draftsmith.core.config.config import read_target_config

        if not (Path(target_path) / CONFIG_NAME).is_file():
            raise ValueError(f"{Path(target_path) / CONFIG_NAME} is missing: not a Hugging Face model folder")
        target = read_target_config(target_path)  # ValueError naming the file and the missing count
        layers, vocab_size = target["num_hidden_layers"], target["vocab_size"]
    return check_export(export_dir, target_num_layers=layers, target_vocab_size=vocab_size, engine=engine)
