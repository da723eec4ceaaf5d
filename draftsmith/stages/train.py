"""EAGLE-3 drafter training with training-time test (TTT): settings, the objective and the loop.

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

Around this file: loader.py streams the batches, distributed.py holds the data-parallel process group,
checkpoints.py decides what to resume and saves. Layout here: settings -> the objective (`Objective`,
`ttt_loss`) -> model and optimizer -> one step (`train_step`, `validate`) -> the record (metrics rows,
position, summary) -> `train()` -> `write_drafter`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from draftsmith.core.atomic import atomic_dir, write_json, write_jsonl
from draftsmith.core.checkpoints import Run, open_run, resume_key
from draftsmith.core.config import SETTINGS_OPS
from draftsmith.core.distributed import Dist, init_distributed, launch_rank
from draftsmith.core.drafter import TTTKV, DrafterConfig, Eagle3Drafter, describe, param_count
from draftsmith.core.export_formats import check_export, save_drafter
from draftsmith.core.layers import convert_layer_ids
from draftsmith.core.loader import Batch, StreamingData, step_plan, verify_share
from draftsmith.core.precision import train_precision
from draftsmith.core.settings import from_schema
from draftsmith.core.target import TargetHead, load_target_head
from draftsmith.core.tracking import Curves, missing_trackers
from draftsmith.core.vocab import load_vocab_map
from draftsmith.stages.manifest import DataError, load_manifest

log = logging.getLogger(__name__)

METRICS_FLUSH_S = 10.0  # rewrite metrics.jsonl at most this often (and at every epoch end / checkpoint)
PROGRESS_EVERY_S = 10.0  # log a training progress line at most this often (validation: always)


# ----------------------------------------------------------------------------------------------- settings


EVAL_MASK_OFFSET = 2  # validation always scores the positions whose predicted token is an assistant token


# One autocast region per forward: on a GPU its cache keeps one bf16 copy of each weight for all TTT steps
# (their weight gradients then add up in bf16, as for any layer used twice under autocast). On a CPU, where
# memory is no concern, each use casts afresh and the gradients add up in fp32, as when autocast was entered
# per step: CPU runs train bit for bit as before. bench/memory.py turns the cache on to measure a GPU's.
CPU_AUTOCAST_CACHE = False


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast (as the EAGLE-3 reference and SpecForge train; on a CPU only worth it where bf16 is
    native: precision.py); fp32 = no autocast."""
    if precision == "bf16":
        cache = device.type != "cpu" or CPU_AUTOCAST_CACHE
        return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()


@from_schema("train", ops=SETTINGS_OPS["train"], unset=("threads",))
class TrainSettings:
    """The `train` config section and the train job's operational knobs; defaults, choices and meanings
    in config.schema.yaml (the objective and optimiser choices were picked by bench/ablate.py)."""

    epochs: int
    max_steps: int | None  # stop early (tests, the untrained drafter's 0); the LR schedule is unchanged
    lr: float
    weight_decay: float  # on matrices only (norm weights are not decayed)
    warmup_steps: int
    grad_clip: float  # max global grad norm
    batch_tokens: int  # token budget per optimizer step (padded size of a batch of whole samples)
    max_seq_len: int  # longer samples are truncated
    ttt_steps: int
    ttt_decay: float  # step j weighs ttt_decay**j ...
    ttt_step_weights: list[float] | None  # ... unless given here, one per step
    lk_loss: str  # none | alpha | lambda: train on the expected acceptance too (LK losses)
    lk_kl_scale: float
    lk_kl_decay: float
    noise_std: float  # uniform noise U(-std, std) on the aux states
    val_fraction: float  # held-out samples, chosen by a hash of the sample id
    seed: int
    precision: str  # auto | bf16 | fp32 (train_precision resolves auto per device)
    head_init: str
    loss_norm: str
    mask_offset: int
    adam_beta2: float
    optimizer: str  # adamw | muon (Muon for the weight matrices, AdamW for the rest)
    muon_lr_scale: float
    muon_weight_decay: float
    loss_positions: str
    layer_init: str
    ttt_prefix: str
    ttt_positions: str
    pack_window: int
    drafter: dict[str, Any]  # train.drafter: explicit shape; nulls = derived from the target
    threads: int | None  # torch.set_num_threads; None = torch's choice (the rule passes the job's)
    checkpoint_every: int  # also checkpoint every N steps (always at epoch ends); 0 = epoch ends only
    loader_threads: int  # background threads decoding the next batches; 0 = decode in the loop
    micro_batch_tokens: int  # a rank's share of a batch in passes of at most this many tokens; 0 = one pass
    checkpoint_ttt: bool  # recompute each TTT step's activations in the backward pass (less memory)
    report_to: list[str]  # trackers besides TensorBoard that get the live curves (wandb, mlflow)

    def check(self) -> None:
        weights = self.ttt_step_weights
        if weights is not None and len(weights) != self.ttt_steps:
            raise ValueError(f"train.ttt_step_weights: {len(weights)} weights for ttt_steps {self.ttt_steps}")
        missing = missing_trackers(self.report_to)
        if missing:
            names = ", ".join(missing)
            raise ValueError(f"resources.train.report_to: {names} not installed (pip install {names})")


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

    def loss(self, weights: tuple[float, ...]) -> float:
        """The objective's weighted sum of the per-step mean losses (steps without positions left out)."""
        return sum(w * (s / n) for w, s, n in zip(weights, self.loss_sum, self.count, strict=True) if n)

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


