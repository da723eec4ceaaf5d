"""train.hidden_states planned at start (core/planning/hidden_plan.py): the rule auto follows, the refusal of a files
run that cannot fit, the figures the plan reads, and a dry run that plans the mode the start line names."""

from __future__ import annotations

import json
import os

import pytest
from helpers.workflow import REPO, snakemake
from snakemake.utils import validate

from draftsmith.core.data.tokens import write_tokens
from draftsmith.core.planning.hidden_plan import (
    FREE_BYTES_ENV,
    StatesEstimate,
    choose_mode,
    files_refusal,
    free_disk,
    kept_mode,
    plan_hidden_states,
    token_bound,
)

GB = 10**9


def est(needed_gb: float, free_gb: float, epochs: int = 3, prefill_s: float | None = None) -> StatesEstimate:
    """An estimate of `needed_gb` of states (1,000 tokens of 1 MB) and `free_gb` free."""
    tokens = int(needed_gb * 1000)
    return StatesEstimate(tokens, "a test", 10**6, int(free_gb * GB), 0, epochs, prefill_s)


VLLM_ON_GPU = "extract.backend vllm beside the trainer on a GPU is not planned yet"


@pytest.mark.parametrize(
    ("needed", "free", "epochs", "prefill", "blocked", "hybrid_blocked", "mode"),
    [
        (10, 100, 3, None, None, None, "files"),  # fits with room: kept for retrains
        (45, 100, 3, None, None, None, "files"),  # 49.5 GB with the margin: within half
        (46, 100, 3, None, None, None, "hybrid"),  # 50.6 GB: over half, fits: only for the run
        (90, 100, 3, None, None, None, "hybrid"),  # 99 GB: fits, just
        (91, 100, 3, None, None, None, "stream"),  # 100.1 GB: does not fit
        (10, 100, 1, None, None, None, "stream"),  # one epoch: one prefill in any mode
        (60, 100, 3, 200.0, None, None, "stream"),  # 2 x 200 s of re-prefill: cheaper than filling the disk
        (60, 100, 3, 400.0, None, None, "hybrid"),  # 2 x 400 s: worth the cache
        (60, 100, 3, None, None, "2 GPUs", "stream"),  # hybrid cannot run: stream
        (91, 100, 3, None, VLLM_ON_GPU, None, "files"),  # stream cannot run: files, the only mode
        (10, 100, 1, None, VLLM_ON_GPU, None, "files"),
    ],
)
def test_auto_picks_by_disk_epochs_and_prefill(needed, free, epochs, prefill, blocked, hybrid_blocked, mode):
    choice = choose_mode(est(needed, free, epochs, prefill), blocked, hybrid_blocked=hybrid_blocked)
    assert choice.mode == mode, choice.why


@pytest.mark.parametrize(
    ("kept", "needed", "blocked", "mode"),
    [
        ("files", 60, None, "files"),  # not hybrid: the shards written stay in use
        ("files", 200, None, "stream"),  # no longer fits
        ("hybrid", 10, None, "hybrid"),  # not files once tokenize's exact count is smaller
        ("stream", 10, None, "stream"),
        ("stream", 10, VLLM_ON_GPU, "files"),
    ],
)
def test_a_mode_an_earlier_start_wrote_is_kept_while_it_still_runs(kept, needed, blocked, mode):
    assert choose_mode(est(needed, 100), blocked, kept=kept).mode == mode


def test_a_files_run_that_cannot_fit_is_refused_with_the_figures():
    assert files_refusal(est(10, 100)) == (None, None)
    refusal, warning = files_refusal(est(200, 100))
    assert warning is None
    assert refusal.startswith("train.hidden_states: files needs up to 220.0 GB of shards (+10% margin;")
    assert "100.0 GB is free: use hybrid" in refusal and "or stream (0 B on disk" in refusal
    # where neither can run, files is the only mode: a warning (the bound is loose), not a refusal
    refusal, warning = files_refusal(est(200, 100), VLLM_ON_GPU)
    assert refusal is None and "hybrid and stream cannot run here" in warning


def config(**sections) -> dict:
    """A config as Snakemake's validate() leaves it (defaults filled in), with `sections` set."""
    cfg = json.loads(json.dumps(sections))
    validate(cfg, schema=str(REPO / "draftsmith" / "config.schema.yaml"))
    return cfg


def test_the_token_bound_is_the_tokens_file_else_prompts_x_max_seq_len(tmp_path):
    results = tmp_path / "results"
    cfg = config(
        prompts={"max_prompts": 100, "num_heldout": 10, "code_prompts": 5}, extract={"max_seq_len": 512}
    )
    assert token_bound(cfg, results) == (
        95 * 512,
        "95 prompts (prompts.max_prompts - num_heldout + code_prompts) x extract.max_seq_len 512",
    )
    (results / "prompts").mkdir(parents=True)
    (results / "prompts" / "train.jsonl").write_text('{"id": 1}\n{"id": 2}\n\n')
    assert token_bound(cfg, results)[0] == 2 * 512
    write_tokens(
        results / "tokens.safetensors", [1, 2, 3, 4, 5], [0, 1, 1, 1, 1], [0, 2, 5], {"shards": [[0, 2]]}
    )
    assert token_bound(cfg, results) == (5, str(results / "tokens.safetensors"))
    assert token_bound(config(prompts={"max_prompts": 0}), tmp_path / "none") is None  # all: unbounded


