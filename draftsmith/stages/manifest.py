"""Manifest stage: data_config.json from the extracted shards, each verified first, written last and
atomically (what it records and how it is read and checked: draftsmith/core/data/manifest.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from draftsmith import __version__
from draftsmith.core.config.config import STREAM_MODES
from draftsmith.core.config.settings import compile_mode_of
from draftsmith.core.config.stage_args import BAD_INPUT, FAILED, arg
from draftsmith.core.config.stage_settings import ManifestSettings
from draftsmith.core.data.manifest import MANIFEST_VERSION, DataError, allowed_shard_dirs, shard_location
from draftsmith.core.data.shards import ShardError, read_shard_meta, verify_shard
from draftsmith.core.data.tokens import load_tokens
from draftsmith.core.io.atomic import write_json
from draftsmith.core.io.digests import file_sha256
from draftsmith.core.model.layers import resolve_aux_layers
from draftsmith.core.model.target import text_config_dict

log = logging.getLogger(__name__)


DTYPE_NOTES = {
    "bfloat16": "bf16 as the target computed it",
    "float8_e4m3fn": "float8_e4m3fn codes, one float32 power-of-two scale per token and layer; reads return "
    "code * scale in bf16 (exact), within 2^-4 of each value as computed",
}


def _by_source(stats: list[dict[str, Any]]) -> dict[str, float | None]:
    """Teacher agreement per sample source over shards' stats. Only "regenerated" is gated: on a
    dataset's original answers the target's argmax need not match the text (the teacher is still right)."""
    sums: dict[str, list[int]] = {}
    for st in stats:
        for source, c in (st.get("teacher_by_source") or {}).items():
            acc = sums.setdefault(source, [0, 0])
            acc[0], acc[1] = acc[0] + c["agree"], acc[1] + c["checked"]
    return {k: (a / n if n else None) for k, (a, n) in sorted(sums.items())}


# the extract settings a stream manifest records: what decides the states a stream captures
STREAM_KEYS = ("aux_layers", "batch_tokens", "storage_dtype", "backend", "compile", "vllm_eager", "dtype")


def build_stream_manifest(
    tokens_path: str, out_path: str, target: str, settings: ManifestSettings, mode: str = "stream"
) -> dict[str, Any]:
    """The manifest for train.hidden_states stream or hybrid (`mode`): no shards; the tokens file (its
    digest) and the extract settings the train job captures the states with (core/data/stream.py), for hybrid
    also its cache shards' codec. The teacher agreement is measured by the train job as it captures."""
    if mode not in STREAM_MODES:
        raise ValueError(f"manifest --cache: hidden_states mode {mode!r} is not stream or hybrid")
    out_dir = Path(out_path).parent
    tensors, meta = load_tokens(tokens_path)
    config = text_config_dict(target)
    layer_ids = resolve_aux_layers(settings.aux_layers, config["num_hidden_layers"])
    recorded = os.path.relpath(tokens_path, out_dir)
    if recorded.startswith(os.pardir):
        recorded = os.path.abspath(tokens_path)
    shard_location(out_dir, recorded, allowed_shard_dirs())
    compile_mode = compile_mode_of(settings.compile)
    stream = {key: getattr(settings, key) for key in STREAM_KEYS} | {"compile": compile_mode}
    if mode == "hybrid":  # the cache shards' bytes (not their tensors)
        stream |= {"codec": settings.codec, "zstd_level": settings.zstd_level}
    manifest = {
        "version": MANIFEST_VERSION,
        "draftsmith_version": __version__,
        "hidden_states": mode,
        "target": str(target),
        "target_architecture": (config.get("architectures") or [None])[0],
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "vocab_size": config["vocab_size"],
        "aux_layer_ids": layer_ids,
        "layer_convention": "input",
        "num_aux": len(layer_ids),
        "final_hidden_state": "after the final norm: teacher logits = lm_head(final)",
        "dtype": settings.storage_dtype,
        "dtype_note": DTYPE_NOTES[settings.storage_dtype],
        "codec": None,
        "format": "no shards: the train job captures the states (draftsmith/core/data/stream.py)",
        "chat_template_fingerprint": meta["template"],
        "num_samples": len(meta["sample_ids"]),
        "num_tokens": int(tensors["input_ids"].numel()),
        "num_masked_tokens": int(tensors["loss_mask"].sum()),
        "bytes": 0,
        "teacher_agreement": None,  # measured by the train job (train_summary.json)
        "teacher_agreement_by_source": {},
        "min_teacher_agreement": settings.min_teacher_agreement,
        "tokens": {"path": recorded, "sha256": file_sha256(tokens_path)},
        "stream": stream,
        "shards": [],
    }
    write_json(out_path, manifest)
    log.info(
        "manifest: %s of %d samples, %d tokens from %s (aux layers %s, %s storage): no shards",
        mode, manifest["num_samples"], manifest["num_tokens"], tokens_path, layer_ids, settings.storage_dtype,
    )  # fmt: skip
    return manifest


