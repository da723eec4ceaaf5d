"""Live training curves (draftsmith/core/training/tracking.py): TensorBoard event files written as training goes, W&B
(offline mode, local files) and MLflow (a local file store) on request, a resumed run's curves without
the steps a killed run logged after its checkpoint."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from helpers.data import make_tiny_data
from helpers.training import rows, settings

from draftsmith.core.training.checkpoints import list_checkpoints
from draftsmith.core.training.tracking import scalars
from draftsmith.stages.train import TrainSettings, train


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return make_tiny_data(tmp_path_factory.mktemp("tracking-data"))


def run(data: dict, root: Path, **over) -> dict:
    s = settings(epochs=2, **over)
    return train(
        data["manifest"], data["vocab"], root / "drafter", root / "checkpoints", root / "metrics.jsonl", s,
        progress=False, log_dir=root / "tensorboard",
    )  # fmt: skip


def run_folder(root: Path) -> Path:
    """The one run-<digest> folder of the curves, named as the checkpoints' run folder."""
    (folder,) = (root / "tensorboard").iterdir()
    assert (root / "checkpoints" / folder.name).is_dir()
    return folder


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_scalars_of_a_row_hand_example() -> None:
    row = {"kind": "val", "step": 4, "loss": 2.0, "acc": [0.5, None], "agreement": [0.25, 0.125],
           "step_loss": [1.5, None], "teacher_acc": 0.75, "tokens": 9}  # fmt: skip
    assert scalars(row) == {
        "val/loss": 2.0,
        "val/accuracy_ttt_step_0": 0.5,
        "val/agreement_ttt_step_0": 0.25,
        "val/agreement_ttt_step_1": 0.125,
        "val/loss_ttt_step_0": 1.5,
        "val/teacher_accuracy": 0.75,
    }
    train_row = {"kind": "train", "step": 1, "loss": 1.0, "lr": 0.1, "grad_norm": 3.0, "tokens_per_s": 50.0}
    assert set(scalars(train_row)) == {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s"}


def test_training_writes_tensorboard_curves_as_it_goes(data: dict, tmp_path: Path) -> None:
    summary = run(data, tmp_path)
    curves = tensorboard_scalars(run_folder(tmp_path))
    train_rows = [r for r in rows(tmp_path) if r["kind"] == "train"]
    val_rows = [r for r in rows(tmp_path) if r["kind"] == "val"]
    assert curves["train/loss"] == [(r["step"], pytest.approx(r["loss"])) for r in train_rows]
    for tag in ("lr", "grad_norm", "tokens_per_s", "accuracy_ttt_step_2", "agreement_ttt_step_0"):
        assert [s for s, _ in curves[f"train/{tag}"]] == list(range(1, summary["steps"] + 1)), tag
    assert curves["val/accuracy_ttt_step_0"] == [(r["step"], pytest.approx(r["acc"][0])) for r in val_rows]
    assert len(val_rows) == 2


def test_a_resumed_run_hides_what_the_killed_run_logged_after_its_checkpoint(
    data: dict, tmp_path: Path
) -> None:
    """A run "killed" at step 3 whose last checkpoint is step 2 logged step 3 twice: TensorBoard shows it
    once, from the resumed run; the curve equals an uninterrupted run's."""
    run(data, tmp_path, max_steps=3, checkpoint_every=2)
    folder = list_checkpoints(next((tmp_path / "checkpoints").iterdir()))
    shutil.rmtree(folder[-1])  # step-3: as if the kill came before it was written
    (tmp_path / "drafter").rename(tmp_path / "drafter-killed")
    summary = run(data, tmp_path, checkpoint_every=2)
    assert summary["resumed_from_step"] == 2
    steps = [s for s, _ in tensorboard_scalars(run_folder(tmp_path))["train/loss"]]
    assert steps == list(range(1, summary["steps"] + 1))


def test_a_run_started_afresh_replaces_its_curves(data: dict, tmp_path: Path) -> None:
    run(data, tmp_path)
    before = sorted(p.name for p in run_folder(tmp_path).iterdir())
    run(data, tmp_path)  # a finished run, run again: trains afresh
    after = sorted(p.name for p in run_folder(tmp_path).iterdir())
    assert len(before) == len(after) == 1 and before != after  # one new event file, the old one gone


def wandb_history(folder: Path) -> list[dict]:
    """The history rows of an offline W&B run, read from its .wandb file (a LevelDB-style log of
    protobuf records: 32 KiB blocks, each record chunk behind a 7-byte header; FULL=1, LAST=4 end one)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, chunk, out = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                out.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
            chunk = b""
    return out


def test_wandb_offline_gets_every_row(data: dict, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    summary = run(data, tmp_path, report_to=["wandb"])
    history = wandb_history(run_folder(tmp_path))
    losses = {h["_step"]: h["train/loss"] for h in history if "train/loss" in h}
    train_rows = [r for r in rows(tmp_path) if r["kind"] == "train"]
    assert losses == {r["step"]: pytest.approx(r["loss"]) for r in train_rows}
    assert sum("val/accuracy_ttt_step_0" in h for h in history) == 2 and summary["steps"] == len(losses)


def test_mlflow_gets_every_row(data: dict, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    store = f"file://{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run(data, tmp_path, report_to=["mlflow"])
    client = MlflowClient(store)
    (experiment,) = [e for e in client.search_experiments() if e.name == "draftsmith"]
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == run_folder(tmp_path).name and found.data.params["lr"] == "0.003"
    history = client.get_metric_history(found.info.run_id, "train/loss")
    train_rows = [r for r in rows(tmp_path) if r["kind"] == "train"]
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["loss"])) for r in train_rows]


def test_a_tracker_not_installed_is_refused_naming_the_key(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(
        ValueError, match=r"resources\.train\.report_to: wandb not installed \(pip install wandb\)"
    ):
        TrainSettings(report_to=["wandb"])
    with pytest.raises(ValueError, match=r"resources\.train\.report_to\.0: 'neptune' is not one of"):
        TrainSettings(report_to=["neptune"])
