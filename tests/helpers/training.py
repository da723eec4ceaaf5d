"""Training runs on tiny data: settings, the objective, a drafter and its inputs, a run and what it left."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from draftsmith.core.model.drafter import DrafterConfig, Eagle3Drafter
from draftsmith.core.model.target import load_target_head
from draftsmith.core.training.checkpoints import list_checkpoints
from draftsmith.core.training.objective import Objective
from draftsmith.stages.train import TrainSettings, train

from .data import TINY_AUX_IDS, TINY_DRAFT_VOCAB


def cli_train(manifest: Path, vocab: Path, root: Path, s: TrainSettings) -> list[str]:
    """`draftsmith train` of this manifest into root/drafter, root/checkpoints, root/metrics.jsonl."""
    return [
        sys.executable, "-m", "draftsmith.cli", "train", "--manifest", str(manifest),
        "--vocab", str(vocab), "--out", str(root / "drafter"),
        "--checkpoints", str(root / "checkpoints"), "--metrics", str(root / "metrics.jsonl"),
        "--settings", json.dumps(s.to_dict()),
    ]  # fmt: skip


def settings(**over) -> TrainSettings:
    """Training settings sized for make_tiny_data's data (2 epochs, 1 thread), with `over` changed."""
    base = {
        "epochs": 2,
        "max_steps": None,
        "lr": 3e-3,
        "weight_decay": 0.01,
        "warmup_steps": 2,
        "grad_clip": 1.0,
        "batch_tokens": 128,
        "max_seq_len": 64,
        "ttt_steps": 3,
        "ttt_decay": 0.8,
        "noise_std": 0.05,
        "val_fraction": 0.2,
        "seed": 0,
        "threads": 1,
        "checkpoint_every": 0,
        "pack_window": 8,
        "loader_threads": 2,
    }
    return TrainSettings.from_dict({**base, **over})


def objective(steps: int = 3, **over) -> Objective:
    """The validation view of `steps` TTT steps weighted 0.8**j in fp32, with `over` changed."""
    view = Objective.from_settings(
        settings(ttt_steps=steps, ttt_decay=0.8, precision="fp32")
    ).for_validation()
    return replace(view, **over)


def build(data: dict, seed: int = 0) -> tuple[Eagle3Drafter, torch.Tensor, torch.Tensor]:
    """A drafter for make_tiny_data's target, initialised from its head, with the target's embedding
    and the teacher's weights over the draft vocabulary."""
    from draftsmith.core.data.vocab import load_vocab_map

    torch.manual_seed(seed)
    head = load_target_head(data["target"])
    vocab = load_vocab_map(data["vocab"])
    drafter = Eagle3Drafter(DrafterConfig.from_target(head.config, TINY_DRAFT_VOCAB, len(TINY_AUX_IDS)))
    drafter.set_vocab_map(vocab["d2t"], vocab["t2d"])
    drafter.init_from_target(head.lm_head, head.norm)
    teacher = head.lm_head[torch.arange(TINY_DRAFT_VOCAB) + vocab["d2t"]]
    return drafter, head.embed, teacher


def run(data: dict, root: Path, s: TrainSettings, progress: bool = False) -> dict:
    """Train on make_tiny_data's `data` into root/drafter, root/checkpoints and root/metrics.jsonl."""
    return train(
        data["manifest"],
        data["vocab"],
        root / "drafter",
        root / "checkpoints",
        root / "metrics.jsonl",
        s,
        progress=progress,
    )


def rows(root: Path) -> list[dict]:
    """The rows of root/metrics.jsonl, as a run wrote them."""
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


def run_folder(root: Path) -> Path:
    """The one run-<key> folder under root/checkpoints."""
    found = sorted((root / "checkpoints").glob("run-*"))
    assert len(found) == 1, found
    return found[0]


def checkpoints_of(root: Path) -> list[Path]:
    """Complete checkpoints in any run folder under root/checkpoints, oldest first."""
    return [p for folder in sorted((root / "checkpoints").glob("run-*")) for p in list_checkpoints(folder)]
