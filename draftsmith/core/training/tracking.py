"""Live training curves: every metrics row, as training writes it, also goes to TensorBoard event files
(when the tensorboard package is installed) and to the trackers of `resources.train.report_to` (W&B,
MLflow), so a run can be watched while it trains:

    tensorboard --logdir results/train/tensorboard

Layout: `<log_dir>/run-<key digest>/` per training run, the digest of checkpoints.py's resume key (the
same as its checkpoint folder), so runs with other data or settings appear side by side. A resumed run
appends to its folder and hides what the killed run logged after the checkpoint it resumes (TensorBoard's
purge_step); a run started afresh replaces its folder. W&B runs are named after the folder and resumed by
id (kept in the checkpoints); MLflow logs to MLFLOW_TRACKING_URI, experiment "draftsmith" (or
MLFLOW_EXPERIMENT_NAME). Only rank 0 reports.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FLUSH_S = 10  # TensorBoard writes its event file at least this often


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row -> {tag: value} of its numbers: "train/loss", "val/accuracy_ttt_step_0", ..."""
    kind = row["kind"]
    out = {f"{kind}/loss": row.get("loss")}
    for name, values in (("accuracy", row.get("acc")), ("agreement", row.get("agreement"))):
        for j, value in enumerate(values or []):
            out[f"{kind}/{name}_ttt_step_{j}"] = value
    for j, value in enumerate(row.get("step_loss") or []):
        out[f"{kind}/loss_ttt_step_{j}"] = value
    out[f"{kind}/teacher_accuracy"] = row.get("teacher_acc")
    for key in ("lr", "grad_norm", "tokens_per_s", "data_wait_s"):
        out[f"{kind}/{key}"] = row.get(key)
    return {tag: float(v) for tag, v in out.items() if v is not None}


class Curves:
    """Where rank 0 sends each metrics row as it is written (see the module docstring)."""

    def __init__(
        self,
        folder: Path,
        report_to: list[str],
        config: dict[str, Any],
        resumed_from: int | None,
        ids: dict[str, str],
    ):
        """folder: this run's folder (`<log_dir>/run-<digest>`); ids: the trackers' run ids a resumed run
        continues (updated in place with new ones, for the checkpoints to keep)."""
        self.ids = ids
        if resumed_from is None:
            shutil.rmtree(folder, ignore_errors=True)  # a run started afresh: its old curves go
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.tensorboard, self.wandb, self.mlflow = folder, None, None, None
        if importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resumed_from is None else resumed_from + 1  # what the killed run logged later
            self.tensorboard = SummaryWriter(str(folder), purge_step=purge, flush_secs=FLUSH_S)
        else:
            log.info("tensorboard is not installed (pip install tensorboard): no live training curves")
        if "wandb" in report_to:
            import wandb

            self.ids.setdefault("wandb", f"{folder.name}-{int(time.time())}")
            self.wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "draftsmith"),
                name=folder.name,
                id=self.ids["wandb"],
                resume="allow",
                config=config,
                dir=str(folder),
            )
        if "mlflow" in report_to:
            import mlflow

            mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "draftsmith"))
            run = mlflow.start_run(run_id=self.ids.get("mlflow"), run_name=folder.name)
            if "mlflow" not in self.ids:
                mlflow.log_params({k: str(v) for k, v in config.items()})
            self.ids["mlflow"], self.mlflow = run.info.run_id, mlflow

    def log(self, row: dict[str, Any]) -> None:
        values, step = scalars(row), int(row["step"])
        if self.tensorboard is not None:
            for tag, value in values.items():
                self.tensorboard.add_scalar(tag, value, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)
        if self.mlflow is not None:
            self.mlflow.log_metrics(values, step=step)

    def flush(self) -> None:
        """Event files up to date now (a checkpoint, an epoch end); otherwise at least every FLUSH_S."""
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            for f in self.folder.glob("events.out.tfevents.*"):
                f.chmod(0o644)
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.end_run()
