"""Crash safety of extraction, with a real SIGKILL: no partial shard is ever taken as complete, a shard
finished before the kill survives Snakemake deleting the job's outputs (the stash), and the rerun extracts
only the rest (and cleans up what the killed job left)."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.data import random_sequences, write_sample_tokens
from helpers.workflow import REPO, cli_env

from draftsmith.core.data.manifest import verify_manifest
from draftsmith.core.data.shards import iter_samples, verify_shard

pytestmark = pytest.mark.slow


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


def test_a_killed_extraction_job_keeps_its_finished_shards_and_the_rerun_extracts_only_the_rest(
    tmp_path, target_model
):
    hidden = tmp_path / "results" / "hidden"
    # shard 0 (15 forward passes) is extracted first, largest first; the kill lands in shard 1 (14)
    ids, masks = random_sequences([200] * 29)
    tokens = tmp_path / "results" / "tokens.safetensors"
    write_sample_tokens(tokens, ids, masks, [[0, 15], [15, 29]])
    env = cli_env()

    # Run the workflow and SIGKILL the whole job tree (snakemake, the extract process, tee) once shard 0
    # is stashed and sealed and shard 1 is mid-way: its background writer streaming into its data file.
    proc = subprocess.Popen(
        snakemake(tmp_path, target_model, "results/data_config.json"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 300
    sealed, streaming = [], []
    try:
        while time.time() < deadline and proc.poll() is None:
            sealed = list(hidden.glob(".done/*/.shard-0.safetensors.sha256"))
            streaming = [
                p for p in hidden.glob(".done/*/.shard-1.safetensors.*.data") if p.stat().st_size > 0
            ]
            if sealed and streaming:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the extraction finished before it could be killed"
        assert sealed and streaming, "shard 0 sealed and shard 1 streaming not seen within 300 s"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    stash = sealed[0].parent
    stashed0 = stash / "shard-0.safetensors"
    before = (stashed0.stat().st_ino, stashed0.read_bytes())
    leftovers = sorted(p.name for p in stash.iterdir() if p.name.startswith(".shard-1.safetensors."))
    assert leftovers, "the killed writer left nothing behind? then the kill came too late"
    # Nothing the killed job left looks like a shard: the manifest rule's input pattern, a shard glob
    # and the extract rule's outputs all skip hidden files and folders.
    assert sorted(p.name for p in hidden.glob("shard-*.safetensors")) == []
    assert not (tmp_path / "results" / "data_config.json").exists()

    dry = subprocess.run(
        snakemake(tmp_path, target_model, "results/data_config.json", "-n"),
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert re.findall(r"^rule (\w+):", dry, re.M) == ["extract"], dry[-3000:]
    assert "checkpoint manifest:" in dry

    # A killed snakemake leaves its lock behind: the documented recovery is --unlock, then rerun.
    subprocess.run(snakemake(tmp_path, target_model, "--unlock"), env=env, check=True, capture_output=True)
    subprocess.run(
        snakemake(tmp_path, target_model, "results/data_config.json"),
        env=env,
        check=True,
        capture_output=True,
    )
    log = (tmp_path / "logs" / "extract.log").read_text()
    assert "extract: reusing shards 0, finished by an earlier run" in log, log[-3000:]
    assert "extract shard 1: samples 15..28" in log and "extract shard 0: samples" not in log, log[-3000:]
    # shard 0 is the stashed file itself (a hard link), not extracted again
    shard0 = hidden / "shard-0.safetensors"
    assert (shard0.stat().st_ino, shard0.read_bytes()) == before
    # no temp file left: the hidden files beside the shards are their seals (damage named at this path)
    hidden_files = sorted(p.name for p in hidden.iterdir() if p.name.startswith(".") and p.name != ".done")
    assert hidden_files == [".shard-0.safetensors.sha256", ".shard-1.safetensors.sha256"], hidden_files
    assert sorted(p.name for p in stash.iterdir()) == [
        ".shard-0.safetensors.sha256",
        ".shard-1.safetensors.sha256",
        "shard-0.safetensors",
        "shard-1.safetensors",
    ]
    manifest = tmp_path / "results" / "data_config.json"
    assert verify_manifest(manifest) == []
    record = json.loads(manifest.read_text())
    assert [s["num_samples"] for s in record["shards"]] == [15, 14]
    assert [s.id for s in iter_samples(hidden / "shard-1.safetensors")] == [f"s{i}" for i in range(15, 29)]
    # the resumed extraction holds exactly what an uninterrupted one gives: the same content digests
    clean = [tmp_path / "clean" / f"shard-{k}.safetensors" for k in (0, 1)]
    cmd = ["draftsmith", "extract", "--target", str(target_model), "--tokens", str(tokens), "--batch-tokens"]
    cmd += ["300", "--compile", "off", "--threads", "2", *map(str, clean)]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    assert [s["content_sha256"] for s in record["shards"]] == [verify_shard(p) for p in clean]
