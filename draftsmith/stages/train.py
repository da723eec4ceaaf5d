"""EAGLE-3 drafter training with training-time test (TTT): the settings and the loop.

A sample is tokens x_0..x_{T-1} with, per position t, the target's aux states a_t [A, Ht] (inputs of the
aux layers) and its final state f_t [Ht] (after the final norm, so the target's distribution of x_{t+1}
is softmax(lm_head(f_t))). The drafter learns, for every position t at once:

    step 0:  hidden = fc(a_t),                 embed e(x_{t+1}),   position t    -> predicts x_{t+2}
    step j:  hidden = its own step-(j-1) output at t, e(x_{t+1+j}), position t+j  -> predicts x_{t+2+j}

with teacher softmax(W_d f_{t+1+j}) over the draft vocabulary (W_d = the target's lm_head rows of the
draft ids). Step j counts only where t+2+j < T and x_{t+2+j} is an assistant token (loss_mask); its
soft cross-entropy (or an LK loss of the expected acceptance) is averaged over those positions and
weighted ttt_decay**j (or ttt_step_weights[j]). One `TTTKV` per forward gives step j at t the keys a
cached drafter would see (drafter.py).

References: EAGLE `eagle/traineagle3/cnets.py` (7 steps, 0.8**j, soft CE to the target softmax, position
ids + j, AdamW betas (0.9, 0.95)); SpecForge `training/strategies/base.py` (ttt_length 7, 0.8**j, cosine
schedule, grad clip 0.5); speculators `models/eagle3/core.py` + `train/noise_transforms.py` (teacher
restricted to the draft vocabulary, uniform noise 0.05 on the aux states; `train/optimizers.py`: Muon
for the weight matrices); SpecForge `core/lk_loss.py` and arXiv 2602.23881 (the LK losses).

Around this file, in draftsmith/core/: objective.py computes the objective above (`Objective`,
`ttt_loss`, `DraftingLoss`), optimizers.py the optimizers and LR schedule, drafter.py builds the drafter
(`build_drafter`), loader.py streams the batches, distributed.py holds the data-parallel process group,
checkpoints.py decides what to resume and saves. Layout here: settings -> one step (`train_step`,
`validate`) -> the record (metrics rows, position, summary) -> `train()` -> `write_drafter` ->
`export_untrained_drafter` (train with 0 steps: the evaluation's baseline).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from draftsmith.backends.extraction import make_extractor
from draftsmith.core.config.stage_args import BAD_INPUT, arg
from draftsmith.core.config.stage_settings import TrainSettings, UntrainedSettings
from draftsmith.core.data.loader import Batch, StreamingData, step_plan, verify_share
from draftsmith.core.data.manifest import DataError, is_stream, load_manifest
from draftsmith.core.data.stream import StateCache, StreamedData, StreamSpec, TeacherDisagrees
from draftsmith.core.data.tokens import load_tokens
from draftsmith.core.data.vocab import VocabMapError, load_vocab_map
from draftsmith.core.export.formats import check_export, save_drafter
from draftsmith.core.io.atomic import atomic_dir, write_json, write_jsonl
from draftsmith.core.io.devices import engine_visible_devices, trainer_index, visible_devices
from draftsmith.core.model.drafter import DraftHead, build_drafter
from draftsmith.core.model.kinds import drafter_loss
from draftsmith.core.model.layers import convert_layer_ids
from draftsmith.core.model.precision import compute_dtype, train_precision
from draftsmith.core.model.target import TargetHead, load_target_head
from draftsmith.core.planning.memory import stream_engine_share
from draftsmith.core.training.checkpoints import CheckpointDiskFull, Run, open_run, resume_key
from draftsmith.core.training.distributed import (
    Dist,
    become_torchrun,
    init_distributed,
    launch_rank,
    rank_threads,
    usable_threads,
    wants_cuda,
)
from draftsmith.core.training.objective import (
    DraftingLoss,
    Objective,
    StepStats,
    noise_seed,
    with_noise,
)
from draftsmith.core.training.optimizers import Chain, make_optimizer, make_scheduler
from draftsmith.core.training.tracking import Curves

log = logging.getLogger(__name__)

METRICS_FLUSH_S = 10.0  # rewrite metrics.jsonl at most this often (and at every epoch end / checkpoint)
PROGRESS_EVERY_S = 10.0  # log a training progress line at most this often (validation: always)


# ----------------------------------------------------------------------------------------------- settings


# -------------------------------------------------------------------------------------- one step


def train_step(
    model: torch.nn.Module,
    batch: Batch | None | list[Batch | None],
    objective: Objective,
    optimizer: torch.optim.Optimizer | Chain,
    scheduler: torch.optim.lr_scheduler.LRScheduler | Chain,
    settings: TrainSettings,
    dist: Dist,
    step: int,
) -> tuple[StepStats, float, float]:
    """One optimizer step on this rank's share of a batch (None: no share), or on its micro-batches (a
    list: as many on every rank, None where a rank has none left), their gradients accumulated ->
    (stats summed over ranks, grad norm, the lr it used). Every rank runs every forward and backward,
    share or not: the last backward is where DistributedDataParallel sums the gradients."""
    parts = batch if isinstance(batch, list) else [batch]
    counts = torch.zeros(objective.ttt_steps, dtype=torch.int64)
    moved: list[Batch | None] = []
    for m, part in enumerate(parts):
        if part is not None:
            part = part.to(dist.device)
            counts += torch.tensor(objective.step_counts(part))
            if objective.noise_std > 0:
                generator = torch.Generator(device=dist.device)
                generator.manual_seed(noise_seed(settings.seed, step, dist.rank, m))
                part = replace(part, aux=with_noise(part.aux, objective.noise_std, generator))
        moved.append(part)
    totals = dist.all_sum(counts.to(dist.device)).tolist()  # the whole batch's, over all ranks
    optimizer.zero_grad(set_to_none=True)
    stats = StepStats.zeros(objective.ttt_steps)
    for m, part in enumerate(moved):
        last = m == len(moved) - 1
        # DistributedDataParallel sums the gradients in the last backward only
        no_sync = getattr(model, "no_sync", None)
        sync = contextlib.nullcontext() if last or no_sync is None else no_sync()
        with sync:
            loss, part_stats = model(part, objective, totals)
            if dist.world > 1:
                loss = loss * dist.world  # a share of the whole batch's loss; DDP averages the gradients
            loss.backward()
        del loss
        stats.add(part_stats)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    return stats.all_sum(dist), float(grad_norm), lr


@torch.no_grad()
def validate(
    model: DraftingLoss, data: StreamingData, objective: Objective, dist: Dist, micro_batch_tokens: int
) -> StepStats:
    """Validation stats in the inference view, over every rank's share of the validation batches (in
    micro-batches of at most micro_batch_tokens, as training)."""
    view = objective.for_validation()
    was_training = model.training
    model.eval()
    stats = StepStats.zeros(view.ttt_steps)
    lengths = [r.num_tokens for r in data.val]
    plan = [
        m
        for b in data.val_batches()
        for m in step_plan(b, lengths, dist.rank, dist.world, micro_batch_tokens)
    ]
    for batch in data.batches(plan, "val"):
        if batch is not None:
            stats.add(model.loss(model.drafter, model.embed, model.teacher, batch.to(dist.device), view)[1])
    model.train(was_training)
    return stats.all_sum(dist)


# ------------------------------------------------------------------------------------- the record


class MetricsLog:
    """Every metrics row of the run so far (a resumed run starts from the rows its checkpoint kept). On
    rank 0 each new row also goes to the live curves (tracking.py) and is a progress line (train rows at
    most every PROGRESS_EVERY_S); the whole file is rewritten at most every METRICS_FLUSH_S."""

    def __init__(
        self,
        path: Path,
        rows: list[dict[str, Any]],
        main: bool,
        progress: bool = True,
        curves: Curves | None = None,
    ):
        self.path, self.rows, self.main, self.progress, self.curves = path, rows, main, progress, curves
        self.last_flush, self.last_line = time.perf_counter(), -math.inf  # the first step is logged
        self.flush(force=True)  # a resumed run's full history, at once

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if not self.main:
            return
        if self.curves is not None:
            self.curves.log(row)
        now = time.perf_counter()
        if self.progress and (row["kind"] != "train" or now - self.last_line > PROGRESS_EVERY_S):
            log.info("%s", progress_line(row))
            self.last_line = now
        self.flush()

    def flush(self, force: bool = False) -> None:
        if self.main and (force or time.perf_counter() - self.last_flush > METRICS_FLUSH_S):
            write_jsonl(self.path, self.rows)
            if self.curves is not None:
                self.curves.flush()
            self.last_flush = time.perf_counter()

    def close(self) -> None:
        self.flush(force=True)
        if self.curves is not None:
            self.curves.close()


def progress_line(row: dict[str, Any]) -> str:
    """'epoch 1 step 12/40 train loss 2.3141 acc 0.312 0.221 0.180 tok/s 812' from a metrics row."""
    where = f"epoch {row['epoch']} step {row['step']}"
    if row["kind"] == "train":
        where += f"/{row['stop_at']}"
    acc = " ".join(f"{a:.3f}" for a in row["acc"] if a is not None)
    speed = f" tok/s {row['tokens_per_s']:.0f}" if row.get("tokens_per_s") else ""
    return f"{where} {row['kind']} loss {row['loss']:.4f} acc {acc}{speed}"


def stats_row(kind: str, stats: StepStats, objective: Objective, **extra: Any) -> dict[str, Any]:
    """A metrics.jsonl row of train or val stats."""
    return {
        "kind": kind,
        **extra,
        "loss": stats.loss(objective.step_weights),
        "step_loss": stats.step_loss(),
        "acc": stats.acc(),
        "agreement": stats.agreement(),
        "positions": stats.count,
        "teacher_acc": stats.teacher_acc(),
        "tokens": stats.tokens,
    }


@dataclass
class Position:
    """Where the loop is: what a checkpoint records besides weights, optimizer and metrics."""

    step: int
    epoch: int  # the epoch to continue (0-based) ...
    batch_in_epoch: int  # ... from this batch of its plan
    epoch_stats: StepStats  # the current epoch's train stats so far
    last_epoch_stats: StepStats | None = None

    @classmethod
    def start(cls, ttt_steps: int) -> Position:
        return cls(0, 0, 0, StepStats.zeros(ttt_steps))

    def advance(self, stats: StepStats) -> None:
        self.step += 1
        self.batch_in_epoch += 1
        self.epoch_stats.add(stats)

    def next_epoch(self) -> None:
        self.last_epoch_stats, self.epoch_stats = (
            self.epoch_stats,
            StepStats.zeros(len(self.epoch_stats.count)),
        )
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def where(self, batches_in_epoch: int, stop_at: int) -> dict[str, int]:
        """A train metrics row's place: after `step` of `stop_at`, batch `batch` of the epoch (1-based)."""
        return {
            "step": self.step,
            "stop_at": stop_at,
            "epoch": self.epoch + 1,
            "batch": self.batch_in_epoch,
            "batches_in_epoch": batches_in_epoch,
        }

    def latest_stats(self) -> StepStats:
        """The running epoch's train stats, or the last finished epoch's when it has none yet."""
        if sum(self.epoch_stats.count) or self.last_epoch_stats is None:
            return self.epoch_stats
        return self.last_epoch_stats

    def to_state(self, **extra: Any) -> dict[str, Any]:
        last = self.last_epoch_stats
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "epoch_stats": self.epoch_stats.to_dict(),
            "last_epoch_stats": last.to_dict() if last else None,
            **extra,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Position:
        last = state["last_epoch_stats"]
        return cls(
            state["step"],
            state["epoch"],
            state["batch_in_epoch"],
            StepStats(**state["epoch_stats"]),
            StepStats(**last) if last else None,
        )


