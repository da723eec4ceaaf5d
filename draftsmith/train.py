"""EAGLE-3 drafter training with training-time test (TTT): settings, the objective and the loop.

A sample is tokens x_0..x_{T-1} with, per position t, the target's aux states a_t [A, Ht] (inputs of the
aux layers) and its final state f_t [Ht] (after the final norm, so the target's distribution of x_{t+1}
is softmax(lm_head(f_t))). The drafter learns, for every position t at once:

    step 0:  hidden = fc(a_t),                 embed e(x_{t+1}),   position t    -> predicts x_{t+2}
    step j:  hidden = its own step-(j-1) output at t, e(x_{t+1+j}), position t+j  -> predicts x_{t+2+j}

with teacher softmax(W_d f_{t+1+j}) over the draft vocabulary (W_d = the target's lm_head rows of the
draft ids). Step j counts only where t+2+j < T and x_{t+2+j} is an assistant token (loss_mask); its
soft cross-entropy is averaged over those positions and weighted ttt_decay**j. One `TTTKV` per forward
gives step j at t the keys a cached drafter would see (drafter.py).

References: EAGLE `eagle/traineagle3/cnets.py` (7 steps, 0.8**j, soft CE to the target softmax, position
ids + j, AdamW betas (0.9, 0.95)); SpecForge `training/strategies/base.py` (ttt_length 7, 0.8**j, cosine
schedule, grad clip 0.5); speculators `models/eagle3/core.py` + `train/noise_transforms.py` (teacher
restricted to the draft vocabulary, uniform noise 0.05 on the aux states).

Around this file: loader.py streams the batches, distributed.py holds the data-parallel process group,
checkpoints.py decides what to resume. Layout here: settings -> target head -> objective -> `train_step`
-> `train()`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import random
import time
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from draftsmith.atomic import atomic_dir, write_json, write_jsonl
from draftsmith.checkpoints import find_resume, load_checkpoint, resume_key, save_checkpoint, start_run
from draftsmith.distributed import Dist, init_distributed, sync_gradients
from draftsmith.drafter import LAYER_INITS, TTTKV, DrafterConfig, Eagle3Drafter, describe, param_count
from draftsmith.export import check_export, save_drafter
from draftsmith.layers import convert_layer_ids
from draftsmith.loader import Batch, StreamingData
from draftsmith.manifest import load_manifest
from draftsmith.precision import TRAIN_PRECISIONS, train_precision
from draftsmith.target import TargetHead, load_target_head
from draftsmith.vocab import load_vocab_map

log = logging.getLogger(__name__)

METRICS_FLUSH_S = 10.0  # rewrite metrics.jsonl at most this often (and at every epoch end / checkpoint)


# ----------------------------------------------------------------------------------------------- settings


HEAD_INITS = ("target", "random")
LOSS_POSITIONS = ("assistant", "all")
LOSS_NORMS = ("position", "sample")
TTT_PREFIXES = ("accepted", "lagged")
TTT_POSITIONS = ("advance", "fixed")
EVAL_MASK_OFFSET = 2  # validation always scores the positions whose predicted token is an assistant token


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast (as the EAGLE-3 reference and SpecForge train; on a CPU only worth it where bf16 is
    native: precision.py); fp32 = no autocast."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class TrainSettings:
    epochs: int  # passes over the training split
    max_steps: int | None  # stop early (tiny configs/tests); does not change the LR schedule; None = no limit
    lr: float
    weight_decay: float  # on matrices only (norm weights are not decayed)
    warmup_steps: int
    grad_clip: float  # max global grad norm; 0 = off
    batch_tokens: int  # token budget per optimizer step (padded size of a batch of whole samples)
    max_seq_len: int  # longer samples are truncated
    ttt_steps: int  # training-time-test steps
    ttt_decay: float  # step j loss weight decay**j (EAGLE-3 reference and SpecForge: 0.8)
    noise_std: float  # uniform noise U(-std, std) on aux states (speculators: 0.05); 0 = off
    val_fraction: float  # held-out samples for validation, chosen by a hash of the sample id
    seed: int
    threads: int | None  # torch.set_num_threads; None = torch's default
    checkpoint_every: (
        int | None
    )  # also checkpoint every N steps (always at each epoch end); None = epochs only
    pack_window: int  # samples sorted by length together before packing into batches (1 = no sorting)
    loader_threads: int  # background threads decoding the next batches; 0 = decode in the loop
    precision: str = "auto"  # bf16: matmuls under bf16 autocast (weights, optimizer, loss in fp32); fp32;
    # auto: bf16 where the device multiplies it natively (precision.py)
    drafter: dict[str, Any] = field(default_factory=dict)  # train.drafter: explicit shape; nulls = derived
    # the objective and optimiser choices below were picked by ablation (bench/ablate.py, README "Training")
    head_init: str = "random"  # random: lm_head N(0, 0.02), norm ones; target: both from the target
    loss_norm: str = "position"  # position: step mean over valid positions; sample: per-sample sum / length
    mask_offset: int = 2  # step j at t trains where loss_mask[t+j+offset]: 2 = the predicted token's own
    adam_beta2: float = 0.95  # AdamW (0.9, beta2); the EAGLE reference 0.95, SpecForge 0.999
    # fan_in: torch's default U(+-1/sqrt(fan_in)), which SpecForge's drafter keeps (it never
    # re-initialises); normal: every linear N(0, 0.02) (the EAGLE reference)
    layer_init: str = "fan_in"
    # assistant: train where the predicted token is an answer token; all: also on prompts and templates
    # (the target's distribution is a teacher everywhere; validation always scores answers)
    loss_positions: str = "assistant"
    # accepted: step j at t attends to the step-0 keys <= t, what a cached drafter sees at inference;
    # lagged: <= t-j, as SpecForge trains (validation always scores the inference view)
    ttt_prefix: str = "accepted"
    # advance: step j at t rotates by position t+j (vLLM's draft positions); fixed: t (SpecForge)
    ttt_positions: str = "advance"

    def __post_init__(self) -> None:
        self.drafter = dict(self.drafter or {})  # a saved null means "all derived"
        problems = []
        if self.epochs < 1:
            problems.append(f"epochs={self.epochs} must be >= 1")
        if self.max_steps is not None and self.max_steps < 0:
            problems.append(f"max_steps={self.max_steps} must be >= 0 or null")
        if not self.lr > 0:
            problems.append(f"lr={self.lr} must be > 0")
        if self.weight_decay < 0 or self.warmup_steps < 0 or self.grad_clip < 0 or self.noise_std < 0:
            problems.append("weight_decay, warmup_steps, grad_clip and noise_std must be >= 0")
        if self.max_seq_len < 3:
            problems.append(f"max_seq_len={self.max_seq_len} must be >= 3 (a prediction needs t+2 < T)")
        if self.batch_tokens < 1:
            problems.append(f"batch_tokens={self.batch_tokens} must be >= 1")
        if self.ttt_steps < 1:
            problems.append(f"ttt_steps={self.ttt_steps} must be >= 1")
        if not self.ttt_decay > 0:
            problems.append(f"ttt_decay={self.ttt_decay} must be > 0")
        if not 0 <= self.val_fraction < 1:
            problems.append(f"val_fraction={self.val_fraction} must be in [0, 1)")
        if self.threads is not None and self.threads < 1:
            problems.append(f"threads={self.threads} must be >= 1 or null")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            problems.append(f"checkpoint_every={self.checkpoint_every} must be >= 1 or null")
        if self.pack_window < 1:
            problems.append(f"pack_window={self.pack_window} must be >= 1")
        if self.precision not in TRAIN_PRECISIONS:
            problems.append(f"precision={self.precision!r} must be one of {list(TRAIN_PRECISIONS)}")
        if self.loader_threads < 0:
            problems.append(f"loader_threads={self.loader_threads} must be >= 0")
        if self.head_init not in HEAD_INITS:
            problems.append(f"head_init={self.head_init!r} must be one of {list(HEAD_INITS)}")
        if self.loss_norm not in LOSS_NORMS:
            problems.append(f"loss_norm={self.loss_norm!r} must be one of {list(LOSS_NORMS)}")
        if self.mask_offset not in (0, 1, 2):
            problems.append(f"mask_offset={self.mask_offset} must be 0, 1 or 2")
        if self.loss_positions not in LOSS_POSITIONS:
            problems.append(f"loss_positions={self.loss_positions!r} must be one of {list(LOSS_POSITIONS)}")
        if self.layer_init not in LAYER_INITS:
            problems.append(f"layer_init={self.layer_init!r} must be one of {list(LAYER_INITS)}")
        if self.ttt_prefix not in TTT_PREFIXES:
            problems.append(f"ttt_prefix={self.ttt_prefix!r} must be one of {list(TTT_PREFIXES)}")
        if self.ttt_positions not in TTT_POSITIONS:
            problems.append(f"ttt_positions={self.ttt_positions!r} must be one of {list(TTT_POSITIONS)}")
        if not 0 < self.adam_beta2 < 1:
            problems.append(f"adam_beta2={self.adam_beta2} must be in (0, 1)")
        if problems:
            raise ValueError("invalid train settings: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainSettings:
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(names))
        optional = {
            f.name for f in fields(cls) if f.default is not MISSING or f.default_factory is not MISSING
        }
        missing = [n for n in names if n not in d and n not in optional]
        if unknown or missing:
            raise ValueError(f"train settings: unknown keys {unknown}, missing keys {missing}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------- objective


def ttt_step_targets(
    loss_mask: Tensor, lengths: Tensor, step: int, mask_offset: int = EVAL_MASK_OFFSET
) -> tuple[Tensor, Tensor, Tensor]:
    """Where TTT step j = `step` is trained, and which tokens it reads and predicts.

    loss_mask [B, T] bool, lengths [B] -> (valid [B, T] bool, src [T], tgt [T]):
      src[t] = t+1+j: the embedded input token and the teacher's final state (f_{t+1+j} gives x_{t+2+j})
      tgt[t] = t+2+j: the predicted token
      valid[b, t] = t+2+j < lengths[b] and loss_mask[b, t+j+mask_offset]
    mask_offset 2 trains where the predicted token is an assistant token; 0 where the token at t+j is
    (SpecForge shifts inputs and teacher but not the mask: it also trains the first two tokens after an
    answer and skips the first two of it). Indices are clamped to T-1; a clamped position is never valid
    (EAGLE's cnets.py shifts input_ids, target and loss_mask left by one per step, padding the end).
    """
    T = loss_mask.shape[1]
    t = torch.arange(T, device=loss_mask.device)
    tgt = t + 2 + step
    src = (t + 1 + step).clamp(max=T - 1)
    in_range = tgt[None, :] < lengths[:, None]
    tgt = tgt.clamp(max=T - 1)
    masked = (t + step + mask_offset).clamp(max=T - 1)
    return in_range & loss_mask[:, masked], src, tgt


@dataclass
class StepStats:
    """Sums over one or more batches, per TTT step j."""

    loss_sum: list[float]  # sum over valid positions of the soft cross-entropy
    correct: list[int]  # drafter top-1 == the real next token
    count: list[int]  # valid positions
    teacher_correct: int = 0  # step 0: the teacher's top-1 over the draft vocab == the real token
    tokens: int = 0
    # drafter top-1 == the teacher's top-1 over the draft vocab: what greedy verification accepts, also
    # on answers the target did not write (where the real token often is not the target's choice)
    agree: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.agree:  # a checkpoint written before the field existed
            self.agree = [0] * len(self.count)

    @classmethod
    def zeros(cls, steps: int) -> StepStats:
        return cls([0.0] * steps, [0] * steps, [0] * steps)

    def add(self, other: StepStats) -> None:
        for j in range(len(self.count)):
            self.loss_sum[j] += other.loss_sum[j]
            self.correct[j] += other.correct[j]
            self.count[j] += other.count[j]
            self.agree[j] += other.agree[j]
        self.teacher_correct += other.teacher_correct
        self.tokens += other.tokens

    def step_loss(self) -> list[float | None]:
        return [s / n if n else None for s, n in zip(self.loss_sum, self.count, strict=True)]

    def acc(self) -> list[float | None]:
        return [c / n if n else None for c, n in zip(self.correct, self.count, strict=True)]

    def agreement(self) -> list[float | None]:
        return [a / n if n else None for a, n in zip(self.agree, self.count, strict=True)]

    def loss(self, decay: float) -> float:
        return sum(
            decay**j * (s / n) for j, (s, n) in enumerate(zip(self.loss_sum, self.count, strict=True)) if n
        )

    def teacher_acc(self) -> float | None:
        return self.teacher_correct / self.count[0] if self.count[0] else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def all_sum(self, dist: Dist) -> StepStats:
        """The sums over every rank (float64 carries the integer counts exactly)."""
        if dist.world == 1:
            return self
        n = len(self.count)
        flat = [*self.loss_sum, *self.correct, *self.count, self.teacher_correct, self.tokens, *self.agree]
        t = dist.all_sum(torch.tensor(flat, dtype=torch.float64, device=dist.device)).tolist()
        ints = [int(round(x)) for x in t[n:]]
        return StepStats(t[:n], ints[:n], ints[n : 2 * n], ints[2 * n], ints[2 * n + 1], ints[2 * n + 2 :])


def ttt_loss(
    drafter: Eagle3Drafter,
    embed_weight: Tensor,
    teacher_weight: Tensor,
    batch: Batch,
    ttt_steps: int,
    ttt_decay: float,
    noise_std: float = 0.0,
    generator: torch.Generator | None = None,
    step_counts: list[int] | None = None,
    precision: str = "fp32",
    mask_offset: int = EVAL_MASK_OFFSET,
    loss_norm: str = "position",
    ttt_prefix: str = "accepted",
    ttt_positions: str = "advance",
) -> tuple[Tensor, StepStats]:
    """The EAGLE-3 TTT objective on a batch -> (weighted loss, stats).

    embed_weight [V, Ht]: the target's frozen input embedding; teacher_weight [Vd, Ht]: the target's
    lm_head rows of the draft ids (teacher_logits = f @ teacher_weight.T). loss_norm "position": step j's
    cross-entropy sum is divided by step_counts[j] (default: this batch's count of valid positions, i.e.
    the mean); "sample": each position is weighted 1/its sample's length and the sum divided by
    step_counts[j] (default: the batch's sample count), so every sample weighs by its share of trained
    positions (SpecForge). Data-parallel ranks pass `ttt_step_counts` summed over all ranks' slices, so
    their losses add up to the whole batch's. mask_offset: see `ttt_step_targets` (stats use it too).
    ttt_prefix / ttt_positions: see TrainSettings; the defaults are what inference sees.
    """
    B, T = batch.input_ids.shape
    device = batch.input_ids.device
    amp = autocast(device, precision)
    aux = batch.aux.float()
    if noise_std > 0:
        # speculators AddUniformNoise: x + 2 * (U[0, 1) - 0.5) * std, on the aux states only
        aux = aux + 2 * (torch.rand(aux.shape, generator=generator, device=device) - 0.5) * noise_std
    positions = torch.arange(T, device=device).expand(B, T)
    # one per forward: step j attends to step-0 keys <= t (lagged: <= t-j) and its own earlier steps at t
    kv = TTTKV(prefix_lag=ttt_prefix == "lagged")
    advance = ttt_positions == "advance"
    stats = StepStats.zeros(ttt_steps)
    stats.tokens = batch.num_tokens
    total = torch.zeros((), device=device)
    with amp:
        hidden = drafter.fuse(aux)  # [B, T, H]
    for j in range(ttt_steps):
        valid, src, tgt = ttt_step_targets(batch.loss_mask, batch.lengths, j, mask_offset)
        with amp:
            embeds = F.embedding(batch.input_ids[:, src], embed_weight)  # e(x_{t+1+j})
            # = drafter.forward(...), with norm + lm_head (the costliest matmul) only on the valid rows
            step_positions = positions + j if advance else positions
            hidden = drafter.midlayer(embeds, hidden, step_positions, kv)  # recurrent state for step j+1
        b, t = valid.nonzero(as_tuple=True)
        if b.numel() == 0:
            continue
        with amp:
            logits = drafter.lm_head(drafter.norm(hidden[b, t]))  # [N, Vd]
        logp = torch.log_softmax(logits.float(), dim=-1)
        with torch.no_grad():
            # teacher: the target's distribution restricted to (renormalised over) the draft vocabulary
            # (EAGLE cnets.py target_p, SpecForge, speculators' verifier_lm_head)
            teacher_logits = batch.final[b, src[t]].float() @ teacher_weight.T
            p = torch.softmax(teacher_logits, dim=-1)
            real = batch.input_ids[b, tgt[t]]  # x_{t+2+j}
            drafted, wanted = logits.argmax(-1), teacher_logits.argmax(-1)
            stats.correct[j] = int((drafter.draft_to_target(drafted) == real).sum())
            stats.agree[j] = int((drafted == wanted).sum())
            if j == 0:
                stats.teacher_correct = int((drafter.draft_to_target(wanted) == real).sum())
        per_position = -(p * logp).sum(-1)  # soft cross-entropy
        stats.loss_sum[j] = float(per_position.detach().sum())
        stats.count[j] = int(b.numel())
        if loss_norm == "sample":
            per_position = per_position / batch.lengths[b].to(per_position.dtype)
        denominator = (
            step_counts[j] if step_counts is not None else (B if loss_norm == "sample" else b.numel())
        )
        total = total + ttt_decay**j * per_position.sum() / denominator
    return total, stats


def real_positions(lengths: Tensor, T: int) -> Tensor:
    """lengths [B] -> [B, T] bool: True on every real (non-padding) position."""
    return torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]


def ttt_step_counts(
    loss_mask: Tensor,
    lengths: Tensor,
    ttt_steps: int,
    mask_offset: int = EVAL_MASK_OFFSET,
    loss_norm: str = "position",
) -> list[int]:
    """What each TTT step's loss of a batch is divided by, known before the forward (masks only):
    its valid positions ("position") or the batch's samples ("sample")."""
    if loss_norm == "sample":
        return [int(lengths.numel())] * ttt_steps
    return [int(ttt_step_targets(loss_mask, lengths, j, mask_offset)[0].sum()) for j in range(ttt_steps)]


def lr_factor(step: int, warmup_steps: int, total_steps: int, final_ratio: float = 0.1) -> float:
    """Linear warm-up to 1, then cosine down to final_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(drafter: Eagle3Drafter, settings: TrainSettings) -> torch.optim.AdamW:
    params = [p for p in drafter.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": settings.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, settings.adam_beta2))


@torch.no_grad()
def evaluate(
    drafter: Eagle3Drafter,
    embed: Tensor,
    teacher: Tensor,
    data: StreamingData,
    settings: TrainSettings,
    dist: Dist,
) -> StepStats:
    """Validation stats over every rank's slice of the validation batches."""
    was_training = drafter.training
    drafter.eval()
    stats = StepStats.zeros(settings.ttt_steps)
    plan = [b[dist.rank :: dist.world] for b in data.val_batches()]
    for batch in data.batches(plan, "val"):
        if batch is not None:
            batch = batch.to(dist.device)
            stats.add(
                ttt_loss(
                    drafter, embed, teacher, batch, settings.ttt_steps, settings.ttt_decay,
                    precision=settings.precision,
                )[1]
            )  # fmt: skip
    drafter.train(was_training)
    return stats.all_sum(dist)


def noise_seed(seed: int, step: int, rank: int) -> int:
    """Seed of the aux-state noise of one step on one rank: reproducible without saving any generator
    state, so a resumed run draws the same noise."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{step}/{rank}".encode()).digest()[:7], "big")


# ------------------------------------------------------------------------------------------------- train


def build_drafter(
    target: TargetHead,
    d2t: Tensor,
    t2d: Tensor,
    num_aux: int,
    seed: int,
    device: torch.device | str,
    shape: dict[str, Any] | None = None,
    head_init: str = "random",
    layer_init: str = "fan_in",
) -> tuple[Eagle3Drafter, Tensor, Tensor]:
    """-> (the drafter at its initial weights, in train mode; the frozen target embedding [V, Ht]; the
    teacher weight [Vd, Ht] = the target's lm_head rows of the draft ids), on device. The initial
    weights are a function of `seed`: every data-parallel rank builds the same drafter. head_init
    "target" copies lm_head rows and the final norm from the target; "random" keeps the drafter's own
    initialisation (lm_head as every other linear layer, norm ones; SpecForge). layer_init "normal" draws
    every linear N(0, 0.02); "fan_in" keeps torch's default, U(+-1/sqrt(fan_in))."""
    if head_init not in HEAD_INITS:
        raise ValueError(f"head_init={head_init!r} must be one of {list(HEAD_INITS)}")
    cfg = DrafterConfig.from_target(target.config, d2t.numel(), num_aux, shape)
    log.info("drafter: %s, %.1f M parameters", describe(cfg), param_count(cfg) / 1e6)
    random.seed(seed)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg)
    if layer_init != "normal":  # the constructor's draw is "normal"
        drafter.init_linears(layer_init)
    drafter.set_vocab_map(d2t, t2d)
    if head_init == "target":
        drafter.init_from_target(target.lm_head, target.norm)
    drafter.to(device).train()
    embed = target.embed.to(device)  # frozen, not part of the drafter
    draft_ids = torch.arange(cfg.draft_vocab_size) + d2t  # target id of each draft id
    return drafter, embed, target.lm_head[draft_ids].to(device)


# ------------------------------------------------------------------------------------------------- train


class MetricsLog:
    """Every metrics row of the run so far; rank 0 rewrites the whole file at most every
    METRICS_FLUSH_S (a resumed run starts from the rows its checkpoint kept)."""

    def __init__(self, path: Path, rows: list[dict[str, Any]], enabled: bool):
        self.path, self.rows, self.enabled, self.last_flush = path, rows, enabled, 0.0

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)

    def flush(self, force: bool = False) -> None:
        if self.enabled and (force or time.perf_counter() - self.last_flush > METRICS_FLUSH_S):
            write_jsonl(self.path, self.rows)
            self.last_flush = time.perf_counter()


def train_step(
    drafter: Eagle3Drafter,
    embed: Tensor,
    teacher_weight: Tensor,
    batch: Batch | None,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    settings: TrainSettings,
    dist: Dist,
    noise_gen: torch.Generator,
    step: int,
) -> tuple[StepStats, float, float]:
    """One optimizer step on this rank's share of a batch (None: no share) -> (stats summed over
    ranks, grad norm, the lr it used)."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    stats = StepStats.zeros(settings.ttt_steps)
    counts = torch.zeros(settings.ttt_steps, dtype=torch.int64)
    if batch is not None:
        batch = batch.to(dist.device)
        if settings.loss_positions == "all":
            batch = replace(batch, loss_mask=real_positions(batch.lengths, batch.loss_mask.shape[1]))
        counts = torch.tensor(
            ttt_step_counts(
                batch.loss_mask, batch.lengths, settings.ttt_steps, settings.mask_offset, settings.loss_norm
            )
        )
    counts = dist.all_sum(counts.to(dist.device)).tolist()  # the whole batch's, over all ranks
    optimizer.zero_grad(set_to_none=True)
    if batch is not None:
        if settings.noise_std > 0:
            noise_gen.manual_seed(noise_seed(settings.seed, step, dist.rank))
        loss, stats = ttt_loss(
            drafter, embed, teacher_weight, batch, settings.ttt_steps, settings.ttt_decay,
            settings.noise_std, noise_gen, step_counts=counts, precision=settings.precision,
            mask_offset=settings.mask_offset, loss_norm=settings.loss_norm,
            ttt_prefix=settings.ttt_prefix, ttt_positions=settings.ttt_positions,
        )  # fmt: skip
        if loss.requires_grad:  # False only if no position of the batch is trainable
            loss.backward()
    sync_gradients(params, dist)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        params, settings.grad_clip if settings.grad_clip > 0 else float("inf")
    )
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    return stats.all_sum(dist), float(grad_norm), lr


def stats_row(kind: str, stats: StepStats, settings: TrainSettings, **extra: Any) -> dict[str, Any]:
    """A metrics.jsonl row of train or val stats."""
    return {
        "kind": kind,
        **extra,
        "loss": stats.loss(settings.ttt_decay),
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

    step: int = 0
    epoch: int = 0  # the epoch to continue (0-based) ...
    batch_in_epoch: int = 0  # ... from this batch of its plan
    epoch_stats: StepStats | None = None  # the current epoch's train stats so far
    last_epoch_stats: StepStats | None = None

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
) -> dict[str, Any]:
    """Train a drafter on the shards of data_config.json and export it to out_dir -> summary dict.

    Resumes from the newest complete checkpoint of this data and these settings (checkpoints.py says
    when); `fresh` discards every checkpoint first. Checkpoints are written at each epoch end, every
    `checkpoint_every` steps and when max_steps stops the run. Under torchrun (WORLD_SIZE > 1) this runs
    on every rank; rank 0 writes checkpoints, metrics and the export.
    """
    wall_start = time.perf_counter()
    out_dir, metrics_path = Path(out_dir), Path(metrics_path)
    dist = init_distributed(device)
    settings = replace(settings, precision=train_precision(settings.precision, dist.device))
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    manifest, vocab, target = load_inputs(manifest_path, vocab_path)
    tcfg = target.config
    num_aux = int(manifest["num_aux"])

    data = StreamingData.from_manifest(manifest, settings)
    steps_per_epoch = [len(data.epoch_batches(e)) for e in range(settings.epochs)]
    total_steps = sum(steps_per_epoch)  # the schedule's horizon; max_steps only stops early
    stop_at = total_steps if settings.max_steps is None else min(total_steps, settings.max_steps)

    drafter, embed, teacher_weight = build_drafter(
        target, vocab["d2t"], vocab["t2d"], num_aux, settings.seed, dist.device, settings.drafter,
        settings.head_init, settings.layer_init,
    )  # fmt: skip
    del target
    optimizer = make_optimizer(drafter, settings)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, settings.warmup_steps, total_steps)
    )
    noise_gen = torch.Generator(device=dist.device)

    # ---- resume: every rank reads the same checkpoint; rank 0 removes the rest after the others read
    key = resume_key(settings, manifest, vocab, drafter.cfg)
    latest, remove = find_resume(checkpoint_dir, key, stop_at, fresh=fresh, verbose=dist.main)
    pos, rows = Position(epoch_stats=StepStats.zeros(settings.ttt_steps)), []
    if latest is not None:
        state, rows = load_checkpoint(latest, drafter, optimizer, scheduler)
        pos = Position.from_state(state)
        rows.append({"kind": "resume", "step": pos.step, "checkpoint": str(latest), "world_size": dist.world})
        if dist.main:
            log.info(
                "resumed from step %d (%s; epoch %d, batch %d)",
                pos.step,
                latest,
                pos.epoch + 1,
                pos.batch_in_epoch,
            )
    resumed_from = pos.step if latest is not None else None
    dist.barrier()
    run_folder = start_run(checkpoint_dir, key, remove) if dist.main else None
    metrics = MetricsLog(metrics_path, rows, dist.main)
    metrics.flush(force=True)  # a resumed run's full history, at once

    def checkpoint_now() -> None:  # reads only: no state of the loop changes here
        metrics.flush(force=True)  # metrics first: they also go into the checkpoint
        if dist.main:
            state = pos.to_state(total_steps=total_steps, world_size=dist.world, resume_key=key)
            save_checkpoint(run_folder, pos.step, drafter, optimizer, scheduler, state, metrics.rows)

    # ---- loop
    last_saved = resumed_from
    trained_tokens, train_time, wait_time = 0, 0.0, 0.0
    bar = tqdm(
        total=stop_at,
        initial=min(pos.step, stop_at),
        disable=not (progress and dist.main),
        desc="train",
        mininterval=1.0,
    )
    while pos.epoch < settings.epochs and pos.step < stop_at:
        plan = data.epoch_batches(pos.epoch)
        todo = plan[pos.batch_in_epoch : pos.batch_in_epoch + stop_at - pos.step]  # none past max_steps
        batches = data.batches([b[dist.rank :: dist.world] for b in todo], "train")
        for _ in todo:
            t_wait = time.perf_counter()
            batch = next(batches)  # decoded in the background while the previous step trained
            t0 = time.perf_counter()
            stats, grad_norm, lr = train_step(
                drafter, embed, teacher_weight, batch, optimizer, scheduler, settings, dist, noise_gen, pos.step
            )  # fmt: skip
            dt = time.perf_counter() - t0
            pos.step += 1
            pos.batch_in_epoch += 1
            pos.epoch_stats.add(stats)
            trained_tokens, train_time, wait_time = (
                trained_tokens + stats.tokens,
                train_time + dt,
                wait_time + t0 - t_wait,
            )
            metrics.append(
                stats_row(
                    "train", stats, settings, step=pos.step, epoch=pos.epoch + 1, batch=pos.batch_in_epoch,
                    batches_in_epoch=len(plan), lr=lr, grad_norm=grad_norm,
                    tokens_per_s=stats.tokens / dt if dt > 0 else None, data_wait_s=t0 - t_wait,
                )
            )  # fmt: skip
            bar.update(1)
            acc = " ".join(f"acc{j} {a:.2f}" for j, a in enumerate(stats.acc()) if a is not None)
            bar.set_postfix_str(
                f"loss {stats.loss(settings.ttt_decay):.3f} {acc} tok/s {stats.tokens / dt:.0f}"
            )
            metrics.flush()
            every = settings.checkpoint_every
            if every and pos.step % every == 0 and pos.batch_in_epoch < len(plan):
                checkpoint_now()
                last_saved = pos.step
        batches.close()
        if pos.batch_in_epoch < len(plan):
            break  # stopped by max_steps
        # ---- epoch end: validation, then a checkpoint positioned at the next epoch
        if data.val:
            v = evaluate(drafter, embed, teacher_weight, data, settings, dist)
            metrics.append(
                stats_row("val", v, settings, step=pos.step, epoch=pos.epoch + 1, samples=len(data.val))
            )
            if dist.main:
                log.info("epoch %d val loss %.4f acc %s", pos.epoch + 1, metrics.rows[-1]["loss"], v.acc())
        pos.last_epoch_stats, pos.epoch_stats = pos.epoch_stats, StepStats.zeros(settings.ttt_steps)
        pos.epoch, pos.batch_in_epoch = pos.epoch + 1, 0
        checkpoint_now()
        last_saved = pos.step
    bar.close()
    data.close()
    if last_saved != pos.step:  # stopped since the last checkpoint
        checkpoint_now()
    metrics.flush(force=True)

    # ---- summary + export
    stats = pos.epoch_stats if sum(pos.epoch_stats.count) else (pos.last_epoch_stats or pos.epoch_stats)
    val_rows = [r for r in metrics.rows if r["kind"] == "val"]
    summary = {
        "steps": pos.step,
        "total_steps": total_steps,
        "epochs": settings.epochs,
        "epochs_completed": pos.epoch,
        "steps_per_epoch": steps_per_epoch,
        "stopped_early": pos.step < total_steps,
        "resumed_from_step": resumed_from,
        "world_size": dist.world,
        "device": str(dist.device),
        "train_samples": len(data.train),
        "val_samples": len(data.val),
        "train_loss": stats.loss(settings.ttt_decay) if sum(stats.count) else None,
        "train_acc": stats.acc(),
        "train_agreement": stats.agreement(),
        "teacher_acc": stats.teacher_acc(),
        "val_loss": val_rows[-1]["loss"] if val_rows else None,
        "val_acc": val_rows[-1]["acc"] if val_rows else None,
        "val_agreement": val_rows[-1]["agreement"] if val_rows else None,
        "trained_tokens": trained_tokens,
        "tokens_per_s": trained_tokens / train_time if train_time > 0 else None,
        # time the loop waited for the loader: ~0 when background decoding keeps ahead of training
        "data_wait_s": wait_time,
        "data_wait_fraction": wait_time / (wait_time + train_time) if train_time > 0 else None,
        "wall_s": time.perf_counter() - wall_start,
    }
    if dist.main:
        aux_ids = convert_layer_ids(
            [int(i) for i in manifest["aux_layer_ids"]], manifest.get("layer_convention", "input"), "input"
        )
        export(drafter, out_dir, aux_ids, str(manifest["target"]), tcfg, settings, summary)
    dist.barrier()  # the export exists before any rank returns
    if dist.owns_group:
        torch.distributed.destroy_process_group()
    return summary


def export(
    drafter: Eagle3Drafter,
    out_dir: Path,
    aux_ids_input: list[int],
    target: str,
    target_config: Any,
    settings: TrainSettings,
    summary: dict[str, Any],
) -> None:
    """The drafter in the serving format, checked, with the training summary; all or nothing."""
    with atomic_dir(out_dir) as tmp:
        extra = {"training": {"settings": settings.to_dict(), "summary": summary}}
        save_drafter(drafter, tmp, aux_ids_input, target, extra=extra)
        problems = check_export(
            tmp, target_num_layers=target_config.num_hidden_layers, target_vocab_size=target_config.vocab_size
        )
        if problems:
            raise RuntimeError(f"the export failed its own checks: {problems}")
        write_json(tmp / "train_summary.json", summary)
    log.info("exported the drafter to %s", out_dir)