def build_manifest(
    shard_paths: list[str], out_path: str, target: str, settings: ManifestSettings
) -> dict[str, Any]:
    min_teacher_agreement = settings.min_teacher_agreement
    out_dir = Path(out_path).parent
    target_config = text_config_dict(target)  # a wrapper's (Kimi-K2.5) language-model settings
    shards, metas, damaged = [], [], []
    for path in shard_paths:
        # written relative to the manifest; one outside its folder only where the reader will follow it
        recorded = os.path.relpath(path, out_dir)
        if recorded.startswith(os.pardir):
            recorded = os.path.abspath(path)
        shard_location(out_dir, recorded, allowed_shard_dirs())
        try:
            content = verify_shard(path)  # decodes every sample: a damaged shard never gets a manifest
            meta = read_shard_meta(path)
        except ShardError as err:
            damaged.append(str(err))
            continue
        metas.append(meta)
        stats = meta["stats"]
        shards.append(
            {
                "path": recorded,
                "num_samples": stats["num_samples"],
                "num_tokens": stats["num_tokens"],
                "num_masked_tokens": stats["num_masked_tokens"],
                "bytes": Path(path).stat().st_size,
                "content_sha256": content,
                "teacher_agreement": stats["teacher_agreement"],  # regenerated samples only (gated)
                "teacher_agreement_by_source": _by_source([stats]),
            }
        )
    if damaged:
        raise DataError("\n".join(damaged))
    for key in ("aux_layer_ids", "layer_convention", "template", "dtype", "codec"):
        values = {json.dumps(m[key]) for m in metas}
        if len(values) > 1:
            raise DataError(f"shards disagree on {key}: {sorted(values)}; re-extract them together")
    agree = sum(m["stats"]["teacher_agree"] for m in metas)
    checked = sum(m["stats"]["teacher_checked"] for m in metas)
    manifest = {
        "version": MANIFEST_VERSION,
        "draftsmith_version": __version__,
        "target": str(target),
        "target_architecture": (target_config.get("architectures") or [None])[0],
        "num_layers": target_config["num_hidden_layers"],
        "hidden_size": target_config["hidden_size"],
        "vocab_size": target_config["vocab_size"],
        "aux_layer_ids": metas[0]["aux_layer_ids"],
        "layer_convention": metas[0]["layer_convention"],
        "layer_convention_note": "input: id k is the input to decoder layer k (HF hidden_states[k]); "
        "SGLang/SpecForge 'output' ids are one lower",
        "num_aux": len(metas[0]["aux_layer_ids"]),
        "final_hidden_state": "after the final norm: teacher logits = lm_head(final)",
        "dtype": metas[0]["dtype"],  # the storage dtype; reads return bf16 either way
        "dtype_note": DTYPE_NOTES[metas[0]["dtype"]],
        "codec": metas[0]["codec"],
        "format": "safetensors shards; layout and codecs documented in draftsmith/core/data/shards.py",
        "chat_template_fingerprint": metas[0]["template"],
        "num_samples": sum(s["num_samples"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "num_masked_tokens": sum(s["num_masked_tokens"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards),
        "teacher_agreement": agree / checked if checked else None,
        "teacher_agreement_by_source": _by_source([m["stats"] for m in metas]),
        "min_teacher_agreement": min_teacher_agreement,
        "shards": shards,
    }
    low = [
        s
        for s in shards
        if s["teacher_agreement"] is not None and s["teacher_agreement"] < min_teacher_agreement
    ]
    if low:
        names = ", ".join(f"{s['path']} ({s['teacher_agreement']:.3f})" for s in low)
        raise DataError(
            f"teacher agreement below {min_teacher_agreement} in {names}: argmax(lm_head(final)) does not "
            "reproduce the traces' next tokens. Check the aux/final layers and final norm, the chat template "
            "of traces vs target, and whether traces were sampled (then lower extract.min_teacher_agreement)."
        )
    write_json(out_path, manifest)
    by_source = manifest["teacher_agreement_by_source"] or {"regenerated": manifest["teacher_agreement"]}
    log.info(
        f"manifest: {manifest['num_samples']} samples, {manifest['num_tokens']} tokens, "
        f"{manifest['bytes'] / 1e6:.1f} MB in {len(shards)} shards, teacher agreement by source "
        + ", ".join(f"{k} {'n/a' if v is None else f'{v:.4f}'}" for k, v in by_source.items())
    )
    return manifest


@dataclasses.dataclass
class ManifestPaths:
    target: str = arg("--target", "Target model folder.", kind="dir", required=True, exists=True)
    out: str = arg("--out", "data_config.json to write.", required=True, sealed=True)
    shards: tuple[str, ...] = arg("[SHARD]...", "", exists=True, multiple=True)
    tokens: str | None = arg(
        "--tokens",
        "Instead of SHARDs: a stream manifest of this tokens file (train.hidden_states stream: the train "
        "job captures the states).",
        exists=True,
    )
    cache: bool = arg(
        "--cache",
        "With --tokens: hybrid (train.hidden_states hybrid): the train job caches epoch 0's states in "
        "shards that later epochs read.",
        kind="flag",
    )


Settings, Paths = ManifestSettings, ManifestPaths
EXITS = {DataError: FAILED, ValueError: BAD_INPUT}


def run(paths: ManifestPaths, settings: ManifestSettings) -> list[str]:
    """Check the shards and write data_config.json (last, atomically); with --tokens, a stream manifest
    (no shards: the train job captures the states)."""
    if bool(paths.shards) == bool(paths.tokens) or (paths.cache and not paths.tokens):
        raise ValueError(
            "manifest: give SHARD... (extracted shards), or --tokens FILE [--cache] (a stream or hybrid manifest)"
        )
    if paths.tokens:
        build_stream_manifest(
            paths.tokens, paths.out, paths.target, settings, "hybrid" if paths.cache else "stream"
        )
    else:
        build_manifest(list(paths.shards), paths.out, paths.target, settings)
    return []
