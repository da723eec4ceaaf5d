"""Draft vocabulary: the most frequent target tokens among those the drafter must predict.

`d2t[i]` is an int64 offset, `target_id = i + d2t[i]`; `t2d` is a bool mask over the target vocabulary
(EAGLE-3 reference, SpecForge and vLLM all use this form). Counts cover loss-masked tokens only, like
speculators and SpecForge: prompt tokens are never drafted.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsmith.core.atomic import atomic_path

log = logging.getLogger(__name__)


def check_draft_vocab_size(draft_vocab_size: int, target_vocab_size: int) -> None:
    """1 <= draft < target: vLLM allocates its draft-to-target map only when the two sizes differ, so a
    draft vocabulary as large as the target's would load without the d2t the export carries."""
    if draft_vocab_size < 1:
        raise ValueError(f"draft vocabulary size {draft_vocab_size} must be at least 1")
    if draft_vocab_size >= target_vocab_size:
        raise ValueError(
            f"draft vocabulary size {draft_vocab_size} must be smaller than the target vocabulary "
            f"({target_vocab_size})"
        )


def select_draft_tokens(counts: Tensor, draft_vocab_size: int) -> Tensor:
    """counts [V] -> sorted target ids [Vd]: top counts (ties to the lower id), padded with unseen low ids."""
    check_draft_vocab_size(draft_vocab_size, counts.numel())
    # stable sort on -count keeps ascending id order among equal counts
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values


def vocab_maps(draft_ids: Tensor, target_vocab_size: int) -> tuple[Tensor, Tensor]:
    """sorted target ids [Vd] -> (d2t [Vd] int64 offsets, t2d [V] bool)."""
    d2t = draft_ids.to(torch.int64) - torch.arange(draft_ids.numel(), dtype=torch.int64)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def build_vocab_map(masked_tokens: Tensor, target_vocab_size: int, draft_vocab_size: int) -> dict[str, Any]:
    counts = torch.bincount(masked_tokens.to(torch.int64), minlength=target_vocab_size)
    draft_ids = select_draft_tokens(counts, draft_vocab_size)
    d2t, t2d = vocab_maps(draft_ids, target_vocab_size)
    total = int(counts.sum())
    covered = int(counts[draft_ids].sum())
    unseen = max(0, draft_vocab_size - int((counts > 0).sum()))
    if unseen:
        log.info(
            "%d of %d draft tokens never occur in the training answers (padded with low ids)",
            unseen,
            draft_vocab_size,
        )
    return {
        "d2t": d2t,
        "t2d": t2d,
        "draft_vocab_size": draft_vocab_size,
        "target_vocab_size": target_vocab_size,
        "counted_tokens": total,
        "distinct_tokens": int((counts > 0).sum()),
        "coverage": covered / total if total else 0.0,
    }


def save_vocab_map(path: str | Path, vocab: dict[str, Any]) -> None:
    with atomic_path(path) as tmp:
        torch.save(vocab, tmp)


def load_vocab_map(path: str | Path) -> dict[str, Any]:
    vocab = torch.load(path, map_location="cpu", weights_only=True)
    d2t, t2d = vocab["d2t"], vocab["t2d"]
    if int(t2d.sum()) != d2t.numel():
        raise ValueError(f"{path}: t2d marks {int(t2d.sum())} tokens but d2t has {d2t.numel()}")
    return vocab
