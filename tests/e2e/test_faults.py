"""The fault matrix as code: each fault done to a real workflow (Snakemake, the real target, real
shards) and the outcome it must have. kill -9 during extraction is tests/e2e/test_extract_kill.py;
`python -m bench.faults` runs both modules and prints the matrix.

| fault                                   | outcome asserted                                              |
|-----------------------------------------|---------------------------------------------------------------|
| shard replaced by a flipped-bit copy    | refused at start naming it and --forcerun extract, which works |
| truncated shard                         | one line naming the shard, no traceback                       |
| damaged shards deleted, workflow rerun  | only they are re-extracted; same content digests as before    |
| missing drafter config.json             | evaluate / evaluate-vllm: one line, exit 2, before any model  |
| disk too small for a shard              | one line with the numbers, exit 1, nothing left behind        |
| bad config values                       | the dry run fails naming the config key                       |
| corrupt vocab_map.pt, mtime changed     | stopped at start naming it and --forcerun vocab; drafter kept  |
| data_config.json deleted                | rebuilt to the same bytes; train does not rerun                |
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.data import random_sequences, write_sample_tokens
from helpers.workflow import REPO, cli_env

from draftsmith.core.data.shards import read_header

pytestmark = pytest.mark.slow


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, **kw)


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    """The error a command printed, asserted to be a message and not a traceback."""
    out = result.stdout + result.stderr
    assert "Traceback" not in out, out[-3000:]
    return out


@pytest.fixture
def workflow(tiny_run, tmp_path, target_model):
    """A copy of the shared tiny run (tests/conftest.py) to damage: its two shards, extracted by the real
    workflow from real traces, and their manifest."""
    run = tiny_run.copy(tmp_path / "run")
    manifest = json.loads((run.results / "data_config.json").read_text())
    return run, target_model, manifest


def _flip_state_bit(path: Path) -> None:
    data_start, entries, _ = read_header(path)
    start, end = entries["blob"]["data_offsets"]
    data = bytearray(path.read_bytes())
    data[data_start + (start + end) // 2] ^= 0x40  # a sign/exponent-plane byte: off by a factor once
    path.write_bytes(bytes(data))  # a new mtime, as any copy or restore gives


def test_bit_rot_and_truncation_are_caught_and_only_damaged_shards_redone(workflow):
    run, target, first = workflow
    root, hidden = run.workdir, run.results / "hidden"
    manifest = (root / "results" / "data_config.json").read_bytes()
    # a damaged copy put in its place (a new inode, as a copy or restore gives): its seal stops the run at
    # start, named where the user sees it (not the stash copy), before the manifest job deletes anything
    shutil.copy(hidden / "shard-1.safetensors", root / "copy-1")
    _flip_state_bit(root / "copy-1")
    (root / "copy-1").replace(hidden / "shard-1.safetensors")
    result = run.snakemake("results/data_config.json", check=False)
    assert result.returncode == 2
    out = _one_line_error(result)
    assert (
        "results/hidden/shard-1.safetensors: damaged (its sha256 differs from what rule extract wrote)" in out
    )
    assert "rerun with `snakemake --forcerun extract`" in out and ".done" not in out, out[-3000:]
    assert (root / "results" / "data_config.json").read_bytes() == manifest
    # the advice followed: the forced extraction makes the shard again, and the manifest job passes
    # (the target first: --forcerun takes every word after it)
    run.snakemake("results/data_config.json", "--forcerun", "extract")
    again = json.loads((root / "results" / "data_config.json").read_text())
    assert [s["content_sha256"] for s in again["shards"]] == [s["content_sha256"] for s in first["shards"]]

    # a truncated shard: one line naming it, from `draftsmith manifest` as the rule runs it
    shard0 = hidden / "shard-0.safetensors"
    shard0.write_bytes(shard0.read_bytes()[:-1000])
    cmd = ["draftsmith", "manifest", "--target", str(target), "--out", str(root / "m.json"), str(shard0)]
    result = _run(cmd)
    assert result.returncode == 1
    out = _one_line_error(result)
    assert f"{shard0}: truncated" in out and "SafetensorError" not in out

    # the fix as the start advises it: force the extraction (the shards deleted too, as a user might);
    # its stash redoes only what is not intact (shard 0, truncated through its hard link), to the same
    # content. (A plain rerun plans nothing: the manifest is up to date, so Snakemake needs no shard.)
    (hidden / "shard-1.safetensors").unlink()
    shard0.unlink()
    dry = run.snakemake("results/data_config.json", "--forcerun", "extract", "-n").stdout
    assert re.search(r"rule extract:", dry), dry[-3000:]  # the one extraction job
    run.snakemake("results/data_config.json", "--forcerun", "extract")
    again = json.loads((root / "results" / "data_config.json").read_text())
    digests = [s["content_sha256"] for s in again["shards"]]
    assert digests == [s["content_sha256"] for s in first["shards"]]  # bit-identical tensors
    verify = _run(["draftsmith", "verify", str(root / "results" / "data_config.json")])
    assert verify.returncode == 0, verify.stderr


def test_a_damaged_intermediate_stops_the_run_at_start_and_keeps_what_reads_it(workflow):
    """A corrupt vocab_map.pt with a new mtime: Snakemake would rerun train, deleting the drafter before
    torch fails on the file. The digest its stage sealed it with stops the run at start, naming the file
    and the stage to rerun; the drafter and its metrics stay."""
    run, _, _ = workflow
    vocab = run.results / "vocab_map.pt"
    data = bytearray(vocab.read_bytes())
    data[len(data) // 2] ^= 0xFF
    vocab.write_bytes(bytes(data))  # same size, a new mtime
    # the drafter's files (not their seals, which a start rewrites for this copy's new inodes)
    kept = {
        p: p.read_bytes() for p in (run.results / "drafter").iterdir() if p.is_file() and p.name[0] != "."
    }
    for args in (("-n",), ()):
        result = run.snakemake(*args, check=False)
        assert result.returncode == 2
        out = _one_line_error(result)
        assert "results/vocab_map.pt: damaged (its sha256 differs from what rule vocab wrote)" in out, out
        assert "rerun with `snakemake --forcerun vocab`" in out
    assert {p: p.read_bytes() for p in kept} == kept
    assert (run.results / "train" / "metrics.jsonl").is_file()
    # the named fix: the forced vocab stage makes it again (same tokens, same map)
    run.snakemake("results/vocab_map.pt", "--forcerun", "vocab")
    assert vocab.read_bytes() != bytes(data)


def test_a_deleted_manifest_is_rebuilt_and_does_not_retrain(workflow):
    """Content decides, not mtime: data_config.json deleted, the manifest is made again from the same
    shards to the same bytes and training does not run again. (The evaluation jobs do: Snakemake planned
    them behind train before the checkpoint was judged again, and keeps that plan; but every vLLM run is
    kept by what it measured, so none loads an engine again.)"""
    run, _, _ = workflow
    data = run.results / "data_config.json"
    before = data.read_bytes()
    trained = ["drafter/model.safetensors", "drafter/config.json", "train/metrics.jsonl"]
    stamps = {name: (run.results / name).stat().st_mtime_ns for name in trained}
    data.unlink()
    result = run.snakemake()
    ran = re.findall(r"^(?:local)?(?:rule|checkpoint) (\w+):", result.stdout + result.stderr, re.M)
    assert data.read_bytes() == before
    assert "manifest" in ran and "train" not in ran, ran
    assert {name: (run.results / name).stat().st_mtime_ns for name in trained} == stamps, ran
    log = (run.workdir / "logs" / "evaluate_vllm.log").read_text()
    assert "evaluate_vllm" not in ran or "vllm: 0 engine runs measured" in log, log[-2000:]


@pytest.mark.parametrize("command", ["evaluate", "evaluate-vllm"])
def test_missing_drafter_config_is_one_line_before_any_model_loads(tmp_path, target_model, command):
    drafter = tmp_path / "drafter"
    drafter.mkdir()  # results/drafter exists, its config.json does not (a half-finished export)
    prompts = tmp_path / "heldout.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    cmd = ["draftsmith", command, "--target", str(target_model), "--drafter", str(drafter)]
    held = "split=" if command == "evaluate-vllm" else ""  # evaluate-vllm takes SET=PATH per held-out set
    args = ["--prompts", f"{held}{prompts}", "--out", f"{held}{tmp_path / 'eval.json'}"]
    result = _run([*cmd, *args], timeout=120)
    assert result.returncode == 2
    out = _one_line_error(result)
    assert f"{drafter / 'config.json'} is missing" in out
    assert len([line for line in out.splitlines() if line.strip()]) == 1, out
    assert not (tmp_path / "eval.json").exists()


def _small_disk_available() -> bool:
    """A private tmpfs through an unprivileged user+mount namespace (`unshare -rm`), or as root."""
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _small_disk_available(), reason="cannot mount a private tmpfs (unshare -rm)")
def test_disk_too_small_is_a_clear_message(tmp_path, target_model):
    """A real small disk: a 2 MB tmpfs holds the probe's few samples but not the shard (~5 MB)."""
    ids, masks = random_sequences([200] * 8)
    tokens = tmp_path / "tokens.safetensors"
    write_sample_tokens(tokens, ids, masks, [[0, 8]])
    disk = tmp_path / "small"
    disk.mkdir()
    extract = [sys.executable, "-m", "draftsmith.cli", "extract", "--target", str(target_model)]
    extract += ["--tokens", str(tokens), "--shard", "0", "--out", str(disk / "shard-0.safetensors")]
    extract += ["--compile", "off", "--batch-tokens", "400"]
    script = f"mount -t tmpfs -o size=2m tmpfs {disk} && exec {' '.join(extract)}"
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], env=cli_env(), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 1, result.stderr[-3000:]
    out = _one_line_error(result)
    assert "not enough free disk" in out or "disk full while writing shard 0" in out, out[-2000:]
    assert "MB free" in out and "extract.codec" not in out  # zstd-planes is already in use
    assert not list(disk.iterdir())  # the mount is gone with its namespace; nothing leaked beneath


@pytest.mark.parametrize(
    ("section", "values", "key"),
    [
        ("vocab", {"size": 0}, "vocab.size"),
        ("extract", {"aux_layers": [2, 2, 3]}, "extract.aux_layers"),
        ("extract", {"aux_layers": [5, 2, 3]}, "extract.aux_layers"),
        ("extract", {"aux_layers": [2, 15, 99]}, "extract.aux_layers"),
        ("vocab", {"size": 10**6}, "vocab.size"),
    ],
)
def test_bad_config_values_are_refused_naming_the_key(tmp_path, target_model, section, values, key):
    config = yaml.safe_load((REPO / "tests" / "config.tiny.yaml").read_text())
    config.setdefault(section, {}).update(values)
    config["target"] = {"model": str(target_model), "gguf_wheel": None}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cmd = ["snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path)]
    result = _run([*cmd, "--configfile", str(path), "-n"], timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-2000:]
    assert key in out, out[-2000:]