@dataclass(frozen=True)
class Objective:
    """What the TTT loss computes, built from the settings (`from_settings`); `for_validation()` is the
    view validation scores: what a cached drafter sees at inference, on answer tokens."""

    ttt_steps: int
    step_weights: tuple[float, ...]  # step j's loss weight
    precision: str  # "bf16" (matmuls under autocast) or "fp32"
    mask_offset: int  # see ttt_step_targets
    loss_norm: str  # "position": step mean over valid positions; "sample": per-sample sum / length
    loss_positions: str  # "assistant": where the predicted token is an answer token; "all": every real one
    ttt_prefix: str  # "accepted": step j sees step-0 keys <= t (inference); "lagged": <= t-j (SpecForge)
    ttt_positions: str  # "advance": step j rotates by t+j (vLLM's draft positions); "fixed": by t
    noise_std: float  # uniform noise on the aux states (train_step draws it)
    lk_loss: str  # "none": soft cross-entropy; "alpha" / "lambda": the LK losses (see `ttt_loss`)
    lk_kl_scale: float
    lk_kl_decay: float
    checkpoint_ttt: bool = False  # activation checkpointing per TTT step (memory, not results)

    @classmethod
    def from_settings(cls, settings: TrainSettings, device: torch.device | str | None = None) -> Objective:
        return cls(
            ttt_steps=settings.ttt_steps,
            step_weights=tuple(
                settings.ttt_step_weights or (settings.ttt_decay**j for j in range(settings.ttt_steps))
            ),
            precision=train_precision(settings.precision, device),
            mask_offset=settings.mask_offset,
            loss_norm=settings.loss_norm,
            loss_positions=settings.loss_positions,
            ttt_prefix=settings.ttt_prefix,
            ttt_positions=settings.ttt_positions,
            noise_std=settings.noise_std,
            lk_loss=settings.lk_loss,
            lk_kl_scale=settings.lk_kl_scale,
            lk_kl_decay=settings.lk_kl_decay,
            checkpoint_ttt=settings.checkpoint_ttt,
        )

    def for_validation(self) -> Objective:
        """The same steps, weights and precision with every training-only option at the inference view:
        no noise, answer positions only (mask offset 2), each valid position alike, the accepted prefix at
        advancing positions, the soft cross-entropy. So validation figures compare across variants."""
        return replace(
            self,
            lk_loss="none",
            mask_offset=EVAL_MASK_OFFSET,
            loss_norm="position",
            loss_positions="assistant",
            ttt_prefix="accepted",
            ttt_positions="advance",
            noise_std=0.0,
        )

    def trained_mask(self, batch: Batch) -> Tensor:
        """[B, T] bool: the positions whose tokens count as targets (before the per-step offset)."""
        if self.loss_positions == "all":
            return real_positions(batch.lengths, batch.loss_mask.shape[1])
        return batch.loss_mask

    def step_counts(self, batch: Batch) -> list[int]:
        """What each step's loss of the batch is divided by, known before the forward (masks only)."""
        return ttt_step_counts(
            self.trained_mask(batch), batch.lengths, self.ttt_steps, self.mask_offset, self.loss_norm
        )


