"""The vocab stage: the draft vocabulary, the most frequent target tokens among those the drafter must
predict, as a vocabulary map (its form, d2t and t2d: draftsmith.core.data.vocab). Counts cover loss-masked
tokens only, like speculators and SpecForge: prompt tokens are never drafted.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import Tensor

from draftsmith.core.config.config import read_target_config
from draftsmith.core.config.stage_args import BAD_INPUT, arg
from draftsmith.core.config.stage_settings import VocabSettings
from draftsmith.core.data.tokens import load_tokens
from draftsmith.core.data.vocab import save_vocab_map, vocab_maps

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


def build_vocab(tokens_path: str, target_path: str, out_path: str, settings: VocabSettings) -> dict[str, Any]:
    """The vocab stage: count the loss-masked tokens of tokenize's output, keep the `settings.size` most
    frequent as the draft vocabulary and save its map at `out_path`; returns the map with its coverage.
    A ValueError names what in the input rules it out (the target's config, the size)."""
    try:
        target_vocab = read_target_config(target_path)["vocab_size"]
    except OSError as err:
        raise ValueError(str(err)) from err
    try:
        check_draft_vocab_size(settings.size, target_vocab)
    except ValueError as err:
        raise ValueError(f"vocab.size: {err}") from err
    tensors, _ = load_tokens(tokens_path)
    masked = tensors["input_ids"][tensors["loss_mask"].bool()]
    result = build_vocab_map(masked, target_vocab, settings.size)
    save_vocab_map(out_path, result)
    return result


@dataclasses.dataclass
class VocabPaths:
    tokens: str = arg("--tokens", "tokens.safetensors from tokenize.", required=True, exists=True)
    target: str = arg("--target", "Target model folder.", kind="dir", required=True, exists=True)
    out: str = arg("--out", "vocab_map.pt to write.", required=True, sealed=True)


Settings, Paths = VocabSettings, VocabPaths
EXITS = {ValueError: BAD_INPUT}


def run(paths: VocabPaths, settings: VocabSettings) -> list[str]:
    """Build the draft vocabulary (d2t/t2d) from loss-masked token counts; prints its coverage."""
    result = build_vocab(paths.tokens, paths.target, paths.out, settings)
    return [
        f"vocab: {settings.size} draft tokens cover {result['coverage']:.2%} of {result['counted_tokens']:,} "
        f"assistant tokens ({result['distinct_tokens']:,} distinct)"
    ]
