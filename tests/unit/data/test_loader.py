"""loader.py: batch plans (pure functions of seed and epoch), random access to shard samples, the
streaming loader against the in-memory reference, and background prefetching."""

from __future__ import annotations

import pytest
import torch
from helpers.data import make_tiny_data
from helpers.training import settings

from draftsmith.core.data.loader import InMemoryData, StreamingData, is_validation, plan_batches, prefetch
from draftsmith.core.data.manifest import load_manifest
from draftsmith.core.data.shards import ShardReader


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return make_tiny_data(tmp_path_factory.mktemp("loader-data"))


def test_plan_batches_budget_and_determinism() -> None:
    lengths = [10, 30, 20, 5, 40, 25, 60]
    g = torch.Generator().manual_seed(3)
    batches = plan_batches(lengths, 64, g, 1)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 64
    assert batches == plan_batches(lengths, 64, torch.Generator().manual_seed(3), 1)
    assert plan_batches(lengths, 64, None, 1)[0] == [0, 1]  # unshuffled: in order


def test_plan_batches_packs_by_length() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 100, (200,), generator=gen).tolist()

    def padded(batches: list[list[int]]) -> int:
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)

    def plan(window: int, seed: int = 1) -> list[list[int]]:
        return plan_batches(lengths, 400, torch.Generator().manual_seed(seed), window)

    for window in (1, 16, 200):
        batches = plan(window)
        assert sorted(i for b in batches for i in b) == list(range(200)), window
        assert all(len(b) * max(lengths[i] for i in b) <= 400 for b in batches)
        assert batches == plan(window)  # a pure function of the generator's seed
        assert batches != plan(window, seed=2)
    # sorting by length within windows packs with less padding than plain shuffling
    assert padded(plan(200)) < padded(plan(16)) < padded(plan(1))


def test_streaming_loader_matches_in_memory(data: dict, monkeypatch) -> None:
    """The same plans and bit-identical batches, whether decoded in background threads on demand or
    up front; the streaming loader decodes nothing until a batch is asked for."""
    manifest = load_manifest(data["manifest"])
    reads = []
    real_read = ShardReader.read
    monkeypatch.setattr(ShardReader, "read", lambda self, i, n=None: reads.append(i) or real_read(self, i, n))
    stream = StreamingData.from_manifest(manifest, settings(loader_threads=2))
    assert reads == []  # the index comes from token masks only: no state decoded to build it
    memory = InMemoryData.from_manifest(manifest, settings())
    assert len(reads) == len(memory.train) + len(memory.val) == 24
    assert [r.id for r in stream.val] == [r.id for r in memory.val] and len(stream.val) > 0
    assert all(is_validation(r.id, 0.2) for r in stream.val)
    reads.clear()
    first = stream.epoch_batches(0)[:2]
    batches = stream.batches(first, "train")
    next(batches)
    batches.close()
    assert len(reads) <= sum(len(b) for b in first)  # at most what was asked for was decoded
    for epoch in (0, 1):
        plan = stream.epoch_batches(epoch)
        assert plan == memory.epoch_batches(epoch)
        for a, b in zip(stream.batches(plan, "train"), memory.batches(plan, "train"), strict=True):
            for name in ("input_ids", "loss_mask", "lengths", "aux", "final"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert stream.epoch_batches(0) != stream.epoch_batches(1)  # reshuffled every epoch
    shards = {stream.train[i].shard for b in stream.epoch_batches(0)[:3] for i in b}
    assert shards == {0, 1}  # batches mix the shards
    stream.close()


def test_prefetch_keeps_order_and_stops_early() -> None:
    import threading

    started = []
    lock = threading.Lock()

    def slow_square(x: int) -> int:
        with lock:
            started.append(x)
        return x * x

    assert list(prefetch(slow_square, range(20), threads=3, depth=4)) == [x * x for x in range(20)]
    started.clear()
    it = prefetch(slow_square, range(1000), threads=2, depth=4)
    assert [next(it) for _ in range(3)] == [0, 1, 4]
    it.close()
    assert len(started) <= 3 + 4  # nothing is decoded far beyond what was consumed


def test_rank_shares_balance_tokens_not_sample_count() -> None:
    """Data-parallel shares by tokens (LPT): no rank above the batch's tokens / world + one sample; each
    sample once; one rank gets the batch as it is. Two long samples no longer land on one rank."""
    from draftsmith.core.data.loader import rank_shares

    assert rank_shares([3, 1, 2], [5, 6, 7, 8], 1) == [[3, 1, 2]]
    lengths = [7000, 300, 7000, 200, 100, 250]
    shares = rank_shares(list(range(6)), lengths, 2)
    assert sorted(sum(shares, [])) == list(range(6))
    assert not any({0, 2} <= set(s) for s in shares)  # count-based b[rank::world] gave both to rank 0
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n, world = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(2, 9, (1,), generator=g))
        lengths = torch.randint(1, 8192, (n,), generator=g).tolist()
        batch = torch.randperm(n, generator=g).tolist()
        shares = rank_shares(batch, lengths, world)
        assert sorted(sum(shares, [])) == sorted(batch)
        assert all(s == [i for i in batch if i in s] for s in shares)  # the batch's order kept
        bound = sum(lengths) / world + max(lengths)
        assert max(sum(lengths[i] for i in s) for s in shares) <= bound


def test_step_plan_gives_every_rank_as_many_micro_batches_within_budget() -> None:
    from draftsmith.core.data.loader import micro_batches, step_plan

    lengths = [40, 10, 30, 20, 50, 5, 5, 60]
    batch = list(range(8))
    assert micro_batches(batch, lengths, 0) == [batch]
    assert micro_batches([1, 5], lengths, 100) == [[1, 5]]  # fits: as it is
    for world in (1, 2, 3):
        plans = [step_plan(batch, lengths, r, world, 64) for r in range(world)]
        assert len({len(p) for p in plans}) == 1
        got = [i for p in plans for m in p for i in m]
        assert sorted(got) == batch
        for p in plans:
            for m in p:
                assert not m or len(m) == 1 or len(m) * max(lengths[i] for i in m) <= 64
    assert step_plan(batch, lengths, 0, 1, 0) == [batch]  # defaults: the batch in one pass, as before
