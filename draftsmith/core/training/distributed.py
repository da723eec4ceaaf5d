"""Data-parallel process groups for training: under `torchrun` (or `draftsmith train --nproc N`) every
rank takes a share of every batch, balanced by tokens (loader.rank_shares); each rank's loss is normalised by the *global* count of
trained positions, and torch's DistributedDataParallel sums the gradients across ranks (bucketed,
overlapped with the backward pass), so N processes compute the gradient one process computes on the whole
batch. gloo on CPU, nccl on CUDA; rank 0 writes checkpoints, metrics and the drafter.

Every rank trains a full copy of the drafter and its optimizer state: 16 bytes per parameter in fp32
(weights, gradients, AdamW's two moments; Kimi-K2.5's 1.06 B-parameter drafter: 17 GB), beside the frozen
target embedding and teacher rows. Those are not what decides whether training fits: the activations
kept for the backward pass are (megabytes per token: draftsmith/core/planning/memory.py), which
resources.train.micro_batch_tokens and checkpoint_ttt bound; `draftsmith plan` adds it all up per rank. A
drafter several times larger would need its parameters sharded (FSDP2's `fully_shard`), which draftsmith
does not do.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from draftsmith.core.io.cores import allowed_cores

log = logging.getLogger(__name__)


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

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module as this run trains it: itself in one process, else under DistributedDataParallel,
        whose backward all-reduces the gradients (averaged over ranks: callers scale the loss by
        `world` where, as here, each rank's loss is already a share of the whole batch's)."""
        if self.world == 1:
            return module
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            module,
            device_ids=[self.device] if self.device.type == "cuda" else None,
            gradient_as_bucket_view=True,  # gradients live in the all-reduce buckets: no second copy
        )

    def total(self, count: int) -> int:
        """An integer summed over every rank."""
        return int(self.all_sum(torch.tensor([count], device=self.device)).item())

    def finish(self) -> None:
        """Wait for every rank (rank 0's writes are done), then leave the group this call created."""
        self.barrier()
        if self.owns_group:
            torch.distributed.destroy_process_group()


def rank_threads(threads: int, world: int) -> int:
    """A rank's share of the job's CPU threads: every rank of a node is one process of the same job, so
    each taking the whole count oversubscribes the CPUs world-fold (8 ranks x 32 threads on 32 CPUs).
    An extraction job's engines share its threads the same way."""
    return max(1, threads // max(1, world))


def usable_threads(threads: int) -> int:
    """`threads`, at most the cores this process may run on (its affinity: a cpuset, taskset, a test
    worker's share): torch's threads spin-wait at every barrier, so two threads on one core ran the
    offline evaluation over 10x slower than one."""
    return max(1, min(threads, len(allowed_cores())))


def become_torchrun(nproc: int, module_args: Sequence[str]) -> None:
    """Replace this process by torchrun starting `nproc` copies of `python -m MODULE ARGS` on this machine
    (each then finds WORLD_SIZE set and runs as one rank); nothing when nproc is 1 or already a rank."""
    if nproc <= 1 or "WORLD_SIZE" in os.environ:
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    sys.stdout.flush()
    os.execv(sys.executable, [*cmd, "-m", *module_args])


def launch_rank() -> tuple[int, int]:
    """(rank, world size) of this process as torchrun launched it, before any process group exists."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def wants_cuda(device: str | torch.device | None) -> bool:
    """Whether init_distributed(device) runs on CUDA (None: when it is available)."""
    return torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"


def init_distributed(device: str | torch.device | None) -> Dist:
    """Join the torchrun process group when WORLD_SIZE > 1: nccl on CUDA (rank r on cuda:LOCAL_RANK),
    gloo on CPU. Otherwise a single process on `device` (default: CUDA when available)."""
    rank, world = launch_rank()
    use_cuda = wants_cuda(device)
    if world == 1:
        return Dist(device=torch.device(device or ("cuda" if use_cuda else "cpu")))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    owns = not torch.distributed.is_initialized()
    if owns:
        torch.distributed.init_process_group("nccl" if use_cuda else "gloo")
    return Dist(rank, world, dev, owns)
