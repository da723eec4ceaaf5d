"""Training checkpoints and when to resume them.

Layout: `<checkpoints>/run-<key digest>/step-<n>/` where the key (`resume_key`) covers everything that
changes what training computes: the content digest of every shard, the vocabulary map, the aux layers,
the target, the drafter architecture and every setting but RESUME_FREE_SETTINGS. A run with other data
or settings therefore never sees another run's checkpoints (they are removed, with the differences
logged). Within its own folder a run resumes from the newest complete checkpoint, unless that checkpoint
is already where the run stops: then the run had finished and is being run again on purpose (e.g.
`snakemake --forcerun train`), so it trains afresh instead of re-exporting the old weights. A kill
after the last checkpoint but before the export costs a retrain, never a wrong drafter.

Each checkpoint also holds the metrics rows up to its step, so a resumed run rewrites the full
metrics.jsonl even after Snakemake deleted it (it is a declared output).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from draftsmith.core.io.atomic import atomic_dir, disk_full, write_json, write_jsonl
from draftsmith.core.io.units import human_bytes

if TYPE_CHECKING:  # the optimizers import the drafter; checkpoints only save what they are given
    from draftsmith.core.training.optimizers import Chain

log = logging.getLogger(__name__)

KEEP_CHECKPOINTS = 2
COMPLETE_MARKER = "COMPLETE"  # written last: a step folder without it is partial
KEY_FILE = "resume_key.json"  # in each run folder: the key, to log what differs
METRICS_FILE = "metrics.jsonl"  # in each checkpoint: the metrics rows up to its step
# settings that do not change the trajectory: a run may resume under different values
RESUME_FREE_SETTINGS = (
    "max_steps",
    "threads",
    "checkpoint_every",
    "loader_threads",
    "report_to",
    "micro_batch_tokens",  # the same optimizer steps in fewer or more passes
    "checkpoint_ttt",
)


# ---------------------------------------------------------------------------------------------- the key


def shard_digest(shard: dict[str, Any]) -> str:
    """The content digest a manifest lists for a shard (content-only when the manifest has one)."""
    digest = shard.get("content_sha256") or shard.get("sha256")
    if not digest:
        raise ValueError(f"manifest shard {shard.get('path')!r} lists no content_sha256 or sha256")
    return str(digest)


def resume_key(settings: Any, manifest: dict[str, Any], vocab: dict[str, Any], drafter_cfg: Any) -> dict:
    """What must match to resume a checkpoint: data content, vocab, target, model and settings
    (RESUME_FREE_SETTINGS aside). Shard paths are left out: moving the data changes nothing."""
    data = {
        "shards": [[shard_digest(s), s.get("num_samples"), s.get("num_tokens")] for s in manifest["shards"]],
        "aux_layer_ids": [int(i) for i in manifest["aux_layer_ids"]],
        "layer_convention": manifest.get("layer_convention", "input"),
        "target": str(manifest.get("target")),
        "d2t_sha256": hashlib.sha256(vocab["d2t"].to(torch.int64).numpy().tobytes()).hexdigest(),
    }
    if manifest.get("hidden_states") in (
        "stream",
        "hybrid",
    ):  # no shards: the tokens and what is captured from them
        data["stream"] = {"tokens_sha256": manifest["tokens"]["sha256"], **manifest["stream"]}
    kept = {k: v for k, v in settings.to_dict().items() if k not in RESUME_FREE_SETTINGS}
    return {"settings": kept, "data": data, "drafter": drafter_cfg.to_dict()}


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def run_dir(checkpoint_dir: str | Path, key: dict) -> Path:
    """The folder of the checkpoints of one (data, settings) combination."""
    return Path(checkpoint_dir) / f"run-{key_digest(key)}"


def differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """'key: old -> new' for every leaf that differs between two nested dicts."""
    out = []
    for k in sorted(set(a) | set(b)):
        if isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
            out += differences(a[k], b[k], f"{prefix}{k}.")
        elif a.get(k) != b.get(k):
            out.append(f"{prefix}{k}: {a.get(k)!r} -> {b.get(k)!r}")
    return out


# ------------------------------------------------------------------------------------ step folders


def step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith("step-") or not name[5:].isdigit():
        return None
    return int(name[5:])


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Complete checkpoints of a run folder (marker present), oldest first; partial ones are ignored."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.is_dir() and step_of(p) is not None and (p / COMPLETE_MARKER).is_file()
    ]
    return sorted(found, key=lambda p: int(p.name[5:]))  # step-N folders only (step_of is not None)


def save_checkpoint(
    folder: str | Path,
    step: int,
    drafter: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Chain,
    scheduler: torch.optim.lr_scheduler.LRScheduler | Chain,
    state: dict[str, Any],
    rows: list[dict[str, Any]],
) -> Path:
    """folder/step-{n}/: model.safetensors (fp32), optimizer.pt, trainer.pt (scheduler + RNG),
    state.json (position, key), metrics.jsonl (rows so far), COMPLETE (last). Keeps the newest
    KEEP_CHECKPOINTS."""
    path = Path(folder) / f"step-{step}"
    try:
        _write_checkpoint(path, step, drafter, optimizer, scheduler, state, rows)
    except OSError as err:
        if not disk_full(err):
            raise
        raise CheckpointDiskFull(disk_full_message(path, checkpoint_bytes(drafter, optimizer))) from None
    for old in list_checkpoints(folder)[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)
    return path


class CheckpointDiskFull(RuntimeError):
    """The disk filled up while a checkpoint was written (the message names the folder and the bytes)."""


def checkpoint_bytes(drafter: torch.nn.Module, optimizer: torch.optim.Optimizer | Chain) -> int:
    """About what one checkpoint takes: the weights and every tensor of the optimizer's state."""
    tensors = list(drafter.state_dict().values())
    tensors += [v for per_param in optimizer.state.values() for v in per_param.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def disk_full_message(path: Path, need: int) -> str:
    """One line: where, how much a checkpoint needs, how much is free, and that a rerun resumes."""
    folder = path.parent
    free = shutil.disk_usage(folder).free if folder.is_dir() else 0
    return (
        f"{folder}: the disk is full writing checkpoint {path.name}: a checkpoint needs about "
        f"{human_bytes(need)} ({need:,} bytes), {human_bytes(free)} free there; free space and rerun "
        "(training resumes from the last complete checkpoint)"
    )


def _write_checkpoint(
    path: Path,
    step: int,
    drafter: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Chain,
    scheduler: torch.optim.lr_scheduler.LRScheduler | Chain,
    state: dict[str, Any],
    rows: list[dict[str, Any]],
) -> None:
    with atomic_dir(path) as tmp:
        weights = {k: v.detach().to("cpu").contiguous().clone() for k, v in drafter.state_dict().items()}
        save_file(weights, str(tmp / "model.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        rng = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate(),
        }
        torch.save({"scheduler": scheduler.state_dict(), "rng": rng}, tmp / "trainer.pt")
        write_json(tmp / "state.json", state)
        write_jsonl(tmp / METRICS_FILE, rows)
        (tmp / COMPLETE_MARKER).write_text(f"step {step}\n", encoding="utf-8")


def load_checkpoint(
    path: Path,
    drafter: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Chain,
    scheduler: torch.optim.lr_scheduler.LRScheduler | Chain,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Restore weights, optimizer, scheduler and RNG in place -> (state.json, metrics rows)."""
    device = next(drafter.parameters()).device
    drafter.load_state_dict(load_file(str(path / "model.safetensors"), device=str(device)), strict=True)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
    trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    scheduler.load_state_dict(trainer["scheduler"])
    rng = trainer["rng"]
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    random.setstate(rng["python"])
    state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    metrics = path / METRICS_FILE
    rows = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
    return state, rows


def remove_partial_checkpoints(folder: str | Path) -> None:
    """What a run killed while writing a checkpoint left: atomic_dir's hidden temp folders, step-N
    folders without the COMPLETE marker."""
    root = Path(folder)
    if not root.is_dir():
        return
    for p in root.iterdir():
        partial = step_of(p) is not None and not (p / COMPLETE_MARKER).is_file()
        if p.is_dir() and (partial or (p.name.startswith(".step-") and p.name.endswith(".tmp"))):
            shutil.rmtree(p, ignore_errors=True)


# ------------------------------------------------------------------------------------ resume or not


def _is_run_dir(p: Path) -> bool:
    return p.is_dir() and p.name.startswith("run-") and len(p.name) == 20


def _is_legacy_step(p: Path) -> bool:  # step-N folders from before runs had their own folder
    return p.is_dir() and (
        step_of(p) is not None or (p.name.startswith(".step-") and p.name.endswith(".tmp"))
    )


def find_resume(
    checkpoint_dir: str | Path, key: dict, stop_at: int, *, fresh: bool = False, verbose: bool = True
) -> tuple[Path | None, list[Path]]:
    """-> (the checkpoint to resume or None, the folders to remove once every rank has read it).

    Reads only: every data-parallel rank calls it and gets the same answer; rank 0 then removes. Logs
    (when verbose: rank 0) why each other checkpoint folder is not resumed."""

    def say(level: int, msg: str, *args: Any) -> None:  # other ranks decide the same, silently
        if verbose:
            log.log(level, msg, *args)

    root, mine = Path(checkpoint_dir), run_dir(checkpoint_dir, key)
    if not root.is_dir():
        return None, []
    others = [p for p in sorted(root.iterdir()) if p != mine and (_is_run_dir(p) or _is_legacy_step(p))]
    for other in others if not fresh else []:
        if other.name.startswith("run-") and (other / KEY_FILE).is_file():
            old = json.loads((other / KEY_FILE).read_text(encoding="utf-8"))
            why = "; ".join(differences(old, key)) or "other key"
        else:
            why = "written by an older draftsmith"
        say(logging.WARNING, "not resuming %s: written for other data/settings (%s); removing it", other, why)
    if fresh:
        found = [p for p in (*others, mine) if p.exists()]
        if found:
            say(logging.INFO, "--fresh: discarding %d checkpoint folder(s) in %s", len(found), root)
        return None, found
    done = list_checkpoints(mine)
    if not done:
        return None, others
    latest = done[-1]
    if int(latest.name[5:]) >= stop_at:
        say(
            logging.INFO,
            "%s is where this run stops: the run had finished, so it trains afresh (a rerun on purpose, "
            "e.g. snakemake --forcerun train)",
            latest,
        )
        return None, [*others, mine]
    return latest, others


def start_run(checkpoint_dir: str | Path, key: dict, remove: list[Path]) -> Path:
    """Rank 0, after every rank has read its checkpoint: remove what will not be resumed, drop partial
    checkpoints, and record the key in the run folder -> the run folder."""
    for p in remove:
        shutil.rmtree(p, ignore_errors=True)
    folder = run_dir(checkpoint_dir, key)
    folder.mkdir(parents=True, exist_ok=True)
    remove_partial_checkpoints(folder)
    write_json(folder / KEY_FILE, key)
    return folder


@dataclass
class Run:
    """One training run's checkpoints: what it resumed (state None: a fresh start) and where rank 0
    saves the next ones."""

    folder: Path
    main: bool  # this process writes (rank 0)
    checkpoint: Path | None  # the checkpoint resumed
    state: dict[str, Any] | None  # its state.json
    rows: list[dict[str, Any]]  # its metrics rows

    def save(
        self,
        step: int,
        drafter: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Chain,
        scheduler: torch.optim.lr_scheduler.LRScheduler | Chain,
        state: dict[str, Any],
        rows: list[dict[str, Any]],
    ) -> None:
        if self.main:
            save_checkpoint(self.folder, step, drafter, optimizer, scheduler, state, rows)


def open_run(
    checkpoint_dir: str | Path,
    key: dict,
    stop_at: int,
    drafter: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Chain,
    scheduler: torch.optim.lr_scheduler.LRScheduler | Chain,
    *,
    fresh: bool,
    dist: Any,
) -> Run:
    """Resume or start the run of `key`, on every rank: each loads the same checkpoint (if any) into
    drafter, optimizer and scheduler; once all have read it, rank 0 removes what will not be resumed."""
    latest, remove = find_resume(checkpoint_dir, key, stop_at, fresh=fresh, verbose=dist.main)
    state, rows = load_checkpoint(latest, drafter, optimizer, scheduler) if latest else (None, [])
    dist.barrier()
    folder = start_run(checkpoint_dir, key, remove) if dist.main else run_dir(checkpoint_dir, key)
    return Run(folder, dist.main, latest, state, rows)