def ttt_loss(
    drafter: Eagle3Drafter,
    embed_weight: Tensor,
    teacher_weight: Tensor,
    batch: Batch,
    objective: Objective,
    step_counts: list[int] | None = None,
    *,
    draft_mass: Tensor | None = None,
    all_sum: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, StepStats]:
    """The EAGLE-3 TTT objective on a batch -> (weighted loss, stats).

    embed_weight [V, Ht]: the target's frozen input embedding; teacher_weight [Vd, Ht]: the target's
    lm_head rows of the draft ids (teacher_logits = f @ teacher_weight.T). Step j's cross-entropy sum is
    divided by step_counts[j], by default this batch's `objective.step_counts` (loss_norm "position": its
    valid positions, i.e. the mean; "sample": its samples, each position weighted 1/its sample's length,
    as SpecForge). Data-parallel ranks pass the counts summed over all ranks' slices, so their losses add
    up to the whole batch's. The aux states are used as given (train_step adds the noise).

    The LK losses (objective.lk_loss) replace each position's cross-entropy by a term of its expected
    acceptance alpha = sum_x min(p(x), q(x)), where q is the drafter's distribution and p the target's
    restricted to the draft vocabulary: the renormalised teacher times `draft_mass` [B, T], the target's
    probability mass on the draft vocabulary at each position (`draft_mass`; None: 1). "alpha": -log(alpha);
    "lambda": w * cross-entropy + (1 - w) * (1 - alpha), w = lk_kl_scale * exp(-lk_kl_decay * the step's
    mean alpha over the whole batch, `all_sum` adding the ranks' sums; not differentiated). The stats
    keep the cross-entropy, so that its figures compare with and without them.
    """
    B, T = batch.input_ids.shape
    device = batch.input_ids.device
    steps = objective.ttt_steps
    loss_mask = objective.trained_mask(batch)
    positions = torch.arange(T, device=device).expand(B, T)
    # one per forward: step j attends to step-0 keys <= t (lagged: <= t-j) and its own earlier steps at t
    kv = TTTKV(prefix_lag=objective.ttt_prefix == "lagged", steps=steps)
    advance = objective.ttt_positions == "advance"
    plain_ce = objective.lk_loss == "none"
    checkpointed = objective.checkpoint_ttt and torch.is_grad_enabled()
    # every step's trained positions read here, before the loop: no host sync inside it (one more after)
    targets = [ttt_step_targets(loss_mask, batch.lengths, j, objective.mask_offset) for j in range(steps)]
    found = torch.stack([valid for valid, _, _ in targets]).nonzero()  # [K, 3]: step, b, t
    counts = torch.bincount(found[:, 0], minlength=steps).tolist()
    rows = found[:, 1:].split(counts)
    # on CUDA the teacher's head runs in bf16 (fp32 accumulation) and p is kept in bf16 (the states' dtype);
    # elsewhere in fp32 as before (CPU results unchanged)
    fast_teacher = device.type == "cuda" and objective.precision == "bf16"

    def head(hidden_rows: Tensor, final_rows: Tensor) -> tuple[Tensor, ...]:
        """Step j's loss terms on its trained rows -> (per-position loss [N], drafted, wanted[, logp, p])."""
        logits = drafter.lm_head(drafter.norm(hidden_rows))  # [N, Vd]
        with torch.no_grad():
            # teacher: the target's distribution restricted to (renormalised over) the draft vocabulary
            # (EAGLE cnets.py target_p, SpecForge, speculators' verifier_lm_head)
            with contextlib.nullcontext() if fast_teacher else torch.autocast(device.type, enabled=False):
                teacher_logits = final_rows.float() @ teacher_weight.T
            p = torch.softmax(teacher_logits.float(), dim=-1)
            drafted, wanted = logits.argmax(-1), teacher_logits.argmax(-1)
        if plain_ce:  # saves the logits and p, not fp32 log-probabilities as well
            return soft_cross_entropy(logits, p.bfloat16() if fast_teacher else p), drafted, wanted
        logp = torch.log_softmax(logits.float(), dim=-1)
        return -(p * logp).sum(-1), drafted, wanted, logp, p

    def layer(view: TTTKV, src_ids: Tensor, step_positions: Tensor, hidden: Tensor) -> Tensor:
        embeds = F.embedding(src_ids, embed_weight)  # e(x_{t+1+j})
        return drafter.midlayer(embeds, hidden, step_positions, view)  # recurrent state for step j+1

    def layer_again(
        src_ids: Tensor, step_positions: Tensor, hidden: Tensor, *past: Tensor
    ) -> tuple[Tensor, ...]:
        """`layer` as a function of its inputs (checkpointed: run again in the backward pass) -> (its
        output, its keys, its values)."""
        view = kv.with_past(past[: len(past) // 2], past[len(past) // 2 :])
        return layer(view, src_ids, step_positions, hidden), view.keys[-1], view.values[-1]

    sums: list[Tensor] = []  # per step: loss sum, correct, agree (summed on the device, read once)
    teacher_correct = torch.zeros((), dtype=torch.int64, device=device)
    total = torch.zeros((), device=device)
    # one autocast region per forward: the bf16 copies of the weights are made (and saved) once, not per step
    with autocast(device, objective.precision):
        hidden = drafter.fuse(batch.aux.float())  # [B, T, H]
        if checkpointed and steps > 1:
            kv.ensure_bias(T, hidden.dtype, device)  # shared by every step's recomputation
        for j in range(steps):
            _, src, tgt = targets[j]
            step_positions = positions + j if advance else positions
            # = drafter.forward(...), with norm + lm_head (the costliest matmul) only on the valid rows
            if checkpointed:  # keep the step's inputs, recompute its activations in the backward pass
                hidden, k, v = checkpoint(
                    layer_again,
                    batch.input_ids[:, src],
                    step_positions,
                    hidden,
                    *kv.keys,
                    *kv.values,
                    use_reentrant=False,
                )
                kv.keys.append(k)
                kv.values.append(v)
            else:
                hidden = layer(kv, batch.input_ids[:, src], step_positions, hidden)
            b, t = rows[j].unbind(1)
            if b.numel() == 0:
                if objective.lk_loss == "lambda":
                    batch_acceptance(torch.zeros(0, device=device), all_sum)  # every rank sums as often
                sums.append(torch.zeros(3, device=device, dtype=torch.float64))
                continue
            final_rows = batch.final[b, src[t]]
            if checkpointed and plain_ce:
                per_position, drafted, wanted = checkpoint(
                    head, hidden[b, t], final_rows, use_reentrant=False
                )
            else:
                per_position, drafted, wanted, *lk = head(hidden[b, t], final_rows)
            with torch.no_grad():
                real = batch.input_ids[b, tgt[t]]  # x_{t+2+j}
                correct = (drafter.draft_to_target(drafted) == real).sum()
                sums.append(
                    torch.stack([per_position.detach().sum().double(), correct, (drafted == wanted).sum()])
                )
                if j == 0:
                    teacher_correct = (drafter.draft_to_target(wanted) == real).sum()
            if objective.lk_loss != "none":
                mass = draft_mass[b, src[t]] if draft_mass is not None else None
                per_position = lk_terms(per_position, *lk, mass, objective, all_sum)
            if objective.loss_norm == "sample":
                per_position = per_position / batch.lengths[b].to(per_position.dtype)
            if step_counts is not None:
                denominator = step_counts[j]
            else:
                denominator = B if objective.loss_norm == "sample" else counts[j]
            total = total + objective.step_weights[j] * per_position.sum() / denominator
    stats = StepStats.zeros(steps)
    # one read for every figure: per step (loss sum, correct, agree), then (teacher correct, tokens, 0)
    last = torch.stack([teacher_correct, batch.lengths.sum(), torch.zeros_like(teacher_correct)])
    *read, (teacher_read, tokens, _) = torch.stack(
        [*sums, last.to(device=device, dtype=torch.float64)]
    ).tolist()
    for j, (loss_sum, correct, agree) in enumerate(read):
        stats.loss_sum[j], stats.correct[j], stats.agree[j] = loss_sum, int(correct), int(agree)
    stats.count = list(counts)
    stats.teacher_correct = int(teacher_read)
    stats.tokens = int(tokens)
    return total, stats


class SoftCrossEntropy(torch.autograd.Function):
    """-(p * log_softmax(logits)).sum(-1) in fp32, saving only the logits (in their compute dtype) and p:
    the backward recomputes the softmax instead of keeping fp32 log-probabilities (the largest tensors
    of a step: draft vocabulary wide)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, p: Tensor) -> Tensor:
        ctx.save_for_backward(logits, p)
        return -(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        logits, p = ctx.saved_tensors
        logp = torch.log_softmax(logits.float(), dim=-1)  # what the forward computed, bit for bit
        # autograd's own steps for -(p * logp).sum(-1), in its order: the same gradient to the last bit
        grad_logp = (-grad)[:, None].expand_as(logp) * p
        return torch._log_softmax_backward_data(grad_logp, logp, -1, torch.float32).to(logits.dtype), None


def soft_cross_entropy(logits: Tensor, p: Tensor) -> Tensor:
    """logits [N, V], p [N, V] (rows summing to 1, not differentiated) -> [N] soft cross-entropy."""
    return SoftCrossEntropy.apply(logits, p)


def lk_terms(
    cross_entropy: Tensor,
    logp: Tensor,
    p: Tensor,
    mass: Tensor | None,
    objective: Objective,
    all_sum: Callable[[Tensor], Tensor] | None,
) -> Tensor:
    """One TTT step's per-position LK loss terms [N] (see `ttt_loss`) from its cross-entropy [N], the
    drafter's log-probabilities [N, Vd], the renormalised teacher [N, Vd] and its draft-vocabulary mass [N]."""
    target = p if mass is None else p * mass[:, None]
    alpha = torch.minimum(target, logp.exp()).sum(-1)  # expected acceptance of each position
    if objective.lk_loss == "alpha":
        return -torch.log(alpha.clamp_min(torch.finfo(alpha.dtype).tiny))
    weight = objective.lk_kl_scale * torch.exp(-objective.lk_kl_decay * batch_acceptance(alpha, all_sum))
    return weight * cross_entropy + (1 - weight) * (1 - alpha)


def batch_acceptance(alpha: Tensor, all_sum: Callable[[Tensor], Tensor] | None) -> Tensor:
    """The mean of alpha [N] over every rank's positions, not differentiated (0 without positions)."""
    sums = torch.stack([alpha.detach().sum(), torch.tensor(float(alpha.numel()), device=alpha.device)])
    if all_sum is not None:
        sums = all_sum(sums)
    return sums[0] / sums[1].clamp_min(1)


@torch.no_grad()
def draft_mass(final: Tensor, teacher_weight: Tensor, lm_head: Tensor, rows: int = 1024) -> Tensor:
    """final [B, T, Ht] -> [B, T]: the target's probability of the next token falling in the draft
    vocabulary, exp(logsumexp of the draft rows' logits - logsumexp of all), `rows` positions at a time."""
    flat = final.reshape(-1, final.shape[-1]).float()
    parts = [
        torch.logsumexp(f @ teacher_weight.T, -1) - torch.logsumexp(f @ lm_head.T, -1)
        for f in flat.split(rows)
    ]
    return torch.cat(parts).exp().view(final.shape[:-1])


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


def with_noise(aux: Tensor, std: float, generator: torch.Generator) -> Tensor:
    """speculators' AddUniformNoise on the aux states: x + 2 * (U[0, 1) - 0.5) * std, in fp32."""
    aux = aux.float()
    return aux + 2 * (torch.rand(aux.shape, generator=generator, device=aux.device) - 0.5) * std


def noise_seed(seed: int, step: int, rank: int, part: int = 0) -> int:
    """Seed of the aux-state noise of one step on one rank (of its micro-batch `part`): reproducible
    without saving any generator state, so a resumed run draws the same noise."""
    key = f"{seed}/{step}/{rank}" + (f"/{part}" if part else "")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:7], "big")