def test_free_disk_is_the_real_disk_unless_a_test_says(tmp_path, monkeypatch):
    monkeypatch.delenv(FREE_BYTES_ENV, raising=False)
    assert free_disk(tmp_path / "results" / "not yet") > 0  # its nearest existing folder's disk
    monkeypatch.setenv(FREE_BYTES_ENV, "12e6")
    assert free_disk(tmp_path) == 12_000_000


def test_the_kept_mode_is_the_newest_manifest(tmp_path):
    assert kept_mode(tmp_path) is None
    (tmp_path / "stream_config.json").write_text(json.dumps({"hidden_states": "hybrid"}))
    assert kept_mode(tmp_path) == "hybrid"
    (tmp_path / "data_config.json").write_text("{}")
    later = (tmp_path / "stream_config.json").stat().st_mtime + 10
    os.utime(tmp_path / "data_config.json", (later, later))
    assert kept_mode(tmp_path) == "files"


TARGET = {
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}


def test_the_plan_of_a_config_names_its_figures(tmp_path, monkeypatch):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(TARGET))
    monkeypatch.setenv(FREE_BYTES_ENV, str(10 * GB))
    cfg = config(
        target={"model": str(tmp_path / "target"), "gguf_wheel": None},
        prompts={"max_prompts": 110, "num_heldout": 10},
        extract={"max_seq_len": 1000},
        train={"hidden_states": "auto", "epochs": 3},
    )
    mode, line, refusal = plan_hidden_states(cfg, tmp_path / "results")
    # 100 prompts x 1000 tokens x 4 layers (3 aux + final) x 576 x 2 bytes = 460.8 MB
    assert (mode, refusal) == ("files", None)
    assert line.startswith("train.hidden_states auto -> files: the states fit in half the free disk")
    assert "states up to 460.8 MB (100,000 tokens from 100 prompts" in line and "10.0 GB free" in line
    monkeypatch.setenv(FREE_BYTES_ENV, str(100 * 10**6))
    cfg["train"]["hidden_states"] = "files"
    mode, line, refusal = plan_hidden_states(cfg, tmp_path / "results")
    assert "files needs up to 506.9 MB of shards" in refusal and "100.0 MB is free" in refusal
    # a vLLM engine beside the trainer on a GPU too small for both: stream cannot run, files only warns
    cfg["extract"]["backend"], cfg["resources"]["train"]["gpus"] = "vllm", 1
    cfg["resources"]["gpu_memory_gib"] = 0.5
    mode, line, refusal = plan_hidden_states(cfg, tmp_path / "results")
    assert refusal is None and line.startswith("warning: train.hidden_states: files needs up to 506.9 MB")
    assert "the train job's engine and trainer do not fit its GPUs: train: engine (each GPU) needs" in line
    cfg["resources"]["gpu_memory_gib"] = 80  # both fit: streaming is possible, so files is refused
    assert plan_hidden_states(cfg, tmp_path / "results")[2].startswith("train.hidden_states: files needs")


# the tiny configuration: 21 training prompts x extract.max_seq_len 256 = 5,376 tokens x 4 x 576 x 2 bytes
# = 24.8 MB of states, 27.2 MB with the margin; 2 epochs
@pytest.mark.parametrize(("free", "mode"), [(10**9, "files"), (40 * 10**6, "hybrid"), (20 * 10**6, "stream")])
def test_a_dry_run_plans_the_mode_auto_names(tmp_path, monkeypatch, free, mode):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(TARGET))
    monkeypatch.setenv(FREE_BYTES_ENV, str(free))
    proc = snakemake(tmp_path, "-n", "-p", "--config", "target={model: target, gguf_wheel: null}",
                     "train={hidden_states: auto}")  # fmt: skip
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("train.hidden_states auto")]
    assert line.startswith(f"train.hidden_states auto -> {mode}: ")
    jobs = proc.stdout
    assert ("rule extract:" in jobs) == (mode == "files")
    assert ("rule stream_manifest:" in jobs) == (mode != "files")
    assert ("--cache" in jobs) == (mode == "hybrid")
    train_reads = "results/stream_config.json" if mode != "files" else "results/data_config.json"
    assert f"--manifest {train_reads}" in jobs


def test_a_files_run_that_cannot_fit_stops_at_start(tmp_path, monkeypatch):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(TARGET))
    monkeypatch.setenv(FREE_BYTES_ENV, str(20 * 10**6))
    proc = snakemake(tmp_path, "-n", "--config", "target={model: target, gguf_wheel: null}", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "train.hidden_states: files needs up to 27.2 MB of shards" in proc.stderr
    assert "20.0 MB is free: use hybrid" in proc.stderr
    assert not (tmp_path / "results").exists()  # before any job
