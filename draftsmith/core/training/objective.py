"""The EAGLE-3 training-time-test (TTT) objective: what one training forward computes and scores.

`Objective` (the loss's options, from the train settings; `for_validation()`: the inference view),
`ttt_loss` (the TTT forward over a batch -> weighted loss and `StepStats`), its pieces (`ttt_step_targets`,
the soft cross-entropy, the LK losses' terms, the draft-vocabulary mass, the aux-state noise) and
`DraftingLoss` (the module a data-parallel wrapper sees). The loop that drives it: draftsmith/stages/train.py
(its module docstring states the objective); benches measure `ttt_loss` from here.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from draftsmith.core.config.stage_settings import ObjectiveSettings
from draftsmith.core.data.loader import Batch
from draftsmith.core.model.drafter import TTTKV, DraftHead, Eagle3Drafter
from draftsmith.core.model.precision import train_precision
from draftsmith.core.training.distributed import Dist

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


def ttt_step_targets(
    loss_mask: Tensor, lengths: Tensor, step: int, mask_offset: int
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
    checkpoint_ttt: bool  # activation checkpointing per TTT step (memory, not results)

    @classmethod
    def from_settings(
        cls, settings: ObjectiveSettings, device: torch.device | str | None = None
    ) -> Objective:
        """Every field from the setting of the same name, but the step weights (ttt_step_weights, else
        ttt_decay**j) and the precision (resolved for the device)."""
        derived: dict[str, Any] = {
            "step_weights": tuple(
                settings.ttt_step_weights or (settings.ttt_decay**j for j in range(settings.ttt_steps))
            ),
            "precision": train_precision(settings.precision, device),
        }
        same = {f.name: getattr(settings, f.name) for f in fields(cls) if f.name not in derived}
        return cls(**same, **derived)

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
        return drafter.midlayer(embeds, hidden, step_positions, view)  # pre-norm state of step j

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
        parallel = drafter.cfg.parallel  # P-EAGLE (the one parallel kind of this layer)
        if parallel:  # steps j >= 1 are mask slots: the mask token and fuse(mask_hidden), no recurrence
            assert drafter.cfg.mask_token_id is not None  # a peagle config has one
            mask_ids = torch.full_like(batch.input_ids, drafter.cfg.mask_token_id)  # [B, T]
            mask_state = drafter.fused_mask().expand(B, T, -1)  # [B, T, H]
        for j in range(steps):
            _, src, tgt = targets[j]
            step_positions = positions + j if advance else positions
            src_ids = mask_ids if parallel and j > 0 else batch.input_ids[:, src]
            step_hidden = mask_state if parallel and j > 0 else hidden
            # = drafter.forward(...), with norm + lm_head (the costliest matmul) only on the valid rows
            if checkpointed:  # keep the step's inputs, recompute its activations in the backward pass
                prenorm, k, v = checkpoint(
                    layer_again,
                    src_ids,
                    step_positions,
                    step_hidden,
                    *kv.keys,
                    *kv.values,
                    use_reentrant=False,
                )
                kv.keys.append(k)
                kv.values.append(v)
            else:
                prenorm = layer(kv, src_ids, step_positions, step_hidden)
            hidden = drafter.recurrent(prenorm)  # step j+1's input (EAGLE 3.1: post-norm)
            b, t = rows[j].unbind(1)
            if b.numel() == 0:
                if objective.lk_loss == "lambda":
                    batch_acceptance(torch.zeros(0, device=device), all_sum)  # every rank sums as often
                sums.append(torch.zeros(3, device=device, dtype=torch.float64))
                continue
            final_rows = batch.final[b, src[t]]
            if checkpointed and plain_ce:
                per_position, drafted, wanted = checkpoint(
                    head, prenorm[b, t], final_rows, use_reentrant=False
                )
            else:
                per_position, drafted, wanted, *lk = head(prenorm[b, t], final_rows)
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
                logp, p = lk  # the head's extra outputs under an LK loss
                per_position = lk_terms(per_position, logp, p, mass, objective, all_sum)
            total = total + weighted_step_loss(per_position, b, j, batch, objective, step_counts, counts)
        if parallel and total.requires_grad and not any(counts[1:]):
            # no mask slot trained (always so with ttt_steps 1): mask_hidden's gradient is an explicit 0, not
            # None, so DDP (find_unused_parameters=False) still gets it from this rank. Cheaper than DDP's
            # find_unused_parameters, which walks the autograd graph every step for every kind; 1 and N
            # processes alike see a zero gradient (AdamW: no change at weight_decay 0)
            total = total + 0.0 * mask_state.sum()
    return total, read_step_stats(sums, teacher_correct, batch, counts)


def weighted_step_loss(
    per_position: Tensor,
    rows: Tensor,
    j: int,
    batch: Batch,
    objective: Objective,
    step_counts: list[int] | None,
    counts: list[int],
) -> Tensor:
    """Draft position j's share of the loss: its per-position losses (of batch rows `rows`) summed, each
    divided by its sample's length for loss_norm "sample", over step_counts[j] (else this batch's: its
    samples, or its valid positions `counts[j]`), times the position's weight."""
    if objective.loss_norm == "sample":
        per_position = per_position / batch.lengths[rows].to(per_position.dtype)
    if step_counts is not None:
        denominator = step_counts[j]
    else:
        denominator = batch.lengths.shape[0] if objective.loss_norm == "sample" else counts[j]
    return objective.step_weights[j] * per_position.sum() / denominator


def read_step_stats(
    sums: list[Tensor], teacher_correct: Tensor, batch: Batch, counts: list[int]
) -> StepStats:
    """StepStats from the device-side sums (per draft position: loss sum, correct, agree) in one host
    read, with the teacher's correct count and the batch's tokens."""
    device = batch.input_ids.device
    stats = StepStats.zeros(len(counts))
    last = torch.stack([teacher_correct, batch.lengths.sum(), torch.zeros_like(teacher_correct)])
    *read, (teacher_read, tokens, _) = torch.stack(
        [*sums, last.to(device=device, dtype=torch.float64)]
    ).tolist()
    for j, (loss_sum, correct, agree) in enumerate(read):
        stats.loss_sum[j], stats.correct[j], stats.agree[j] = loss_sum, int(correct), int(agree)
    stats.count = list(counts)
    stats.teacher_correct = int(teacher_read)
    stats.tokens = int(tokens)
    return stats


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
    mask_offset: int,
    loss_norm: str,
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


class DraftingLoss(torch.nn.Module):
    """The drafter and the frozen target tensors it learns from: forward = `ttt_loss`, so one module
    call computes the loss (what a data-parallel wrapper needs to see). embed, teacher and lm_head (the
    target's whole head, for the LK losses' draft-vocabulary mass; None: not needed) are plain attributes,
    not parameters or buffers: never trained, saved or synchronised. all_sum adds a tensor over ranks."""

    def __init__(
        self,
        drafter: DraftHead,
        embed: Tensor,
        teacher: Tensor,
        lm_head: Tensor | None = None,
        all_sum: Callable[[Tensor], Tensor] | None = None,
        loss: Callable[..., tuple[Tensor, StepStats]] = ttt_loss,
    ):
        super().__init__()
        self.drafter, self.embed, self.teacher, self.lm_head, self.all_sum = (
            drafter,
            embed,
            teacher,
            lm_head,
            all_sum,
        )
        self.loss = loss  # the kind's objective (core/model/kinds.drafter_loss), with ttt_loss's signature

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
        loss, stats = self.loss(
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
        return torch.stack([p.sum() for p in self.parameters()]).sum() * 0.0
