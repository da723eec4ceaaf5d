"""EAGLE-3 drafter training with training-time test (TTT), in one readable file.

A sample is tokens x_0..x_{T-1} with, per position t, the target's aux states a_t [A, Ht] (inputs of the
aux layers) and its final state f_t [Ht] (after the final norm, so the target's distribution of x_{t+1}
is softmax(lm_head(f_t))). The drafter learns, for every position t at once:

    step 0:  hidden = fc(a_t),                 embed e(x_{t+1}),   position t    -> predicts x_{t+2}
    step j:  hidden = its own step-(j-1) output at t, e(x_{t+1+j}), position t+j  -> predicts x_{t+2+j}

with teacher softmax(W_d f_{t+1+j}) over the draft vocabulary (W_d = the target's lm_head rows of the
draft ids). Step j counts only where t+2+j < T and x_{t+2+j} is an assistant token (loss_mask); its
soft cross-entropy is averaged over those positions and weighted ttt_decay**j. One `TTTKV` per forward
gives step j at t the keys a cached drafter would see (drafter.py).

References: EAGLE `eagle/traineagle3/cnets.py` (7 steps, 0.8**j, soft CE to the target softmax, position
ids + j, AdamW betas (0.9, 0.95)); SpecForge `training/strategies/base.py` (ttt_length 7, 0.8**j, cosine
schedule, grad clip 0.5); speculators `models/eagle3/core.py` + `train/noise_transforms.py` (teacher
restricted to the draft vocabulary, uniform noise 0.05 on the aux states).

Data: the shards are never loaded whole (the seed's data was 828 GB). `StreamingData` indexes samples
from token arrays only, plans each epoch's batches as a pure function of (seed, epoch) — shuffled across
shards, packed by length within windows, under a padded token budget — and decodes the samples of the
next batches in background threads while the current one trains. A run resumes at (epoch, batch).

Data parallel: under `torchrun` (or `draftsmith train --nproc N`) every rank takes a disjoint slice of
every batch; each rank's loss is normalised by the *global* count of trained positions, and gradients
are summed across ranks, so N processes compute the gradient one process computes on the whole batch.
gloo on CPU, nccl on CUDA; rank 0 writes checkpoints, metrics and the export.

Layout: settings -> target head -> distributed -> data -> the TTT objective -> checkpoints -> `train()`.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import random
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from draftsmith.atomic import atomic_dir, write_json, write_jsonl
from draftsmith.drafter import TTTKV, DrafterConfig, Eagle3Drafter
from draftsmith.export import check_export, save_drafter
from draftsmith.layers import convert_layer_ids
from draftsmith.manifest import load_manifest
from draftsmith.shards import Sample, ShardReader
from draftsmith.vocab import load_vocab_map

log = logging.getLogger(__name__)

METRICS_FLUSH_S = 10.0  # rewrite metrics.jsonl at most this often (and at every epoch end / checkpoint)
KEEP_CHECKPOINTS = 2
COMPLETE_MARKER = "COMPLETE"
# settings that do not change the trajectory: a run may resume under different values
RESUME_FREE_SETTINGS = ("max_steps", "threads", "checkpoint_every", "loader_threads")


# ----------------------------------------------------------------------------------------------- settings


PRECISIONS = ("bf16", "fp32")
HEAD_INITS = ("target", "random")
LOSS_NORMS = ("position", "sample")
EVAL_MASK_OFFSET = 2  # validation always scores the positions whose predicted token is an assistant token


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on any device (CPU too: 1.5-1.9x the fp32 training tokens/s measured on 2 cores,
    same loss to 1e-4), as the EAGLE-3 reference and SpecForge train in bf16; fp32 = no autocast."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class TrainSettings:
    epochs: int  # passes over the training split
    max_steps: int | None  # stop early (tiny configs/tests); does not change the LR schedule; None = no limit
    lr: float
    weight_decay: float  # on matrices only (norm weights are not decayed)
    warmup_steps: int
    grad_clip: float  # max global grad norm; 0 = off
    batch_tokens: int  # token budget per optimizer step (padded size of a batch of whole samples)
    max_seq_len: int  # longer samples are truncated
    ttt_steps: int  # training-time-test steps
    ttt_decay: float  # step j loss weight decay**j (EAGLE-3 reference and SpecForge: 0.8)
    noise_std: float  # uniform noise U(-std, std) on aux states (speculators: 0.05); 0 = off
    val_fraction: float  # held-out samples for validation, chosen by a hash of the sample id
    seed: int
    threads: int | None  # torch.set_num_threads; None = torch's default
    checkpoint_every: (
        int | None
    )  # also checkpoint every N steps (always at each epoch end); None = epochs only
    pack_window: int  # samples sorted by length together before packing into batches (1 = no sorting)
    loader_threads: int  # background threads decoding the next batches; 0 = decode in the loop
    precision: str = "bf16"  # bf16: matmuls under bf16 autocast (weights, optimizer, loss in fp32); fp32
    # the objective and optimiser choices below were picked by ablation (bench/ablate.py, README "Training")
    head_init: str = "random"  # random: lm_head N(0, 0.02), norm ones; target: both from the target
    loss_norm: str = "position"  # position: step mean over valid positions; sample: per-sample sum / length
    mask_offset: int = 2  # step j at t trains where loss_mask[t+j+offset]: 2 = the predicted token's own
    adam_beta2: float = 0.95  # AdamW (0.9, beta2); the EAGLE reference 0.95, SpecForge 0.999

    def __post_init__(self) -> None:
        problems = []
        if self.epochs < 1:
            problems.append(f"epochs={self.epochs} must be >= 1")
        if self.max_steps is not None and self.max_steps < 0:
            problems.append(f"max_steps={self.max_steps} must be >= 0 or null")
        if not self.lr > 0:
            problems.append(f"lr={self.lr} must be > 0")
        if self.weight_decay < 0 or self.warmup_steps < 0 or self.grad_clip < 0 or self.noise_std < 0:
            problems.append("weight_decay, warmup_steps, grad_clip and noise_std must be >= 0")
        if self.max_seq_len < 3:
            problems.append(f"max_seq_len={self.max_seq_len} must be >= 3 (a prediction needs t+2 < T)")
        if self.batch_tokens < 1:
            problems.append(f"batch_tokens={self.batch_tokens} must be >= 1")
        if self.ttt_steps < 1:
            problems.append(f"ttt_steps={self.ttt_steps} must be >= 1")
        if not self.ttt_decay > 0:
            problems.append(f"ttt_decay={self.ttt_decay} must be > 0")
        if not 0 <= self.val_fraction < 1:
            problems.append(f"val_fraction={self.val_fraction} must be in [0, 1)")
        if self.threads is not None and self.threads < 1:
            problems.append(f"threads={self.threads} must be >= 1 or null")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            problems.append(f"checkpoint_every={self.checkpoint_every} must be >= 1 or null")
        if self.pack_window < 1:
            problems.append(f"pack_window={self.pack_window} must be >= 1")
        if self.precision not in PRECISIONS:
            problems.append(f"precision={self.precision!r} must be one of {list(PRECISIONS)}")
        if self.loader_threads < 0:
            problems.append(f"loader_threads={self.loader_threads} must be >= 0")
        if self.head_init not in HEAD_INITS:
            problems.append(f"head_init={self.head_init!r} must be one of {list(HEAD_INITS)}")
        if self.loss_norm not in LOSS_NORMS:
            problems.append(f"loss_norm={self.loss_norm!r} must be one of {list(LOSS_NORMS)}")
        if self.mask_offset not in (0, 1, 2):
            problems.append(f"mask_offset={self.mask_offset} must be 0, 1 or 2")
        if not 0 < self.adam_beta2 < 1:
            problems.append(f"adam_beta2={self.adam_beta2} must be in (0, 1)")
        if problems:
            raise ValueError("invalid train settings: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainSettings:
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(names))
        optional = {f.name for f in fields(cls) if f.default is not MISSING}
        missing = [n for n in names if n not in d and n not in optional]
        if unknown or missing:
            raise ValueError(f"train settings: unknown keys {unknown}, missing keys {missing}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------------------ target


@dataclass
class TargetHead:
    """The three target tensors the drafter needs; the rest of the target is dropped."""

    config: Any  # the target's transformers config
    embed: Tensor  # [V, Ht] input embeddings (frozen, shared with the target as vLLM does)
    lm_head: Tensor  # [V, Ht]
    norm: Tensor  # [Ht] final norm weight


HEAD_TENSORS = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}


def _read_head_tensors(folder: Path, tied: bool) -> dict[str, Tensor] | None:
    """embed/norm/lm_head straight from the safetensors files (Llama-style names), without building the
    model: a 1T-parameter target must not be loaded to train its drafter. None when a name is absent."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    elif (folder / "model.safetensors").is_file():
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        return None
    wanted = {k: v for k, v in HEAD_TENSORS.items() if not (tied and k == "lm_head")}
    if any(name not in weight_map for name in wanted.values()):
        return None
    out = {}
    for key, name in wanted.items():
        with safe_open(str(folder / weight_map[name]), framework="pt") as f:
            out[key] = f.get_tensor(name).to(torch.float32)
    out.setdefault("lm_head", out["embed"])
    return out


