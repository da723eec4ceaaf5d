import os
import shutil
from pathlib import Path

import pytest

from draftsmith.core.io.digests import damage, damage_under, seal, sealed, sidecar, unseal


def _write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _rewrite(path, data: bytes):
    """A file written again the usual way: a new file renamed over it (a new inode)."""
    _write(path.with_name(path.name + ".new"), data)
    os.replace(path.with_name(path.name + ".new"), path)
    return path


def test_a_sealed_file_changed_under_its_digest_is_named_with_the_stage_to_rerun(tmp_path):
    vocab = _write(tmp_path / "results" / "vocab_map.pt", b"good" * 100)
    seal([vocab], "vocab")
    assert sidecar(vocab).name == ".vocab_map.pt.sha256" and damage(vocab) == (None, None)
    _rewrite(vocab, b"evil" * 100)  # same size, new inode
    error, _ = damage(vocab)
    assert error.startswith(f"{vocab}: damaged (its sha256 differs from what rule vocab wrote)")
    assert error.endswith("; rerun with `snakemake --forcerun vocab` (rule vocab writes it again)")
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
    _rewrite(data, b"[]\n")
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


def test_snakemakes_touch_rehashes_nothing_and_a_copy_is_hashed_once(tmp_path, monkeypatch):
    """Snakemake touches every output after its job: the mtime moves, the size and inode do not, so a
    start only stats it. A copy (new inode) is hashed once, then sealed with its new inode."""
    import draftsmith.core.io.digests as digests

    shard = _write(tmp_path / "results" / "hidden" / "shard-0.safetensors", b"s" * 64)
    seal([shard], "extract")
    monkeypatch.setattr(digests, "SMALL_BYTES", 16)  # a shard is large: its stat is trusted
    hashed = []
    real = digests.file_sha256
    monkeypatch.setattr(digests, "file_sha256", lambda p, *a: hashed.append(p) or real(p, *a))
    os.utime(shard, ns=(5, 5))  # Snakemake's touch
    assert damage(shard) == (None, None) and digests.intact(shard) and hashed == []
    shutil.copy(shard, tmp_path / "copy")
    os.replace(tmp_path / "copy", shard)
    assert damage(shard) == (None, None) and len(hashed) == 1
    assert damage(shard) == (None, None) and len(hashed) == 1  # resealed with the copy's inode


def test_a_shard_rewritten_as_a_new_inode_is_named_at_its_own_path_not_the_stash(tmp_path):
    """The stash copy (results/hidden/.done/<key>/) is the extract stage's to check; the published shard
    carries its own seal, so damage is named where the user sees it, with a --forcerun that works."""
    from draftsmith.core.io.digests import seal_as

    hidden = tmp_path / "results" / "hidden"
    stashed = _write(hidden / ".done" / "k" / "shard-1.safetensors", b"a" * 32)
    seal([stashed], "extract")
    out = hidden / "shard-1.safetensors"
    os.link(stashed, out)
    seal_as(out, stashed)
    assert damage_under(tmp_path / "results") == ([], [])
    _rewrite(out, b"b" * 32)
    _rewrite(stashed, b"c" * 32)
    errors, _ = damage_under(tmp_path / "results")
    assert errors == [
        f"{out}: damaged (its sha256 differs from what rule extract wrote); "
        "rerun with `snakemake --forcerun extract` (rule extract writes it again)"
    ]
    # what the advice runs: the forced rule makes it again, so the start lets it through
    errors, warnings = damage_under(tmp_path / "results", forced={"extract"})
    assert errors == [] and "rule extract is forced to write it again" in warnings[0]


def test_an_older_seal_without_inode_is_hashed_once(tmp_path):
    import json

    data = _write(tmp_path / "summary.json", b"{}")
    side = sidecar(data)
    side.write_text(json.dumps({"sha256": "0" * 64, "bytes": 2, "mtime_ns": 1, "stage": "eval-summary"}))
    error, _ = damage(data)
    assert "rule eval_summary" in error and "--forcerun eval_summary" in error


def test_unsealed_junk_a_rule_writes_is_named_with_its_rule_before_anything_runs(tmp_path):
    """A vocab_map.pt without its sidecar (as after `cp results/*`) or a summary.json of junk: both would
    let Snakemake delete the outputs of the job that reads them; found at start instead."""
    import zipfile

    from draftsmith.core.io.digests import unreadable_under

    root = tmp_path / "results"
    writers = {"vocab_map.pt": "vocab", "summary.json": "eval_summary", "model.safetensors": "train"}

    def writer(path):
        return writers.get(Path(path).name)

    _write(root / "vocab_map.pt", b"junk")
    _write(root / "eval" / "summary.json", b"{junk")
    _write(root / "drafter" / "model.safetensors", (10**9).to_bytes(8, "little") + b"{}")
    _write(root / "notes.json", b"junk")  # no rule writes it: no job reads it
    _write(root / ".done" / "summary.json", b"junk")  # hidden: the stage's own
    assert unreadable_under(root, writer) == [
        f"{root}/drafter/model.safetensors: not a safetensors file; "
        "rerun with `snakemake --forcerun train` (rule train writes it again)",
        f"{root}/eval/summary.json: unreadable (JSONDecodeError); "
        "rerun with `snakemake --forcerun eval_summary` (rule eval_summary writes it again)",
        f"{root}/vocab_map.pt: not a torch file; rerun with `snakemake --forcerun vocab` (rule vocab writes it again)",
    ]
    assert len(unreadable_under(root, writer, forced={"vocab", "eval_summary"})) == 1
    # good files pass: JSON, a torch zip, a safetensors header
    _write(root / "eval" / "summary.json", b"{}")
    with zipfile.ZipFile(root / "vocab_map.pt", "w") as archive:
        archive.writestr("archive/data.pkl", b"x")
    header = b'{"__metadata__": {}}'
    _write(root / "drafter" / "model.safetensors", len(header).to_bytes(8, "little") + header)
    assert unreadable_under(root, writer) == []


def test_forced_rules_are_read_from_snakemakes_command_line():
    from draftsmith.core.io.digests import forced_rules

    assert forced_rules(["snakemake", "--cores", "1", "--forcerun", "extract", "vocab", "-n"]) == {
        "extract",
        "vocab",
    }
    assert forced_rules(["snakemake", "-R", "train", "--cores", "1"]) == {"train"}
    assert forced_rules(["snakemake", "--forcerun=manifest"]) == {"manifest"}
    assert "anything" in forced_rules(["snakemake", "-F"])
    assert "train" not in forced_rules(["snakemake", "--cores", "all", "train"])


def test_a_small_file_edited_in_place_is_still_seen(tmp_path):
    """Same size, same inode, new bytes: a small file (milliseconds to hash) is hashed when its mtime moved."""
    vocab = _write(tmp_path / "vocab_map.pt", b"good" * 100)
    seal([vocab], "vocab")
    os.utime(vocab, ns=(9, 9))  # Snakemake's touch: hashed, intact
    assert damage(vocab) == (None, None)
    inode = vocab.stat().st_ino
    _write(vocab, b"evil" * 100)
    assert vocab.stat().st_ino == inode and "sha256 differs" in damage(vocab)[0]