# ------------------------------------------------------------------------------ model and optimizer


def build_drafter(
    target: TargetHead,
    d2t: Tensor,
    t2d: Tensor,
    num_aux: int,
    settings: TrainSettings,
    device: torch.device | str,
) -> tuple[Eagle3Drafter, Tensor, Tensor]:
    """-> (the drafter at its initial weights, in train mode; the frozen target embedding [V, Ht]; the
    teacher weight [Vd, Ht] = the target's lm_head rows of the draft ids), on device.

    The initial weights are a function of settings.seed: every data-parallel rank builds the same
    drafter. settings.drafter shapes it; layer_init "normal" draws every linear N(0, 0.02), "fan_in" keeps
    torch's default U(+-1/sqrt(fan_in)); head_init "target" then copies lm_head rows and the final norm
    from the target, "random" keeps the drafter's own draw (SpecForge)."""
    cfg = DrafterConfig.from_target(target.config, d2t.numel(), num_aux, settings.drafter)
    log.info("drafter: %s, %.1f M parameters", describe(cfg), param_count(cfg) / 1e6)
    random.seed(settings.seed)
    torch.manual_seed(settings.seed)
    drafter = Eagle3Drafter(cfg)
    if settings.layer_init != "normal":  # the constructor's draw is "normal"
        drafter.init_linears(settings.layer_init)
    drafter.set_vocab_map(d2t, t2d)
    if settings.head_init == "target":
        drafter.init_from_target(target.lm_head, target.norm)
    drafter.to(device).train()
    embed = target.embed.to(device)  # frozen, not part of the drafter
    draft_ids = torch.arange(cfg.draft_vocab_size) + d2t  # target id of each draft id
    return drafter, embed, target.lm_head[draft_ids].to(device)


