"""The DFlash objective: every trained position of a sequence anchors a block, all blocks in one forward.

Index convention (core/training/objective.py): aux[b, t] = the target's features after token x_t, final[b, t] =
its final state whose lm_head gives x_{t+1}. The block anchored after position t holds x_{t+1} (slot 0,
the bonus token vLLM feeds) and the mask token in slots 1..K at positions t+1..t+1+K; slot i drafts
x_{t+1+i} against the teacher final[t+i]. That is TTT step j = i-1 exactly (`ttt_step_targets`: src
t+1+j, tgt t+2+j), so the valid positions, the step weights, the statistics per draft position and the
normalisation are `ttt_loss`'s; K = objective.ttt_steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.core.data.loader import Batch
from draftsmith.core.model.dflash import DFlashDrafter, dflash_anchor_mask
from draftsmith.core.training.objective import (
    Objective,
    StepStats,
    autocast,
    read_step_stats,
    soft_cross_entropy,
    ttt_step_targets,
    weighted_step_loss,
)


def check_dflash_objective(objective: Objective) -> None:
    """The options of the EAGLE-3 objective that have no DFlash meaning (ValueError)."""
    if objective.lk_loss != "none":
        raise ValueError(f"lk_loss {objective.lk_loss!r} is not for dflash (only 'none')")
    if objective.ttt_prefix != "accepted":
        raise ValueError(f"ttt_prefix {objective.ttt_prefix!r} is not for dflash (only 'accepted')")
    if objective.ttt_positions != "advance":
        raise ValueError(f"ttt_positions {objective.ttt_positions!r} is not for dflash (only 'advance')")


def dflash_block_inputs(
    input_ids: Tensor, mask_token_id: int, K: int, anchors: Tensor
) -> tuple[Tensor, Tensor]:
    """input_ids [B, T], anchors [Na] -> (block token ids [B, (K+1)*Na], positions [B, (K+1)*Na]),
    slot-major: entry i*Na + a is slot i of the block anchored after t = anchors[a]: x_{t+1} (clamped
    to T-1) for i = 0, else the mask token; at position t+1+i."""
    B, T = input_ids.shape
    bonus = input_ids[:, (anchors + 1).clamp(max=T - 1)]  # [B, Na]
    masks = torch.full(
        (B, K * anchors.numel()), mask_token_id, dtype=input_ids.dtype, device=input_ids.device
    )
    positions = torch.cat([anchors + 1 + i for i in range(K + 1)])[None].expand(B, -1)
    return torch.cat([bonus, masks], dim=1), positions


def dflash_loss(
    drafter: DFlashDrafter,
    embed_weight: Tensor,
    teacher_weight: Tensor,
    batch: Batch,
    objective: Objective,
    step_counts: list[int] | None = None,
    *,
    draft_mass: Tensor | None = None,
    all_sum: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, StepStats]:
    """The DFlash objective on a batch -> (weighted loss, stats), with `ttt_loss`'s arguments and
    semantics (embed_weight [V, Ht] the target's frozen embedding, teacher_weight [Vd, Ht] its lm_head
    rows of the draft ids; draft position i-1 of the stats = block slot i; step_counts as there).

    One forward: the context keys of every position, then the blocks of K+1 slots of every anchor some
    slot trains, through the layers in one attention call per layer under `dflash_anchor_mask`. The LK
    losses are not implemented (draft_mass and all_sum are accepted for the signature and unused)."""
    check_dflash_objective(objective)
    B, T = batch.input_ids.shape
    device = batch.input_ids.device
    K = objective.ttt_steps
    loss_mask = objective.trained_mask(batch)
    targets = [ttt_step_targets(loss_mask, batch.lengths, j, objective.mask_offset) for j in range(K)]
    found = torch.stack([valid for valid, _, _ in targets]).nonzero()  # [N, 3]: step, b, t
    counts = torch.bincount(found[:, 0], minlength=K).tolist()  # host reads: these and the anchors
    rows = found[:, 1:].split(counts)
    fast_teacher = device.type == "cuda" and objective.precision == "bf16"  # as ttt_loss
    # only the blocks some slot of some sample trains (answers, not prompts): the same loss, less work
    anchors = torch.unique(found[:, 2])  # [Na], sorted
    Na = anchors.numel()
    slot_of = torch.zeros(T, dtype=torch.long, device=device)
    slot_of[anchors] = torch.arange(Na, device=device)  # anchor position -> its block's index
    assert drafter.cfg.mask_token_id is not None  # a dflash config has one
    ids, block_positions = dflash_block_inputs(batch.input_ids, drafter.cfg.mask_token_id, K, anchors)
    mask = dflash_anchor_mask(anchors, T, K)  # [(K+1)Na, T + (K+1)Na]
    positions = torch.arange(T, device=device).expand(B, T)

    sums: list[Tensor] = []  # per slot: loss sum, correct, agree (read once at the end)
    teacher_correct = torch.zeros((), dtype=torch.int64, device=device)
    total = torch.zeros((), device=device)
    with autocast(device, objective.precision):
        if Na:
            context = drafter.context(batch.aux.float(), positions)
            h = drafter(F.embedding(ids, embed_weight), block_positions, context, mask)  # [B, (K+1)Na, H]
        for j in range(K):
            _, src, tgt = targets[j]
            b, t = rows[j].unbind(1)
            if b.numel() == 0:
                sums.append(torch.zeros(3, device=device, dtype=torch.float64))
                continue
            logits = drafter.lm_head(h[b, (j + 1) * Na + slot_of[t]])  # slot j+1 of the blocks after t
            with torch.no_grad():
                # the target's distribution restricted to (renormalised over) the draft vocabulary
                with contextlib.nullcontext() if fast_teacher else torch.autocast(device.type, enabled=False):
                    teacher_logits = batch.final[b, src[t]].float() @ teacher_weight.T
                p = torch.softmax(teacher_logits.float(), dim=-1)
                drafted, wanted = logits.argmax(-1), teacher_logits.argmax(-1)
                real = batch.input_ids[b, tgt[t]]  # x_{t+2+j}
                correct = (drafter.draft_to_target(drafted) == real).sum()
                if j == 0:
                    teacher_correct = (drafter.draft_to_target(wanted) == real).sum()
            per_position = soft_cross_entropy(logits, p.bfloat16() if fast_teacher else p)
            with torch.no_grad():
                sums.append(
                    torch.stack([per_position.detach().sum().double(), correct, (drafted == wanted).sum()])
                )
            total = total + weighted_step_loss(per_position, b, j, batch, objective, step_counts, counts)
    return total, read_step_stats(sums, teacher_correct, batch, counts)
