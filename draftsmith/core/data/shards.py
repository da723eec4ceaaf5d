"""Hidden-state shards: one safetensors file per shard, readable without draftsmith.

Every shard (N tokens over S samples, A aux layers, hidden size H) holds

    input_ids      int64 [N]       token ids of all samples, concatenated
    loss_mask      uint8 [N]       1 on assistant tokens (the tokens the drafter learns to predict)
    offsets        int64 [S + 1]   sample i is tokens offsets[i]:offsets[i+1]

and the states in one of two storage dtypes and one of two codecs (metadata key `draftsmith_shard`,
JSON, says which).

Storage dtype (metadata `dtype`, `extract.storage_dtype`):

bfloat16 (lossless: the states as the target computed them in bf16).
float8_e4m3fn (half the bytes, lossy): every row (one token's H values in one slot) is stored as H
    float8_e4m3fn codes and one float32 scale, value = float(code) * scale. The scale is the smallest
    power of two with row absmax / scale <= 448 (e4m3's largest finite value), so x / scale is exact
    and the only rounding is e4m3's own (3 mantissa bits, nearest-even: |error| <= 2^-4 |x|, or
    2^-10 * scale below e4m3's smallest normal 2^-6), and code * scale is exact in bf16, which is what
    a read returns. Rows with a non-finite value are refused.

Slots: for sample i, slot l is 0..A-1 (the aux layers, in id order) or A (the final state).

codec "none":
    aux_hidden_states    bf16 [N, A, H]  input to each aux layer (HF hidden_states[k]), layer-id order
    final_hidden_states  bf16 [N, H]     after the final norm: exactly what lm_head consumes
  with float8_e4m3fn these two are F8_E4M3 codes, beside
    aux_scales           f32 [N, A]      per-row scales of aux_hidden_states
    final_scales         f32 [N]         per-row scales of final_hidden_states

codec "zstd-planes" (lossless over what is stored; see bench/codec.py for why): each slot of each
sample is two byte planes, each one zstd frame:
  bfloat16: the sample's [T, H] bf16 values split into the high bytes (sign, exponent, top mantissa
    bit: these compress ~2.8x) and the low bytes (mantissa bits, which do not compress: they are written
    at zstd's fastest level, which stores them as raw blocks). To decode: value_u16 = (high << 8) | low,
    reinterpreted as bfloat16, shape [T, H].
  float8_e4m3fn: plane 0 the [T, H] codes (sign and exponent bits compress, like bf16's high bytes),
    plane 1 the [T] float32 scales (little-endian).
    blob        uint8 [B]               all frames back to back
    blob_index  int64 [S, A + 1, 2, 2]  [i, l, plane] = (byte offset, byte length); bf16: plane 0 high,
                                        1 low; float8: plane 0 codes, 1 scales
Every frame carries zstd's content checksum, so a flipped bit fails its frame instead of decoding to a
wrong value.

Content digests (format 2 on): the writer records per sample `sample_sha256`, the sha256 of
    (T, A, H) as three little-endian uint64, input_ids int64 [T], loss_mask uint8 [T],
    then the stored values slot by slot (aux layers in id order, then final), each [T, H] row-major:
    bf16 bit patterns, or float8 codes followed by the float32 scales, [A + 1, T],
whatever the codec, and per shard `content_sha256`, the sha256 of the layer ids, dtype and the list of
(sample id, sample digest). Both depend on the stored tensors only: two extractions of the same data
give the same digests whatever their timing stats (which the header also holds) or codec. Every read
recomputes the sample's digest from what it read, before dequantizing, and refuses a mismatch, naming
the shard and the sample. Format 3 added float8_e4m3fn; a format-2 shard is a bf16 shard of the same
layout and reads as one.

Tensors may lie in the file in any order (the blob first: it streams straight into the final file),
and the JSON header may end in spaces (room reserved for it before the data was known).

The metadata also holds sample ids, aux layer ids and their convention, dtype, and extraction stats.
`iter_samples` streams samples in order, decoding one at a time; `ShardReader` reads any one sample
alone (random access, for training's shuffled streaming loader); `verify_shard` decodes them all.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import os
import queue
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
import zstandard
from torch import Tensor

from draftsmith.core.io.atomic import atomic_path, commit_file

SHARD_FORMAT_VERSION = 3  # 2: frame checksums and content digests; 3: float8_e4m3fn storage
READABLE_FORMATS = (2, 3)  # a format-2 shard is a bf16 shard laid out as format 3 lays bf16 out
CODECS = ("none", "zstd-planes")
STORAGE_DTYPES = ("bfloat16", "float8_e4m3fn")
FP8_MAX = 448.0  # e4m3fn's largest finite value, 1.75 * 2^8


class ShardError(RuntimeError):
    """A shard that cannot be read back as it was written; the message names the file (and sample)."""


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


def bf16_bits(x: Tensor) -> np.ndarray:
    """The bit patterns of a tensor's bf16 values as uint16 (a view when x is bf16 already)."""
    return x.to(torch.bfloat16).view(torch.uint16).numpy()


