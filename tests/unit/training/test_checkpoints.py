"""checkpoints.py: what the resume key covers and which checkpoint a run resumes (on fabricated folders;
the training round trips are in test_train.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from draftsmith.core.training.checkpoints import (
    COMPLETE_MARKER,
    KEY_FILE,
    find_resume,
    key_digest,
    list_checkpoints,
    resume_key,
    run_dir,
    shard_digest,
    start_run,
)


class _Cfg:
    def __init__(self, **d):
        self.d = d

    def to_dict(self) -> dict:
        return dict(self.d)


def _key(sha: str = "aa", lr: float = 1e-3, max_steps: int | None = None, **shard) -> dict:
    manifest = {
        "shards": [
            {"path": "hidden/shard-0.safetensors", "sha256": sha, "num_samples": 4, "num_tokens": 99, **shard}
        ],
        "aux_layer_ids": [1, 2, 3],
        "target": "resources/t",
    }
    vocab = {"d2t": torch.arange(8)}
    return resume_key(_Cfg(lr=lr, max_steps=max_steps, threads=1), manifest, vocab, _Cfg(hidden=64))


def test_key_covers_content_and_settings_not_operational_knobs() -> None:
    base = _key()
    assert key_digest(_key(sha="bb")) != key_digest(base)  # same names and counts, other content
    assert key_digest(_key(lr=2e-3)) != key_digest(base)
    assert key_digest(_key(max_steps=5)) == key_digest(base)  # stops early: same trajectory
    assert key_digest(_key(path="elsewhere/shard-0.safetensors")) == key_digest(base)  # moved data
    # a content-only digest wins over the file digest when the manifest lists one
    assert shard_digest({"sha256": "file", "content_sha256": "content"}) == "content"
    assert key_digest(_key(sha="x", content_sha256="c")) == key_digest(_key(sha="y", content_sha256="c"))
    with pytest.raises(ValueError, match="shard-9"):
        shard_digest({"path": "shard-9"})


def _fake_checkpoint(folder: Path, step: int, complete: bool = True) -> Path:
    p = folder / f"step-{step}"
    p.mkdir(parents=True)
    if complete:
        (p / COMPLETE_MARKER).write_text("ok")
    return p


def test_find_resume_decisions(tmp_path: Path, caplog) -> None:
    root, key = tmp_path / "ckpt", _key()
    assert find_resume(root, key, stop_at=10) == (None, [])  # nothing yet

    mine = run_dir(root, key)
    _fake_checkpoint(mine, 4)
    _fake_checkpoint(mine, 6, complete=False)  # killed mid-write: ignored
    other_key = _key(sha="bb")
    other = start_run(root, other_key, [])
    _fake_checkpoint(other, 8)
    legacy = _fake_checkpoint(root, 2)

    with caplog.at_level(logging.WARNING, logger="draftsmith.core.training.checkpoints"):
        latest, remove = find_resume(root, key, stop_at=10)
    assert latest == mine / "step-4" and set(remove) == {other, legacy}
    assert any("data.shards" in r.getMessage() for r in caplog.records)

    # the newest checkpoint is where the run stops: it had finished, train afresh
    latest, remove = find_resume(root, key, stop_at=4)
    assert latest is None and mine in remove
    # --fresh: everything goes
    latest, remove = find_resume(root, key, stop_at=10, fresh=True)
    assert latest is None and set(remove) == {mine, other, legacy}

    folder = start_run(root, key, remove)
    assert folder == mine and list_checkpoints(mine) == [] and not other.exists() and not legacy.exists()
    assert json.loads((mine / KEY_FILE).read_text()) == key