class DraftingLoss(torch.nn.Module):
    """The drafter and the frozen target tensors it learns from: forward = `ttt_loss`, so one module
    call computes the loss (what a data-parallel wrapper needs to see). embed, teacher and lm_head (the
    target's whole head, for the LK losses' draft-vocabulary mass; None: not needed) are plain attributes,
    not parameters or buffers: never trained, saved or synchronised. all_sum adds a tensor over ranks."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        embed: Tensor,
        teacher: Tensor,
        lm_head: Tensor | None = None,
        all_sum: Callable[[Tensor], Tensor] | None = None,
    ):
        super().__init__()
        self.drafter, self.embed, self.teacher, self.lm_head, self.all_sum = (
            drafter,
            embed,
            teacher,
            lm_head,
            all_sum,
        )

    def forward(
        self, batch: Batch | None, objective: Objective, step_counts: list[int] | None = None
    ) -> tuple[Tensor, StepStats]:
        """batch None (a data-parallel rank without a share of this batch): a loss of 0 whose gradient
        is 0 for every parameter, so that this rank still takes part in the gradient sum."""
        if batch is None:
            if objective.lk_loss == "lambda":  # the other ranks sum each step's acceptance
                for _ in range(objective.ttt_steps):
                    batch_acceptance(torch.zeros(0, device=self.teacher.device), self.all_sum)
            return self.zero(), StepStats.zeros(objective.ttt_steps)
        mass = None
        if objective.lk_loss != "none" and self.lm_head is not None:
            mass = draft_mass(batch.final, self.teacher, self.lm_head)
        loss, stats = ttt_loss(
            self.drafter,
            self.embed,
            self.teacher,
            batch,
            objective,
            step_counts,
            draft_mass=mass,
            all_sum=self.all_sum,
        )
        return (loss if loss.requires_grad else loss + self.zero()), stats

    def zero(self) -> Tensor:
        return sum(p.sum() for p in self.parameters()) * 0.0


def make_optimizer(drafter: Eagle3Drafter, settings: TrainSettings) -> torch.optim.Optimizer | Chain:
    """AdamW over every trainable parameter (weight decay on matrices only); with optimizer "muon",
    torch's Muon over the weight matrices instead and AdamW over the rest (`muon_split`)."""
    named = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
    muon = muon_split(named) if settings.optimizer == "muon" else set()
    rest = [p for n, p in named if n not in muon]
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": settings.weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, settings.adam_beta2))
    if not muon:
        return adamw
    matrices = [p for n, p in named if n in muon]
    lr, decay = settings.lr * settings.muon_lr_scale, settings.muon_weight_decay
    # match_rms_adamw: updates scaled to AdamW's RMS (Moonshot's rule), as speculators configures it
    return Chain(adamw, torch.optim.Muon(matrices, lr=lr, weight_decay=decay, adjust_lr_fn="match_rms_adamw"))