def load_target_head(path: str | Path) -> TargetHead:
    from transformers import AutoConfig

    from draftsmith.target import check_target_dir

    folder = check_target_dir(path)
    config = AutoConfig.from_pretrained(folder)
    tensors = _read_head_tensors(folder, bool(getattr(config, "tie_word_embeddings", False)))
    if tensors is not None:
        return TargetHead(config, tensors["embed"], tensors["lm_head"], tensors["norm"])
    from transformers import AutoModelForCausalLM  # other layouts: build the model, keep three tensors

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    embed = model.get_input_embeddings().weight.detach().clone()
    out = model.get_output_embeddings().weight.detach()
    lm_head = embed if out.data_ptr() == model.get_input_embeddings().weight.data_ptr() else out.clone()
    norm = getattr(model, "model", model).norm.weight.detach().clone()
    config = model.config
    del model
    return TargetHead(config, embed, lm_head, norm)


# ------------------------------------------------------------------------------------------- distributed


@dataclass
class Dist:
    """This process's place in a data-parallel run (rank 0 of 1 when not under torchrun)."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # this train() call created the process group (and destroys it)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, t: Tensor) -> Tensor:
        if self.world > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


def init_distributed(device: str | torch.device | None) -> Dist:
    """Join the torchrun process group when WORLD_SIZE > 1: nccl on CUDA (rank r on cuda:LOCAL_RANK),
    gloo on CPU. Otherwise a single process on `device` (default: CUDA when available)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if world == 1:
        return Dist(device=torch.device(device or ("cuda" if use_cuda else "cpu")))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    owns = not torch.distributed.is_initialized()
    if owns:
        torch.distributed.init_process_group("nccl" if use_cuda else "gloo")
    return Dist(rank, world, dev, owns)


def sync_gradients(params: list[torch.nn.Parameter], dist: Dist) -> None:
    """Sum gradients over ranks in one flat all-reduce (each rank's loss already carries the global
    normalisation). A parameter no rank produced a gradient for keeps grad None, as in one process, so
    the optimizer skips it the same way."""
    if dist.world == 1:
        return
    parts = [
        p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device) for p in params
    ]
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=dist.device)
    flat = dist.all_sum(torch.cat([*parts, has]))
    present = flat[-len(params) :] > 0
    offset = 0
    for p, keep in zip(params, present.tolist(), strict=True):
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone() if keep else None
        offset += n


