"""data_config.json: the contract between extraction and training, written last and atomically.

It records what the hidden states are (aux layer ids and their convention, final state after the final
norm, dtype, storage), where they came from (target, chat-template fingerprint) and, per shard, sample
and token counts, byte size, sha256 and teacher agreement. No manifest, no data: train reads only
what it lists, after checking it. Here: reading and verifying it (the loader, train, summaries); the
manifest stage (stages/manifest.py) writes it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from draftsmith.core.config.config import STREAM_MODES
from draftsmith.core.data.shards import ShardError, read_header, verify_shard
from draftsmith.core.io.digests import file_sha256

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


def is_stream(manifest: Mapping[str, Any]) -> bool:
    """A stream manifest (train.hidden_states stream or hybrid): no shards, the tokens file the train job captures
    states from, and what it captures (`stream`: the extract settings that decide the states)."""
    return manifest.get("hidden_states") in STREAM_MODES


def _manifest_shape_problem(manifest: Any) -> str | None:
    """What makes a parsed data_config.json unusable before any shard is looked at, or None."""
    if not isinstance(manifest, dict):
        return f"not a JSON object (a {type(manifest).__name__})"
    shards = manifest.get("shards")
    if is_stream(manifest):
        tokens = manifest.get("tokens")
        if (
            not isinstance(tokens, dict)
            or not isinstance(tokens.get("path"), str)
            or not tokens.get("sha256")
        ):
            return "a stream manifest without 'tokens' (path and sha256)"
        if not isinstance(manifest.get("stream"), dict):
            return "a stream manifest without its 'stream' settings"
        shards = shards or [{"path": "", "bytes": 0}]  # none to check
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
    if is_stream(manifest):  # the tokens file, confined as shards are
        try:
            manifest["tokens"]["path"] = shard_location(
                path.parent, manifest["tokens"]["path"], allowed
            ).resolve()
        except DataError as err:
            raise DataError(f"{path}: {err}") from None
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
    if is_stream(manifest):  # the states are captured as training reads them: the tokens must be these
        tokens = manifest["tokens"]["path"]
        if not tokens.is_file():
            problems.append(f"{tokens}: missing (the stream manifest's tokens file)")
        elif file_sha256(tokens) != manifest["tokens"]["sha256"]:
            problems.append(f"{tokens}: sha256 differs from the stream manifest's; re-run the manifest rule")
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
