"""Verified data: the manifest and `draftsmith verify` decode every sample and compare it with the
digests its writer recorded; `draftsmith train` refuses data that fails, naming the shard. Every test
runs on bfloat16 and on float8_e4m3fn shards."""

import json

import pytest
import torch
from click.testing import CliRunner
from helpers.data import flip_state_bit

from draftsmith.cli import main
from draftsmith.core.data.manifest import DataError, load_manifest, verify_manifest
from draftsmith.core.data.shards import Sample, write_shard
from draftsmith.core.data.vocab import save_vocab_map
from draftsmith.core.io.atomic import write_json
from draftsmith.stages.manifest import ManifestSettings, build_manifest
from draftsmith.stages.vocab import build_vocab_map


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


@pytest.fixture(params=["bfloat16", "float8_e4m3fn"])
def dtype(request) -> str:
    """The storage dtype of the `data` fixture's shards."""
    return request.param


@pytest.fixture
def data(tmp_path, dtype):
    """Two zstd-planes shards, their manifest and a vocabulary map, as the workflow lays them out."""
    target = tmp_path / "target"
    target.mkdir()
    write_json(target / "config.json", {"num_hidden_layers": 6, "hidden_size": 16, "vocab_size": 300})
    shards = []
    for k, agreement in enumerate((1.0, 0.9)):
        samples = _samples(k)
        path = tmp_path / "results" / "hidden" / f"shard-{k}.safetensors"
        write_shard(
            path, samples, _meta(samples, agreement), codec="zstd-planes", storage_dtype=dtype, level=1
        )
        shards.append(path)
    manifest = tmp_path / "results" / "data_config.json"
    build_manifest(
        [str(p) for p in shards], str(manifest), str(target), ManifestSettings(min_teacher_agreement=0.8)
    )
    vocab = tmp_path / "results" / "vocab_map.pt"
    save_vocab_map(vocab, build_vocab_map(torch.arange(300), 300, 64))
    return manifest, shards, vocab


def _train(tmp_path, manifest, vocab):
    args = ["train", "--manifest", str(manifest), "--vocab", str(vocab), "--out", str(tmp_path / "drafter")]
    args += ["--checkpoints", str(tmp_path / "ckpt"), "--metrics", str(tmp_path / "metrics.jsonl")]
    return CliRunner().invoke(main, args)


def test_verify_passes_clean_data(data):
    manifest, _, _ = data
    result = CliRunner().invoke(main, ["verify", str(manifest)])
    assert result.exit_code == 0, result.output
    assert "all shards verified" in result.output


def test_train_refuses_a_corrupted_shard_naming_it(tmp_path, data):
    manifest, shards, vocab = data
    flip_state_bit(shards[1])
    verify = CliRunner().invoke(main, ["verify", str(manifest)])
    assert verify.exit_code == 1
    assert "shard-1.safetensors: sample " in verify.output and "shard-0" not in verify.output
    # --fast checks sizes only: a flipped bit passes it, which is why train uses the full check
    assert CliRunner().invoke(main, ["verify", "--fast", str(manifest)]).exit_code == 0
    result = _train(tmp_path, manifest, vocab)
    assert result.exit_code != 0
    assert "refusing to train" in result.output
    assert "shard-1.safetensors: sample " in result.output and "shard-0" not in result.output
    assert not (tmp_path / "drafter").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_rebuilt_manifest_refuses_a_damaged_shard(tmp_path, data):
    """The bit-rot path: a copy changes the shard's mtime, Snakemake reruns `manifest`; it must decode,
    not re-hash what is on disk."""
    manifest, shards, _ = data
    flip_state_bit(shards[0])
    target = tmp_path / "target"
    result = CliRunner().invoke(
        main, ["manifest", "--target", str(target), "--out", str(manifest), *map(str, shards)]
    )
    assert result.exit_code == 1
    assert "shard-0.safetensors: sample 1 (s0-1)" in result.output and "shard-1" not in result.output
    verify = CliRunner().invoke(main, ["verify", str(manifest)])  # the old manifest still names it
    assert verify.exit_code == 1 and "shard-0.safetensors: sample 1 (s0-1)" in verify.output


