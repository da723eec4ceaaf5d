"""Engine runs kept by what they measured (draftsmith.core.evaluation.run_cache): content decides, never a path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from draftsmith.core.evaluation.run_cache import RunCache, export_identity, run_key, target_identity


def _folder(path: Path, weights: bytes = b"w" * 10) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_a_copied_target_is_the_same_target_and_another_weight_size_is_not(tmp_path):
    a = _folder(tmp_path / "a")
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    assert target_identity(a) == target_identity(b)
    c = _folder(tmp_path / "c", b"w" * 11)
    assert target_identity(a) != target_identity(c)


def test_an_export_is_its_bytes_and_its_model_card_does_not_count(tmp_path):
    a = _folder(tmp_path / "a")
    before = export_identity(a)
    (a / "README.md").write_text("card")
    assert export_identity(a) == before
    (a / "model.safetensors").write_bytes(b"x" * 10)  # same size, other bytes
    assert export_identity(a) != before


def test_the_key_is_stable_and_order_free():
    assert run_key({"a": 1, "b": [1, 2]}) == run_key({"b": [1, 2], "a": 1})
    assert run_key({"a": 1}) != run_key({"a": 2})


def test_a_kept_run_is_reused_and_a_broken_one_measured_again(tmp_path):
    cache = RunCache(tmp_path / "runs")
    calls = []

    def measure():
        calls.append(1)
        return {"outputs": [[1, 2]]}

    assert cache.run("k1", measure) == {"outputs": [[1, 2]]}
    assert cache.run("k1", measure) == {"outputs": [[1, 2]]}
    assert (len(calls), cache.measured, cache.reused) == (1, 1, 1)
    cache.path("k1").write_text('{"outputs": [[1,')  # a torn write by another tool
    assert cache.run("k1", measure) == {"outputs": [[1, 2]]}
    assert len(calls) == 2 and oct(cache.path("k1").stat().st_mode & 0o777) == "0o644"


def test_no_folder_keeps_nothing(tmp_path):
    cache = RunCache(None)
    assert cache.run("k", lambda: {"x": 1}) == {"x": 1}
    assert cache.run("k", lambda: {"x": 2}) == {"x": 2}