def byte_planes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint16 bf16 bit patterns -> (high bytes, low bytes), each the same shape, in one pass each.

    numpy rather than torch: these run in the writer thread, and numpy neither holds the GIL on large
    arrays nor competes for torch's compute threads."""
    return (values >> 8).astype(np.uint8), values.astype(np.uint8)


def sample_slots(sample: Sample) -> np.ndarray:
    """bf16 bit patterns of one sample, [A + 1, T, H] uint16: slots in storage order (aux layers, then
    the final state), each slot's [T, H] values row-major."""
    aux, final = bf16_bits(sample.aux), bf16_bits(sample.final)  # [T, A, H], [T, H]
    slots = np.empty((aux.shape[1] + 1, *final.shape), dtype=np.uint16)  # [A + 1, T, H]
    slots[:-1] = aux.transpose(1, 0, 2)
    slots[-1] = final
    return slots


def sample_planes(sample: Sample) -> tuple[np.ndarray, np.ndarray]:
    """(high, low) byte planes of one sample, each [A + 1, T * H] (see sample_slots)."""
    slots = sample_slots(sample)
    return byte_planes(slots.reshape(slots.shape[0], -1))


@dataclass
class Stored:
    """One sample's states as a shard stores them, slot-major (aux layers in id order, then final)."""

    values: np.ndarray  # [A + 1, T, H]: uint16 bf16 bit patterns, or uint8 float8_e4m3fn codes
    scales: np.ndarray | None = None  # [A + 1, T] float32 per-row scales (float8_e4m3fn only)

    @property
    def storage_dtype(self) -> str:
        return "bfloat16" if self.scales is None else "float8_e4m3fn"

    def bf16_bits(self) -> np.ndarray:
        """The states a read returns, [A + 1, T, H] uint16 bf16 bit patterns (float8 dequantized)."""
        return self.values if self.scales is None else fp8_dequantize(self.values, self.scales)


@functools.cache
def fp8_tables() -> tuple[np.ndarray, np.ndarray]:
    """(e4m3fn code of every bf16 bit pattern [65536] uint8, float32 value of every code [256]), both
    computed by torch's own conversions (round to nearest, ties to even), so that the hot loops can run
    in numpy, which releases the GIL and leaves torch's compute threads to the forward pass."""
    every_bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    codes = every_bf16.float().to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    return codes, values


def fp8_scale_exponents(absmax: np.ndarray) -> np.ndarray:
    """Per row, the smallest k with absmax / 2^k <= FP8_MAX, by exact integer arithmetic: absmax =
    m * 2^e with 0.5 <= m < 1, and FP8_MAX = 0.875 * 2^9, so k = e - 9, or e - 8 when m > 0.875.
    (A zero row gets 2^-9: any scale stores zeros exactly.)"""
    mantissa, exponent = np.frexp(absmax)
    return (exponent - 9 + (mantissa > 0.875)).astype(np.int32)


