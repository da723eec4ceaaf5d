"""Crash safety of extraction, with a real SIGKILL: no partial shard is ever taken as complete, and the
rerun redoes only the missing shard (and cleans up what the killed job left)."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import DEFAULT_TARGET, REPO, cli_env
from safetensors.torch import save_file

from draftsmith.manifest import verify_manifest
from draftsmith.shards import iter_samples, verify_shard

pytestmark = pytest.mark.slow


def random_sequences(lengths: list[int], seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Random token ids with the second half of each sample loss-masked: crash safety does not depend
    on the words (but no teacher can agree with them)."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]
    return ids, [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]


def write_tokens(path: Path, ids: list[list[int]], masks: list[list[int]], shards: list[list[int]]) -> None:
    """A tokens.safetensors as `draftsmith tokenize` writes it, with the given shard plan."""
    lengths = [len(s) for s in ids]
    meta = {
        "sample_ids": [f"s{i}" for i in range(len(ids))],
        "template": "test",
        "target": str(DEFAULT_TARGET),
        "max_seq_len": max(lengths),
        "shards": shards,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            "input_ids": torch.tensor([t for s in ids for t in s], dtype=torch.int64),
            "loss_mask": torch.tensor([m for s in masks for m in s], dtype=torch.uint8),
            "offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64),
        },
        str(path),
        metadata={"draftsmith_tokens": json.dumps(meta)},
    )


def snakemake(workdir: Path, target: Path, *args: str, **popen) -> list[str]:
    # Random ids: the teacher cannot agree with them, so the agreement floor is off here. Small
    # batches make the shard many forward passes long, so the kill lands mid-shard.
    config = [
        f"target={{model: {target}, gguf_wheel: null}}",
        "extract={num_shards: 2, batch_tokens: 300, min_teacher_agreement: 0.0, compile: 'off'}",
    ]
    return [
        "snakemake",
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--configfile",
        str(REPO / "tests" / "config.tiny.yaml"),
        "--cores",
        "2",
        "--printshellcmds",
        *args,
        "--config",  # last: it takes every argument after it
        *config,
    ]


def planned_extract_shards(dry_run_output: str) -> list[int]:
    return sorted(int(s) for s in re.findall(r"draftsmith extract .*?--shard (\d+)", dry_run_output))


def test_killed_extraction_leaves_no_shard_and_the_rerun_redoes_only_it(tmp_path, target_model):
    hidden = tmp_path / "results" / "hidden"
    # shard 0: one short sample (done first, must survive untouched); shard 1: 14 forward passes
    ids, masks = random_sequences([40] + [200] * 14)
    write_tokens(tmp_path / "results" / "tokens.safetensors", ids, masks, [[0, 1], [1, 15]])
    env = cli_env()
    subprocess.run(
        snakemake(tmp_path, target_model, "results/hidden/shard-0.safetensors"),
        check=True,
        env=env,
        capture_output=True,
    )
    shard0 = hidden / "shard-0.safetensors"
    before = (shard0.stat().st_mtime_ns, shard0.read_bytes())

    # Run the rest and SIGKILL the whole job tree (snakemake, the extract process, tee) mid-shard:
    # once the background writer has streamed some samples into its hidden data file.
    proc = subprocess.Popen(
        snakemake(tmp_path, target_model, "results/data_config.json"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 300
    try:
        while time.time() < deadline and proc.poll() is None:
            streaming = [p for p in hidden.glob(".shard-1.safetensors.*.data") if p.stat().st_size > 0]
            if streaming:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the extraction finished before it could be killed"
        assert streaming, "no streamed data seen within 300 s"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    leftovers = sorted(p.name for p in hidden.iterdir() if p.name.startswith(".shard-1.safetensors."))
    assert not (hidden / "shard-1.safetensors").exists()
    assert leftovers, "the killed writer left nothing behind? then the kill came too late"
    # Nothing the killed job left looks like a shard: the manifest rule's input pattern, a shard glob
    # and the extract rule's output pattern (shard=\d+) all skip hidden temporary files.
    assert sorted(p.name for p in hidden.glob("shard-*.safetensors")) == ["shard-0.safetensors"]
    assert not (tmp_path / "results" / "data_config.json").exists()

    dry = subprocess.run(
        snakemake(tmp_path, target_model, "results/data_config.json", "-n"),
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert planned_extract_shards(dry) == [1], dry[-3000:]
    assert "checkpoint manifest:" in dry

    # A killed snakemake leaves its lock behind: the documented recovery is --unlock, then rerun.
    subprocess.run(snakemake(tmp_path, target_model, "--unlock"), env=env, check=True, capture_output=True)
    subprocess.run(
        snakemake(tmp_path, target_model, "results/data_config.json"),
        env=env,
        check=True,
        capture_output=True,
    )
    assert (shard0.stat().st_mtime_ns, shard0.read_bytes()) == before  # not redone
    assert not [p for p in hidden.iterdir() if p.name.startswith(".")], "the rerun left temp files"
    manifest = tmp_path / "results" / "data_config.json"
    assert verify_manifest(manifest) == []
    record = json.loads(manifest.read_text())
    assert [s["num_samples"] for s in record["shards"]] == [1, 14]
    assert [s.id for s in iter_samples(hidden / "shard-1.safetensors")] == [f"s{i}" for i in range(1, 15)]
    # the resumed shard holds exactly what an uninterrupted extraction gives: same content digest
    clean = tmp_path / "clean" / "shard-1.safetensors"
    cmd = ["draftsmith", "extract", "--target", str(target_model), "--shard", "1", "--out", str(clean)]
    cmd += ["--tokens", str(tmp_path / "results" / "tokens.safetensors"), "--batch-tokens", "300"]
    subprocess.run([*cmd, "--compile", "off", "--threads", "2"], env=env, check=True, capture_output=True)
    assert record["shards"][1]["content_sha256"] == verify_shard(clean)
