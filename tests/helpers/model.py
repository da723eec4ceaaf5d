"""Drafters and floating-point tolerances: a small exported-style drafter, the tolerance of a reduction."""

from __future__ import annotations

import math
from typing import Any

import torch

from draftsmith.core.data.vocab import vocab_maps
from draftsmith.core.model.drafter import DrafterConfig, Eagle3Drafter
from draftsmith.core.model.kinds import new_drafter


def fp_tolerance(dtype: torch.dtype, depth: int, reduction: int = 1, scale: float = 1.0) -> dict[str, float]:
    """rtol/atol for torch.testing.assert_close between two computations of the same maths in `dtype`
    that round differently (other kernels, batch shapes, summation orders: AMX vs AVX-512 CPUs).

    A sum of `reduction` products is off by about eps * sqrt(reduction) of its magnitude (rounding
    errors add like a random walk); `depth` such steps in sequence add their errors (linearly, the
    pessimistic case); the worst of thousands of elements sits about 4 standard deviations out.
    `scale` is the magnitude of the compared values (e.g. max |reference|), which makes atol absolute.
    Real bugs (a wrong position, mask or cache entry) move values by O(scale), far beyond this.
    """
    rel = 4 * torch.finfo(dtype).eps * math.sqrt(reduction) * depth
    return {"rtol": rel, "atol": rel * float(scale)}


EXPORT_TARGET_VOCAB, EXPORT_DRAFT_VOCAB = 256, 96


EXPORT_AUX_IDS = [2, 4, 5]  # "input" convention


def make_drafter(seed: int = 0, target_hidden_size: int = 40, **kind: Any) -> Eagle3Drafter:
    """A small random drafter of any kind (EAGLE-3 unless `kind` says; its model class from the kind's
    record) with a draft vocabulary of EXPORT_DRAFT_VOCAB of EXPORT_TARGET_VOCAB ids."""
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        hidden_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        intermediate_size=80,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        target_hidden_size=target_hidden_size,
        target_vocab_size=EXPORT_TARGET_VOCAB,
        draft_vocab_size=EXPORT_DRAFT_VOCAB,
        num_aux=3,
        **{"kind": "eagle3", **kind},  # kind=..., mask_token_id=...
    )
    model = new_drafter(cfg)
    ids = torch.sort(torch.randperm(EXPORT_TARGET_VOCAB)[:EXPORT_DRAFT_VOCAB]).values
    model.set_vocab_map(*vocab_maps(ids, EXPORT_TARGET_VOCAB))
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1 so a dropped tensor would show
            p.add_(0.01 * torch.randn_like(p))
    return model
