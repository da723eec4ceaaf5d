"""The vocabulary map: which target tokens the drafter predicts, in the form the engines read, and its file
(results/vocab_map.pt, written by the vocab stage, read by training and the summary).

`d2t[i]` is an int64 offset, `target_id = i + d2t[i]`; `t2d` is a bool mask over the target vocabulary
(EAGLE-3 reference, SpecForge and vLLM all use this form).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsmith.core.io.atomic import atomic_path


def vocab_maps(draft_ids: Tensor, target_vocab_size: int) -> tuple[Tensor, Tensor]:
    """sorted target ids [Vd] -> (d2t [Vd] int64 offsets, t2d [V] bool)."""
    d2t = draft_ids.to(torch.int64) - torch.arange(draft_ids.numel(), dtype=torch.int64)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def save_vocab_map(path: str | Path, vocab: dict[str, Any]) -> None:
    with atomic_path(path) as tmp:
        torch.save(vocab, tmp)


class VocabMapError(ValueError):
    """A vocab_map.pt that is none (the message names the file and the rule that writes it again)."""


def load_vocab_map(path: str | Path) -> dict[str, Any]:
    try:
        vocab = torch.load(path, map_location="cpu", weights_only=True)
        d2t, t2d = vocab["d2t"], vocab["t2d"]
        if not (torch.is_tensor(d2t) and torch.is_tensor(t2d)):
            raise TypeError("d2t and t2d are no tensors")
    except Exception as err:  # torch.load of junk raises many kinds (UnpicklingError, struct.error, ...)
        why = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}" if str(err) else type(err).__name__
        raise VocabMapError(
            f"{path}: not a vocabulary map ({why}); rerun with `snakemake --forcerun vocab`"
        ) from None
    if int(t2d.sum()) != d2t.numel():
        raise ValueError(f"{path}: t2d marks {int(t2d.sum())} tokens but d2t has {d2t.numel()}")
    return vocab