def fp8_quantize(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bf16 bit patterns [..., H] uint16 -> (float8_e4m3fn codes [..., H] uint8, scales [...] float32),
    one power-of-two scale per row of H values; raises ValueError on a non-finite value."""
    values = (bits.astype(np.uint32) << 16).view(np.float32)  # exact: bf16 is fp32's top half
    absmax = np.abs(values).max(axis=-1)
    if not np.isfinite(absmax).all():
        raise ValueError("a hidden state is inf or nan: float8_e4m3fn cannot store it (store bfloat16)")
    k = fp8_scale_exponents(absmax)
    scaled = np.ldexp(values, -k[..., None])  # exact (a power of two), |scaled| <= FP8_MAX
    # scaled is a bf16 value again (below fp32's normals only where e4m3 rounds it to 0 anyway)
    codes = np.take(fp8_tables()[0], (scaled.view(np.uint32) >> 16).astype(np.uint16))
    return codes, np.ldexp(np.float32(1), k).astype(np.float32)


def fp8_dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float8_e4m3fn codes [..., H] and row scales [...] -> bf16 bit patterns [..., H] uint16. Exact:
    a code has at most 4 significant bits and a scale is a power of two, so code * scale is a bf16
    value, and its fp32 bits' top half are its bf16 bits."""
    values = np.take(fp8_tables()[1], codes)  # float32 [..., H]; take: ~4x fancy indexing's speed
    values *= scales[..., None]
    return (values.view(np.uint32) >> 16).astype(np.uint16)


def store(sample: Sample, storage_dtype: str) -> Stored:
    """A sample's states in a storage dtype (see the module docstring)."""
    slots = sample_slots(sample)  # [A + 1, T, H]
    if storage_dtype == "bfloat16":
        return Stored(slots)
    if storage_dtype == "float8_e4m3fn":
        try:
            return Stored(*fp8_quantize(slots))
        except ValueError as err:
            raise ValueError(f"sample {sample.id}: {err}") from None
    raise ValueError(f"unknown storage dtype {storage_dtype!r}; expected one of {STORAGE_DTYPES}")


def as_stored(x: Tensor, storage_dtype: str) -> Tensor:
    """What a shard of storage `storage_dtype` gives back for states x [..., H] (bf16): x itself, or its
    float8_e4m3fn round trip (per-row scales over the last dimension)."""
    if storage_dtype == "bfloat16":
        return x.to(torch.bfloat16)
    bits = bf16_bits(x.contiguous())
    return torch.from_numpy(fp8_dequantize(*fp8_quantize(bits))).view(torch.bfloat16)


def sample_digest(input_ids: Tensor, loss_mask: Tensor, stored: Stored | np.ndarray) -> str:
    """sha256 of one sample's content: its shape, tokens, loss mask and slot-major stored values (then,
    for float8, the row scales).

    stored: as store() returns it, or [A + 1, T, H] uint16 bf16 bit patterns (sample_slots)."""
    stored = stored if isinstance(stored, Stored) else Stored(stored)
    num_slots, num_tokens, hidden = stored.values.shape
    h = hashlib.sha256(struct.pack("<QQQ", num_tokens, num_slots - 1, hidden))
    h.update(input_ids.to(torch.int64).contiguous().numpy().tobytes())
    h.update(loss_mask.to(torch.uint8).contiguous().numpy().tobytes())
    h.update(np.ascontiguousarray(stored.values).data.cast("B"))  # no copy; hashlib drops the GIL
    if stored.scales is not None:
        h.update(np.ascontiguousarray(stored.scales, dtype="<f4").data.cast("B"))
    return h.hexdigest()


def content_digest(meta: dict[str, Any], ids: list[str], digests: list[str]) -> str:
    """A shard's content digest: what the states are (layer ids, convention, dtype, shape) and every
    sample's id and digest, in order. Codec, compression level and timing stats stay out of it."""
    record = {
        "aux_layer_ids": meta.get("aux_layer_ids"),
        "layer_convention": meta.get("layer_convention"),
        "final": meta.get("final"),
        "dtype": meta.get("dtype"),
        "num_aux": meta.get("num_aux"),
        "hidden_size": meta.get("hidden_size"),
        "samples": [[i, d] for i, d in zip(ids, digests, strict=True)],
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


MANTISSA_LEVEL = -5  # zstd's fastest mode: the low plane does not compress, so this only frames it


def high_plane_params(level: int) -> zstandard.ZstdCompressionParameters:
    """zstd settings for the sign/exponent bytes. They compress by their skewed value distribution
    (entropy-coded literals); matches shorter than 7 bytes cost more than they save, and hunting for
    them is most of zstd's time: on SmolLM2's states min_match 7 with a small hash table gives ratio
    0.358 instead of 0.374 at 2.7x the speed of stock level 1 (bench/codec.py)."""
    return zstandard.ZstdCompressionParameters.from_level(level, min_match=7, hash_log=7, write_checksum=True)


class PlaneEncoder:
    """Encodes samples into zstd-planes frames; holds its zstd contexts, so one per thread."""

    def __init__(self, level: int = 1):
        self.high = zstandard.ZstdCompressor(compression_params=high_plane_params(level))
        self.low = zstandard.ZstdCompressor(level=MANTISSA_LEVEL, write_checksum=True)
        self.scales = zstandard.ZstdCompressor(level=level, write_checksum=True)

    def encode(self, stored: Stored) -> list[bytes]:
        """Frames of one sample: for each slot (aux layers, then final) its two planes: bf16 high and
        low bytes; float8 codes (compressed as the bf16 high bytes are) and scales."""
        values = stored.values.reshape(stored.values.shape[0], -1)  # [A + 1, T * H]
        if stored.scales is None:
            high, low = byte_planes(values)
            pairs = zip(high, low, strict=True)
            return [f for h, lo in pairs for f in (self.high.compress(h), self.low.compress(lo))]
        scales = np.ascontiguousarray(stored.scales, dtype="<f4")
        pairs = zip(values, scales, strict=True)
        return [f for c, sc in pairs for f in (self.high.compress(c), self.scales.compress(sc))]


_DTYPES = {
    torch.int64: ("I64", 8),
    torch.uint8: ("U8", 1),
    torch.bfloat16: ("BF16", 2),
    torch.float32: ("F32", 4),
}
# safetensors' name and numpy's type of the stored states, per storage dtype
_STATE_CODES = {"bfloat16": ("BF16", np.uint16), "float8_e4m3fn": ("F8_E4M3", np.uint8)}


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


def yield_cpu_to_compute() -> None:
    """Lower the calling thread's priority (Linux nice values are per thread): when the cores are
    short, the forward pass runs and the writer catches up in its gaps; the bounded queue between
    them stops the writer from falling far behind."""
    with contextlib.suppress(AttributeError, OSError):  # elsewhere both keep the same priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


HEADER_ROOM = 64 * 1024  # bytes kept for the header's metadata and stats, beside the sample ids
SYNC_BYTES = 16 << 20  # the writer thread syncs to disk as it goes, so closing waits for little


class ShardWriter:
    """Streams samples into one shard file; encoding and writing run in a background thread.

    `add()` returns at once (a bounded queue gives back-pressure). State bytes are written where they
    will stay: into a hidden temporary file, after room kept for the header. `close()` appends the small
    tensors, writes the header into its room and renames the file into place, so finishing a shard
    copies nothing (unless the header outgrew its room: then the file is rewritten once). Until then
    only hidden temporary files exist. Pass the sample ids when known, so the room fits them.

    `storage_dtype` is the storage dtype (STORAGE_DTYPES); samples are given in bf16 either way, and the header's
    `dtype` (the metadata key) is always this one, whatever `meta` says.

    `threads` > 1 encodes that many samples at once in a pool (zstd, numpy and hashlib release the GIL),
    each thread with its own zstd contexts; the writer thread still writes them in add() order, so the
    file's bytes are the same whatever the count. One thread compresses ~0.4 GB of states per CPU-second
    while a GPU's prefill yields about twice that: one writer thread alone throttles the engine.
    """

    def __init__(
        self,
        path: str | Path,
        meta: dict[str, Any],
        codec: str,
        level: int,
        storage_dtype: str,
        queue_size: int = 64,
        sample_ids: list[str] | None = None,
        threads: int = 1,
    ):
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
        if storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"unknown storage dtype {storage_dtype!r}; expected one of {STORAGE_DTYPES}")
        self.path, self.meta, self.codec, self.level, self.storage_dtype = (
            Path(path),
            meta,
            codec,
            level,
            storage_dtype,
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._data = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in close()/abort())
            prefix=f".{self.path.name}.", suffix=".data", dir=self.path.parent, delete=False
        )
        # the ids, and one quoted 64-hex digest per sample
        ids_room = (
            len(json.dumps(sample_ids, ensure_ascii=False).encode()) + 67 * len(sample_ids)
            if sample_ids
            else 0
        )
        self._header_room = -(-(HEADER_ROOM + ids_room + 2 * len(json.dumps(meta))) // 8) * 8
        self._data.seek(8 + self._header_room)  # the states start here; the gap is filled at close()
        self._final: IO[bytes] | None = None
        if codec == "none":  # aux and final are separate tensors: the final states wait in their own file
            self._final = tempfile.NamedTemporaryFile(  # noqa: SIM115
                prefix=f".{self.path.name}.", suffix=".final", dir=self.path.parent, delete=False
            )
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        self.ids: list[str] = []
        self._input_ids: list[Tensor] = []
        self._masks: list[Tensor] = []
        self._index: list[list[list[list[int]]]] = []  # per sample, per frame pair: [[offset, size]] x 2
        self._scales: list[np.ndarray] = []  # codec none, float8: [A + 1, T] per sample
        self._digests: list[str] = []  # sample_sha256, in add() order (one writer thread keeps it)
        self.num_aux: int | None = None
        self.hidden_size: int | None = None
        self.bytes_written = 0  # state bytes (blob, or aux + final + scales), all the file's bulk
        self.tokens_written = 0  # tokens whose states are in bytes_written (the queue holds the rest)
        self.cpu_seconds = 0.0  # the writer's CPU time, its encoding threads' included: what writing costs
        self.threads = max(1, threads)
        self._local = threading.local()  # each encoding thread's PlaneEncoder (zstd contexts are not shared)
        self._pool = (
            ThreadPoolExecutor(
                self.threads, f"shard-encoder-{self.path.name}", initializer=yield_cpu_to_compute
            )
            if self.threads > 1
            else None
        )
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
        # in the pool, encoding starts now; the bounded queue of futures still gives back-pressure
        self._queue.put(self._pool.submit(self._encode, sample) if self._pool else sample)

    def _encode(self, sample: Sample) -> tuple[Sample, Stored, str, list[bytes] | None, float]:
        """(sample, stored states, digest, zstd-planes frames, CPU seconds): everything but the write."""
        cpu = time.thread_time()
        stored = store(sample, self.storage_dtype)  # [A + 1, T, H] (+ scales [A + 1, T])
        digest = sample_digest(sample.input_ids, sample.loss_mask, stored)
        frames = None
        if self.codec == "zstd-planes":
            encoder = getattr(self._local, "encoder", None)
            if encoder is None:
                encoder = self._local.encoder = PlaneEncoder(self.level)
            frames = encoder.encode(stored)
        return sample, stored, digest, frames, time.thread_time() - cpu

    def _work(self) -> None:
        yield_cpu_to_compute()
        synced = 0
        while (item := self._queue.get()) is not None:
            if self._error:
                if isinstance(item, Future):
                    item.cancel()
                continue
            cpu = time.thread_time()
            try:
                if isinstance(item, Future):
                    encoded = item.result()
                    self.cpu_seconds += encoded[-1]  # the encoding thread's
                else:
                    encoded = self._encode(item)  # in this thread: counted below
                self._write(*encoded[:-1])
                if self.bytes_written - synced >= SYNC_BYTES:  # flush to disk here, not all in close()
                    for f in (self._data, self._final):
                        if f is not None:
                            f.flush()
                            os.fdatasync(f.fileno())
                    synced = self.bytes_written
            except BaseException as err:  # reported by add() / close()
                self._error = err
            finally:
                self.cpu_seconds += time.thread_time() - cpu

    def _write(self, sample: Sample, stored: Stored, digest: str, frames: list[bytes] | None) -> None:
        self._digests.append(digest)
        if self.codec == "none":
            aux = np.ascontiguousarray(stored.values[:-1].transpose(1, 0, 2))  # [T, A, H]
            assert self._final is not None  # codec none opens it
            self._data.write(aux.data)
            self._final.write(stored.values[-1].data)  # [T, H]
            self.bytes_written += stored.values.nbytes
            if stored.scales is not None:
                self._scales.append(stored.scales)
                self.bytes_written += stored.scales.nbytes
            self.tokens_written += sample.num_tokens
            return
        assert frames is not None
        rows, offset = [], self.bytes_written
        for i in range(0, len(frames), 2):
            rows.append([[offset, len(frames[i])], [offset + len(frames[i]), len(frames[i + 1])]])
            offset += len(frames[i]) + len(frames[i + 1])
        for frame in frames:
            self._data.write(frame)
        self._index.append(rows)
        self.bytes_written = offset
        self.tokens_written += sample.num_tokens

    def close(self, extra_meta: dict[str, Any] | None = None) -> None:
        """Finish the file: small tensors appended, header written into its room, fsynced, renamed."""
        self.meta = {**self.meta, **(extra_meta or {})}
        self._stop()
        try:
            if self._error:
                raise RuntimeError(f"writing {self.path} failed") from self._error
            self._assemble()
        finally:
            self._remove_temp_files()

    def abort(self) -> None:
        self._stop()
        self._remove_temp_files()

    def _stop(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self._pool:
            self._pool.shutdown(cancel_futures=True)

    def _remove_temp_files(self) -> None:
        for f in (self._data, self._final):
            if f is not None:
                f.close()
                Path(f.name).unlink(missing_ok=True)

    def _assemble(self) -> None:
        n_tok = sum(t.numel() for t in self._input_ids)
        lengths = [t.numel() for t in self._input_ids]
        num_aux, hidden = self.num_aux or 0, self.hidden_size or 0
        # the bulk first (already in place), then what follows it, in file order
        tensors: list[tuple[str, str, list[int], int]] = []  # (name, dtype, shape, bytes)
        if self.codec == "zstd-planes":
            tensors.append(("blob", "U8", [self.bytes_written], self.bytes_written))
        else:
            code, np_type = _STATE_CODES[self.storage_dtype]
            size = np.dtype(np_type).itemsize
            aux_bytes = n_tok * num_aux * hidden * size
            tensors += [
                ("aux_hidden_states", code, [n_tok, num_aux, hidden], aux_bytes),
                ("final_hidden_states", code, [n_tok, hidden], n_tok * hidden * size),
            ]
            scale_bytes = sum(sc.nbytes for sc in self._scales)
            assert self.bytes_written == aux_bytes + n_tok * hidden * size + scale_bytes
            assert self._final is not None  # codec none opens it
            self._final.flush()
            with open(self._final.name, "rb") as src:
                shutil.copyfileobj(src, self._data, 1 << 24)
        small = {
            "input_ids": torch.cat(self._input_ids) if self._input_ids else torch.zeros(0, dtype=torch.int64),
            "loss_mask": torch.cat(self._masks) if self._masks else torch.zeros(0, dtype=torch.uint8),
            "offsets": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64),
        }
        if self.codec == "zstd-planes":
            small["blob_index"] = torch.tensor(self._index, dtype=torch.int64).reshape(
                len(self.ids), num_aux + 1, 2, 2
            )
        elif self.storage_dtype == "float8_e4m3fn":
            scales = np.concatenate(self._scales, axis=1) if self._scales else np.zeros((num_aux + 1, 0))
            scales = torch.from_numpy(np.ascontiguousarray(scales.T, dtype=np.float32))  # [N, A + 1]
            small["aux_scales"], small["final_scales"] = (
                scales[:, :-1].contiguous(),
                scales[:, -1].contiguous(),
            )
        for name, tensor in small.items():
            code, size = _DTYPES[tensor.dtype]
            tensors.append((name, code, list(tensor.shape), tensor.numel() * size))
            self._data.write(tensor.contiguous().view(torch.uint8).numpy().data)
        self._data.flush()

        header_meta = {
            "version": SHARD_FORMAT_VERSION,
            "codec": self.codec,
            "zstd_level": self.level if self.codec != "none" else None,
            "num_aux": num_aux,
            "hidden_size": hidden,
            **self.meta,
            "dtype": self.storage_dtype,
            "sample_ids": self.ids,
            "sample_sha256": self._digests,
        }
        header_meta["content_sha256"] = content_digest(header_meta, self.ids, self._digests)
        header: dict[str, Any] = {"__metadata__": {"draftsmith_shard": json.dumps(header_meta)}}
        offset = 0
        for name, code, shape, size in tensors:
            header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        data_start = 8 + self._header_room
        if len(blob) <= self._header_room:  # the usual case: fill the room, rename, done
            self._data.seek(0)
            self._data.write(struct.pack("<Q", self._header_room) + blob.ljust(self._header_room))
            self._data.flush()
            commit_file(self._data.name, self.path)
            return
        blob += b" " * (-len(blob) % 8)  # safetensors pads the header to 8 bytes
        with atomic_path(self.path) as tmp, open(tmp, "wb") as out, open(self._data.name, "rb") as src:
            out.write(struct.pack("<Q", len(blob)) + blob)
            src.seek(data_start)
            shutil.copyfileobj(src, out, 1 << 24)


def write_shard(
    path: str | Path,
    samples: list[Sample],
    meta: dict[str, Any],
    codec: str,
    level: int,
    storage_dtype: str,
    threads: int = 1,
) -> int:
    """Write samples to one shard file atomically (see ShardWriter for the streaming form); returns
    the bytes the states took."""
    ids = [s.id for s in samples]
    writer = ShardWriter(path, meta, codec, level, storage_dtype, sample_ids=ids, threads=threads)
    try:
        for sample in samples:
            writer.add(sample)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return writer.bytes_written


def read_header(path: str | Path) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """(data start, tensor entries, draftsmith metadata) of a shard, checked: a missing, truncated,
    garbled or older-format file raises ShardError naming it, with what to do."""
    path = Path(path)
    redo = "delete it and rerun its extract job"
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            (header_len,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            if header_len is None or 8 + header_len > size:
                raise ShardError(f"{path}: truncated ({size:,} bytes, its header alone needs more); {redo}")
            header = json.loads(fh.read(header_len))
        meta = json.loads(header["__metadata__"]["draftsmith_shard"])
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        end = 8 + header_len + max((e["data_offsets"][1] for e in entries.values()), default=0)
    except FileNotFoundError:
        raise ShardError(f"{path}: missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ShardError(f"{path}: not a readable draftsmith shard (header: {err}); {redo}") from None
    if size < end:
        raise ShardError(f"{path}: truncated ({size:,} bytes, its header says {end:,}); {redo}")
    version = meta.get("version")
    if version not in READABLE_FORMATS:
        raise ShardError(
            f"{path}: shard format {version}, this draftsmith reads formats "
            f"{' and '.join(map(str, READABLE_FORMATS))} (content digests); re-extract it ({redo})"
        )
    if meta.get("dtype", "bfloat16") not in STORAGE_DTYPES:
        raise ShardError(
            f"{path}: stores {meta['dtype']}, this draftsmith reads {' and '.join(STORAGE_DTYPES)}; {redo}"
        )
    return 8 + header_len, entries, meta


def read_shard_meta(path: str | Path) -> dict[str, Any]:
    return read_header(path)[2]


def iter_samples(path: str | Path) -> Iterator[Sample]:
    """Stream the samples of one shard in order, decoding and checking one at a time."""
    with ShardReader(path) as reader:
        for i in range(len(reader)):
            yield reader.read(i)


def verify_shard(path: str | Path) -> str:
    """Decode every sample of a shard and check it against the digests recorded by its writer; returns
    the shard's content digest. Raises ShardError naming the shard (and sample) on any mismatch."""
    with ShardReader(path) as reader:
        for i in range(len(reader)):
            reader.read(i)
        digest = content_digest(reader.meta, reader.ids, reader.digests)
        if digest != reader.meta.get("content_sha256"):
            raise ShardError(
                f"{reader.path}: content_sha256 in its header does not match its samples' digests"
            )
    return digest


def _frame(decompressor, data: memoryview, expected: int) -> np.ndarray:
    out = decompressor.decompress(data)
    if len(out) != expected:
        raise zstandard.ZstdError(f"{len(out)} bytes decoded, {expected} expected")
    return np.frombuffer(out, dtype=np.uint8)


def decode_sample(
    blob: np.ndarray, index: list, num_tokens: int, hidden: int, decompressor, storage_dtype: str
) -> Stored:
    """One sample's frames -> its stored states (bf16 bit patterns [A + 1, T, H] uint16, or float8
    codes and scales), without intermediate copies. zstd checks each frame's content checksum
    (ZstdError on a mismatch)."""
    view = blob.data
    slots, n = len(index), num_tokens * hidden
    if storage_dtype == "float8_e4m3fn":
        codes = np.empty((slots, n), dtype=np.uint8)
        scales = np.empty((slots, num_tokens), dtype="<f4")
        for slot, ((c_off, c_len), (s_off, s_len)) in enumerate(index):
            codes[slot] = _frame(decompressor, view[c_off : c_off + c_len], n)
            scales[slot] = _frame(decompressor, view[s_off : s_off + s_len], 4 * num_tokens).view("<f4")
        return Stored(codes.reshape(slots, num_tokens, hidden), scales)
    pairs = np.empty((slots, n, 2), dtype=np.uint8)  # little-endian [low, high]
    for slot, ((h_off, h_len), (l_off, l_len)) in enumerate(index):
        for plane, off, size in ((1, h_off, h_len), (0, l_off, l_len)):
            pairs[slot, :, plane] = _frame(decompressor, view[off : off + size], n)
    return Stored(pairs.view(np.uint16).reshape(slots, num_tokens, hidden))


def split_slots(slots: np.ndarray) -> tuple[Tensor, Tensor]:
    """[A + 1, T, H] uint16 bit patterns -> (aux [T, A, H], final [T, H]) bf16 views."""
    states = torch.from_numpy(slots).view(torch.bfloat16)
    return states[:-1].transpose(0, 1), states[-1]


def read_tokens(path: str | Path) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids [N], loss_mask [N] bool, offsets [S+1]) of a shard, without touching hidden states."""
    with ShardReader(path) as reader:
        return (
            reader.read_tensor("input_ids"),
            reader.read_tensor("loss_mask").bool(),
            reader.read_tensor("offsets"),
        )


class ShardReader:
    """Random access to one shard: `read(i)` reads, decodes and checks sample i alone, in any order.

    Only the offsets and the frame index stay in memory; a sample's bytes are fetched with one
    positioned read (os.preadv, which releases the GIL, as zstd, numpy and hashlib do), so background
    threads can decode samples of many shards at once. Thread-safe: reads share one file descriptor
    (positioned, no seek), and each thread gets its own zstd decompressor.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._data_start, self._entries, self.meta = read_header(self.path)
        self.codec = self.meta.get("codec", "none")
        self.storage_dtype: str = self.meta.get("dtype", "bfloat16")
        self.ids: list[str] = list(self.meta["sample_ids"])
        self.digests: list[str] = list(self.meta["sample_sha256"])
        self.num_aux, self.hidden_size = int(self.meta["num_aux"]), int(self.meta["hidden_size"])
        self._fd = os.open(self.path, os.O_RDONLY)
        self._local = threading.local()
        self.offsets: list[int] = self.read_tensor("offsets").tolist()
        self._index = self.read_tensor("blob_index").tolist() if self.codec == "zstd-planes" else None
        if not (len(self.offsets) == len(self.ids) + 1 == len(self.digests) + 1):
            raise ShardError(f"{self.path}: {len(self.ids)} sample ids, {len(self.offsets) - 1} offsets")

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
            raise ShardError(f"{self.path}: short read at byte {self._data_start + start} (truncated file?)")
        return np.frombuffer(buf, dtype=np.uint8)

    _TYPES = {  # safetensors dtype -> (numpy type of its bits, torch dtype to view them as)
        "I64": (np.int64, None),
        "U8": (np.uint8, None),
        "F32": (np.float32, None),
        "BF16": (np.uint16, torch.bfloat16),
        "F8_E4M3": (np.uint8, torch.float8_e4m3fn),
    }

    def read_array(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows start:stop (along the first dimension) of a stored tensor, read from disk, as numpy
        (bf16 and float8 as their bit patterns, uint16 and uint8)."""
        entry = self._entries[name]
        np_dtype = self._TYPES[entry["dtype"]][0]
        shape = entry["shape"]
        row = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(np_dtype).itemsize
        stop = shape[0] if stop is None else stop
        raw = self._pread(entry["data_offsets"][0] + start * row, (stop - start) * row)
        return raw.view(np_dtype).reshape(stop - start, *shape[1:])

    def read_tensor(self, name: str, start: int = 0, stop: int | None = None) -> Tensor:
        """Rows start:stop (along the first dimension) of a stored tensor, read from disk."""
        torch_dtype = self._TYPES[self._entries[name]["dtype"]][1]
        t = torch.from_numpy(self.read_array(name, start, stop))
        return t.view(torch_dtype) if torch_dtype is not None else t

    def _stored(self, i: int) -> Stored:
        """Sample i's states as stored (bf16 bit patterns, or float8 codes and scales)."""
        a, b = self.offsets[i], self.offsets[i + 1]
        if self.codec == "none":
            aux = self.read_array("aux_hidden_states", a, b)  # [T, A, H]
            final = self.read_array("final_hidden_states", a, b)  # [T, H]
            values = np.concatenate([aux.transpose(1, 0, 2), final[None]])  # [A + 1, T, H]
            if self.storage_dtype == "bfloat16":
                return Stored(values)
            aux_scales = self.read_array("aux_scales", a, b)  # [T, A]
            final_scales = self.read_array("final_scales", a, b)  # [T]
            return Stored(values, np.concatenate([aux_scales.T, final_scales[None]]))
        # the sample's frames lie back to back: one read, offsets rebased onto it
        assert self._index is not None  # zstd-planes shards have one
        frames = self._index[i]
        first = min(off for slot in frames for off, _ in slot)
        last = max(off + size for slot in frames for off, size in slot)
        blob = self._pread(self._entries["blob"]["data_offsets"][0] + first, last - first)
        local = [[[off - first, size] for off, size in slot] for slot in frames]
        decompressor = getattr(self._local, "decompressor", None)
        if decompressor is None:
            decompressor = self._local.decompressor = zstandard.ZstdDecompressor()
        return decode_sample(blob, local, b - a, self.hidden_size, decompressor, self.storage_dtype)

    def read(self, i: int, max_tokens: int | None = None) -> Sample:
        """Sample i, checked against its recorded digest, in bf16 (float8 dequantized after the check),
        cut to its first max_tokens tokens (the whole sample is read and checked, then sliced)."""
        a, b = self.offsets[i], self.offsets[i + 1]
        where = f"{self.path}: sample {i} ({self.ids[i]})"
        input_ids = self.read_tensor("input_ids", a, b)
        loss_mask = self.read_tensor("loss_mask", a, b)
        try:
            stored = self._stored(i)
        except zstandard.ZstdError as err:
            raise ShardError(f"{where}: a frame fails to decode ({err}); re-extract this shard") from None
        if sample_digest(input_ids, loss_mask, stored) != self.digests[i]:
            raise ShardError(
                f"{where}: content differs from the digest recorded at extraction (corrupted); "
                "re-extract this shard"
            )
        n = b - a if max_tokens is None else min(b - a, max_tokens)
        aux, final = split_slots(stored.bf16_bits())
        return Sample(self.ids[i], input_ids[:n], loss_mask[:n].bool(), aux[:n], final[:n])


def read_sample(path: str | Path, i: int) -> Sample:
    """Sample i of a shard, read on its own (see ShardReader to read many)."""
    with ShardReader(path) as reader:
        return reader.read(i)
