"""torch.distributed groups of one process that open no socket (`SingleRankGroup`, a backend of its own).

gloo is torch's CPU backend, and every gloo process group creates its own gloo TCP device, which listens
on a TCP port from the moment it exists (gloo/transport/tcp/device.cc, its Listener), whether or not a
peer ever connects; no setting of torch 2.13 avoids it (TORCH_GLOO_LAZY_INIT defers connecting, not
listening; GLOO_DEVICE_TRANSPORT offers no other transport in the CPU build). A group of one process needs
no transport at all: every collective over one rank is exact without one (the sum over one rank is the
tensor, the gather of one is a copy). `groups_of_one_without_sockets` gives such groups this backend where
gloo was asked for; vllm_one_process.py opens it around vLLM's distributed start.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

BACKEND = "one_process"  # the name torch.distributed knows the backend by (Backend.ONE_PROCESS)


def _done(result: Any) -> dist.Work:
    """A finished torch.distributed Work holding `result` (what the collective's future returns)."""
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(future)  # type: ignore[attr-defined]


def _exact_reduction(opts: Any) -> None:
    """A reduction over one rank is its input for every op but PREMUL_SUM (a scaling: NCCL's only, which
    gloo refuses too)."""
    if opts is not None and opts.reduceOp == dist.ReduceOp.PREMUL_SUM:
        raise NotImplementedError("PREMUL_SUM: gloo has no such reduction, nor does a single-rank group")


def _copied(outputs: Sequence[Tensor], inputs: Sequence[Tensor]) -> dist.Work:
    """Each output takes its input (a gather, scatter or all-to-all over one rank), as a finished Work."""
    for out, tensor in zip(outputs, inputs, strict=True):
        out.copy_(tensor.reshape(out.shape))
    return _done(list(outputs))


class SingleRankGroup(dist.ProcessGroup):
    """torch.distributed's collectives over a group of one process, in place, with no transport.

    Every reduction over one rank is its input (SUM, AVG, MIN, MAX, PRODUCT and the bitwise ones alike),
    a broadcast from the only rank changes nothing, a gather or an all-to-all copies the input to the
    output; the methods take torch's argument lists (ProcessGroup's pybind trampoline and
    distributed_c10d call them by these names)."""

    def __init__(self, rank: int, size: int) -> None:
        if (rank, size) != (0, 1):
            raise ValueError(f"a single-rank process group is rank 0 of 1, not rank {rank} of {size}")
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stub knows only the store's form
        self._group_name = self._group_desc = ""

    def getBackendName(self) -> str:
        return BACKEND

    # torch names a group through its backends, and this one has none: it keeps its own name and
    # description (destroy_process_group unregisters a group by its name)
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def allreduce(  # type: ignore[override]  # the list form torch calls, not the stub's overloads
        self, tensors: list[Tensor], opts: Any = None
    ) -> dist.Work:
        _exact_reduction(opts)
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:
        _exact_reduction(opts)
        return _done(tensors)

    def broadcast(  # type: ignore[override]  # the list form torch calls, not the stub's overloads
        self, tensors: list[Tensor], opts: object = None
    ) -> dist.Work:
        return _done(tensors)

    def barrier(self, opts: object = None) -> dist.Work:
        return _done(None)

    def reduce(  # type: ignore[override]  # the list form torch calls, not the stub's overloads
        self, tensors: list[Tensor], opts: Any = None
    ) -> dist.Work:
        _exact_reduction(opts)
        return _done(tensors)

    def allgather(  # type: ignore[override]  # the list form torch calls, not the stub's overloads
        self, outputs: list[list[Tensor]], inputs: list[Tensor], opts: object = None
    ) -> dist.Work:
        return _copied([out[0] for out in outputs], inputs)

    def allgather_coalesced(
        self, outputs: list[list[Tensor]], inputs: list[Tensor], opts: object = None
    ) -> dist.Work:
        return _copied(outputs[0], inputs)  # outputs[rank][i] takes that rank's inputs[i]

    def all_gather_single(self, output: Tensor, tensor: Tensor, opts: object = None) -> dist.Work:
        return _copied([output], [tensor])

    def all_gather_single_coalesced(
        self, outputs: list[Tensor], inputs: list[Tensor], opts: object = None
    ) -> dist.Work:
        return _copied(outputs, inputs)

    def gather(  # type: ignore[override]  # the list form torch calls, not the stub's overloads
        self, outputs: list[list[Tensor]], inputs: list[Tensor], opts: object = None
    ) -> dist.Work:
        return _copied([out[0] for out in outputs], inputs)

    def scatter(  # type: ignore[override]  # the list form torch calls, not the stub's overloads
        self, outputs: list[Tensor], inputs: list[list[Tensor]], opts: object = None
    ) -> dist.Work:
        return _copied(outputs, [parts[0] for parts in inputs])

    def reduce_scatter(  # type: ignore[override]  # the list form torch calls, not the stub's overloads
        self, outputs: list[Tensor], inputs: list[list[Tensor]], opts: Any = None
    ) -> dist.Work:
        _exact_reduction(opts)
        return _copied(outputs, [parts[0] for parts in inputs])

    def reduce_scatter_single(self, output: Tensor, tensor: Tensor, opts: Any = None) -> dist.Work:
        _exact_reduction(opts)
        return _copied([output], [tensor])

    def reduce_scatter_single_coalesced(
        self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None
    ) -> dist.Work:
        _exact_reduction(opts)
        return _copied(outputs, inputs)

    def alltoall(self, outputs: list[Tensor], inputs: list[Tensor], opts: object = None) -> dist.Work:
        return _copied(outputs, inputs)

    def all_to_all_single(
        self,
        output: Tensor,
        tensor: Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: object = None,
    ) -> dist.Work:
        return _copied([output], [tensor])

    def send(self, tensors: list[Tensor], dst: int, tag: int = 0) -> dist.Work:
        raise RuntimeError(f"send to rank {dst}: a single-rank process group has no other process")

    def recv(self, tensors: list[Tensor], src: int, tag: int = 0) -> dist.Work:
        raise RuntimeError(f"recv from rank {src}: a single-rank process group has no other process")


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> SingleRankGroup:
    """torch.distributed's creator for the backend (the store and timeout serve no one in a group of one)."""
    return SingleRankGroup(rank, size)


def register() -> None:
    """Make BACKEND a torch.distributed backend in this process (registering again replaces it)."""
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


@contextlib.contextmanager
def groups_of_one_without_sockets() -> Iterator[None]:
    """While it is open, torch.distributed's world of one process and each new group of one process take
    the single-rank backend where gloo (or the default) was asked for; a group of more processes keeps
    what it asked for. vLLM calls both functions through the `torch.distributed` module, which is where
    they are replaced, and only for the time of its distributed start."""
    register()
    init, new = dist.init_process_group, dist.new_group

    def one_process_backend(
        function: Callable[..., Any], members: Callable[[dict[str, Any]], int]
    ) -> Callable[..., Any]:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            asked = bound.arguments.get("backend")
            if members(bound.arguments) == 1 and (asked is None or str(asked).lower() in ("gloo", BACKEND)):
                bound.arguments["backend"] = BACKEND
            return function(*bound.args, **bound.kwargs)

        return call

    def world(arguments: dict[str, Any]) -> int:
        return int(arguments.get("world_size", -1))  # -1: from the environment (torchrun), left alone

    def group(arguments: dict[str, Any]) -> int:
        ranks = arguments.get("ranks")
        return len(ranks) if ranks is not None else dist.get_world_size()

    replaced: dict[str, Callable[..., Any]] = {"init_process_group": init, "new_group": new}
    dist.init_process_group = one_process_backend(init, world)
    dist.new_group = one_process_backend(new, group)
    try:
        yield
    finally:
        for name, function in replaced.items():
            setattr(dist, name, function)
