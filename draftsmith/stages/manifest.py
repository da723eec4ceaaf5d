"""data_config.json: the contract between extraction and training, written last and atomically.

It records what the hidden states are (aux layer ids and their convention, final state after the final
norm, dtype, storage), where they came from (target, chat-template fingerprint) and, per shard, sample
and token counts, byte size, sha256 and teacher agreement. No manifest, no data: train reads only
what it lists, after checking it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from draftsmith import __version__
from draftsmith.core.atomic import write_json
from draftsmith.core.shards import ShardError, read_header, read_shard_meta, verify_shard
from draftsmith.core.target import text_config_dict

log = logging.getLogger(__name__)

MANIFEST_VERSION = 2  # 2: content_sha256 per shard
# A manifest is data: the shard paths it lists are followed only inside its own folder and the folders
# named here (absolute paths separated by os.pathsep), e.g. a scratch disk the shards were written to.
SHARD_DIRS_ENV = "DRAFTSMITH_SHARD_DIRS"


class DataError(RuntimeError):
    pass


def allowed_shard_dirs(env: Mapping[str, str] = os.environ) -> list[Path]:
    """The folders besides a manifest's own where its shards may live (DRAFTSMITH_SHARD_DIRS)."""
    return [Path(os.path.abspath(p)) for p in env.get(SHARD_DIRS_ENV, "").split(os.pathsep) if p]


def shard_location(manifest_dir: str | Path, recorded: str, allowed: Sequence[Path] = ()) -> Path:
    """The file a shard path recorded in a manifest names, if it lies inside the manifest's folder or an
    allowed one; DataError otherwise. Judged on the written path ('..' resolved as text): links the user
    made inside the folder (results/hidden -> a big disk) are followed, a path climbing out is not."""
    base = Path(os.path.abspath(manifest_dir))
    path = Path(os.path.normpath(base / recorded))
    if any(path.is_relative_to(root) for root in (base, *allowed)):
        return path
    raise DataError(
        f"shard path {recorded!r} leads outside {base}; a manifest's shards must lie in its folder, or in a "
        f"folder named in {SHARD_DIRS_ENV} (absolute paths separated by {os.pathsep!r})"
    )


def _manifest_shape_problem(manifest: Any) -> str | None:
    """What makes a parsed data_config.json unusable before any shard is looked at, or None."""
    if not isinstance(manifest, dict):
        return f"not a JSON object (a {type(manifest).__name__})"
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not shards:
        return "no 'shards' list"
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict) or not isinstance(shard.get("path"), str):
            return f"shards[{i}] has no 'path'"
        if not isinstance(shard.get("bytes"), int) or isinstance(shard.get("bytes"), bool):
            return f"shards[{i}] ({shard['path']}) has no integer 'bytes'"
    agreement = manifest.get("min_teacher_agreement")
    if not isinstance(agreement, int | float) or isinstance(agreement, bool):
        return "no numeric 'min_teacher_agreement'"
    return None


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


def build_manifest(
    shard_paths: list[str], out_path: str, target: str, min_teacher_agreement: float
) -> dict[str, Any]:
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
        "format": "safetensors shards; layout and codecs documented in draftsmith/core/shards.py",
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


def load_manifest(path: str | Path) -> dict[str, Any]:
    """Read data_config.json; shard paths become absolute Paths under key "path", each confined to the
    manifest's folder or DRAFTSMITH_SHARD_DIRS (shard_location). A damaged manifest is a DataError
    naming the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path} is missing: no manifest means no data (extraction did not finish)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not valid JSON ({err}); re-run the manifest rule") from None
    if problem := _manifest_shape_problem(manifest):
        raise DataError(f"{path}: {problem}: not a data_config.json that `draftsmith manifest` wrote")
    allowed = allowed_shard_dirs()
    for shard in manifest["shards"]:
        try:
            shard["path"] = shard_location(path.parent, shard["path"], allowed).resolve()
        except DataError as err:
            raise DataError(f"{path}: {err}") from None
    return manifest


def verify_manifest(path: str | Path, decode: bool = True) -> list[str]:
    """Problems found (empty = every shard present, of the recorded size, every sample decoding to its
    recorded digest, the shard's content digest the manifest's, teacher agreement OK). decode=False
    reads headers only: presence, sizes and the content digest each shard's writer recorded (training then
    checks every sample's digest as it reads it)."""
    manifest = load_manifest(path)
    problems = []
    for shard in manifest["shards"]:
        p = shard["path"]
        if not p.is_file():
            problems.append(f"{p}: missing")
            continue
        if p.stat().st_size != shard["bytes"]:
            problems.append(f"{p}: {p.stat().st_size} bytes, manifest says {shard['bytes']}")
        elif decode:
            problems += _content_problems(p, shard.get("content_sha256"))
        else:
            problems += _header_problems(p, shard.get("content_sha256"))
        agreement = shard.get("teacher_agreement")
        if agreement is not None and agreement < manifest["min_teacher_agreement"]:
            problems.append(f"{p}: teacher agreement {agreement:.3f} < {manifest['min_teacher_agreement']}")
    return problems


def _header_problems(path: Path, recorded: str | None) -> list[str]:
    try:
        _, _, meta = read_header(path)
    except ShardError as err:
        return [str(err)]
    if meta.get("content_sha256") != recorded:
        return [f"{path}: content_sha256 in its header is not the manifest's; re-run the manifest rule"]
    return []


def _content_problems(path: Path, recorded: str | None) -> list[str]:
    try:
        content = verify_shard(path)
    except ShardError as err:
        return [str(err)]
    if recorded is None:
        return [
            f"{path}: the manifest records no content_sha256 (written by an older draftsmith); re-run "
            "the manifest rule"
        ]
    if content != recorded:
        return [
            f"{path}: content_sha256 {content[:12]}... differs from the manifest's {recorded[:12]}... "
            "(the shard was re-extracted with other data after the manifest was written)"
        ]
    return []
