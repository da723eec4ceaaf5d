"""The drafter's optimizers and learning-rate schedule: AdamW, or Muon for the weight matrices with AdamW
for the rest (speculators' `train/optimizers.py` split), stepped and saved as one (`Chain`); linear warm-up
then cosine decay (`lr_factor`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.optim._muon import _adjust_lr  # torch's own learning-rate rule per adjust_lr_fn, not a copy

from draftsmith.core.model.drafter import DraftHead
from draftsmith.core.model.precision import train_precision


class OptimizerSettings(Protocol):
    """The settings the optimizers and schedule read (train.TrainSettings has them): core does not import
    the train stage."""

    lr: float
    weight_decay: float
    warmup_steps: int
    adam_beta2: float
    optimizer: str
    muon_lr_scale: float
    muon_weight_decay: float
    precision: str


def make_optimizer(drafter: DraftHead, settings: OptimizerSettings) -> torch.optim.Optimizer | Chain:
    """AdamW over every trainable parameter (weight decay on matrices only); with optimizer "muon",
    torch's Muon over the weight matrices instead and AdamW over the rest (`muon_split`)."""
    named = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
    muon_names = muon_split(named) if settings.optimizer == "muon" else set()
    rest = [p for n, p in named if n not in muon_names]
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": settings.weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, settings.adam_beta2))
    if not muon_names:
        return adamw
    matrices = [p for n, p in named if n in muon_names]
    lr, decay = settings.lr * settings.muon_lr_scale, settings.muon_weight_decay
    # match_rms_adamw: updates scaled to AdamW's RMS (Moonshot's rule), as speculators configures it
    muon = Muon(matrices, lr=lr, weight_decay=decay, adjust_lr_fn="match_rms_adamw")
    muon.fp32_newton_schulz = train_precision(settings.precision, matrices[0].device) == "fp32"
    return Chain(adamw, muon)


def muon_split(named: Sequence[tuple[str, Tensor]]) -> set[str]:
    """The parameters Muon trains: matrices with both dimensions > 1 except the output head (speculators'
    rule, after Keller Jordan's Muon: orthogonalised updates suit the inner weight matrices only)."""
    return {n for n, p in named if p.dim() == 2 and min(p.shape) > 1 and "lm_head" not in n}


class Muon(torch.optim.Muon):
    """torch's Muon; with `fp32_newton_schulz` its orthogonalisation runs in fp32. torch runs it in bf16,
    which a CPU without native bf16 emulates (AVX2 only: one 576x1728 Newton-Schulz took 5.4 s in bf16
    against 0.3 s in fp32, so Muon cost ~40 s a step): a run that trains in fp32 orthogonalises in fp32."""

    fp32_newton_schulz = False

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]  # torch overloads it by closure
        if not self.fp32_newton_schulz:
            return super().step(closure)
        for group in self.param_groups:
            for param in (p for p in group["params"] if p.grad is not None):
                grad, momentum = param.grad, group["momentum"]
                buf = self.state[param].setdefault("momentum_buffer", torch.zeros_like(grad))
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(
                    update.float(), group["ns_coefficients"], group["ns_steps"], group["eps"]
                )
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(update, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], param.shape))
        return None


def newton_schulz(update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> Tensor:
    """The quintic Newton-Schulz iteration torch's Muon applies (an approximate U V^T of update = U S V^T),
    in update's own dtype. update: [rows, cols]."""
    a, b, c = coefficients
    wide = update.T if update.size(0) > update.size(1) else update  # [min, max]: the Gram matrix is small
    x = wide / wide.norm().clamp(min=eps)  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if update.size(0) > update.size(1) else x


class Chain:
    """Optimizers (AdamW's first: its groups lead `param_groups`) or their LR schedulers, stepped and saved
    as one, so that the loop and the checkpoints treat Muon + AdamW as one optimizer."""

    def __init__(self, *parts: Any):  # optimizers, or LR schedulers: what each method needs, they have
        self.parts = parts

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts for group in part.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        """Every part's per-parameter state (each parameter is in one part): what a checkpoint holds."""
        return {param: kept for part in self.parts for param, kept in part.state.items()}

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
    optimizer: torch.optim.Optimizer | Chain, settings: OptimizerSettings, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR | Chain:
    """`lr_factor` times each group's own learning rate; a Chain of one LambdaLR per optimizer of a Chain."""

    def schedule(part: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(
            part, lambda s: lr_factor(s, settings.warmup_steps, total_steps)
        )

    if isinstance(optimizer, Chain):
        return Chain(*[schedule(part) for part in optimizer.parts])
    return schedule(optimizer)
