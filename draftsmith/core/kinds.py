"""The drafter kinds (train.drafter.kind), each mapped once to what builds, trains and runs it: its model
class, its loss and its offline proposer. The kinds themselves: `draftsmith.core.drafter.KINDS`."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from draftsmith.core.dflash import DFlashDrafter, DFlashProposer, check_dflash_config, dflash_param_count
from draftsmith.core.drafter import DrafterConfig, Eagle3Drafter, describe, param_count
from draftsmith.core.objective import ttt_loss
from draftsmith.core.objective_dflash import dflash_loss
from draftsmith.core.speculate import Eagle3Proposer, PEagleProposer, Proposer
from draftsmith.core.target import TargetHead

log = logging.getLogger(__name__)


def new_drafter(cfg: DrafterConfig) -> nn.Module:
    """An untrained drafter of cfg's kind (weights as its constructor draws them)."""
    if cfg.kind == "dflash":
        check_dflash_config(cfg)
        return DFlashDrafter(cfg)
    return Eagle3Drafter(cfg)


def drafter_loss(cfg: DrafterConfig) -> Callable[..., Any]:
    """The training objective of cfg's kind, with `ttt_loss`'s signature."""
    return dflash_loss if cfg.kind == "dflash" else ttt_loss


def drafter_proposer(drafter: nn.Module, embed: nn.Module) -> Proposer:
    """Offline drafting as vLLM serves the drafter's kind."""
    if drafter.cfg.kind == "dflash":
        return DFlashProposer(drafter, embed)
    if drafter.cfg.kind == "peagle":
        return PEagleProposer(drafter, embed)
    return Eagle3Proposer(drafter, embed)


class DrafterInit(Protocol):
    """The settings a drafter's initial weights follow (train.TrainSettings has them)."""

    seed: int
    drafter: dict[str, Any]
    layer_init: str
    head_init: str


def build_drafter(
    target: TargetHead,
    d2t: Tensor,
    t2d: Tensor,
    num_aux: int,
    settings: DrafterInit,
    device: torch.device | str,
) -> tuple[nn.Module, Tensor, Tensor]:
    """-> (the drafter at its initial weights, in train mode; the frozen target embedding [V, Ht]; the
    teacher weight [Vd, Ht] = the target's lm_head rows of the draft ids), on device.

    The initial weights are a function of settings.seed: every data-parallel rank builds the same
    drafter. settings.drafter shapes it; layer_init "normal" draws every linear N(0, 0.02), "fan_in" keeps
    torch's default U(+-1/sqrt(fan_in)); head_init "target" then copies lm_head rows and the final norm
    from the target, "random" keeps the drafter's own draw (SpecForge)."""
    cfg = DrafterConfig.from_target(target.config, d2t.numel(), num_aux, settings.drafter)
    count = dflash_param_count(cfg) if cfg.kind == "dflash" else param_count(cfg)
    log.info("drafter: %s, %.1f M parameters", describe(cfg), count / 1e6)
    random.seed(settings.seed)
    torch.manual_seed(settings.seed)
    drafter = new_drafter(cfg)
    if settings.layer_init != "normal":  # the constructor's draw is "normal"
        drafter.init_linears(settings.layer_init)
    drafter.set_vocab_map(d2t, t2d)
    if settings.head_init == "target":
        drafter.init_from_target(target.lm_head, target.norm)
    drafter.to(device).train()
    embed = target.embed.to(device)  # frozen, not part of the drafter
    draft_ids = torch.arange(cfg.draft_vocab_size) + d2t  # target id of each draft id
    return drafter, embed, target.lm_head[draft_ids].to(device)
