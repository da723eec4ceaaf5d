"""vLLM on a CPU in one process without a TCP listener: the vLLM worker whose torch.distributed groups of
one process open no socket.

vLLM's CPU worker starts torch.distributed even for one process: the world group and, per parallel
dimension (TP, PP, DCP, PCP, DP, EP, EPLB), a device group and a CPU group, all gloo, and each gloo
group's device listens on its own TCP port (single_rank_group.py): the workflow's CPU server listened on
15 ports of 127.0.0.1 besides its HTTP port. The rendezvous is vLLM's own FileStore (`file://`), not a
TCPStore, and the API server, its engine core and the worker talk over ZMQ ipc sockets and shared memory:
the gloo devices were the only other listeners. `OneProcessCPUWorker` is vLLM's CPU worker with its
distributed start under `groups_of_one_without_sockets`; backends.common.one_process_worker names it to
vLLM wherever draftsmith starts an engine of one process on a CPU (the server, evaluation, extraction).
vLLM skips the collectives of a group of one itself (GroupCoordinator's `world_size == 1` paths); the
single-rank backend still does each one it offers exactly.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from draftsmith.backends.single_rank_group import groups_of_one_without_sockets


class OneProcessCPUWorker(CPUWorker):
    """vLLM's CPU worker, its distributed start under `groups_of_one_without_sockets`: a world of one
    process opens no TCP listener (gloo's device would, one per group)."""

    def init_device(self) -> None:
        with groups_of_one_without_sockets():
            super().init_device()