@dataclass
class Throughput:
    """This process's training time, loader waits and tokens (not checkpointed: a resumed run reports
    its own)."""

    started: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    train_s: float = 0.0
    wait_s: float = 0.0

    def add(self, tokens: int, train_s: float, wait_s: float) -> None:
        self.tokens, self.train_s, self.wait_s = (
            self.tokens + tokens,
            self.train_s + train_s,
            self.wait_s + wait_s,
        )


def training_summary(
    pos: Position,
    steps_per_epoch: list[int],
    settings: TrainSettings,
    objective: Objective,
    data: StreamingData,
    dist: Dist,
    rows: list[dict[str, Any]],
    resumed_from: int | None,
    throughput: Throughput,
) -> dict[str, Any]:
    """train_summary.json: where the run ended, its last train and validation figures, its speed."""
    total_steps = sum(steps_per_epoch)
    stats = pos.latest_stats()
    val = [r for r in rows if r["kind"] == "val"]
    last_val = val[-1] if val else {}
    t = throughput
    return {
        "steps": pos.step,
        "total_steps": total_steps,
        "epochs": settings.epochs,
        "epochs_completed": pos.epoch,
        "steps_per_epoch": steps_per_epoch,
        "stopped_early": pos.step < total_steps,
        "resumed_from_step": resumed_from,
        "world_size": dist.world,
        "device": str(dist.device),
        "hidden_states": data.stats(),  # stream: tokens prefilled, capture time, teacher agreement
        "train_samples": len(data.train),
        "val_samples": len(data.val),
        "train_loss": stats.loss(objective.step_weights) if sum(stats.count) else None,
        "train_acc": stats.acc(),
        "train_agreement": stats.agreement(),
        "teacher_acc": stats.teacher_acc(),
        "val_loss": last_val.get("loss"),
        "val_acc": last_val.get("acc"),
        "val_agreement": last_val.get("agreement"),
        "trained_tokens": t.tokens,
        "tokens_per_s": t.tokens / t.train_s if t.train_s > 0 else None,
        # time the loop waited for the loader: ~0 when background decoding keeps ahead of training
        "data_wait_s": t.wait_s,
        "data_wait_fraction": t.wait_s / (t.wait_s + t.train_s) if t.train_s > 0 else None,
        "wall_s": time.perf_counter() - t.started,
        # this rank's peak, to hold against `draftsmith plan`'s train figure (memory.py)
        "max_memory_allocated": (
            torch.cuda.max_memory_allocated(dist.device) if dist.device.type == "cuda" else None
        ),
    }


