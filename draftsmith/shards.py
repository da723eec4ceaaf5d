"""Hidden-state shards: one safetensors file per shard, readable without draftsmith.

Every shard (N tokens over S samples, A aux layers, hidden size H) holds

    input_ids      int64 [N]       token ids of all samples, concatenated
    loss_mask      uint8 [N]       1 on assistant tokens (the tokens the drafter learns to predict)
    offsets        int64 [S + 1]   sample i is tokens offsets[i]:offsets[i+1]

and the states in one of two codecs (metadata key `draftsmith_shard`, JSON, says which):

codec "none":
    aux_hidden_states    bf16 [N, A, H]  input to each aux layer (HF hidden_states[k]), layer-id order
    final_hidden_states  bf16 [N, H]     after the final norm: exactly what lm_head consumes

codec "zstd-planes" (lossless; see bench/codec.py for why): for sample i and slot l (0..A-1 the aux
layers, A the final state), the sample's [T, H] bf16 values are split into two byte planes — the high
bytes (sign, exponent, top mantissa bit: these compress ~2x) and the low bytes (mantissa) — and each
plane is compressed as one zstd frame:
    blob        uint8 [B]               all frames back to back
    blob_index  int64 [S, A + 1, 2, 2]  [i, l, plane (0 high, 1 low)] = (byte offset, byte length)
To decode: value_u16 = (high << 8) | low, then reinterpret as bfloat16, shape [T, H].

The metadata also holds sample ids, aux layer ids and their convention, dtype, and extraction stats.
`iter_samples` streams samples in order, decoding one at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from draftsmith.atomic import atomic_path

SHARD_FORMAT_VERSION = 1
CODECS = ("none", "zstd-planes")


@dataclass
class Sample:
    id: str
    input_ids: Tensor  # [T] int64
    loss_mask: Tensor  # [T] bool
    aux: Tensor  # [T, A, H] bf16
    final: Tensor  # [T, H] bf16

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def split_planes(x: Tensor) -> tuple[bytes, bytes]:
    """bf16 tensor -> (high bytes, low bytes) of each value, in element order."""
    pairs = x.contiguous().view(torch.uint8).numpy().reshape(-1, 2)  # little-endian: [low, high]
    return pairs[:, 1].tobytes(), pairs[:, 0].tobytes()


def _slots(sample: Sample) -> list[Tensor]:
    """The [T, H] tensors of one sample in storage order: aux layers, then the final state."""
    return [sample.aux[:, a] for a in range(sample.aux.shape[1])] + [sample.final]


def encode_samples(samples: list[Sample], level: int) -> tuple[Tensor, Tensor]:
    """-> (blob uint8 [B], blob_index int64 [S, A+1, 2, 2]) for codec zstd-planes."""
    compressor = zstandard.ZstdCompressor(level=level)
    frames: list[bytes] = []
    index = []
    offset = 0
    for sample in samples:
        rows = []
        for slot in _slots(sample):
            planes = []
            for plane in split_planes(slot.to(torch.bfloat16)):
                frame = compressor.compress(plane)
                frames.append(frame)
                planes.append((offset, len(frame)))
                offset += len(frame)
            rows.append(planes)
        index.append(rows)
    blob = (
        torch.frombuffer(bytearray(b"".join(frames)), dtype=torch.uint8)
        if frames
        else torch.zeros(0, dtype=torch.uint8)
    )
    return blob, torch.tensor(index, dtype=torch.int64).reshape(len(samples), -1, 2, 2)


def write_shard(
    path: str | Path, samples: list[Sample], meta: dict[str, Any], codec: str = "none", level: int = 1
) -> None:
    """Write samples to one shard file atomically."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
    offsets = [0]
    for s in samples:
        offsets.append(offsets[-1] + s.num_tokens)
    tensors = {
        "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int64),
        "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.uint8),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
    }
    if codec == "none":
        tensors["aux_hidden_states"] = torch.cat([s.aux for s in samples]).to(torch.bfloat16).contiguous()
        tensors["final_hidden_states"] = torch.cat([s.final for s in samples]).to(torch.bfloat16).contiguous()
    else:
        tensors["blob"], tensors["blob_index"] = encode_samples(samples, level)
    num_aux = samples[0].aux.shape[1] if samples else 0
    hidden = samples[0].final.shape[-1] if samples else 0
    header = {
        "version": SHARD_FORMAT_VERSION,
        "codec": codec,
        "zstd_level": level if codec != "none" else None,
        "num_aux": num_aux,
        "hidden_size": hidden,
        "sample_ids": [s.id for s in samples],
        **meta,
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"draftsmith_shard": json.dumps(header)})


def read_shard_meta(path: str | Path) -> dict[str, Any]:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["draftsmith_shard"])


def iter_samples(path: str | Path) -> Iterator[Sample]:
    """Stream the samples of one shard in order (memory-mapped; decodes one sample at a time)."""
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["draftsmith_shard"])
        codec = meta.get("codec", "none")
        offsets = f.get_tensor("offsets").tolist()
        input_ids = f.get_tensor("input_ids")
        loss_mask = f.get_tensor("loss_mask").bool()
        if codec == "none":
            aux = f.get_slice("aux_hidden_states")
            final = f.get_slice("final_hidden_states")
        else:
            blob = f.get_tensor("blob").numpy()
            index = f.get_tensor("blob_index").tolist()
            decompressor = zstandard.ZstdDecompressor()
        for i, sample_id in enumerate(meta["sample_ids"]):
            a, b = offsets[i], offsets[i + 1]
            if codec == "none":
                yield Sample(sample_id, input_ids[a:b], loss_mask[a:b], aux[a:b], final[a:b])
                continue
            yield Sample(
                sample_id,
                input_ids[a:b],
                loss_mask[a:b],
                *decode_sample(blob, index[i], b - a, meta, decompressor),
            )


def decode_sample(
    blob: np.ndarray, index: list, num_tokens: int, meta: dict, decompressor
) -> tuple[Tensor, Tensor]:
    """One sample's frames -> (aux [T, A, H], final [T, H]), bf16, without intermediate copies."""
    view = memoryview(blob)
    slots = len(index)
    pairs = np.empty(
        (slots, num_tokens * meta["hidden_size"], 2), dtype=np.uint8
    )  # little-endian [low, high]
    for slot, ((h_off, h_len), (l_off, l_len)) in enumerate(index):
        pairs[slot, :, 1] = np.frombuffer(
            decompressor.decompress(view[h_off : h_off + h_len]), dtype=np.uint8
        )
        pairs[slot, :, 0] = np.frombuffer(
            decompressor.decompress(view[l_off : l_off + l_len]), dtype=np.uint8
        )
    states = torch.from_numpy(pairs).view(torch.bfloat16).reshape(slots, num_tokens, -1)  # [A+1, T, H]
    return states[:-1].transpose(0, 1), states[-1]


def read_tokens(path: str | Path) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids [N], loss_mask [N] bool, offsets [S+1]) of a shard, without touching hidden states."""
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("input_ids"), f.get_tensor("loss_mask").bool(), f.get_tensor("offsets")
