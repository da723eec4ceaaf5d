"""data_config.json: the contract between extraction and training, written last and atomically.

It records what the hidden states are (aux layer ids and their convention, final state after the final
norm, dtype, storage), where they came from (target, chat-template fingerprint) and, per shard, sample
and token counts, byte size, sha256 and teacher agreement. No manifest, no data: train reads only
what it lists, after checking it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

from draftsmith import __version__
from draftsmith.atomic import write_json
from draftsmith.shards import read_shard_meta
from draftsmith.target import file_sha256

MANIFEST_VERSION = 1


class DataError(RuntimeError):
    pass


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
    with open(Path(target) / "config.json", encoding="utf-8") as fh:
        target_config = json.load(fh)
    shards, metas = [], []
    for path in shard_paths:
        meta = read_shard_meta(path)
        metas.append(meta)
        stats = meta["stats"]
        shards.append(
            {
                "path": os.path.relpath(path, out_dir),
                "num_samples": stats["num_samples"],
                "num_tokens": stats["num_tokens"],
                "num_masked_tokens": stats["num_masked_tokens"],
                "bytes": Path(path).stat().st_size,
                "sha256": file_sha256(path),
                "teacher_agreement": stats["teacher_agreement"],  # regenerated samples only (gated)
                "teacher_agreement_by_source": _by_source([stats]),
            }
        )
    for key in ("aux_layer_ids", "layer_convention", "template", "dtype", "codec"):
        values = {json.dumps(m[key]) for m in metas}
        if len(values) > 1:
            raise DataError(f"shards disagree on {key}: {sorted(values)}; re-extract them together")
    agree = sum(m["stats"]["teacher_agree"] for m in metas)
    checked = sum(m["stats"]["teacher_checked"] for m in metas)
    manifest = {
        "version": MANIFEST_VERSION,
        "draftsmith_version": __version__,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
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
        "dtype": metas[0]["dtype"],
        "codec": metas[0]["codec"],
        "format": "safetensors shards; layout and codecs documented in draftsmith/shards.py",
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
    print(
        f"manifest: {manifest['num_samples']} samples, {manifest['num_tokens']} tokens, "
        f"{manifest['bytes'] / 1e6:.1f} MB in {len(shards)} shards, teacher agreement by source "
        + ", ".join(f"{k} {'n/a' if v is None else f'{v:.4f}'}" for k, v in by_source.items()),
        flush=True,
    )
    return manifest


def load_manifest(path: str | Path) -> dict[str, Any]:
    """Read data_config.json; shard paths become absolute Paths under key "path"."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path} is missing: no manifest means no data (extraction did not finish)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err}); re-run the manifest rule") from err
    for shard in manifest["shards"]:
        shard["path"] = (path.parent / shard["path"]).resolve()
    return manifest


def verify_manifest(path: str | Path, check_hashes: bool = True) -> list[str]:
    """Problems found (empty = all shards present, of the recorded size and checksum, agreement OK)."""
    manifest = load_manifest(path)
    problems = []
    for shard in manifest["shards"]:
        p = shard["path"]
        if not p.is_file():
            problems.append(f"{p}: missing")
            continue
        if p.stat().st_size != shard["bytes"]:
            problems.append(f"{p}: {p.stat().st_size} bytes, manifest says {shard['bytes']}")
        elif check_hashes and file_sha256(p) != shard["sha256"]:
            problems.append(f"{p}: sha256 differs from the manifest (corrupted or rewritten)")
        agreement = shard.get("teacher_agreement")
        if agreement is not None and agreement < manifest["min_teacher_agreement"]:
            problems.append(f"{p}: teacher agreement {agreement:.3f} < {manifest['min_teacher_agreement']}")
    return problems
