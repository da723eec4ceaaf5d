"""Streamed hidden states (train.hidden_states: stream): the train job captures the states itself, batch
by batch as training asks for them, and no shard is ever written.

Bit for bit what `files` would have stored: the states are captured in the extract stage's own batches
(per shard of the tokens file's plan, `token_batches` at extract.batch_tokens: a sample's bf16 states
depend on which samples share its forward), converted to bf16 and to the storage dtype exactly as the
shard writer stores them, and read back as a shard read returns them (float8 dequantized, cut to
train.max_seq_len). Those capture batches ("units") are what an epoch shuffles: an epoch takes the
units in a seeded order and packs training batches from their samples (sorted by length within
pack_window), so the states held in memory at once are a few units', not an epoch's. The plan is a pure
function of (seed, epoch), as the files loader's, so a run resumes at (epoch, batch); every epoch
captures again (one prefill of the data per epoch, validation's units included).

hybrid (train.hidden_states: hybrid): the same, and every captured sample is also handed to the extract
stage's shard writer, one cache shard per shard of the plan (`StateCache`: compressed, each sample's
digest the one extraction records); once every unit of a shard that training or validation uses is
written, the shard is closed, sealed and verified (every sample decoded against its digest), and from
then on its units are read from it instead of captured: epoch 0 prefills, later epochs read. A killed
run finds the finished cache shards intact and verifies them again; what was being written is captured
again when first needed. The data are the same bits either way, so the plan and the weights are too.

The teacher-agreement check of the extract stage runs on every unit the first time it is captured;
once enough positions are checked, an agreement below extract.min_teacher_agreement stops training.

The engine comes from the caller's factory (stages/train.py builds it from backends/extraction.py),
called at the first capture (an untrained drafter's export plans batches but never loads it), closed by
close(): anything with `capture(list of [T] ids) -> [(aux [T, A, H], final [T, H])]`, `lm_head_weight`
and `close()`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.core.data.batch_plan import token_batches
from draftsmith.core.data.loader import (
    Batch,
    BatchSettings,
    SampleRef,
    StreamingData,
    collate,
    is_validation,
    plan_batches,
    prefetch,
    trainable,
)
from draftsmith.core.data.shards import (
    Sample,
    ShardError,
    ShardReader,
    ShardWriter,
    remove_stale_temp_files,
    split_slots,
    store,
    verify_shard,
)
from draftsmith.core.data.teacher import checked_positions, count_agreeing
from draftsmith.core.data.tokens import load_tokens
from draftsmith.core.io.digests import intact, seal

log = logging.getLogger(__name__)

MIN_CHECKED = 256  # positions checked before a low teacher agreement stops the run (noise below that)


class TeacherDisagrees(RuntimeError):
    """The streamed states fail the teacher-agreement check (wrong layers, norm or template)."""


@dataclass
class StreamSpec:
    """What a stream captures, as the stream manifest records it (stages/manifest.py)."""

    storage_dtype: str
    batch_tokens: int  # extract.batch_tokens: the capture batches (units)
    min_teacher_agreement: float


def capture_units(offsets: list[int], shards: list[list[int]], batch_tokens: int) -> list[list[int]]:
    """The extract stage's capture batches over all shards of the plan, as global sample indices: per
    shard, `token_batches` of its samples' lengths (what extract_shard captures together)."""
    units = []
    for start, end in shards:
        lengths = [offsets[i + 1] - offsets[i] for i in range(start, end)]
        units += [[start + i for i in batch] for batch in token_batches(lengths, batch_tokens)]
    return units


def unit_windows(
    unit_order: list[int], units: list[list[int]], position: dict[int, int], min_samples: int
) -> list[list[int]]:
    """Consecutive runs of whole capture units (in `unit_order`) holding at least `min_samples` of the
    samples `position` maps (global index -> train position): each run's train positions; the last run
    takes what is left."""
    windows: list[list[int]] = [[]]
    for u in unit_order:
        if len(windows[-1]) >= min_samples:
            windows.append([])
        windows[-1] += [position[i] for i in units[u] if i in position]
    return [w for w in windows if w]


def stored_sample(sample_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux, final) -> Sample:
    """A captured sample as the extract stage hands it to the shard writer (bf16, whatever the compute
    dtype)."""
    return Sample(sample_id, input_ids, loss_mask.bool(), aux.to(torch.bfloat16), final.to(torch.bfloat16))


