"""Hidden-state shards: one safetensors file per shard, readable without draftsmith.

Layout of `shard-{k}.safetensors` (N tokens over S samples, A aux layers, hidden size H):

    input_ids            int64 [N]       token ids of all samples, concatenated
    loss_mask            uint8 [N]       1 on assistant tokens (the tokens the drafter learns to predict)
    offsets              int64 [S + 1]   sample i is tokens offsets[i]:offsets[i+1]
    aux_hidden_states    bf16  [N, A, H] input to each aux layer (HF hidden_states[k]), in layer-id order
    final_hidden_states  bf16  [N, H]    after the final norm: exactly what lm_head consumes

The safetensors metadata holds `draftsmith_shard` (JSON): sample ids, aux layer ids and their convention,
dtype. A sample is `Sample`; `iter_samples` streams them in order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from draftsmith.atomic import atomic_path

SHARD_FORMAT_VERSION = 1


@dataclass
class Sample:
    id: str
    input_ids: Tensor  # [T] int64
    loss_mask: Tensor  # [T] bool
    aux: Tensor  # [T, A, H]
    final: Tensor  # [T, H]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def write_shard(path: str | Path, samples: list[Sample], meta: dict[str, Any]) -> None:
    """Write samples to one shard file atomically."""
    offsets = [0]
    for s in samples:
        offsets.append(offsets[-1] + s.num_tokens)
    tensors = {
        "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int64),
        "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.uint8),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "aux_hidden_states": torch.cat([s.aux for s in samples]).contiguous(),
        "final_hidden_states": torch.cat([s.final for s in samples]).contiguous(),
    }
    header = {"version": SHARD_FORMAT_VERSION, "sample_ids": [s.id for s in samples], **meta}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"draftsmith_shard": json.dumps(header)})


def read_shard_meta(path: str | Path) -> dict[str, Any]:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["draftsmith_shard"])


def iter_samples(path: str | Path) -> Iterator[Sample]:
    """Stream the samples of one shard in order (memory-mapped; one sample's tensors at a time)."""
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["draftsmith_shard"])
        offsets = f.get_tensor("offsets").tolist()
        input_ids = f.get_tensor("input_ids")
        loss_mask = f.get_tensor("loss_mask").bool()
        aux = f.get_slice("aux_hidden_states")
        final = f.get_slice("final_hidden_states")
        for i, sample_id in enumerate(meta["sample_ids"]):
            a, b = offsets[i], offsets[i + 1]
            yield Sample(sample_id, input_ids[a:b], loss_mask[a:b], aux[a:b], final[a:b])


def read_tokens(path: str | Path) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids [N], loss_mask [N] bool, offsets [S+1]) of a shard, without touching hidden states."""
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("input_ids"), f.get_tensor("loss_mask").bool(), f.get_tensor("offsets")
