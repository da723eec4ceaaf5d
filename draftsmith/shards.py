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
`iter_samples` streams samples in order, decoding one at a time; `ShardReader` reads any one sample
alone (random access, for training's shuffled streaming loader).
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import shutil
import struct
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard
from safetensors import safe_open
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


def encode_sample(sample: Sample, compressor: zstandard.ZstdCompressor) -> list[bytes]:
    """zstd-planes frames of one sample: for each slot (aux layers, then final) high plane, low plane."""
    return [
        compressor.compress(plane)
        for slot in _slots(sample)
        for plane in split_planes(slot.to(torch.bfloat16))
    ]


_DTYPES = {torch.int64: ("I64", 8), torch.uint8: ("U8", 1), torch.bfloat16: ("BF16", 2)}


def remove_stale_temp_files(path: str | Path) -> list[Path]:
    """Delete what a killed writer of `path` left behind: hidden `.{name}.*` files and folders beside it
    (ShardWriter's data files, atomic_path's temp file, an extraction job's scratch folder). Call it
    before a new writer of the same shard starts; returns what was removed."""
    path = Path(path)
    stale = sorted(path.parent.glob(f".{path.name}.*")) if path.parent.is_dir() else []
    for p in stale:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return stale


class ShardWriter:
    """Streams samples into one shard file; encoding and writing run in a background thread.

    `add()` returns at once (a bounded queue gives back-pressure); state bytes go to a temporary data
    file as they are encoded; `close()` writes the safetensors header and the small tensors, appends the
    data and renames the result into place. Until then only a hidden temporary file exists.
    """

    def __init__(
        self,
        path: str | Path,
        meta: dict[str, Any],
        codec: str = "zstd-planes",
        level: int = 1,
        queue_size: int = 64,
    ):
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
        self.path, self.meta, self.codec, self.level = Path(path), meta, codec, level
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._data = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in close()/abort())
            prefix=f".{self.path.name}.", suffix=".data", dir=self.path.parent, delete=False
        )
        self._final = None
        if codec == "none":  # aux and final are separate tensors: the final states wait in their own file
            self._final = tempfile.NamedTemporaryFile(  # noqa: SIM115
                prefix=f".{self.path.name}.", suffix=".final", dir=self.path.parent, delete=False
            )
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        self.ids: list[str] = []
        self._input_ids: list[Tensor] = []
        self._masks: list[Tensor] = []
        self._index: list[list[list[int]]] = []
        self.num_aux = self.hidden_size = None
        self.bytes_written = 0
        self._thread = threading.Thread(target=self._work, name=f"shard-writer-{self.path.name}", daemon=True)
        self._thread.start()

    def add(self, sample: Sample) -> None:
        if self._error:
            raise RuntimeError(f"writing {self.path} failed") from self._error
        if self.num_aux is None:
            self.num_aux, self.hidden_size = sample.aux.shape[1], sample.final.shape[-1]
        elif (sample.aux.shape[1], sample.final.shape[-1]) != (self.num_aux, self.hidden_size):
            raise ValueError(f"sample {sample.id}: shape differs from the shard's first sample")
        self.ids.append(sample.id)
        self._input_ids.append(sample.input_ids.to(torch.int64))
        self._masks.append(sample.loss_mask.to(torch.uint8))
        self._queue.put(sample)

    def _work(self) -> None:
        compressor = zstandard.ZstdCompressor(level=self.level)
        while (sample := self._queue.get()) is not None:
            if self._error:
                continue
            try:
                if self.codec == "none":
                    aux = sample.aux.to(torch.bfloat16).contiguous().view(torch.uint8).numpy()
                    final = sample.final.to(torch.bfloat16).contiguous().view(torch.uint8).numpy()
                    self._data.write(aux.tobytes())
                    self._final.write(final.tobytes())
                    self.bytes_written += aux.nbytes + final.nbytes
                    continue
                rows, frames = [], encode_sample(sample, compressor)
                offset = self.bytes_written
                for i in range(0, len(frames), 2):
                    rows.append([[offset, len(frames[i])], [offset + len(frames[i]), len(frames[i + 1])]])
                    offset += len(frames[i]) + len(frames[i + 1])
                for frame in frames:
                    self._data.write(frame)
                self._index.append(rows)
                self.bytes_written = offset
            except BaseException as err:  # reported by add() / close()
                self._error = err

    def close(self, extra_meta: dict[str, Any] | None = None) -> None:
        """Finish the file: header + small tensors + streamed data, fsynced and renamed into place."""
        self.meta = {**self.meta, **(extra_meta or {})}
        self._queue.put(None)
        self._thread.join()
        try:
            if self._error:
                raise RuntimeError(f"writing {self.path} failed") from self._error
            self._assemble()
        finally:
            for f in (self._data, self._final):
                if f is not None:
                    f.close()
                    Path(f.name).unlink(missing_ok=True)

    def abort(self) -> None:
        self._queue.put(None)
        self._thread.join()
        for f in (self._data, self._final):
            if f is not None:
                f.close()
                Path(f.name).unlink(missing_ok=True)

    def _assemble(self) -> None:
        n_tok = sum(t.numel() for t in self._input_ids)
        lengths = [t.numel() for t in self._input_ids]
        small = {
            "input_ids": torch.cat(self._input_ids) if self._input_ids else torch.zeros(0, dtype=torch.int64),
            "loss_mask": torch.cat(self._masks) if self._masks else torch.zeros(0, dtype=torch.uint8),
            "offsets": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64),
        }
        num_aux, hidden = self.num_aux or 0, self.hidden_size or 0
        if self.codec == "zstd-planes":
            small["blob_index"] = torch.tensor(self._index, dtype=torch.int64).reshape(
                len(self.ids), num_aux + 1, 2, 2
            )
            streamed = [("blob", "U8", [self.bytes_written], self._data)]
        else:
            aux_bytes = n_tok * num_aux * hidden * 2
            streamed = [
                ("aux_hidden_states", "BF16", [n_tok, num_aux, hidden], self._data),
                ("final_hidden_states", "BF16", [n_tok, hidden], self._final),
            ]
            assert self.bytes_written == aux_bytes + n_tok * hidden * 2
        header_meta = {
            "version": SHARD_FORMAT_VERSION,
            "codec": self.codec,
            "zstd_level": self.level if self.codec != "none" else None,
            "num_aux": num_aux,
            "hidden_size": hidden,
            "sample_ids": self.ids,
            **self.meta,
        }
        header: dict[str, Any] = {"__metadata__": {"draftsmith_shard": json.dumps(header_meta)}}
        offset = 0
        for name, tensor in small.items():
            code, size = _DTYPES[tensor.dtype]
            header[name] = {
                "dtype": code,
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + tensor.numel() * size],
            }
            offset += tensor.numel() * size
        for name, code, shape, f in streamed:
            f.flush()
            size = Path(f.name).stat().st_size
            header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # safetensors pads the header to 8 bytes
        with atomic_path(self.path) as tmp, open(tmp, "wb") as out:
            out.write(struct.pack("<Q", len(blob)))
            out.write(blob)
            for tensor in small.values():
                out.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())
            for _, _, _, f in streamed:
                with open(f.name, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 24)