def test_content_digests_match_for_identical_data_whatever_the_stats(tmp_path, data, dtype):
    manifest, shards, _ = data
    first = json.loads(manifest.read_text())["shards"]
    again = tmp_path / "again"
    paths = []
    for k, agreement in enumerate((1.0, 0.9)):
        samples = _samples(k)
        meta = _meta(samples, agreement)
        meta["stats"] |= {"seconds": 123.4 + k, "tokens_per_second": 9.9}  # another run's timing
        paths.append(again / "hidden" / f"shard-{k}.safetensors")
        write_shard(paths[-1], samples, meta, codec="zstd-planes", level=3, storage_dtype=dtype)
    second = build_manifest(
        [str(p) for p in paths],
        str(again / "data_config.json"),
        str(tmp_path / "target"),
        ManifestSettings(min_teacher_agreement=0.8),
    )
    assert [s["content_sha256"] for s in first] == [s["content_sha256"] for s in second["shards"]]
    assert paths[1].read_bytes() != shards[1].read_bytes()  # the files differ: stats, zstd level


def test_verify_names_a_shard_re_extracted_with_other_data(tmp_path, data, dtype):
    manifest, shards, _ = data
    other = _samples(7)  # same shapes, other values: same byte size with codec none
    write_shard(shards[0], other, _meta(other, 1.0), codec="none", storage_dtype=dtype, level=1)
    record = json.loads(manifest.read_text())
    record["shards"][0]["bytes"] = shards[0].stat().st_size
    manifest.write_text(json.dumps(record))
    problems = verify_manifest(manifest)
    assert len(problems) == 1 and "shard-0.safetensors: content_sha256" in problems[0]
    del record["shards"][1]["content_sha256"]  # a manifest from before content digests
    manifest.write_text(json.dumps(record))
    assert any(
        "shard-1.safetensors: the manifest records no content_sha256" in p for p in verify_manifest(manifest)
    )


def test_train_refuses_a_missing_or_truncated_shard(tmp_path, data):
    manifest, shards, vocab = data
    shards[0].write_bytes(shards[0].read_bytes()[:-10])
    shards[1].unlink()
    result = _train(tmp_path, manifest, vocab)
    assert result.exit_code != 0
    assert "shard-0.safetensors: " in result.output and "manifest says" in result.output
    assert "shard-1.safetensors: missing" in result.output
    rebuilt = CliRunner().invoke(
        main, ["manifest", "--target", str(tmp_path / "target"), "--out", str(manifest), str(shards[0])]
    )
    assert rebuilt.exit_code == 1 and "shard-0.safetensors: truncated" in rebuilt.output
    assert "Traceback" not in rebuilt.output and "SafetensorError" not in rebuilt.output


def test_train_refuses_low_teacher_agreement_naming_the_shard(tmp_path, data):
    manifest, _, vocab = data
    record = json.loads(manifest.read_text())
    record["min_teacher_agreement"] = 0.95  # shard-1 was extracted at 0.9 agreement
    manifest.write_text(json.dumps(record))
    result = _train(tmp_path, manifest, vocab)
    assert result.exit_code != 0
    assert "shard-1.safetensors: teacher agreement 0.900 < 0.95" in result.output
    assert "shard-0" not in result.output


def test_manifest_records_the_contract(tmp_path, data, dtype):
    manifest, shards, _ = data
    record = json.loads(manifest.read_text())
    assert record["version"] == 2 and record["num_tokens"] == sum(s["num_tokens"] for s in record["shards"])
    assert record["layer_convention"] == "input" and record["codec"] == "zstd-planes"
    assert record["dtype"] == dtype and record["dtype_note"]
    assert record["shards"][0]["path"] == "hidden/shard-0.safetensors"
    assert all(len(s["content_sha256"]) == 64 for s in record["shards"])
    assert load_manifest(manifest)["shards"][0]["path"] == shards[0].resolve()
    assert verify_manifest(manifest) == []
    samples = _samples(0)
    other_dtype = {"bfloat16": "float8_e4m3fn", "float8_e4m3fn": "bfloat16"}[dtype]
    write_shard(
        shards[0], samples, _meta(samples, 1.0), codec="zstd-planes", storage_dtype=other_dtype, level=1
    )
    with pytest.raises(DataError, match=r"shards disagree on dtype: \[.*bfloat16.*float8_e4m3fn"):
        build_manifest(
            [str(p) for p in shards],
            str(tmp_path / "other.json"),
            str(tmp_path / "target"),
            ManifestSettings(min_teacher_agreement=0.8),
        )
    write_shard(shards[0], samples, _meta(samples, 0.5), codec="zstd-planes", storage_dtype=dtype, level=1)
    with pytest.raises(DataError, match="teacher agreement below 0.8 in results/hidden/shard-0.safetensors"):
        build_manifest(
            [str(p) for p in shards],
            str(tmp_path / "other.json"),
            str(tmp_path / "target"),
            ManifestSettings(min_teacher_agreement=0.8),
        )
    with pytest.raises(DataError, match="missing"):
        load_manifest(tmp_path / "nope.json")