def as_read(sample: Sample, storage_dtype: str, max_tokens: int) -> Sample:
    """`sample` as a shard of `storage_dtype` reads it back (ShardReader.read): stored, float8
    dequantized, cut to its first max_tokens tokens."""
    aux, final = split_slots(store(sample, storage_dtype).bf16_bits())
    return truncated(Sample(sample.id, sample.input_ids, sample.loss_mask, aux, final), max_tokens)


def truncated(sample: Sample, max_tokens: int) -> Sample:
    """The sample's first max_tokens tokens (train.max_seq_len), as a shard read cuts it."""
    n = min(sample.num_tokens, max_tokens)
    return Sample(sample.id, sample.input_ids[:n], sample.loss_mask[:n], sample.aux[:n], sample.final[:n])


class StateCache:
    """hybrid's cache: per shard k of the tokens file's plan, `folder/shard-k.safetensors` written by the
    extract stage's ShardWriter as its units are captured, then closed, sealed and verified; readable from
    then on. A shard intact from an earlier (killed) job is verified and read at once."""

    def __init__(self, folder: Path, shards: int, meta: dict[str, Any], codec: str, zstd_level: int):
        self.folder, self.meta, self.codec, self.zstd_level = Path(folder), meta, codec, zstd_level
        self.folder.mkdir(parents=True, exist_ok=True)
        self.writers: dict[int, ShardWriter] = {}
        self.readers: dict[int, ShardReader] = {}
        self.where: dict[int, dict[str, int]] = {}  # shard -> sample id -> its index in the cache shard
        self.bytes_written = 0
        for k in range(shards):
            path = self.path(k)
            if intact(path):
                try:
                    self._open(k)
                    continue
                except ShardError as err:  # sealed but not what its digests say: written again
                    log.warning("hybrid cache: %s; capturing its samples again", err)
            path.unlink(missing_ok=True)
            remove_stale_temp_files(path)  # a killed job's partial shard (and the seal of a damaged one)

    def path(self, k: int) -> Path:
        return self.folder / f"shard-{k}.safetensors"

    def _open(self, k: int) -> None:
        verify_shard(self.path(k))  # every sample against its digest, before anything reads it
        reader = ShardReader(self.path(k))
        self.readers[k], self.where[k] = reader, {sample_id: i for i, sample_id in enumerate(reader.ids)}

    def read(self, k: int, sample_id: str) -> Sample:
        return self.readers[k].read(self.where[k][sample_id])

    def add(self, k: int, sample: Sample, storage_dtype: str) -> None:
        if k not in self.writers:
            self.writers[k] = ShardWriter(
                self.path(k), dict(self.meta), self.codec, self.zstd_level, storage_dtype
            )
        self.writers[k].add(sample)

    def finish(self, k: int) -> None:
        """Close shard k's writer, seal the file as the extract stage seals its shards, verify and open it."""
        writer = self.writers.pop(k)
        writer.close({"final": "post_final_norm", "stats": {"written_by": "train (hidden_states hybrid)"}})
        self.bytes_written += self.path(k).stat().st_size
        seal([self.path(k)], "extract")
        self._open(k)
        log.info("hybrid cache: %s written and verified (%d samples)", self.path(k), len(self.where[k]))

    def close(self) -> None:
        for writer in self.writers.values():
            writer.abort()
        self.writers.clear()
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()