def write_shard(
    path: str | Path, samples: list[Sample], meta: dict[str, Any], codec: str = "none", level: int = 1
) -> None:
    """Write samples to one shard file atomically (see ShardWriter for the streaming form)."""
    writer = ShardWriter(path, meta, codec, level)
    try:
        for sample in samples:
            writer.add(sample)
    except BaseException:
        writer.abort()
        raise
    writer.close()


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


class ShardReader:
    """Random access to one shard: `read(i)` reads and decodes sample i alone, in any order.

    Only the offsets and the frame index stay in memory; a sample's bytes are fetched with one
    positioned read (os.preadv, which releases the GIL, as zstd and numpy do), so background threads can
    decode samples of many shards at once. Thread-safe: reads share one file descriptor (positioned, no
    seek), and each thread gets its own zstd decompressor.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        self._data_start = 8 + header_len
        self._entries = {k: v for k, v in header.items() if k != "__metadata__"}
        self.meta: dict[str, Any] = json.loads(header["__metadata__"]["draftsmith_shard"])
        self.codec = self.meta.get("codec", "none")
        self.ids: list[str] = list(self.meta["sample_ids"])
        if self.codec == "none":  # shapes from the header (older shards lack these metadata keys)
            _, self.num_aux, self.hidden_size = self._entries["aux_hidden_states"]["shape"]
        else:
            self.num_aux, self.hidden_size = int(self.meta["num_aux"]), int(self.meta["hidden_size"])
        self._fd = os.open(self.path, os.O_RDONLY)
        self._local = threading.local()
        self.offsets: list[int] = self.read_tensor("offsets").tolist()
        self._index = self.read_tensor("blob_index").tolist() if self.codec == "zstd-planes" else None

    def __len__(self) -> int:
        return len(self.ids)

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def num_tokens(self, i: int) -> int:
        return self.offsets[i + 1] - self.offsets[i]

    def _pread(self, start: int, length: int) -> np.ndarray:
        buf = bytearray(length)  # writable, so torch.from_numpy does not warn
        if length and os.preadv(self._fd, [buf], self._data_start + start) != length:
            raise OSError(f"{self.path}: short read at byte {self._data_start + start} (truncated file?)")
        return np.frombuffer(buf, dtype=np.uint8)

    def read_tensor(self, name: str, start: int = 0, stop: int | None = None) -> Tensor:
        """Rows start:stop (along the first dimension) of a stored tensor, read from disk."""
        entry = self._entries[name]
        np_dtype, torch_dtype = {
            "I64": (np.int64, None),
            "U8": (np.uint8, None),
            "BF16": (np.uint16, torch.bfloat16),
        }[entry["dtype"]]
        shape = entry["shape"]
        row = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(np_dtype).itemsize
        stop = shape[0] if stop is None else stop
        raw = self._pread(entry["data_offsets"][0] + start * row, (stop - start) * row)
        t = torch.from_numpy(raw.view(np_dtype).reshape(stop - start, *shape[1:]))
        return t.view(torch_dtype) if torch_dtype is not None else t

    def read(self, i: int, max_tokens: int | None = None) -> Sample:
        """Sample i, cut to its first max_tokens tokens (whole frames are decoded, then sliced)."""
        a, b = self.offsets[i], self.offsets[i + 1]
        n = b - a if max_tokens is None else min(b - a, max_tokens)
        input_ids = self.read_tensor("input_ids", a, a + n)
        loss_mask = self.read_tensor("loss_mask", a, a + n).bool()
        if self.codec == "none":
            aux = self.read_tensor("aux_hidden_states", a, a + n)
            final = self.read_tensor("final_hidden_states", a, a + n)
            return Sample(self.ids[i], input_ids, loss_mask, aux, final)
        # the sample's frames lie back to back: one read, offsets rebased onto it
        frames = self._index[i]
        first = min(off for slot in frames for off, _ in slot)
        last = max(off + size for slot in frames for off, size in slot)
        blob_start = self._entries["blob"]["data_offsets"][0]
        blob = self._pread(blob_start + first, last - first)
        local = [[[off - first, size] for off, size in slot] for slot in frames]
        decompressor = getattr(self._local, "decompressor", None)
        if decompressor is None:
            decompressor = self._local.decompressor = zstandard.ZstdDecompressor()
        aux, final = decode_sample(blob, local, b - a, self.meta, decompressor)
        return Sample(self.ids[i], input_ids, loss_mask, aux[:n], final[:n])


def read_sample(path: str | Path, i: int) -> Sample:
    """Sample i of a shard, read on its own (see ShardReader to read many)."""
    with ShardReader(path) as reader:
        return reader.read(i)