# ----------------------------------------------------------------------------- paths a manifest may name


def _rewrite(manifest, **changes) -> None:
    data = json.loads(manifest.read_text())
    data["shards"][0].update(changes)
    manifest.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "recorded", ["../../../../etc/passwd", "/etc/passwd", "hidden/../../outside.safetensors"]
)
def test_a_shard_path_leading_out_of_the_results_folder_is_refused(data, recorded, monkeypatch):
    monkeypatch.delenv("DRAFTSMITH_SHARD_DIRS", raising=False)
    manifest, _, _ = data
    _rewrite(manifest, path=recorded)
    with pytest.raises(DataError, match=f"^{manifest}: shard path '{recorded}' leads outside"):
        load_manifest(manifest)
    result = CliRunner().invoke(main, ["verify", str(manifest)])
    assert result.exit_code != 0 and "leads outside" in result.output and "root:" not in result.output


def test_shards_in_a_folder_named_in_the_setting_are_followed(tmp_path, data, monkeypatch):
    manifest, shards, _ = data
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    moved = scratch / shards[0].name
    shards[0].rename(moved)
    _rewrite(manifest, path=str(moved))
    monkeypatch.delenv("DRAFTSMITH_SHARD_DIRS", raising=False)
    with pytest.raises(DataError, match="leads outside"):
        load_manifest(manifest)
    monkeypatch.setenv("DRAFTSMITH_SHARD_DIRS", str(scratch))
    assert load_manifest(manifest)["shards"][0]["path"] == moved
    assert verify_manifest(manifest) == []


def test_a_link_made_inside_the_results_folder_is_followed(tmp_path, data, monkeypatch):
    """results/hidden as a link to a big disk, the usual set-up: the written path stays inside."""
    monkeypatch.delenv("DRAFTSMITH_SHARD_DIRS", raising=False)
    manifest, shards, _ = data
    disk = tmp_path / "disk"
    shards[0].parent.rename(disk)
    shards[0].parent.symlink_to(disk)
    assert verify_manifest(manifest) == []


def test_building_a_manifest_over_shards_outside_its_folder_needs_the_setting(tmp_path, data, monkeypatch):
    monkeypatch.delenv("DRAFTSMITH_SHARD_DIRS", raising=False)
    _, shards, _ = data
    out = tmp_path / "elsewhere" / "data_config.json"
    with pytest.raises(DataError, match="DRAFTSMITH_SHARD_DIRS"):
        build_manifest(
            [str(p) for p in shards],
            str(out),
            str(tmp_path / "target"),
            ManifestSettings(min_teacher_agreement=0.8),
        )
    monkeypatch.setenv("DRAFTSMITH_SHARD_DIRS", str(shards[0].parent))
    built = build_manifest(
        [str(p) for p in shards],
        str(out),
        str(tmp_path / "target"),
        ManifestSettings(min_teacher_agreement=0.8),
    )
    assert built["shards"][0]["path"] == str(shards[0])  # absolute: it is outside the manifest's folder
    assert verify_manifest(out) == []


# ----------------------------------------------------------------------------- verify on a damaged manifest


def _without(mapping: dict, key: str) -> dict:
    return {k: v for k, v in mapping.items() if k != key}


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda m: _without(m, "shards"), "no 'shards' list"),
        (
            lambda m: {**m, "shards": [m["shards"][0], _without(m["shards"][1], "bytes")]},
            "shards[1] (hidden/shard-1.safetensors) has no integer 'bytes'",
        ),
        (lambda m: _without(m, "min_teacher_agreement"), "no numeric 'min_teacher_agreement'"),
        (lambda m: [m], "not a JSON object (a list)"),
    ],
    ids=["no-shards", "no-bytes", "no-min-teacher-agreement", "a-list"],
)
def test_verify_on_a_damaged_manifest_is_one_line_exit_2(data, edit, fragment):
    manifest, _, _ = data
    manifest.write_text(json.dumps(edit(json.loads(manifest.read_text()))))
    result = CliRunner().invoke(main, ["verify", str(manifest)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert lines[0].startswith(f"error: {manifest}: ") and fragment in lines[0], lines[0]
