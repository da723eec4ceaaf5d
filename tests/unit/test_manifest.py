"""Verified data: `draftsmith verify` re-checks the manifest, and `draftsmith train` refuses data that
fails it, naming the shard."""

import json

import pytest
import torch
from click.testing import CliRunner

from draftsmith.atomic import write_json
from draftsmith.cli import main
from draftsmith.manifest import build_manifest
from draftsmith.shards import Sample, write_shard
from draftsmith.vocab import build_vocab_map, save_vocab_map


def _samples(seed: int, n: int = 3, hidden: int = 16) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 6 + i
        out.append(
            Sample(
                f"s{seed}-{i}",
                torch.randint(0, 300, (t,), generator=g),
                torch.tensor([0] * (t // 2) + [1] * (t - t // 2), dtype=torch.bool),
                torch.randn(t, 3, hidden, generator=g).bfloat16(),
                torch.randn(t, hidden, generator=g).bfloat16(),
            )
        )
    return out


def _meta(samples: list[Sample], agreement: float) -> dict:
    checked = 10
    return {
        "aux_layer_ids": [1, 2, 3],
        "layer_convention": "input",
        "dtype": "bfloat16",
        "template": "t",
        "final": "post_final_norm",
        "stats": {
            "num_samples": len(samples),
            "num_tokens": sum(s.num_tokens for s in samples),
            "num_masked_tokens": int(sum(s.loss_mask.sum() for s in samples)),
            "teacher_agree": round(agreement * checked),
            "teacher_checked": checked,
            "teacher_agreement": round(agreement * checked) / checked,
        },
    }


@pytest.fixture
def data(tmp_path):
    """Two zstd-planes shards, their manifest and a vocabulary map, as the workflow lays them out."""
    target = tmp_path / "target"
    target.mkdir()
    write_json(target / "config.json", {"num_hidden_layers": 6, "hidden_size": 16, "vocab_size": 300})
    shards = []
    for k, agreement in enumerate((1.0, 0.9)):
        samples = _samples(k)
        path = tmp_path / "results" / "hidden" / f"shard-{k}.safetensors"
        write_shard(path, samples, _meta(samples, agreement), codec="zstd-planes")
        shards.append(path)
    manifest = tmp_path / "results" / "data_config.json"
    build_manifest([str(p) for p in shards], str(manifest), str(target), 0.8)
    vocab = tmp_path / "results" / "vocab_map.pt"
    save_vocab_map(vocab, build_vocab_map(torch.arange(300), 300, 64))
    return manifest, shards, vocab


def _train(tmp_path, manifest, vocab):
    args = ["train", "--data", str(manifest), "--vocab", str(vocab), "--out", str(tmp_path / "drafter")]
    args += ["--checkpoints", str(tmp_path / "ckpt"), "--metrics", str(tmp_path / "metrics.jsonl")]
    return CliRunner().invoke(main, args)


def _flip_byte(path, offset_from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01  # same size: only the checksum can tell
    path.write_bytes(bytes(data))


def test_verify_passes_clean_data(data):
    manifest, _, _ = data
    result = CliRunner().invoke(main, ["verify", str(manifest)])
    assert result.exit_code == 0, result.output
    assert "all shards verified" in result.output


def test_train_refuses_a_corrupted_shard_naming_it(tmp_path, data):
    manifest, shards, vocab = data
    _flip_byte(shards[1])
    verify = CliRunner().invoke(main, ["verify", str(manifest)])
    assert verify.exit_code == 1
    assert "shard-1.safetensors: sha256 differs" in verify.output and "shard-0" not in verify.output
    # --fast checks sizes only: a flipped byte passes it, which is why train uses the full check
    assert CliRunner().invoke(main, ["verify", "--fast", str(manifest)]).exit_code == 0
    result = _train(tmp_path, manifest, vocab)
    assert result.exit_code != 0
    assert "refusing to train" in result.output
    assert "shard-1.safetensors: sha256 differs" in result.output and "shard-0" not in result.output
    assert not (tmp_path / "drafter").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_train_refuses_a_missing_or_truncated_shard(tmp_path, data):
    manifest, shards, vocab = data
    shards[0].write_bytes(shards[0].read_bytes()[:-10])
    shards[1].unlink()
    result = _train(tmp_path, manifest, vocab)
    assert result.exit_code != 0
    assert "shard-0.safetensors: " in result.output and "manifest says" in result.output
    assert "shard-1.safetensors: missing" in result.output


def test_train_refuses_low_teacher_agreement_naming_the_shard(tmp_path, data):
    manifest, _, vocab = data
    record = json.loads(manifest.read_text())
    record["min_teacher_agreement"] = 0.95  # shard-1 was extracted at 0.9 agreement
    manifest.write_text(json.dumps(record))
    result = _train(tmp_path, manifest, vocab)
    assert result.exit_code != 0
    assert "shard-1.safetensors: teacher agreement 0.900 < 0.95" in result.output
    assert "shard-0" not in result.output
