"""Atomic writes: all or nothing, and every result readable by others (0666/0777 minus the umask)."""

import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.core.data.shards import HEADER_ROOM, Sample, ShardWriter, write_shard
from draftsmith.core.data.vocab import save_vocab_map
from draftsmith.core.io.atomic import (
    atomic_dir,
    atomic_path,
    process_umask,
    write_json,
    write_jsonl,
    write_text,
)
from draftsmith.stages.vocab import build_vocab_map


@pytest.fixture
def umask():
    """Run the test under a chosen umask (process-wide), restored afterwards."""
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _sample(i: int) -> Sample:
    t = 4 + i
    return Sample(f"s{i}", torch.arange(t), torch.ones(t, dtype=torch.bool), torch.randn(t, 2, 8).bfloat16(),
                  torch.randn(t, 8).bfloat16())  # fmt: skip


def _write_everything(root) -> list:
    """One file from each way draftsmith writes results; returns the paths."""
    with atomic_path(root / "tokens.safetensors") as tmp:  # tokenize; safetensors creates its file 0600
        save_file({"x": torch.zeros(3)}, str(tmp))
    save_vocab_map(root / "vocab_map.pt", build_vocab_map(torch.arange(50), 50, 8))  # torch.save
    write_json(root / "data_config.json", {"a": 1})
    write_jsonl(root / "metrics.jsonl", [{"step": 1}])
    write_text(root / "report.md", "x")
    with atomic_dir(root / "drafter") as tmp:  # exports, checkpoints, the converted target
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        torch.save({}, tmp / "optimizer.pt")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "config.json").write_text("{}")
    write_shard(
        root / "shard-0.safetensors",
        [_sample(0), _sample(1)],
        {},
        codec="zstd-planes",
        level=1,
        storage_dtype="bfloat16",
    )
    write_shard(
        root / "shard-1.safetensors", [_sample(0)], {}, codec="none", level=1, storage_dtype="bfloat16"
    )
    writer = ShardWriter(
        root / "shard-2.safetensors", {}, codec="zstd-planes", level=1, storage_dtype="bfloat16"
    )  # header outgrows its room: rewritten once
    writer.add(_sample(0))
    writer.close({"notes": "x" * (2 * HEADER_ROOM)})
    return sorted(root.rglob("*"))


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_every_writer_gives_umask_modes(tmp_path, umask, mask):
    umask(mask)
    assert process_umask() == mask
    paths = _write_everything(tmp_path)
    assert len([p for p in paths if p.is_file()]) == 11
    for p in paths:
        want = (0o777 if p.is_dir() else 0o666) & ~mask  # 0644 / 0755 under the usual umask 022
        assert _mode(p) == want, (p.relative_to(tmp_path), oct(_mode(p)), oct(want))
    assert not [p for p in paths if p.name.startswith(".")]  # no temp file left


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert path.read_text() == "old"
    assert list(tmp_path.iterdir()) == [path]


def test_atomic_dir_replaces_whole_or_not_at_all(tmp_path):
    out = tmp_path / "drafter"
    with atomic_dir(out) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        (tmp / "b").write_text("2")
        raise RuntimeError("crash mid-export")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "drafter"]
