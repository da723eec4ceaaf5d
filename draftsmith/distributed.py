"""Data-parallel process groups for training: under `torchrun` (or `draftsmith train --nproc N`) every
rank takes a disjoint slice of every batch; each rank's loss is normalised by the *global* count of
trained positions and gradients are summed across ranks, so N processes compute the gradient one process
computes on the whole batch. gloo on CPU, nccl on CUDA; rank 0 writes checkpoints, metrics and the export.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor


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

    def finish(self) -> None:
        """Wait for every rank (rank 0's writes are done), then leave the group this call created."""
        self.barrier()
        if self.owns_group:
            torch.distributed.destroy_process_group()


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
