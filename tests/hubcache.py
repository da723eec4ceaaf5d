"""A Hugging Face Hub cache prepared on disk, as huggingface_hub lays one out after a download
(`<repo_type>s--<owner>--<name>/blobs/<sha256>`, `snapshots/<commit>/<file>` linking to its blob,
`refs/<branch>` holding the commit): what a machine that downloaded a model earlier, or a cache copied
onto an offline cluster, holds. Tests read it with HF_HUB_OFFLINE=1; the Hub itself is never reached.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_repo(
    cache: Path,
    repo_id: str,
    files: dict[str, bytes | Path],
    repo_type: str = "model",
    commit: str = COMMIT,
    ref: str = "main",
) -> Path:
    """Put `files` (name in the repository -> bytes, or a file to take them from) into the Hub cache
    `cache` as repository `repo_id` at `commit`, with `ref` pointing at it; returns the snapshot folder."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def add_model_folder(cache: Path, repo_id: str, folder: Path, **kw) -> Path:
    """Every file of a local model folder as Hub repository `repo_id` in the cache."""
    files = {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*")) if p.is_file()}
    return add_repo(cache, repo_id, files, **kw)
