"""Data-parallel training: 2 CPU processes (torchrun, gloo, DistributedDataParallel) train the weights
1 process trains; a killed 2-process run resumes exactly; a run resumes on another world size; damaged
data stops every rank before training.

Each rank trains a disjoint slice of every batch and normalises its loss by the whole batch's count of
trained positions; DDP sums the gradients over ranks. So 2 processes compute the same gradient as 1, up
to floating-point summation order: the per-position counts and token counts must match exactly, losses
within TOLERANCE.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.data import flip_state_bit, make_tiny_data
from helpers.training import build, checkpoints_of, objective, rows, run, run_folder, settings
from safetensors.torch import load_file

from draftsmith.core.data.loader import StreamingData, verify_share
from draftsmith.core.data.manifest import load_manifest
from draftsmith.core.data.shards import ShardReader
from draftsmith.core.io.devices import process_tree
from draftsmith.core.training.distributed import Dist, rank_threads
from draftsmith.core.training.objective import DraftingLoss, StepStats

# 1 vs 2 processes differ only in how fp32 sums are grouped (one sum over the batch vs two partial sums
# added). Measured on this data over 30 steps: loss curves agree to 1.2e-7 relative, fp32 weights to
# 6e-7 absolute. The tolerance leaves ~100x margin, yet catches subtle bugs: each rank averaging over
# its own slice (instead of dividing by the whole batch's count) already moves the loss by 9e-4
# relative and the weights by 3e-3; a missing all-reduce or overlapping slices by far more.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return make_tiny_data(tmp_path_factory.mktemp("ddp-data"))


def _settings(**over):
    # batch_tokens 64: batches of 1-4 samples, so some ranks get an empty slice (the one-sample batches)
    # 10 epochs (~100 steps, seconds): a kill at the first checkpoint lands mid-run even on a busy machine
    base = {"epochs": 10, "batch_tokens": 64, "noise_std": 0.0, "checkpoint_every": 4, "precision": "fp32"}
    return settings(**{**base, **over})


def train_command(data: dict, root: Path, s, nproc: int = 2) -> list[str]:
    """`draftsmith train --nproc 2`: re-executes itself under torch.distributed.run (gloo on CPU)."""
    return [
        sys.executable, "-m", "draftsmith.cli", "train", "--nproc", str(nproc),
        "--manifest", str(data["manifest"]), "--vocab", str(data["vocab"]), "--out", str(root / "drafter"),
        "--checkpoints", str(root / "checkpoints"), "--metrics", str(root / "metrics.jsonl"),
        "--settings", json.dumps(s.to_dict()),
    ]  # fmt: skip


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def torchrun_train(data: dict, root: Path, s, nproc: int = 2, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        train_command(data, root, s, nproc), env=ENV, capture_output=True, text=True, timeout=600
    )
    if ok:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return proc


def curve(root: Path, kind: str = "train") -> list[dict]:
    return [r for r in rows(root) if r["kind"] == kind]


def assert_same_curve(one: list[dict], two: list[dict]) -> None:
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two, strict=True):
        # integers: every position and token trained exactly once across the ranks
        assert a["positions"] == b["positions"] and a["tokens"] == b["tokens"], a["step"]
        assert b["loss"] == pytest.approx(a["loss"], rel=TOLERANCE), (a["step"], a["loss"], b["loss"])
        for x, y in zip(a["step_loss"], b["step_loss"], strict=True):
            assert (x is None and y is None) or y == pytest.approx(x, rel=TOLERANCE)


def final_weights(root: Path, step: int) -> dict[str, torch.Tensor]:
    """The fp32 weights of the checkpoint at `step` (the drafter written is bf16-rounded)."""
    return load_file(str(run_folder(root) / f"step-{step}" / "model.safetensors"))


@pytest.fixture(scope="module")
def one(data: dict, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """An uninterrupted single-process run -> (its folder, its summary)."""
    root = tmp_path_factory.mktemp("one")
    return root, run(data, root, _settings())


@pytest.fixture(scope="module")
def two(data: dict, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """An uninterrupted 2-process run -> (its folder, its summary)."""
    root = tmp_path_factory.mktemp("two")
    proc = torchrun_train(data, root, _settings())
    assert "on 2 process(es)" in proc.stdout
    return root, json.loads((root / "drafter" / "train_summary.json").read_text())


@pytest.mark.slow
def test_two_processes_train_the_single_process_weights(data: dict, one, two) -> None:
    (one_root, one_summary), (two_root, two_summary) = one, two
    loader = StreamingData.from_manifest(load_manifest(data["manifest"]), _settings())
    plans = [loader.epoch_batches(e) for e in range(10)]
    loader.close()
    assert any(len(b) == 1 for p in plans for b in p)  # rank 1 then trains nothing and still syncs
    assert two_summary["world_size"] == 2 and two_summary["steps"] == one_summary["steps"]
    assert_same_curve(curve(one_root), curve(two_root))
    assert_same_curve(curve(one_root, "val"), curve(two_root, "val"))
    a, b = final_weights(one_root, one_summary["steps"]), final_weights(two_root, two_summary["steps"])
    for name in a:
        if a[name].is_floating_point():
            torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)
        else:
            assert torch.equal(a[name], b[name])


@pytest.mark.slow
def test_a_killed_two_process_run_resumes_exactly(data: dict, two, tmp_path: Path) -> None:
    """SIGKILL torchrun and both workers once a mid-run checkpoint exists, rerun the same command: the
    weights, losses and drafter equal the uninterrupted 2-process run's bit for bit."""
    two_root, two_summary = two
    proc = subprocess.Popen(
        train_command(data, tmp_path, _settings()), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not checkpoints_of(tmp_path):
        time.sleep(0.01)
    for pid in process_tree(proc.pid):  # torchrun and its workers (each in its own session)
        os.kill(pid, signal.SIGKILL)
    out = proc.communicate()[0].decode(errors="replace")
    assert proc.returncode == -signal.SIGKILL, f"finished before the kill:\n{out[-3000:]}"
    done = checkpoints_of(tmp_path)
    assert done and not (tmp_path / "drafter").exists()
    (tmp_path / "metrics.jsonl").unlink()  # Snakemake deletes a failed job's declared outputs

    torchrun_train(data, tmp_path, _settings())
    summary = json.loads((tmp_path / "drafter" / "train_summary.json").read_text())
    assert summary["resumed_from_step"] is not None and summary["steps"] == two_summary["steps"]
    a, b = final_weights(two_root, summary["steps"]), final_weights(tmp_path, summary["steps"])
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    a = load_file(str(two_root / "drafter" / "model.safetensors"))
    b = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert all(torch.equal(a[n], b[n]) for n in a)

    def losses(root: Path) -> list:
        return [(r["kind"], r["step"], r["loss"]) for r in rows(root) if r["kind"] in ("train", "val")]

    assert losses(tmp_path) == losses(two_root)
    assert [r["kind"] for r in rows(tmp_path)].count("resume") == 1


@pytest.mark.slow
def test_a_run_resumes_on_another_world_size(data: dict, one, tmp_path: Path, caplog) -> None:
    """Stopped under 2 processes, resumed by 1: the same batches and sums, so the run ends where the
    single-process run does (within the summation-order tolerance), and says that the world changed."""
    one_root, one_summary = one
    k = one_summary["steps_per_epoch"][0] + 2  # mid-epoch 2
    torchrun_train(data, tmp_path, _settings(max_steps=k))
    with caplog.at_level(logging.WARNING, logger="draftsmith.stages.train"):
        summary = run(data, tmp_path, _settings())
    assert summary["resumed_from_step"] == k and summary["world_size"] == 1
    assert any("checkpoint of 2 process(es) on 1" in r.getMessage() for r in caplog.records)
    assert_same_curve(curve(one_root), curve(tmp_path))
    a, b = final_weights(one_root, one_summary["steps"]), final_weights(tmp_path, summary["steps"])
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_damaged_data_stops_every_rank_before_training(data: dict, tmp_path: Path) -> None:
    """A flipped bit in one shard: the rank whose share holds the sample names it, the other says
    another rank found damage, both exit 1 at once (no rank waits in a collective), nothing trains."""
    copy = tmp_path / "data"
    shutil.copytree(data["root"], copy, ignore=shutil.ignore_patterns("target"))
    manifest = json.loads((copy / "data_config.json").read_text())
    manifest["target"] = str(data["target"])
    (copy / "data_config.json").write_text(json.dumps(manifest))
    flip_state_bit(copy / "hidden" / "shard-1.safetensors")
    damaged = {**data, "manifest": copy / "data_config.json", "vocab": copy / "vocab_map.pt"}
    t0 = time.perf_counter()
    proc = torchrun_train(damaged, tmp_path, _settings(), ok=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and time.perf_counter() - t0 < 120
    assert "refusing to train on data that fails verification" in out and "shard-1.safetensors: sample" in out
    assert "another rank found data that fails verification" in out
    assert not (tmp_path / "drafter").exists() and not (tmp_path / "checkpoints").exists()


def test_the_ranks_verify_every_sample_once(data: dict, monkeypatch) -> None:
    """verify_share: 2 ranks decode disjoint shares that together are every sample of every shard."""
    read: list[tuple[str, int]] = []
    original = ShardReader.read

    def recording(self: ShardReader, i: int, max_tokens: int | None = None):
        read.append((self.path.name, i))
        return original(self, i, max_tokens)

    monkeypatch.setattr(ShardReader, "read", recording)
    shares = []
    for rank in (0, 1):
        read.clear()
        assert verify_share(data["manifest"], rank, 2, threads=0) == []
        shares.append(set(read))
    every = {(f"shard-{k}.safetensors", i) for k in (0, 1) for i in range(12)}
    assert shares[0] | shares[1] == every and not shares[0] & shares[1]
    assert abs(len(shares[0]) - len(shares[1])) <= 1


def test_one_process_trains_the_module_itself() -> None:
    module = torch.nn.Linear(2, 2)
    assert Dist().wrap(module) is module and Dist().total(3) == 3
    stats = StepStats([1.5], [2], [3], 1, 10)
    assert stats.all_sum(Dist()) is stats


def test_a_rank_without_a_share_gives_zero_gradients(data: dict) -> None:
    """DDP needs every rank's backward: a rank without samples in a batch contributes exact zeros."""
    drafter, embed, teacher = build(data)
    sums: list[torch.Tensor] = []
    model = DraftingLoss(drafter, embed, teacher, all_sum=lambda t: sums.append(t) or t)
    loss, stats = model(None, objective())
    loss.backward()
    assert float(loss.detach()) == 0 and stats.count == [0, 0, 0]
    assert all(p.grad is not None and not p.grad.any() for p in drafter.parameters())
    model(None, objective(lk_loss="lambda"))  # the other ranks sum each step's acceptance: so does it
    assert [t.tolist() for t in sums] == [[0.0, 0.0]] * 3


def test_two_processes_in_micro_batches_train_the_single_process_weights(data: dict, tmp_path: Path) -> None:
    """Shares by tokens, each in micro-batches of ~one sample (gradients accumulated, DDP's sum in the
    last backward only): the weights of one process training each batch in one pass."""
    whole = _settings(epochs=2, checkpoint_every=0)
    one_summary = run(data, tmp_path / "one", whole)
    torchrun_train(data, tmp_path / "two", replace(whole, micro_batch_tokens=20))
    assert_same_curve(curve(tmp_path / "one"), curve(tmp_path / "two"))
    a = final_weights(tmp_path / "one", one_summary["steps"])
    b = final_weights(tmp_path / "two", one_summary["steps"])
    for name in a:
        if a[name].is_floating_point():
            torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)


def test_peagle_with_one_ttt_step_trains_under_ddp(data: dict, tmp_path: Path) -> None:
    """P-EAGLE's mask_hidden reaches the loss only through TTT steps >= 1: with ttt_steps 1 no rank uses
    it, and DDP (find_unused_parameters=False) failed the second step waiting for its gradient."""
    s = _settings(drafter={"kind": "peagle"}, ttt_steps=1, epochs=1, max_steps=2, checkpoint_every=0)
    torchrun_train(data, tmp_path, s)
    summary = json.loads((tmp_path / "drafter" / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2


def test_each_rank_takes_its_share_of_the_job_threads() -> None:
    """train.threads is the job's count: 8 ranks on 32 CPUs take 4 each, never fewer than 1."""
    assert rank_threads(32, 8) == 4 and rank_threads(32, 1) == 32
    assert rank_threads(8, 3) == 2 and rank_threads(2, 8) == 1
