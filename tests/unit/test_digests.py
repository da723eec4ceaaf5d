import os
import shutil
from pathlib import Path

import pytest

from draftsmith.core.digests import damage, damage_under, seal, sealed, sidecar, unseal


def _write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_a_sealed_file_changed_under_its_digest_is_named_with_the_stage_to_rerun(tmp_path):
    vocab = _write(tmp_path / "results" / "vocab_map.pt", b"good" * 100)
    seal([vocab], "vocab")
    assert sidecar(vocab).name == ".vocab_map.pt.sha256" and damage(vocab) == (None, None)
    _write(vocab, b"evil" * 100)  # same size, new mtime
    error, _ = damage(vocab)
    assert error.startswith(f"{vocab}: damaged (its sha256 differs from what rule vocab wrote)")
    assert error.endswith("; delete it and Snakemake reruns rule vocab")
    _write(vocab, b"short")
    assert "5 bytes where rule vocab wrote 400" in damage(vocab)[0]
    assert damage_under(tmp_path / "results")[0] == [damage(vocab)[0]]


def test_the_same_content_with_a_new_mtime_passes_and_a_large_one_is_only_a_warning(tmp_path):
    data = _write(tmp_path / "data_config.json", b"{}\n")
    seal([data], "manifest")
    shutil.copy(data, tmp_path / "copy")
    os.replace(tmp_path / "copy", data)  # a copy: same bytes, new mtime
    os.utime(data, ns=(1, 1))
    assert damage(data) == (None, None)
    _write(data, b"[]\n")
    os.utime(data, ns=(2, 2))
    error, warning = damage(data, max_bytes=1)
    assert error is None and "too large to check at start" in warning


def test_unsealed_missing_and_unreadable_sidecars_are_not_errors(tmp_path):
    plain = _write(tmp_path / "plain.json", b"{}")
    assert damage(plain) == (None, None)
    seal([plain], "prompts")
    plain.unlink()
    assert damage(plain) == (None, None)  # gone: Snakemake makes it again
    _write(plain, b"x")
    sidecar(plain).write_text("[" * 100_000)  # not a record
    assert damage(plain) == (None, None)
    assert damage_under(tmp_path / "nowhere") == ([], [])


def test_a_folder_seals_its_visible_files_and_unseal_clears_them(tmp_path):
    drafter = tmp_path / "drafter"
    for name in ("config.json", "model.safetensors", ".hidden"):
        _write(drafter / name, name.encode())
    (drafter / "link").symlink_to(drafter / "config.json")
    seal([drafter], "train")
    assert sorted(p.name for p in drafter.glob(".*.sha256")) == [
        ".config.json.sha256",
        ".model.safetensors.sha256",
    ]
    unseal([drafter])
    assert not list(drafter.glob(".*.sha256"))


def test_a_stage_seals_only_when_it_returns(tmp_path):
    out = tmp_path / "out.jsonl"

    @sealed("prompts", "out")
    def stage(out, fail):
        _write(Path(out), b"rows")
        if fail:
            raise SystemExit(1)

    stage(out=str(out), fail=False)
    assert sidecar(out).is_file()
    with pytest.raises(SystemExit):
        stage(out=str(out), fail=True)
    assert not sidecar(out).exists()  # a failed run leaves no digest of what it may have half-written
