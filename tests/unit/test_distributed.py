"""Data-parallel training: 2 CPU processes (torchrun, gloo) follow the loss curve of 1 process.

Each rank trains a disjoint slice of every batch and normalises its loss by the whole batch's count of
trained positions; gradients are summed over ranks. So 2 processes compute the same gradient as 1,
up to floating-point summation order: the per-position counts and token counts must match exactly,
losses within TOLERANCE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train import make_tiny_data, rows, run, run_folder, settings

from draftsmith.distributed import Dist, sync_gradients
from draftsmith.loader import StreamingData
from draftsmith.manifest import load_manifest
from draftsmith.train import StepStats

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
    base = {"epochs": 3, "batch_tokens": 64, "noise_std": 0.0, "checkpoint_every": 0, "precision": "fp32"}
    return settings(**{**base, **over})


def torchrun_train(data: dict, root: Path, s, nproc: int = 2) -> subprocess.CompletedProcess:
    """`draftsmith train --nproc 2`: re-executes itself under torch.distributed.run (gloo on CPU)."""
    cmd = [
        sys.executable, "-m", "draftsmith.cli", "train", "--nproc", str(nproc),
        "--data", str(data["manifest"]), "--vocab", str(data["vocab"]), "--out", str(root / "drafter"),
        "--checkpoints", str(root / "checkpoints"), "--metrics", str(root / "metrics.jsonl"),
        "--settings", json.dumps(s.to_dict()),
    ]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
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


def test_two_processes_follow_one(data: dict, tmp_path: Path) -> None:
    s = _settings()
    one = run(data, tmp_path / "one", s)
    k = one["steps_per_epoch"][0] + 2  # the 2-process run stops mid-epoch 2, then resumes
    assert k < one["steps"]
    loader = StreamingData.from_manifest(load_manifest(data["manifest"]), s)
    plans = [loader.epoch_batches(e) for e in range(s.epochs)]
    loader.close()
    assert any(len(b) == 1 for p in plans for b in p)  # rank 1 then trains nothing and still syncs

    two = tmp_path / "two"
    first = torchrun_train(data, two, _settings(max_steps=k))
    assert "on 2 process(es)" in first.stdout
    assert_same_curve(curve(tmp_path / "one")[:k], curve(two))
    # both ranks resume from the checkpoint rank 0 wrote, and finish the run
    torchrun_train(data, two, s)
    summary = json.loads((two / "drafter" / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["resumed_from_step"] == k
    assert summary["steps"] == one["steps"]
    assert_same_curve(curve(tmp_path / "one"), curve(two))
    assert_same_curve(curve(tmp_path / "one", "val"), curve(two, "val"))
    n = one["steps"]  # the fp32 weights of the last checkpoint (the export is bf16-rounded)
    a = load_file(str(run_folder(tmp_path / "one") / f"step-{n}" / "model.safetensors"))
    b = load_file(str(run_folder(two) / f"step-{n}" / "model.safetensors"))
    for name in a:
        if a[name].is_floating_point():
            torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)
        else:
            assert torch.equal(a[name], b[name])


def test_sync_gradients_single_process_is_identity() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([1.0, 2.0, 3.0])
    sync_gradients([p, q], Dist())
    assert p.grad.tolist() == [1.0, 2.0, 3.0] and q.grad is None
    stats = StepStats([1.5], [2], [3], 1, 10)
    assert stats.all_sum(Dist()) is stats