# -------------------------------------------------------------------------------------------------- data


def is_validation(sample_id: str, val_fraction: float) -> bool:
    """Deterministic split: a sample is held out when the hash of its id falls below val_fraction."""
    h = int.from_bytes(hashlib.sha256(sample_id.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 < val_fraction


@dataclass(frozen=True)
class SampleRef:
    """Where a sample lives and how many of its tokens are trained (after truncation to max_seq_len)."""

    shard: int  # index into the manifest's shard list
    index: int  # sample index within the shard
    id: str
    num_tokens: int


def index_samples(
    readers: list[ShardReader], max_seq_len: int, num_aux: int, hidden_size: int
) -> tuple[list[SampleRef], int]:
    """The usable samples of the shards in storage order, from token masks only (no state is decoded)
    -> (refs, skipped). Usable: some x_{t+2} (t >= 0) within the first max_seq_len tokens is an
    assistant token, so the sample has a position to train."""
    refs, skipped = [], 0
    for k, reader in enumerate(readers):
        if (reader.num_aux, reader.hidden_size) != (num_aux, hidden_size):
            raise ValueError(
                f"{reader.path}: stores {reader.num_aux} aux states of size {reader.hidden_size}, expected "
                f"{num_aux} x {hidden_size} from the manifest"
            )
        mask = reader.read_tensor("loss_mask").numpy()
        for i, sample_id in enumerate(reader.ids):
            a = reader.offsets[i]
            n = min(reader.num_tokens(i), max_seq_len)
            if n > 2 and mask[a + 2 : a + n].any():
                refs.append(SampleRef(k, i, sample_id, n))
            else:
                skipped += 1
    return refs, skipped


def pack_batches(order: Iterable[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Greedily fill batches in `order` while B * longest <= batch_tokens (the padded size). A sample
    longer than the budget gets a batch of its own."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, lengths[i])
        if current and new_longest * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


def plan_batches(
    lengths: list[int], batch_tokens: int, generator: torch.Generator | None, pack_window: int = 1
) -> list[list[int]]:
    """The batches of one pass: a pure function of its arguments (so a resumed run sees the same ones).

    With a generator the samples are shuffled first (across all shards). pack_window > 1 then sorts each
    run of pack_window samples by length, longest first, before packing, so a batch holds samples of
    similar length (less padding); the batches are shuffled again so that the order of lengths within a
    window does not become the order of training."""
    n = len(lengths)
    order = torch.randperm(n, generator=generator).tolist() if generator is not None else list(range(n))
    if pack_window > 1:
        windows = (order[i : i + pack_window] for i in range(0, n, pack_window))
        order = [i for w in windows for i in sorted(w, key=lambda i: -lengths[i])]  # stable for ties
    batches = pack_batches(order, lengths, batch_tokens)
    if generator is not None and pack_window > 1:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    return batches


@dataclass
class Batch:
    input_ids: Tensor  # [B, T] int64, right-padded with 0
    loss_mask: Tensor  # [B, T] bool, False on padding
    lengths: Tensor  # [B] int64 real lengths
    aux: Tensor  # [B, T, A*Ht] stored dtype, zeros on padding
    final: Tensor  # [B, T, Ht]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self)))


def collate(samples: list[Sample], device: torch.device | str = "cpu") -> Batch:
    """Right-pad to the longest sample: causal attention keeps real tokens unaffected by padding."""
    B, T = len(samples), max(s.num_tokens for s in samples)
    A, Ht = samples[0].aux.shape[1:]
    input_ids = torch.zeros(B, T, dtype=torch.int64)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    aux = torch.zeros(B, T, A * Ht, dtype=samples[0].aux.dtype)
    final = torch.zeros(B, T, Ht, dtype=samples[0].final.dtype)
    for b, s in enumerate(samples):
        n = s.num_tokens
        input_ids[b, :n] = s.input_ids
        loss_mask[b, :n] = s.loss_mask
        aux[b, :n] = s.aux.reshape(n, A * Ht)  # aux layers concatenated in id order, as fc expects
        final[b, :n] = s.final
    lengths = torch.tensor([s.num_tokens for s in samples], dtype=torch.int64)
    return Batch(input_ids, loss_mask, lengths, aux, final).to(device)


_END = object()


def prefetch(fn: Callable[[Any], Any], items: Iterable[Any], threads: int, depth: int) -> Iterator[Any]:
    """fn(item) for each item, in order; with threads > 0 computed up to `depth` items ahead by a pool of
    background threads. Closing the iterator early cancels what is queued."""
    if threads == 0:
        yield from map(fn, items)
        return
    items = iter(items)
    with ThreadPoolExecutor(threads, thread_name_prefix="draftsmith-loader") as pool:
        pending = deque(pool.submit(fn, item) for item in itertools.islice(items, max(1, depth)))
        try:
            while pending:
                result = pending.popleft().result()
                nxt = next(items, _END)
                if nxt is not _END:
                    pending.append(pool.submit(fn, nxt))
                yield result
        finally:
            for future in pending:
                future.cancel()


class StreamingData:
    """Train/validation samples of a manifest, read from the shards on demand.

    Memory holds only the sample index (shard, position, length); the loop asks for an epoch's plan
    (`epoch_batches`, lists of sample indices) and iterates `batches(plan)`, which decodes and collates
    the next batches in `loader_threads` background threads while the current one trains. (Collating in
    the training thread is also slow on a busy CPU: its many small copies each wait for torch's
    intra-op thread team; measured 70x slower than in a background thread with 2 threads on 2 busy cores.)
    """

    def __init__(
        self,
        readers: list[ShardReader],
        train: list[SampleRef],
        val: list[SampleRef],
        settings: TrainSettings,
    ):
        if not train:
            raise ValueError("no training samples (all held out for validation, or none with a target token)")
        self.readers, self.train, self.val = readers, train, val
        self.batch_tokens, self.seed = settings.batch_tokens, settings.seed
        self.pack_window, self.threads = settings.pack_window, settings.loader_threads

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], settings: TrainSettings) -> StreamingData:
        readers = [ShardReader(s["path"]) for s in manifest["shards"]]
        refs, skipped = index_samples(
            readers, settings.max_seq_len, int(manifest["num_aux"]), int(manifest["hidden_size"])
        )
        if skipped:
            log.info("skipping %d samples without a predictable assistant token", skipped)
        train = [r for r in refs if not is_validation(r.id, settings.val_fraction)]
        val = [r for r in refs if is_validation(r.id, settings.val_fraction)]
        return cls(readers, train, val, settings)

    def close(self) -> None:
        for reader in self.readers:
            reader.close()

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """The batches of an epoch: a pure function of (seed, epoch), so a resumed run sees the same ones."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return plan_batches([r.num_tokens for r in self.train], self.batch_tokens, g, self.pack_window)

    def val_batches(self) -> list[list[int]]:
        """Validation batches, sorted by length for the least padding."""
        lengths = [r.num_tokens for r in self.val]
        return plan_batches(lengths, self.batch_tokens, None, max(1, len(lengths)))

    def sample(self, split: str, i: int) -> Sample:
        ref = (self.train if split == "train" else self.val)[i]
        return self.readers[ref.shard].read(ref.index, ref.num_tokens)

    def batch(self, indices: list[int], split: str) -> Batch:
        return collate([self.sample(split, i) for i in indices])

    def batches(self, plan: Iterable[list[int]], split: str) -> Iterator[Batch | None]:
        """One CPU batch per list of the plan (None for an empty list: a rank with no share), in order."""

        def make(indices: list[int]) -> Batch | None:
            return self.batch(indices, split) if indices else None

        return prefetch(make, plan, self.threads, 2 * self.threads + 1)


class InMemoryData(StreamingData):
    """The same samples, plans and batches, with every sample decoded once up front and held in memory
    (batches are still collated in the background threads): the streaming loader's reference in
    bench/train.py and the tests."""

    def __init__(
        self,
        readers: list[ShardReader],
        train: list[SampleRef],
        val: list[SampleRef],
        settings: TrainSettings,
    ):
        super().__init__(readers, train, val, settings)
        self.loaded = {
            split: [self.readers[r.shard].read(r.index, r.num_tokens) for r in refs]
            for split, refs in (("train", train), ("val", val))
        }

    def sample(self, split: str, i: int) -> Sample:
        return self.loaded[split][i]


# --------------------------------------------------------------------------------------------- objective


def ttt_step_targets(
    loss_mask: Tensor, lengths: Tensor, step: int, mask_offset: int = EVAL_MASK_OFFSET
) -> tuple[Tensor, Tensor, Tensor]:
    """Where TTT step j = `step` is trained, and which tokens it reads and predicts.

    loss_mask [B, T] bool, lengths [B] -> (valid [B, T] bool, src [T], tgt [T]):
      src[t] = t+1+j: the embedded input token and the teacher's final state (f_{t+1+j} gives x_{t+2+j})
      tgt[t] = t+2+j: the predicted token
      valid[b, t] = t+2+j < lengths[b] and loss_mask[b, t+j+mask_offset]
    mask_offset 2 trains where the predicted token is an assistant token; 0 where the token at t+j is
    (SpecForge shifts inputs and teacher but not the mask: it also trains the first two tokens after an
    answer and skips the first two of it). Indices are clamped to T-1; a clamped position is never valid
    (EAGLE's cnets.py shifts input_ids, target and loss_mask left by one per step, padding the end).
    """
    T = loss_mask.shape[1]
    t = torch.arange(T, device=loss_mask.device)
    tgt = t + 2 + step
    src = (t + 1 + step).clamp(max=T - 1)
    in_range = tgt[None, :] < lengths[:, None]
    tgt = tgt.clamp(max=T - 1)
    masked = (t + step + mask_offset).clamp(max=T - 1)
    return in_range & loss_mask[:, masked], src, tgt


@dataclass
class StepStats:
    """Sums over one or more batches, per TTT step j."""

    loss_sum: list[float]  # sum over valid positions of the soft cross-entropy
    correct: list[int]  # drafter top-1 == the real next token
    count: list[int]  # valid positions
    teacher_correct: int = 0  # step 0: the teacher's top-1 over the draft vocab == the real token
    tokens: int = 0

    @classmethod
    def zeros(cls, steps: int) -> StepStats:
        return cls([0.0] * steps, [0] * steps, [0] * steps)

    def add(self, other: StepStats) -> None:
        for j in range(len(self.count)):
            self.loss_sum[j] += other.loss_sum[j]
            self.correct[j] += other.correct[j]
            self.count[j] += other.count[j]
        self.teacher_correct += other.teacher_correct
        self.tokens += other.tokens

    def step_loss(self) -> list[float | None]:
        return [s / n if n else None for s, n in zip(self.loss_sum, self.count, strict=True)]

    def acc(self) -> list[float | None]:
        return [c / n if n else None for c, n in zip(self.correct, self.count, strict=True)]

    def loss(self, decay: float) -> float:
        return sum(
            decay**j * (s / n) for j, (s, n) in enumerate(zip(self.loss_sum, self.count, strict=True)) if n
        )

    def teacher_acc(self) -> float | None:
        return self.teacher_correct / self.count[0] if self.count[0] else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def all_sum(self, dist: Dist) -> StepStats:
        """The sums over every rank (float64 carries the integer counts exactly)."""
        if dist.world == 1:
            return self
        n = len(self.count)
        flat = [*self.loss_sum, *self.correct, *self.count, self.teacher_correct, self.tokens]
        t = dist.all_sum(torch.tensor(flat, dtype=torch.float64, device=dist.device)).tolist()
        ints = [int(round(x)) for x in t[n:]]
        return StepStats(t[:n], ints[:n], ints[n : 2 * n], ints[2 * n], ints[2 * n + 1])


def ttt_loss(
    drafter: Eagle3Drafter,
    embed_weight: Tensor,
    teacher_weight: Tensor,
    batch: Batch,
    ttt_steps: int,
    ttt_decay: float,
    noise_std: float = 0.0,
    generator: torch.Generator | None = None,
    step_counts: list[int] | None = None,
    precision: str = "fp32",
    mask_offset: int = EVAL_MASK_OFFSET,
    loss_norm: str = "position",
) -> tuple[Tensor, StepStats]:
    """The EAGLE-3 TTT objective on a batch -> (weighted loss, stats).

    embed_weight [V, Ht]: the target's frozen input embedding; teacher_weight [Vd, Ht]: the target's
    lm_head rows of the draft ids (teacher_logits = f @ teacher_weight.T). loss_norm "position": step j's
    cross-entropy sum is divided by step_counts[j] (default: this batch's count of valid positions, i.e.
    the mean); "sample": each position is weighted 1/its sample's length and the sum divided by
    step_counts[j] (default: the batch's sample count), so every sample weighs by its share of trained
    positions (SpecForge). Data-parallel ranks pass `ttt_step_counts` summed over all ranks' slices, so
    their losses add up to the whole batch's. mask_offset: see `ttt_step_targets` (stats use it too).
    """
    B, T = batch.input_ids.shape
    device = batch.input_ids.device
    amp = autocast(device, precision)
    aux = batch.aux.float()
    if noise_std > 0:
        # speculators AddUniformNoise: x + 2 * (U[0, 1) - 0.5) * std, on the aux states only
        aux = aux + 2 * (torch.rand(aux.shape, generator=generator, device=device) - 0.5) * noise_std
    positions = torch.arange(T, device=device).expand(B, T)
    kv = TTTKV()  # one per forward: step j attends to step-0 keys <= t and its own earlier steps at t
    stats = StepStats.zeros(ttt_steps)
    stats.tokens = batch.num_tokens
    total = torch.zeros((), device=device)
    with amp:
        hidden = drafter.fuse(aux)  # [B, T, H]
    for j in range(ttt_steps):
        valid, src, tgt = ttt_step_targets(batch.loss_mask, batch.lengths, j, mask_offset)
        with amp:
            embeds = F.embedding(batch.input_ids[:, src], embed_weight)  # e(x_{t+1+j})
            # = drafter.forward(...), with norm + lm_head (the costliest matmul) only on the valid rows
            hidden = drafter.midlayer(embeds, hidden, positions + j, kv)  # recurrent state for step j+1
        b, t = valid.nonzero(as_tuple=True)
        if b.numel() == 0:
            continue
        with amp:
            logits = drafter.lm_head(drafter.norm(hidden[b, t]))  # [N, Vd]
        logp = torch.log_softmax(logits.float(), dim=-1)
        with torch.no_grad():
            # teacher: the target's distribution restricted to (renormalised over) the draft vocabulary
            # (EAGLE cnets.py target_p, SpecForge, speculators' verifier_lm_head)
            teacher_logits = batch.final[b, src[t]].float() @ teacher_weight.T
            p = torch.softmax(teacher_logits, dim=-1)
            real = batch.input_ids[b, tgt[t]]  # x_{t+2+j}
            stats.correct[j] = int((drafter.draft_to_target(logits.argmax(-1)) == real).sum())
            if j == 0:
                stats.teacher_correct = int(
                    (drafter.draft_to_target(teacher_logits.argmax(-1)) == real).sum()
                )
        per_position = -(p * logp).sum(-1)  # soft cross-entropy
        stats.loss_sum[j] = float(per_position.detach().sum())
        stats.count[j] = int(b.numel())
        if loss_norm == "sample":
            per_position = per_position / batch.lengths[b].to(per_position.dtype)
        denominator = (
            step_counts[j] if step_counts is not None else (B if loss_norm == "sample" else b.numel())
        )
        total = total + ttt_decay**j * per_position.sum() / denominator
    return total, stats


def ttt_step_counts(
    loss_mask: Tensor,
    lengths: Tensor,
    ttt_steps: int,
    mask_offset: int = EVAL_MASK_OFFSET,
    loss_norm: str = "position",
) -> list[int]:
    """What each TTT step's loss of a batch is divided by, known before the forward (masks only):
    its valid positions ("position") or the batch's samples ("sample")."""
    if loss_norm == "sample":
        return [int(lengths.numel())] * ttt_steps
    return [int(ttt_step_targets(loss_mask, lengths, j, mask_offset)[0].sum()) for j in range(ttt_steps)]


def lr_factor(step: int, warmup_steps: int, total_steps: int, final_ratio: float = 0.1) -> float:
    """Linear warm-up to 1, then cosine down to final_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(drafter: Eagle3Drafter, settings: TrainSettings) -> torch.optim.AdamW:
    params = [p for p in drafter.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": settings.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, settings.adam_beta2))


@torch.no_grad()
def evaluate(
    drafter: Eagle3Drafter,
    embed: Tensor,
    teacher: Tensor,
    data: StreamingData,
    settings: TrainSettings,
    dist: Dist,
) -> StepStats:
    """Validation stats over every rank's slice of the validation batches."""
    was_training = drafter.training
    drafter.eval()
    stats = StepStats.zeros(settings.ttt_steps)
    plan = [b[dist.rank :: dist.world] for b in data.val_batches()]
    for batch in data.batches(plan, "val"):
        if batch is not None:
            batch = batch.to(dist.device)
            stats.add(
                ttt_loss(
                    drafter, embed, teacher, batch, settings.ttt_steps, settings.ttt_decay,
                    precision=settings.precision,
                )[1]
            )  # fmt: skip
    drafter.train(was_training)
    return stats.all_sum(dist)


# ------------------------------------------------------------------------------------------- checkpoints


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith("step-") or not name[5:].isdigit():
        return None
    return int(name[5:])


def list_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """Complete checkpoints (marker present), oldest first; partial ones are ignored."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and _step_of(p) is not None and (p / COMPLETE_MARKER).is_file()
    ]
    return sorted(found, key=_step_of)


def save_checkpoint(
    checkpoint_dir: str | Path,
    step: int,
    drafter: Eagle3Drafter,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict[str, Any],
) -> Path:
    """checkpoint_dir/step-{n}/: model.safetensors (fp32), optimizer.pt, trainer.pt (scheduler + RNG),
    state.json (position, settings), COMPLETE (written last). Keeps the newest KEEP_CHECKPOINTS."""
    path = Path(checkpoint_dir) / f"step-{step}"
    with atomic_dir(path) as tmp:
        weights = {k: v.detach().to("cpu").contiguous().clone() for k, v in drafter.state_dict().items()}
        save_file(weights, str(tmp / "model.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        rng = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate(),
        }
        torch.save({"scheduler": scheduler.state_dict(), "rng": rng}, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
        (tmp / COMPLETE_MARKER).write_text(f"step {step}\n", encoding="utf-8")
    for old in list_checkpoints(checkpoint_dir)[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_checkpoint(
    path: Path,
    drafter: Eagle3Drafter,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict[str, Any]:
    device = next(drafter.parameters()).device
    drafter.load_state_dict(load_file(str(path / "model.safetensors"), device=str(device)), strict=True)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
    trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    scheduler.load_state_dict(trainer["scheduler"])
    rng = trainer["rng"]
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    random.setstate(rng["python"])
    return json.loads((path / "state.json").read_text(encoding="utf-8"))


def remove_partial_checkpoints(checkpoint_dir: str | Path) -> None:
    """What a run killed while writing a checkpoint left: atomic_dir's hidden temp folders, step-N
    folders without the COMPLETE marker."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return
    for p in root.iterdir():
        partial = _step_of(p) is not None and not (p / COMPLETE_MARKER).is_file()
        if p.is_dir() and (partial or (p.name.startswith(".step-") and p.name.endswith(".tmp"))):
            shutil.rmtree(p, ignore_errors=True)


def resume_key(
    settings: TrainSettings, manifest: dict[str, Any], vocab: dict[str, Any], cfg: DrafterConfig
) -> dict:
    """What must match to resume a checkpoint: settings (bar RESUME_FREE_SETTINGS), data, vocab, model."""
    data = {
        "shards": [
            [Path(s["path"]).name, s.get("num_samples"), s.get("num_tokens")] for s in manifest["shards"]
        ],
        "aux_layer_ids": [int(i) for i in manifest["aux_layer_ids"]],
        "d2t_sha256": hashlib.sha256(vocab["d2t"].to(torch.int64).numpy().tobytes()).hexdigest(),
    }
    kept = {k: v for k, v in settings.to_dict().items() if k not in RESUME_FREE_SETTINGS}
    return {"settings": kept, "data": data, "drafter": cfg.to_dict()}


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        if isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
            out += _differences(a[k], b[k], f"{prefix}{k}.")
        elif a.get(k) != b.get(k):
            out.append(f"{prefix}{k}: {a.get(k)!r} -> {b.get(k)!r}")
    return out


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def noise_seed(seed: int, step: int, rank: int) -> int:
    """Seed of the aux-state noise of one step on one rank: reproducible without saving any generator
    state, so a resumed run draws the same noise."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{step}/{rank}".encode()).digest()[:7], "big")


# ------------------------------------------------------------------------------------------------- train


def build_drafter(
    target: TargetHead,
    d2t: Tensor,
    t2d: Tensor,
    num_aux: int,
    seed: int,
    device: torch.device | str,
    head_init: str = "random",
) -> tuple[Eagle3Drafter, Tensor, Tensor]:
    """-> (the drafter at its initial weights, in train mode; the frozen target embedding [V, Ht]; the
    teacher weight [Vd, Ht] = the target's lm_head rows of the draft ids), on device. The initial
    weights are a function of the seed: every data-parallel rank builds the same drafter. head_init
    "target" copies lm_head rows and the final norm from the target; "random" keeps the drafter's own
    initialisation (lm_head N(0, 0.02), norm ones; SpecForge)."""
    if head_init not in HEAD_INITS:
        raise ValueError(f"head_init={head_init!r} must be one of {list(HEAD_INITS)}")
    cfg = DrafterConfig.from_target(target.config, d2t.numel(), num_aux)
    random.seed(seed)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab_map(d2t, t2d)
    if head_init == "target":
        drafter.init_from_target(target.lm_head, target.norm)
    drafter.to(device).train()
    embed = target.embed.to(device)  # frozen, not part of the drafter
    draft_ids = torch.arange(cfg.draft_vocab_size) + d2t  # target id of each draft id
    return drafter, embed, target.lm_head[draft_ids].to(device)


def train(
    manifest_path: str | Path,
    vocab_path: str | Path,
    out_dir: str | Path,
    checkpoint_dir: str | Path,
    metrics_path: str | Path,
    settings: TrainSettings,
    *,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train a drafter on the shards of data_config.json and export it to out_dir -> summary dict.

    Resumes from the newest complete checkpoint in checkpoint_dir when it was written with the same
    settings (RESUME_FREE_SETTINGS aside), data and vocabulary; otherwise those checkpoints are removed
    and training starts fresh. Checkpoints are written at each epoch end, every `checkpoint_every` steps
    and when max_steps stops the run. Under torchrun (WORLD_SIZE > 1) this runs on every rank; rank 0
    writes checkpoints, metrics and the export.
    """
    wall_start = time.perf_counter()
    out_dir, checkpoint_dir, metrics_path = Path(out_dir), Path(checkpoint_dir), Path(metrics_path)
    dist = init_distributed(device)
    device = dist.device
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    manifest = load_manifest(manifest_path)
    aux_ids = [int(i) for i in manifest["aux_layer_ids"]]
    convention = manifest.get("layer_convention", "input")  # of aux_layer_ids
    aux_ids_input = convert_layer_ids(aux_ids, convention, "input")
    num_aux = int(manifest["num_aux"])
    if len(aux_ids) != num_aux:
        raise ValueError(f"manifest: {len(aux_ids)} aux_layer_ids {aux_ids} but num_aux = {num_aux}")
    vocab = load_vocab_map(vocab_path)
    d2t, t2d = vocab["d2t"], vocab["t2d"]
    target = load_target_head(manifest["target"])
    tcfg = target.config
    if int(manifest["hidden_size"]) != tcfg.hidden_size:
        raise ValueError(
            f"manifest hidden_size {manifest['hidden_size']} != target hidden_size {tcfg.hidden_size}"
        )
    if t2d.numel() != tcfg.vocab_size:
        raise ValueError(
            f"vocab map covers {t2d.numel()} target ids but the target vocabulary is {tcfg.vocab_size}"
        )

    data = StreamingData.from_manifest(manifest, settings)
    steps_per_epoch = [len(data.epoch_batches(e)) for e in range(settings.epochs)]
    total_steps = sum(steps_per_epoch)  # the schedule's horizon; max_steps only stops early
    stop_at = total_steps if settings.max_steps is None else min(total_steps, settings.max_steps)

    drafter, embed, teacher_weight = build_drafter(
        target, d2t, t2d, num_aux, settings.seed, device, settings.head_init
    )
    cfg = drafter.cfg
    del target
    params = [p for p in drafter.parameters() if p.requires_grad]

    optimizer = make_optimizer(drafter, settings)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, settings.warmup_steps, total_steps)
    )
    noise_gen = torch.Generator(device=device)

    # ---- resume: every rank reads the same checkpoint; rank 0 clears what cannot be resumed, after
    # the others have read
    key = resume_key(settings, manifest, vocab, cfg)
    step, epoch, batch_in_epoch = 0, 0, 0
    epoch_stats, last_epoch_stats = StepStats.zeros(settings.ttt_steps), None
    rows: list[dict[str, Any]] = []
    resumed_from = None
    checkpoints = list_checkpoints(checkpoint_dir)
    foreign = False
    if checkpoints:
        latest = checkpoints[-1]
        saved = json.loads((latest / "state.json").read_text(encoding="utf-8"))
        if saved.get("resume_key") == key:
            saved = load_checkpoint(latest, drafter, optimizer, scheduler)
            step, epoch, batch_in_epoch = saved["step"], saved["epoch"], saved["batch_in_epoch"]
            epoch_stats = StepStats(**saved["epoch_stats"])
            last_epoch_stats = StepStats(**saved["last_epoch_stats"]) if saved["last_epoch_stats"] else None
            rows = [r for r in _read_rows(metrics_path) if r.get("step", 0) <= step]
            rows.append({"kind": "resume", "step": step, "checkpoint": str(latest), "world_size": dist.world})
            resumed_from = step
            if dist.main:
                log.info(
                    "resumed from %s (step %d, epoch %d, batch %d)", latest, step, epoch + 1, batch_in_epoch
                )
        else:
            foreign = True
            if dist.main:
                diff = _differences(saved.get("resume_key") or {}, key)
                log.warning(
                    "not resuming %s: written for other settings/data (%s); starting fresh",
                    latest,
                    "; ".join(diff),
                )
    dist.barrier()
    if dist.main:
        remove_partial_checkpoints(checkpoint_dir)
        if foreign:
            for p in checkpoint_dir.iterdir():
                if p.is_dir() and _step_of(p) is not None:
                    shutil.rmtree(p, ignore_errors=True)

    last_flush = 0.0

    def flush_metrics(force: bool = False) -> None:
        nonlocal last_flush
        if dist.main and (force or time.perf_counter() - last_flush > METRICS_FLUSH_S):
            write_jsonl(metrics_path, rows)
            last_flush = time.perf_counter()

    last_saved = resumed_from

    def checkpoint(at_epoch: int, at_batch: int) -> None:
        nonlocal last_saved
        if last_saved == step:
            return
        state = {
            "step": step,
            "epoch": at_epoch,  # the epoch to continue (0-based) ...
            "batch_in_epoch": at_batch,  # ... from this batch of its plan
            "total_steps": total_steps,
            "world_size": dist.world,
            "epoch_stats": epoch_stats.to_dict(),
            "last_epoch_stats": last_epoch_stats.to_dict() if last_epoch_stats else None,
            "resume_key": key,
        }
        # metrics first: a run killed between the two resumes from an older checkpoint and keeps the
        # rows up to it; the other order would lose the rows since the last flush
        flush_metrics(force=True)
        if dist.main:
            save_checkpoint(checkpoint_dir, step, drafter, optimizer, scheduler, state)
        last_saved = step

    # ---- loop
    trained_tokens, train_time, wait_time = 0, 0.0, 0.0
    bar = tqdm(
        total=stop_at,
        initial=min(step, stop_at),
        disable=not (progress and dist.main),
        desc="train",
        mininterval=1.0,
    )
    while epoch < settings.epochs and step < stop_at:
        plan = data.epoch_batches(epoch)
        todo = plan[batch_in_epoch : batch_in_epoch + stop_at - step]  # no decoding past max_steps
        batches = data.batches([b[dist.rank :: dist.world] for b in todo], "train")
        for _ in todo:
            t_wait = time.perf_counter()
            batch = next(batches)  # decoded in the background while the previous step trained
            t0 = time.perf_counter()
            wait_time += t0 - t_wait
            stats = StepStats.zeros(settings.ttt_steps)
            counts = torch.zeros(settings.ttt_steps, dtype=torch.int64)
            if batch is not None:
                batch = batch.to(device)
                counts = torch.tensor(
                    ttt_step_counts(
                        batch.loss_mask, batch.lengths, settings.ttt_steps, settings.mask_offset,
                        settings.loss_norm,
                    )
                )  # fmt: skip
            counts = dist.all_sum(counts.to(device)).tolist()  # the whole batch's, over all ranks
            optimizer.zero_grad(set_to_none=True)
            if batch is not None:
                if settings.noise_std > 0:
                    noise_gen.manual_seed(noise_seed(settings.seed, step, dist.rank))
                loss, stats = ttt_loss(
                    drafter, embed, teacher_weight, batch, settings.ttt_steps, settings.ttt_decay,
                    settings.noise_std, noise_gen, step_counts=counts, precision=settings.precision,
                    mask_offset=settings.mask_offset, loss_norm=settings.loss_norm,
                )  # fmt: skip
                if loss.requires_grad:  # False only if no position of the batch is trainable
                    loss.backward()
            sync_gradients(params, dist)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                params, settings.grad_clip if settings.grad_clip > 0 else float("inf")
            )
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            stats = stats.all_sum(dist)
            step += 1
            batch_in_epoch += 1
            dt = time.perf_counter() - t0
            trained_tokens += stats.tokens
            train_time += dt
            epoch_stats.add(stats)
            acc = stats.acc()
            loss_value = stats.loss(settings.ttt_decay)
            rows.append(
                {
                    "kind": "train",
                    "step": step,
                    "epoch": epoch + 1,
                    "batch": batch_in_epoch,
                    "batches_in_epoch": len(plan),
                    "lr": lr,
                    "loss": loss_value,
                    "step_loss": stats.step_loss(),
                    "acc": acc,
                    "positions": stats.count,
                    "teacher_acc": stats.teacher_acc(),
                    "grad_norm": float(grad_norm),
                    "tokens": stats.tokens,
                    "tokens_per_s": stats.tokens / dt if dt > 0 else None,
                    "data_wait_s": t0 - t_wait,
                }
            )
            bar.update(1)
            bar.set_postfix_str(
                f"loss {loss_value:.3f} "
                + " ".join(f"acc{j} {a:.2f}" for j, a in enumerate(acc) if a is not None)
                + f" tok/s {stats.tokens / dt:.0f}"
            )
            flush_metrics()
            every = settings.checkpoint_every
            if every and step % every == 0 and batch_in_epoch < len(plan):
                checkpoint(epoch, batch_in_epoch)
        batches.close()
        if batch_in_epoch < len(plan):
            break  # stopped by max_steps
        # ---- epoch end: validation, then a checkpoint positioned at the next epoch
        if data.val:
            v = evaluate(drafter, embed, teacher_weight, data, settings, dist)
            rows.append(
                {
                    "kind": "val",
                    "step": step,
                    "epoch": epoch + 1,
                    "loss": v.loss(settings.ttt_decay),
                    "step_loss": v.step_loss(),
                    "acc": v.acc(),
                    "positions": v.count,
                    "teacher_acc": v.teacher_acc(),
                    "samples": len(data.val),
                    "tokens": v.tokens,
                }
            )
            if dist.main:
                log.info("epoch %d val loss %.4f acc %s", epoch + 1, rows[-1]["loss"], rows[-1]["acc"])
        last_epoch_stats, epoch_stats = epoch_stats, StepStats.zeros(settings.ttt_steps)
        epoch, batch_in_epoch = epoch + 1, 0
        checkpoint(epoch, 0)
    bar.close()
    data.close()
    checkpoint(epoch, batch_in_epoch)  # no-op unless stopped since the last one
    flush_metrics(force=True)

    # ---- summary + export
    train_stats = epoch_stats if sum(epoch_stats.count) else (last_epoch_stats or epoch_stats)
    val_rows = [r for r in rows if r["kind"] == "val"]
    summary = {
        "steps": step,
        "total_steps": total_steps,
        "epochs": settings.epochs,
        "epochs_completed": epoch,
        "steps_per_epoch": steps_per_epoch,
        "stopped_early": step < total_steps,
        "resumed_from_step": resumed_from,
        "world_size": dist.world,
        "device": str(device),
        "train_samples": len(data.train),
        "val_samples": len(data.val),
        "train_loss": train_stats.loss(settings.ttt_decay) if sum(train_stats.count) else None,
        "train_acc": train_stats.acc(),
        "teacher_acc": train_stats.teacher_acc(),
        "val_loss": val_rows[-1]["loss"] if val_rows else None,
        "val_acc": val_rows[-1]["acc"] if val_rows else None,
        "trained_tokens": trained_tokens,
        "tokens_per_s": trained_tokens / train_time if train_time > 0 else None,
        # time the loop waited for the loader: ~0 when background decoding keeps ahead of training
        "data_wait_s": wait_time,
        "data_wait_fraction": wait_time / (wait_time + train_time) if train_time > 0 else None,
        "wall_s": time.perf_counter() - wall_start,
    }
    if dist.main:
        with atomic_dir(out_dir) as tmp:
            save_drafter(
                drafter,
                tmp,
                aux_ids_input,
                str(manifest["target"]),
                extra={"training": {"settings": settings.to_dict(), "summary": summary}},
            )
            problems = check_export(
                tmp, target_num_layers=tcfg.num_hidden_layers, target_vocab_size=tcfg.vocab_size
            )
            if problems:
                raise RuntimeError(f"the export failed its own checks: {problems}")
            write_json(tmp / "train_summary.json", summary)
        log.info("exported the drafter to %s", out_dir)
    dist.barrier()  # the export exists before any rank returns
    if dist.owns_group:
        torch.distributed.destroy_process_group()
    return summary
