"""bench.peer's draftsmith and specforge stages: both trainers at equal data (the optimizer step plan,
SpecForge's run config), each one's training, and SpecForge's weights exported as draftsmith's drafter."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import click
import torch
from torch import Tensor

from bench.peer.install import shim_command, side_env
from draftsmith.core.data.loader import StreamingData
from draftsmith.core.data.manifest import load_manifest
from draftsmith.core.io.atomic import write_json


def draftsmith_steps(manifest_path: Path, settings: dict[str, Any]) -> tuple[int, int]:
    """(optimizer steps of draftsmith's whole run, training samples)."""
    from draftsmith.stages.train import TrainSettings

    data = StreamingData.from_manifest(load_manifest(manifest_path), TrainSettings.from_dict(settings))
    steps = sum(len(data.epoch_batches(e)) for e in range(settings["epochs"]))
    n = len(data.train)
    data.close()
    if settings.get("max_steps") is not None:
        steps = min(steps, settings["max_steps"])
    return steps, n


def specforge_plan(num_samples: int, epochs: int, steps: int) -> dict[str, int]:
    """Micro-batches of one sample, accumulated so that SpecForge makes as many optimizer steps as
    draftsmith: accumulation = round(samples * epochs / steps); the run stops at the last complete step."""
    accumulation = max(1, round(num_samples * epochs / max(1, steps)))
    return {"accumulation_steps": accumulation, "steps": (num_samples * epochs) // accumulation}


def specforge_run_config(
    conv_dir: Path, out_dir: Path, settings: dict[str, Any], plan: dict[str, int], dtype: str
) -> dict[str, Any]:
    """`specforge train`'s config: SpecForge's defaults except the equal-data knobs and the CPU ones."""
    return {
        "model": {
            "target_model_path": str(conv_dir / "target"),
            "draft_model_config": str(conv_dir / "draft_config.json"),
            "vocab_mapping_path": str(conv_dir / "vocab_mapping.pt"),
            "torch_dtype": dtype,
        },
        "data": {
            "hidden_states_path": str(conv_dir / "train"),
            "max_length": int(settings["max_seq_len"]),
            "dataloader_num_workers": 0,  # CPU
        },
        "training": {
            "num_epochs": int(settings["epochs"]),
            "batch_size": 1,
            "accumulation_steps": plan["accumulation_steps"],
            "max_steps": plan["steps"],
            "total_steps": plan["steps"],
            "learning_rate": float(settings["lr"]),
            "ttt_length": int(settings["ttt_steps"]),
            "attention_backend": "sdpa",  # CPU: flex attention has no CPU backward
            "fsdp_sharding": "NO_SHARD",  # CPU, one process
            "seed": int(settings["seed"]),
            "log_interval": 1,
        },
        "output_dir": str(out_dir),
        "run_id": "peer",
    }


def draftsmith_code() -> str:
    """A digest of the draftsmith modules that decide training (the package on the import path)."""
    import draftsmith

    root = Path(draftsmith.__file__).parent
    h = hashlib.sha256()
    for name in (
        "stages/train.py",
        "core/training/objective.py",
        "core/training/optimizers.py",
        "core/model/drafter.py",
        "core/data/loader.py",
        "core/data/shards.py",
        "stages/vocab.py",
        "core/data/vocab.py",
    ):
        h.update((root / name).read_bytes())
    return h.hexdigest()[:16]


def train_draftsmith(
    manifest: Path, vocab: Path, settings: dict[str, Any], out: Path, fresh: bool
) -> dict[str, Any]:
    from draftsmith.stages.train import TrainSettings, train

    summary_path = out / "drafter" / "train_summary.json"
    key_path = out / "settings.json"
    settings = {**settings, "draftsmith_code": draftsmith_code()}  # a changed trainer retrains
    if (
        not fresh
        and summary_path.is_file()
        and key_path.is_file()
        and json.loads(key_path.read_text()) == settings
    ):
        return json.loads(summary_path.read_text())
    shutil.rmtree(out, ignore_errors=True)
    values = {k: v for k, v in settings.items() if k != "draftsmith_code"}
    summary = train(
        manifest, vocab, out / "drafter", out / "checkpoints", out / "metrics.jsonl",
        TrainSettings.from_dict(values), device="cpu", progress=False,
    )  # fmt: skip
    write_json(key_path, settings)
    return summary


def newest_specforge_state(out_dir: Path, run_id: str = "peer") -> Path:
    """The training_state.pt of SpecForge's newest checkpoint (`<output_dir>/<run_id>-latest`)."""
    path = out_dir / f"{run_id}-latest" / "training_state.pt"
    if not path.is_file():
        raise click.ClickException(f"SpecForge wrote no {path}")
    return path


def specforge_weights(state: dict[str, Any]) -> dict[str, Tensor]:
    """The draft weights of a SpecForge training_state.pt (`draft_state_dict`: the model's own dtype, what
    it deploys), under draftsmith's (= vLLM's) names, without the target's frozen embedding."""
    weights = state.get("draft_state_dict", state)
    return {
        name.removeprefix("module.").removeprefix("draft_model."): t
        for name, t in weights.items()
        if isinstance(t, Tensor) and "embed_tokens" not in name
    }


def finished_specforge_run(out: Path, cfg: dict[str, Any], plan: dict[str, int]) -> dict[str, Any] | None:
    """The summary of a SpecForge run under out/ with this config that reached its last step, else None
    (wall time: from its run.json to its final state)."""
    run_json, state = out / "run.json", out / "run" / "peer-latest" / "training_state.pt"
    if not (run_json.is_file() and state.is_file()) or json.loads(run_json.read_text()) != cfg:
        return None
    if int(torch.load(state, map_location="cpu", weights_only=False).get("global_step", -1)) != plan["steps"]:
        return None
    wall = state.stat().st_mtime - run_json.stat().st_mtime
    return {
        "config": cfg,
        "plan": plan,
        "state": str(state),
        "wall_s": round(wall, 1),
        "log": str(out / "train.log"),
    }


def train_specforge(
    venv: Path, conv_dir: Path, settings: dict[str, Any], plan: dict[str, int], dtype: str, threads: int | None,
    out: Path, fresh: bool,
) -> dict[str, Any]:  # fmt: skip
    cfg = specforge_run_config(conv_dir, out / "run", settings, plan, dtype)
    summary_path = out / "summary.json"
    if not fresh and summary_path.is_file() and json.loads(summary_path.read_text())["config"] == cfg:
        return json.loads(summary_path.read_text())
    done = finished_specforge_run(out, cfg, plan)
    if not fresh and done is not None:  # trained, but its summary was never written (the bench was stopped)
        write_json(summary_path, done)
        return done
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    write_json(out / "run.json", cfg)
    t0 = time.perf_counter()
    log_path = out / "train.log"
    with open(log_path, "w", encoding="utf-8") as fh:
        proc = subprocess.run(
            shim_command(venv, "train", "--config", str(out / "run.json")),
            stdout=fh, stderr=subprocess.STDOUT, env=side_env(threads), cwd=out,
        )  # fmt: skip
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise click.ClickException(f"SpecForge's training failed ({proc.returncode}); {log_path}:\n{tail}")
    state_path = newest_specforge_state(out / "run")
    summary = {
        "config": cfg,
        "plan": plan,
        "state": str(state_path),
        "wall_s": round(wall, 1),
        "log": str(log_path),
    }
    write_json(summary_path, summary)
    return summary


def import_specforge(
    state_path: Path, manifest_path: Path, vocab_path: Path, settings: dict[str, Any], out_dir: Path
) -> Path:
    """SpecForge's trained weights in draftsmith's drafter, exported as draftsmith exports its own."""
    from draftsmith.core.model.drafter import build_drafter
    from draftsmith.stages.train import TrainSettings, load_inputs, write_drafter

    manifest, vocab, target = load_inputs(manifest_path, vocab_path)
    s = TrainSettings.from_dict(settings)
    drafter, _, _ = build_drafter(target, vocab["d2t"], vocab["t2d"], int(manifest["num_aux"]), s, "cpu")
    weights = specforge_weights(torch.load(state_path, map_location="cpu", weights_only=False))
    drafter.load_state_dict(
        {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in weights.items()}
    )
    if not torch.equal(drafter.d2t, vocab["d2t"]) or not torch.equal(drafter.t2d, vocab["t2d"]):
        raise click.ClickException(f"{state_path}: its d2t/t2d are not {vocab_path}'s")
    summary = {"trainer": "SpecForge 0.2.0", "state": str(state_path)}
    write_drafter(drafter, out_dir, manifest, target.config, s, summary)
    return out_dir
