"""torch.distributed groups of one process without sockets (draftsmith/backends/single_rank_group.py): a
world of one and its groups asked for gloo get the single-rank backend, which does every collective it
offers exactly and opens no listener, where each gloo group listens on a TCP port."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from helpers.workflow import listeners

from draftsmith.backends.single_rank_group import BACKEND, SingleRankGroup, groups_of_one_without_sockets


def _own_listeners() -> list[tuple[str, str]]:
    return [(netid, local) for netid, local, pids in listeners() if os.getpid() in pids]


@pytest.fixture
def world_of_one():
    """vLLM's start of a world of one process (a FileStore rendezvous, gloo asked for) under the context;
    torch.distributed is left as it was found."""
    assert not dist.is_initialized()
    before = _own_listeners()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with groups_of_one_without_sockets():
                store = dist.FileStore(os.path.join(tmp, "store"), 1)
                dist.init_process_group(backend="gloo", store=store, world_size=1, rank=0)
                cpu = dist.new_group([0], backend="gloo")
                device = dist.new_group([0], backend=dist.get_backend())
            yield before, cpu, device
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def test_a_world_of_one_asked_for_gloo_opens_no_listener(world_of_one):
    before, cpu, device = world_of_one
    assert dist.get_backend() == dist.get_backend(cpu) == dist.get_backend(device) == BACKEND
    assert _own_listeners() == before  # each gloo group would have added a TCP port of its own
    # the replacement lasts only while the context is open
    assert dist.new_group is dist.distributed_c10d.new_group
    assert dist.init_process_group is dist.distributed_c10d.init_process_group
    # a group is known by its name: vLLM's shutdown destroys each group apart
    assert cpu.group_name and cpu.group_name != device.group_name
    dist.destroy_process_group(cpu)
    dist.destroy_process_group(device)


def test_each_collective_over_one_rank_is_exact(world_of_one):
    _, cpu, device = world_of_one
    x = torch.arange(4.0)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG):
        y = x.clone()
        dist.all_reduce(y, op=op, group=cpu)
        assert torch.equal(y, x)
    work = dist.all_reduce(y, group=device, async_op=True)
    work.wait()
    assert work.is_completed() and torch.equal(y, x)
    gathered = [torch.zeros(4)]
    dist.all_gather(gathered, x, group=cpu)
    single = torch.zeros(4)
    dist.all_gather_single(single, x, group=device)
    scattered = torch.zeros(4)
    dist.reduce_scatter_single(scattered, x, group=device)
    swapped = torch.zeros(4)
    dist.all_to_all_single(swapped, x, group=device)
    root = [torch.zeros(4)]
    dist.gather(x, root, dst=0, group=cpu)
    one = torch.zeros(4)
    dist.scatter(one, [x], src=0, group=cpu)
    for out in (gathered[0], single, scattered, swapped, root[0], one):
        assert torch.equal(out, x)
    objects: list[object] = [{"k": 1}]
    dist.broadcast_object_list(objects, src=0, group=cpu)
    dist.barrier(group=cpu)
    assert objects == [{"k": 1}]


def test_what_one_rank_cannot_do_is_refused():
    group = SingleRankGroup(0, 1)
    with pytest.raises(RuntimeError, match="no other process"):
        group.send([torch.zeros(1)], 1)
    with pytest.raises(NotImplementedError, match="PREMUL_SUM"):
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist._make_nccl_premul_sum(2.0)  # 2x: not the input
        group.allreduce([torch.zeros(1)], opts)
    with pytest.raises(ValueError, match="rank 0 of 1, not rank 0 of 2"):
        SingleRankGroup(0, 2)