def load_inputs(
    manifest_path: str | Path, vocab_path: str | Path
) -> tuple[dict[str, Any], dict[str, Any], TargetHead]:
    """The manifest, vocab map and target head, checked against each other."""
    manifest = load_manifest(manifest_path)
    aux_ids = [int(i) for i in manifest["aux_layer_ids"]]
    if len(aux_ids) != int(manifest["num_aux"]):
        raise ValueError(
            f"manifest: {len(aux_ids)} aux_layer_ids {aux_ids} but num_aux = {manifest['num_aux']}"
        )
    vocab = load_vocab_map(vocab_path)
    target = load_target_head(manifest["target"])
    tcfg = target.config
    if int(manifest["hidden_size"]) != tcfg.hidden_size:
        raise ValueError(
            f"manifest hidden_size {manifest['hidden_size']} != target hidden_size {tcfg.hidden_size}"
        )
    if vocab["t2d"].numel() != tcfg.vocab_size:
        raise ValueError(
            f"vocab map covers {vocab['t2d'].numel()} target ids but the target vocabulary is {tcfg.vocab_size}"
        )
    return manifest, vocab, target


# ------------------------------------------------------------------------------------------- train


def train(
    manifest_path: str | Path,
    vocab_path: str | Path,
    out_dir: str | Path,
    checkpoint_dir: str | Path,
    metrics_path: str | Path,
    settings: TrainSettings,
    *,
    device: str | torch.device | None = None,
    progress: bool = True,
    fresh: bool = False,
    log_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Train a drafter on the shards of data_config.json and write it to out_dir -> summary dict.

    Resumes from the newest complete checkpoint of this data and these settings (checkpoints.py says
    when); `fresh` discards every checkpoint first. Checkpoints are written at each epoch end, every
    `checkpoint_every` steps and when max_steps stops the run. Under torchrun (WORLD_SIZE > 1) this runs
    on every rank; rank 0 writes checkpoints, metrics and the drafter. `progress`: log a line as it goes;
    `log_dir`: live curves in <log_dir>/run-<key digest>/ (tracking.py).
    """
    throughput = Throughput()
    rank, world = launch_rank()
    planned = None
    if wants_cuda(device):  # before the shards are decoded, the target's head loaded, the drafter built
        planned = check_memory(manifest_path, vocab_path, settings, world)
    unproven = (
        [] if settings.max_steps == 0 else verify_share(manifest_path, rank, world, settings.loader_threads)
    )
    dist = init_distributed(device)  # only once every rank has checked its share
    if dist.total(len(unproven)):
        raise DataError(refusal(unproven))
    settings = replace(settings, precision=train_precision(settings.precision, dist.device))
    if settings.threads is not None:  # the job's count, shared by the ranks
        torch.set_num_threads(usable_threads(rank_threads(settings.threads, dist.world)))
    manifest, vocab, target = load_inputs(manifest_path, vocab_path)
    data = open_data(manifest, settings, dist.device, planned)
    steps_per_epoch = [len(data.epoch_batches(e)) for e in range(settings.epochs)]
    total_steps = sum(steps_per_epoch)  # the schedule's horizon; max_steps only stops early
    stop_at = total_steps if settings.max_steps is None else min(total_steps, settings.max_steps)

    num_aux = int(manifest["num_aux"])
    drafter, embed, teacher = build_drafter(
        target, vocab["d2t"], vocab["t2d"], num_aux, settings, dist.device
    )
    target_config = target.config
    lm_head = target.lm_head.to(dist.device) if settings.lk_loss != "none" else None  # for draft_mass
    del target  # the embedding and teacher rows live on in model; the rest of the head is freed
    all_sum = dist.all_sum if dist.world > 1 else None
    model = DraftingLoss(drafter, embed, teacher, lm_head, all_sum, drafter_loss(drafter.cfg))
    trained = dist.wrap(model)
    optimizer = make_optimizer(drafter, settings)
    scheduler = make_scheduler(optimizer, settings, total_steps)
    objective = Objective.from_settings(settings.objective, dist.device)

    key = resume_key(settings, manifest, vocab, drafter.cfg)
    run = open_run(checkpoint_dir, key, stop_at, drafter, optimizer, scheduler, fresh=fresh, dist=dist)
    pos, resumed_from = resume_position(run, settings, dist)
    cache = hybrid_cache(manifest, run.folder, dist) if isinstance(data, StreamedData) else None
    if cache is not None and isinstance(data, StreamedData):
        data.use_cache(cache)
    curves = None
    if dist.main and log_dir is not None:
        ids = dict((run.state or {}).get("trackers") or {})  # the trackers' runs a resumed run continues
        config = {**settings.to_dict(), "drafter_shape": drafter.cfg.to_dict()}
        curves = Curves(Path(log_dir) / run.folder.name, settings.report_to, config, resumed_from, ids)
    metrics = MetricsLog(Path(metrics_path), run.rows, dist.main, progress, curves)

    def checkpoint() -> None:  # reads only: no state of the loop changes here
        metrics.flush(force=True)  # metrics first: they also go into the checkpoint
        trackers = curves.ids if curves is not None else {}
        state = pos.to_state(
            total_steps=total_steps, world_size=dist.world, resume_key=key, trackers=trackers
        )
        run.save(pos.step, drafter, optimizer, scheduler, state, metrics.rows)

    last_saved = resumed_from
    while pos.epoch < settings.epochs and pos.step < stop_at:
        plan = data.epoch_batches(pos.epoch)
        todo = plan[pos.batch_in_epoch : pos.batch_in_epoch + stop_at - pos.step]  # none past max_steps
        # this rank's micro-batches of each step: shares balanced by tokens, as many on every rank
        lengths = data.train_lengths()
        steps = [step_plan(b, lengths, dist.rank, dist.world, settings.micro_batch_tokens) for b in todo]
        flat = data.batches([m for parts in steps for m in parts], "train")
        for parts, waited in timed(grouped(flat, [len(parts) for parts in steps])):
            t0 = time.perf_counter()
            stats, grad_norm, lr = train_step(
                trained, parts, objective, optimizer, scheduler, settings, dist, pos.step
            )
            dt = time.perf_counter() - t0
            pos.advance(stats)
            throughput.add(stats.tokens, dt, waited)
            row = stats_row(
                "train", stats, objective, **pos.where(len(plan), stop_at), lr=lr, grad_norm=grad_norm
            )
            metrics.append(
                {**row, "tokens_per_s": stats.tokens / dt if dt > 0 else None, "data_wait_s": waited}
            )
            every = settings.checkpoint_every
            if every and pos.step % every == 0 and pos.batch_in_epoch < len(plan):
                checkpoint()
                last_saved = pos.step
        if pos.batch_in_epoch < len(plan):
            break  # stopped by max_steps
        # epoch end: validation, then a checkpoint positioned at the next epoch
        if data.val:
            v = validate(model, data, objective, dist, settings.micro_batch_tokens)
            metrics.append(
                stats_row("val", v, objective, step=pos.step, epoch=pos.epoch + 1, samples=len(data.val))
            )
        pos.next_epoch()
        checkpoint()
        last_saved = pos.step
    data.close()
    if cache is not None and pos.step >= total_steps and not settings.keep_hidden_cache:
        shutil.rmtree(cache.folder, ignore_errors=True)  # trained: a rerun would not read it
    if last_saved != pos.step:  # stopped since the last checkpoint
        checkpoint()
    metrics.close()

    summary = training_summary(
        pos, steps_per_epoch, settings, objective, data, dist, metrics.rows, resumed_from, throughput
    )
    if dist.main:
        write_drafter(drafter, out_dir, manifest, target_config, settings, summary)
    dist.finish()  # the drafter exists before any rank returns
    return summary


def check_memory(
    manifest_path: str | Path, vocab_path: str | Path, settings: TrainSettings, world: int
) -> tuple[float, float] | None:
    """The plan's training line again, for one of this job's `world` ranks on its GPUs (nvidia-smi),
    before anything loads: ValueError with the figure (a rank out of memory at its first long batch
    would lose the job's hours). Reads only the manifest, the target's config.json and the vocab map.
    -> (the rank's planned bytes, the device's bytes), None when the device is unknown."""
    from draftsmith.core.config.config import text_config_json
    from draftsmith.core.planning.memory import device_memory, drafter_shape, target_size, train_need
    from draftsmith.core.planning.memory import refusal as plan_refusal

    memory, device = device_memory({})
    if memory is None:
        return None
    manifest = load_manifest(manifest_path)
    target_config = text_config_json(manifest["target"])
    train = settings.to_dict()  # the train section and resources.train's knobs (micro_batch_tokens, ...)
    draft_vocab = int(load_vocab_map(vocab_path)["d2t"].numel())
    shape = drafter_shape(
        {"train": train, "vocab": {"size": draft_vocab}}, target_config, int(manifest["num_aux"])
    )
    need = train_need(train, {**train, "gpus": world}, target_size(target_config), shape, memory)
    if stop := plan_refusal([need], device):
        raise ValueError(f"{stop} (the memory plan, checked again by the job)")
    return need.total, memory


def open_data(
    manifest: dict[str, Any],
    settings: TrainSettings,
    device: torch.device,
    planned: tuple[float, float] | None = None,
) -> StreamingData:
    """The training data: the shards a manifest lists, or for a stream manifest the states captured by
    an extraction engine of its settings as training asks for them (core/data/stream.py); the engine loads
    at the first capture (an untrained drafter's export never loads it). On GPUs the vLLM engine runs
    where resources.train.engine_gpus puts it (memory.stream_train_needs): beside this rank at the share
    its `planned` (bytes, device bytes) leaves, or on the first engine_gpus GPUs."""
    if not is_stream(manifest):
        return StreamingData.from_manifest(manifest, settings.batching)
    s = manifest["stream"]
    tokens = manifest["tokens"]["path"]
    _, meta = load_tokens(tokens)

    def engine() -> Any:
        where = "cuda" if device.type == "cuda" else "cpu"
        scratch = Path(tempfile.mkdtemp(prefix="draftsmith-stream-")) if s["backend"] == "vllm" else None
        on_gpus = where == "cuda" and s["backend"] == "vllm"
        share = None
        if on_gpus and not settings.engine_gpus and planned is not None:
            share = stream_engine_share(*planned)
        # on CPU the job's CUDA_VISIBLE_DEVICES is empty: there is no GPU to place the engine on
        visible = None
        if on_gpus:
            visible = engine_visible_devices(
                os.environ.get("CUDA_VISIBLE_DEVICES"), settings.engine_gpus, device.index or 0
            )
        gpus = settings.engine_gpus or 1 if on_gpus else 0
        # vLLM's engine core is a child process: it sees the GPUs visible while it starts
        with visible_devices(visible):
            extractor = make_extractor(
                s["backend"], str(manifest["target"]), [int(i) for i in manifest["aux_layer_ids"]],
                compute_dtype(s["dtype"], where), max(gpus, int(where == "cuda")), int(meta["max_seq_len"]) + 1,
                scratch, s["vllm_eager"], share,
            )  # fmt: skip
        # "auto" compiles in the extract stage only past a time estimate the stream does not make
        if s["compile"] == "on" and s["backend"] == "transformers":
            extractor.compile()
        log.info("stream: %s engine loaded for the states of %s", s["backend"], tokens)
        return extractor

    spec = StreamSpec(s["storage_dtype"], int(s["batch_tokens"]), float(manifest["min_teacher_agreement"]))
    return StreamedData(tokens, engine, spec, settings.batching)


def hybrid_cache(manifest: dict[str, Any], run_folder: Path, dist: Dist) -> StateCache | None:
    """train.hidden_states hybrid: the cache of epoch 0's states in the run's checkpoint folder (its key
    is the data's and the settings'), None for stream."""
    if manifest["hidden_states"] != "hybrid":
        return None
    if dist.world > 1:  # every rank would write the same shards
        raise ValueError(
            "train.hidden_states hybrid with more than one training process is not built yet; use stream "
            "or files"
        )
    s = manifest["stream"]
    meta = {"aux_layer_ids": [int(i) for i in manifest["aux_layer_ids"]], "layer_convention": "input"}
    shards = len(load_tokens(manifest["tokens"]["path"])[1]["shards"])
    return StateCache(run_folder / "hidden", shards, meta, s["codec"], int(s["zstd_level"]))


def refusal(problems: list[str]) -> str:
    """Why no rank trains: this rank's problems, or that another rank found some."""
    if problems:
        return "refusing to train on data that fails verification:\n  " + "\n  ".join(problems)
    return "refusing to train: another rank found data that fails verification (its log names it)"


def resume_position(run: Run, settings: TrainSettings, dist: Dist) -> tuple[Position, int | None]:
    """Where the loop starts -> (position, the step resumed from or None); a resumed run's metrics get
    a "resume" row."""
    if run.state is None:
        return Position.start(settings.ttt_steps), None
    pos = Position.from_state(run.state)
    before = run.state.get("world_size", 1)
    if dist.main and before != dist.world:
        log.warning(
            "resuming a checkpoint of %d process(es) on %d: the same batches and gradient sums, grouped "
            "into other floating-point partial sums%s",
            before,
            dist.world,
            " (and other aux-state noise: it is drawn per rank)" if settings.noise_std > 0 else "",
        )
    run.rows.append(
        {"kind": "resume", "step": pos.step, "checkpoint": str(run.checkpoint), "world_size": dist.world}
    )
    if dist.main:
        log.info(
            "resumed from step %d (%s; epoch %d, batch %d)",
            pos.step,
            run.checkpoint,
            pos.epoch + 1,
            pos.batch_in_epoch,
        )
    return pos, pos.step


def grouped(items: Iterator[Any], sizes: list[int]) -> Iterator[list[Any]]:
    """Consecutive groups of `sizes` items (a step's micro-batches from the loader's one stream)."""
    for n in sizes:
        yield [next(items) for _ in range(n)]


def timed(batches: Iterator[Any]) -> Iterator[tuple[Any, float]]:
    """(batch, seconds waited for it): ~0 while the loader's background threads keep ahead."""
    while True:
        t0 = time.perf_counter()
        batch = next(batches, StopIteration)
        if batch is StopIteration:
            return
        yield batch, time.perf_counter() - t0


def write_drafter(
    drafter: DraftHead,
    out_dir: str | Path,
    manifest: dict[str, Any],
    target_config: Any,
    settings: TrainSettings,
    summary: dict[str, Any],
) -> None:
    """The drafter in vLLM's format (aux ids in its "input" convention), checked, with the training
    summary; all or nothing."""
    aux_ids = convert_layer_ids(
        [int(i) for i in manifest["aux_layer_ids"]], manifest.get("layer_convention", "input"), "input"
    )
    with atomic_dir(Path(out_dir)) as tmp:
        extra = {"training": {"settings": settings.to_dict(), "summary": summary}}
        save_drafter(drafter, tmp, aux_ids, str(manifest["target"]), extra=extra)
        problems = check_export(
            tmp, target_num_layers=target_config.num_hidden_layers, target_vocab_size=target_config.vocab_size
        )
        if problems:
            raise RuntimeError(f"the drafter written failed its own checks: {problems}")
        write_json(tmp / "train_summary.json", summary)
    log.info("wrote the drafter to %s", out_dir)


def export_untrained_drafter(
    manifest_path: str | Path,
    vocab_path: str | Path,
    out_dir: str | Path,
    settings: TrainSettings,
) -> dict[str, Any]:
    """The untrained baseline: `train` with 0 steps and the training settings (seed, drafter shape,
    head_init), so it is exactly the trained drafter's starting point (same architecture and vocabulary
    map; the same initial draw), exported the same way. Returns train's summary."""
    settings = replace(settings, max_steps=0)
    with tempfile.TemporaryDirectory(prefix="draftsmith-untrained-") as tmp:
        work = Path(tmp)
        checkpoints, metrics = work / "checkpoints", work / "metrics.jsonl"
        return train(
            manifest_path, vocab_path, out_dir, checkpoints, metrics, settings, device="cpu", progress=False
        )


@dataclass
class TrainPaths:
    manifest: str = arg("--manifest", "data_config.json (the manifest stage's).", required=True, exists=True)
    vocab: str = arg("--vocab", "vocab_map.pt (the vocab stage's).", required=True, exists=True)
    out: str = arg("--out", "Drafter export folder.", kind="dir", required=True, sealed=True)
    checkpoints: str = arg("--checkpoints", "Resumable checkpoints.", kind="dir", required=True)
    metrics: str = arg("--metrics", "metrics.jsonl to write.", required=True, sealed=True)
    log_dir: str | None = arg(
        "--log-dir",
        "Live training curves (TensorBoard event files, W&B's local files) go to LOG_DIR/run-<digest>/ "
        "[default: tensorboard/ beside --metrics].",
        kind="dir",
    )
    nproc: int = arg(
        "--nproc",
        "Data-parallel processes on this machine, one per visible GPU (nccl) or CPU share (gloo); > 1 "
        "re-runs this command under torchrun.",
        kind="int",
        minimum=1,
        default=1,
    )
    fresh: bool = arg(
        "--fresh",
        "Discard every checkpoint in --checkpoints and train from scratch (a finished run already trains "
        "afresh when run again; this also drops an unfinished one).",
        kind="flag",
    )


@dataclass
class UntrainedPaths:
    manifest: str = arg("--manifest", "data_config.json (the manifest stage's).", required=True, exists=True)
    vocab: str = arg("--vocab", "vocab_map.pt (the vocab stage's).", required=True, exists=True)
    out: str = arg("--out", "Export folder to write.", kind="dir", required=True)


Settings, Paths = TrainSettings, TrainPaths
# unusable data is bad input, as `draftsmith verify` says it; a full disk at a checkpoint is one line too
# (exit 2 like the rest: what the user must change is outside the job; the run resumes once it is freed)
EXITS = {
    DataError: BAD_INPUT, VocabMapError: BAD_INPUT, CheckpointDiskFull: BAD_INPUT, TeacherDisagrees: BAD_INPUT,
}  # fmt: skip


def run(paths: TrainPaths, settings: TrainSettings) -> list[str]:
    """Train the drafter (its kind: train.drafter.kind) with training-time test; resumes from the latest
    complete checkpoint.

    Settings: the `train` config section as --settings JSON (keys, defaults and meanings in
    draftsmith/config.schema.yaml); an option overrides its key.

    \b
    Resume: rerun the same command; it continues from the newest complete checkpoint of the same data
    (content digests) and settings (same weights as an uninterrupted run). Other data or settings, a
    run that had finished, or --fresh train from scratch.
    Data parallel: --nproc 2 on one machine, or across machines:
      torchrun --nnodes 2 --nproc_per_node 8 ... -m draftsmith.cli train --manifest ... (same options)
    """
    log_dir = paths.log_dir or str(Path(paths.metrics).parent / "tensorboard")
    # with --nproc > 1 this command becomes torchrun, which runs it once per rank with the same settings
    command = ["draftsmith.cli", "train", "--manifest", paths.manifest, "--vocab", paths.vocab]
    command += ["--out", paths.out, "--checkpoints", paths.checkpoints, "--metrics", paths.metrics]
    command += ["--log-dir", log_dir, "--settings", json.dumps(settings.to_dict())]
    become_torchrun(paths.nproc, command + (["--fresh"] if paths.fresh else []))
    # every rank decodes its share of the samples first: nothing unproven is trained on
    device = None  # a streamed job's trainer after its engine's own GPUs (resources.train.engine_gpus)
    # the manifest says the mode (train.hidden_states auto is resolved when the workflow starts)
    if settings.engine_gpus and torch.cuda.is_available() and is_stream(load_manifest(paths.manifest)):
        device = f"cuda:{trainer_index(settings.engine_gpus, 0)}"
    summary = train(
        paths.manifest, paths.vocab, paths.out, paths.checkpoints, paths.metrics, settings,
        device=device, fresh=paths.fresh, log_dir=log_dir,
    )  # fmt: skip
    if launch_rank()[0] != 0:
        return []
    acc = " ".join(f"{a:.3f}" for a in summary["train_acc"] if a is not None)
    agree = " ".join(f"{a:.3f}" for a in summary["train_agreement"] if a is not None)
    return [
        f"train: {summary['steps']} steps on {summary['world_size']} process(es), accuracy per TTT step "
        f"{acc} (agreement with the target's top-1 {agree}), {summary['tokens_per_s'] or 0:.0f} tokens/s, "
        f"drafter in {paths.out}"
    ]


def run_untrained(paths: UntrainedPaths, settings: UntrainedSettings) -> list[str]:
    """Export the untrained baseline: the drafter exactly as training starts it (0 steps, same seed),
    so the evaluation shows what training bought."""
    # training's other settings do not decide its starting point: the schema's defaults
    export_untrained_drafter(paths.manifest, paths.vocab, paths.out, TrainSettings(**settings.to_dict()))
    return [f"untrained drafter (seed {settings.seed}) exported to {paths.out}"]