def muon_split(named: list[tuple[str, Tensor]]) -> set[str]:
    """The parameters Muon trains: matrices with both dimensions > 1 except the output head (speculators'
    rule, after Keller Jordan's Muon: orthogonalised updates suit the inner weight matrices only)."""
    return {n for n, p in named if p.dim() == 2 and min(p.shape) > 1 and "lm_head" not in n}


class Chain:
    """Optimizers (AdamW's first: its groups lead `param_groups`) or their LR schedulers, stepped and saved
    as one, so that the loop and the checkpoints treat Muon + AdamW as one optimizer."""

    def __init__(self, *parts: torch.optim.Optimizer):
        self.parts = parts

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts for group in part.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def state_dict(self) -> dict[str, Any]:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part, saved in zip(self.parts, state["parts"], strict=True):
            part.load_state_dict(saved)


def lr_factor(step: int, warmup_steps: int, total_steps: int, final_ratio: float = 0.1) -> float:
    """Linear warm-up to 1, then cosine down to final_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(
    optimizer: torch.optim.Optimizer | Chain, settings: TrainSettings, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR | Chain:
    """`lr_factor` times each group's own learning rate; a Chain of one LambdaLR per optimizer of a Chain."""

    def schedule(part: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(
            part, lambda s: lr_factor(s, settings.warmup_steps, total_steps)
        )

    if isinstance(optimizer, Chain):
        return Chain(*[schedule(part) for part in optimizer.parts])
    return schedule(optimizer)


# -------------------------------------------------------------------------------------- one step


def train_step(
    model: torch.nn.Module,
    batch: Batch | None | list[Batch | None],
    objective: Objective,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
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
    counts = dist.all_sum(counts.to(dist.device)).tolist()  # the whole batch's, over all ranks
    optimizer.zero_grad(set_to_none=True)
    stats = StepStats.zeros(objective.ttt_steps)
    for m, part in enumerate(moved):
        last = m == len(moved) - 1
        # DistributedDataParallel sums the gradients in the last backward only
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            loss, part_stats = model(part, objective, counts)
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
    model: DraftingLoss, data: StreamingData, objective: Objective, dist: Dist, micro_batch_tokens: int = 0
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
            stats.add(ttt_loss(model.drafter, model.embed, model.teacher, batch.to(dist.device), view)[1])
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
    unproven = (
        [] if settings.max_steps == 0 else verify_share(manifest_path, rank, world, settings.loader_threads)
    )
    dist = init_distributed(device)  # only once every rank has checked its share
    if dist.total(len(unproven)):
        raise DataError(refusal(unproven))
    settings = replace(settings, precision=train_precision(settings.precision, dist.device))
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    manifest, vocab, target = load_inputs(manifest_path, vocab_path)
    data = StreamingData.from_manifest(manifest, settings)
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
    model = DraftingLoss(drafter, embed, teacher, lm_head, dist.all_sum if dist.world > 1 else None)
    trained = dist.wrap(model)
    optimizer = make_optimizer(drafter, settings)
    scheduler = make_scheduler(optimizer, settings, total_steps)
    objective = Objective.from_settings(settings, dist.device)

    key = resume_key(settings, manifest, vocab, drafter.cfg)
    run = open_run(checkpoint_dir, key, stop_at, drafter, optimizer, scheduler, fresh=fresh, dist=dist)
    pos, resumed_from = resume_position(run, settings, dist)
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
    drafter: Eagle3Drafter,
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