class StreamedData(StreamingData):
    """StreamingData's interface (epoch plans of sample indices, `batches(plan)` prefetched in a
    background thread) over states captured on demand from a tokens file instead of read from shards."""

    def __init__(
        self,
        tokens_path: str | Path,
        open_engine: Callable[[], Any],
        spec: StreamSpec,
        settings: BatchSettings,
        prefetch_batches: int = 2,
        cache: StateCache | None = None,
    ):  # cache: hybrid (use_cache)
        tensors, meta = load_tokens(tokens_path)
        self.input_ids, self.loss_mask = tensors["input_ids"], tensors["loss_mask"]
        self.offsets = tensors["offsets"].tolist()
        self.ids: list[str] = list(meta["sample_ids"])
        n = len(self.ids)
        self.sources = list(meta.get("sample_sources") or ["regenerated"] * n)
        self.units = capture_units(self.offsets, meta["shards"], spec.batch_tokens)
        self.unit_of = {i: u for u, unit in enumerate(self.units) for i in unit}
        shard_of = {i: k for k, (a, b) in enumerate(meta["shards"]) for i in range(a, b)}
        self.shard_of_unit = [shard_of.get(unit[0], 0) for unit in self.units]
        mask = self.loss_mask.numpy()
        refs, skipped = [], 0
        for i in (i for unit in self.units for i in unit):  # the order a shard stores them, as files reads
            a, length = self.offsets[i], min(self.offsets[i + 1] - self.offsets[i], settings.max_seq_len)
            if trainable(mask, a, length):
                refs.append(SampleRef(shard_of.get(i, 0), i, self.ids[i], length))  # index: global
            else:
                skipped += 1
        if skipped:
            log.warning(
                "skipping %d samples without an assistant token to predict (within max_seq_len)", skipped
            )
        train = [r for r in refs if not is_validation(r.id, settings.val_fraction)]
        val = [r for r in refs if is_validation(r.id, settings.val_fraction)]
        super().__init__([], train, val, settings)
        self.open_engine = open_engine
        self.engine: Any = None  # the extraction engine, loaded at the first capture
        self.spec, self.max_seq_len = spec, settings.max_seq_len
        self.depth = max(1, prefetch_batches)
        self.checked_units: set[int] = set()
        self.teacher: dict[str, list[int]] = {}  # source -> [agreeing, checked]
        self.captured_tokens, self.capture_s = 0, 0.0
        self.lock = threading.Lock()  # the stats, read by the training thread
        self.used = {self.unit_of[r.index] for r in refs}  # units training or validation reads
        self.cache: StateCache | None = None
        self.unwritten: dict[int, set[int]] = {}  # shard -> its used units not in the cache yet
        if cache is not None:
            self.use_cache(cache)

    def use_cache(self, cache: StateCache) -> None:
        """hybrid: write captured units into `cache`, and read those of its finished shards from it."""
        self.cache, self.unwritten = cache, {}
        for u in sorted(self.used):
            if self.shard_of_unit[u] not in cache.readers:
                self.unwritten.setdefault(self.shard_of_unit[u], set()).add(u)

    # ------------------------------------------------------------------------------- the plans

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """An epoch's batches of train indices, a pure function of (seed, epoch): the capture units in a
        seeded order, taken as windows of whole units holding at least pack_window training samples;
        each window planned as `files` plans a whole epoch (loader.plan_batches: its samples shuffled,
        packed by length within pack_window, the batches shuffled). A window's states wait in memory
        until its batches are trained, so memory is bounded by a window, not the epoch. Data of one
        window (at most pack_window training samples) gets the files plan itself: the same batches."""
        key = self.seed * 1_000_003 + epoch
        g = torch.Generator().manual_seed(key)  # the files plan's generator: one window = its very plan
        lengths = self.train_lengths()
        if len(lengths) <= max(1, self.pack_window):
            return plan_batches(lengths, self.batch_tokens, g, self.pack_window)
        position = {r.index: k for k, r in enumerate(self.train)}
        units = torch.randperm(len(self.units), generator=torch.Generator().manual_seed(2 * key + 1)).tolist()
        batches: list[list[int]] = []
        for window in unit_windows(units, self.units, position, max(1, self.pack_window)):
            planned = plan_batches([lengths[i] for i in window], self.batch_tokens, g, self.pack_window)
            batches += [[window[j] for j in batch] for batch in planned]
        return batches

    # ------------------------------------------------------------------------------ the batches

    def sample(self, split: str, i: int) -> Sample:
        """One sample captured alone would not be what `files` stores (its unit decides the rounding):
        samples come from batches(), which captures whole units."""
        raise NotImplementedError("streamed samples are captured per unit: use batches()")

    def batches(self, plan: Iterable[list[int]], split: str) -> Iterator[Batch | None]:
        """One CPU batch per list of the plan (None for an empty list), in order, captured in a
        background thread up to `prefetch_batches` batches ahead. A unit is captured when a batch first
        needs one of its samples; its samples wait in memory until the plan has used them."""
        plan = [list(indices) for indices in plan]
        refs = self.train if split == "train" else self.val
        remaining = Counter(refs[i].index for indices in plan for i in indices)
        ready: dict[int, Sample] = {}  # global index -> sample as read

        def make(indices: list[int]) -> Batch | None:
            if not indices:
                return None
            samples = []
            for i in indices:
                g = refs[i].index
                if g not in ready:
                    self._capture(self.unit_of[g], remaining, ready)
                samples.append(ready[g])
                remaining[g] -= 1
                if remaining[g] == 0:
                    del ready[g]
            return collate(samples)

        # one worker: batches are made in plan order (the units' states share `ready`)
        return prefetch(make, plan, 1, self.depth)

    def _capture(self, u: int, remaining: Counter, ready: dict[int, Sample]) -> None:
        """Capture unit u, keep its samples the plan still needs (as read back), and check teacher
        agreement the first time the unit is seen."""
        unit = self.units[u]
        k = self.shard_of_unit[u]
        if self.cache is not None and k in self.cache.readers:  # hybrid, written: read, not captured
            for i in unit:
                if remaining[i] > 0:
                    ready[i] = truncated(self.cache.read(k, self.ids[i]), self.max_seq_len)
            return
        sequences = [self.input_ids[self.offsets[i] : self.offsets[i + 1]] for i in unit]
        if self.engine is None:
            self.engine = self.open_engine()
        t0 = time.perf_counter()
        captured = self.engine.capture(sequences)
        seconds = time.perf_counter() - t0
        check = u not in self.checked_units
        states: dict[str, list[torch.Tensor]] = {}
        next_ids: dict[str, list[torch.Tensor]] = {}
        for i, (aux, final) in zip(unit, captured, strict=True):
            a, b = self.offsets[i], self.offsets[i + 1]
            sample = stored_sample(self.ids[i], self.input_ids[a:b], self.loss_mask[a:b], aux, final)
            if self.cache is not None and u in self.unwritten.get(k, ()):
                self.cache.add(k, sample, self.spec.storage_dtype)
            full = as_read(sample, self.spec.storage_dtype, sample.num_tokens)
            if remaining[i] > 0:
                ready[i] = truncated(full, self.max_seq_len)
            if check:  # on the final states as stored, as the extract stage checks them
                rows, ids = checked_positions(full.final, full.input_ids, full.loss_mask)
                states.setdefault(self.sources[i], []).append(rows)
                next_ids.setdefault(self.sources[i], []).append(ids)
        with self.lock:
            self.captured_tokens += sum(s.numel() for s in sequences)
            self.capture_s += seconds
            for source, parts in states.items():
                counts = self.teacher.setdefault(source, [0, 0])
                nxt = torch.cat(next_ids[source])
                counts[0] += count_agreeing(self.engine.lm_head_weight, torch.cat(parts), nxt)
                counts[1] += int(nxt.numel())
            self.checked_units.add(u)
            agree, checked = self.teacher.get("regenerated", [0, 0])
        if self.cache is not None and u in self.unwritten.get(k, ()):
            self.unwritten[k].discard(u)
            if not self.unwritten[k]:  # every unit of shard k that is read is written: close and verify
                del self.unwritten[k]
                self.cache.finish(k)
        enough = checked >= MIN_CHECKED or len(self.checked_units) == len(self.units)
        if check and checked and enough and agree / checked < self.spec.min_teacher_agreement:
            raise TeacherDisagrees(
                f"teacher agreement {agree / checked:.3f} over {checked:,} streamed positions < "
                f"extract.min_teacher_agreement {self.spec.min_teacher_agreement}: argmax(lm_head(final)) "
                "does not reproduce the traces' next tokens (check the aux/final layers and final norm, "
                "the chat template of traces vs target, and whether traces were sampled)"
            )

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.cache is not None:
            self.cache.close()

    # ------------------------------------------------------------------------------- the record

    def stats(self) -> dict[str, Any]:
        """What the stream did so far: tokens prefilled, seconds in capture, teacher agreement."""
        with self.lock:
            by_source = {k: (a / n if n else None) for k, (a, n) in sorted(self.teacher.items())}
            agree, checked = self.teacher.get("regenerated", [0, 0])
            cache = self.cache
            return {
                "hidden_states": "hybrid" if cache is not None else "stream",
                "cache_bytes": cache.bytes_written if cache is not None else 0,
                "prefilled_tokens": self.captured_tokens,
                "capture_s": round(self.capture_s, 3),
                "units": len(self.units),
                "teacher_agreement": agree / checked if checked else None,
                "teacher_checked": checked,
                "teacher_agreement_by_source": by_source,
            }
