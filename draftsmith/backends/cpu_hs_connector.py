"""vLLM's hidden-states KV connector, made to work when the KV cache lives in CPU memory.

vLLM 0.32's `ExampleHiddenStatesConnector` copies each finished request's hidden states out of the
KV cache into *pinned* host memory on a CUDA stream, then writes them from a thread pool. On a CPU
build there is no pinned-memory allocator and no CUDA stream, so the first finished request fails
(`pin_memory=True requires a CUDA or other accelerator backend`). When the cache is on the CPU the
copy is a plain gather, so this subclass does just that and hands the write to the same thread pool;
a completed marker stands in for the CUDA event the base class polls. With a GPU cache it defers to
the stock implementation.

vLLM imports this module by name inside its engine process (`kv_connector_module_path`); it must
not be imported by draftsmith itself, which keeps vLLM out of every other process.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for a finished CUDA event: the CPU gather completes before it is recorded."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)

        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        # Advanced indexing gathers into a new tensor: the blocks may be reused once this returns.
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}

        assert self._req_futures.get(pending.req_id) is None, f"duplicate request id {pending.req_id}"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:  # wait_for_save normally created it already
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
