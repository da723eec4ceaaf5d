"""The vLLM extraction back-end: prefill-only requests through vLLM's `extract_hidden_states` method.

vLLM 0.32 captures the residual stream at chosen layer ids during prefill (`speculative_config`
method `extract_hidden_states`) into a KV-cache group of its own; a KV connector copies each finished
request's states into one safetensors file (`hidden_states [T, n_ids, H]`, `token_ids [T]`). On a CPU
build the stock connector fails on pinned memory, hence `cpu_hs_connector.CpuHiddenStatesConnector`.

Layer ids: vLLM's id k is `hidden_states + residual` after decoder layer k-1, the input to layer k:
draftsmith's "input" convention, HF `hidden_states[k]`. The last id, L (the number of layers), is the
final residual stream *before* the final norm, whereas draftsmith stores what lm_head consumes; so
the target's final RMSNorm is applied here.

vLLM spawns its engine core as a child process: construct `VllmExtractor` only in a process whose
main module is guarded by `if __name__ == "__main__"` (the `draftsmith` command is); tests run
`draftsmith extract --backend vllm` in a subprocess.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

log = logging.getLogger(__name__)

CONNECTOR = "CpuHiddenStatesConnector"
CONNECTOR_MODULE = "draftsmith.backends.cpu_hs_connector"


def read_target_tensor(target: str | Path, name: str) -> Tensor:
    """One weight of an HF safetensors folder (single file or sharded with an index), without the model."""
    target = Path(target)
    index = target / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if name not in weight_map:
            raise KeyError(f"{index}: no tensor {name!r}")
        path = target / weight_map[name]
    else:
        path = target / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        if name not in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
            raise KeyError(f"{path}: no tensor {name!r}")
        return f.get_tensor(name)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama's RMSNorm exactly as transformers computes it: normalise in fp32, scale in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * xf.to(x.dtype)


def vllm_layer_ids(aux_layer_ids: list[int], num_layers: int) -> tuple[list[int], list[int]]:
    """(ids to ask vLLM for, slot of each requested aux id in its output).

    vLLM returns the states in ascending id order (it stores the ids as a sorted set), the final
    pre-norm state (id L) last; draftsmith keeps the configured aux order."""
    ids = sorted(set(aux_layer_ids)) + [num_layers]
    return ids, [ids.index(k) for k in aux_layer_ids]


def teacher_device(gpus: int, cuda_available: bool) -> str:
    """Where the teacher-agreement check multiplies by lm_head: the job's first GPU when it has GPUs,
    else the CPU. Kimi-K2.5's 163,840 x 7,168 head over a shard of the motivating run (~1 M checked
    positions) is 2 x 1e6 x 7168 x 163840 = 2.3e15 FLOP: seconds on a GPU, tens of minutes on CPU cores
    while the job's GPUs wait."""
    return "cuda" if gpus > 0 and cuda_available else "cpu"


def teacher_head(lm_head: Tensor, gpus: int) -> Tensor:
    """lm_head on teacher_device; on the CPU, with a warning, when the GPU has no room left beside vLLM."""
    device = teacher_device(gpus, torch.cuda.is_available())
    if device == "cpu":
        return lm_head
    try:
        return lm_head.to(device)
    except torch.OutOfMemoryError:
        log.warning(
            "teacher check on the CPU: no room for lm_head (%.1f GB) on the GPU beside vLLM; lower "
            "resources.extract.gpu_memory_utilization to keep it on the GPU",
            lm_head.numel() * lm_head.element_size() / 1e9,
        )
        return lm_head


class VllmExtractor:
    """Hidden states of token-id sequences through an offline vLLM `LLM`, tensor parallel over the
    job's GPUs; the same (aux, final) per sequence as the transformers back-end."""

    name = "vllm"
    compiled = False  # vLLM compiles (or not, enforce_eager) by itself

    def __init__(
        self,
        target: str,
        aux_layer_ids: list[int],
        dtype: str = "bfloat16",
        tensor_parallel_size: int = 1,
        max_model_len: int = 2048,
        storage_dir: str | Path | None = None,
        enforce_eager: bool = True,
        gpu_memory_utilization: float | None = None,
    ):
        from vllm import LLM

        from draftsmith.backends.common import (
            THREAD_CAPS,
            attention_backend_for,
            one_process_worker,
            vllm_start,
        )
        from draftsmith.core.model.target import read_head_tensors, text_config_dict, trust_remote_code

        config = text_config_dict(target)  # a wrapper's (Kimi-K2.5) text model settings
        self.num_layers = config["num_hidden_layers"]
        self.aux_layer_ids = list(aux_layer_ids)
        self._ids, self._aux_slots = vllm_layer_ids(self.aux_layer_ids, self.num_layers)
        head = read_head_tensors(target, ("norm", "lm_head"), bool(config.get("tie_word_embeddings")))
        self.norm_weight = head["norm"]
        self.norm_eps = float(config.get("rms_norm_eps", 1e-6))
        lm_head = head["lm_head"].to(getattr(torch, dtype))
        # Per-request files land here and are deleted as soon as they are read.
        self._storage = Path(tempfile.mkdtemp(prefix=".vllm-states-", dir=storage_dir))
        # vLLM's engine core is a child of this process and reads its thread settings from the environment
        for key in THREAD_CAPS:  # see backends.vllm_child_env
            os.environ.pop(key, None)
        backend = attention_backend_for(str(target), dtype)
        start = time.perf_counter()
        with vllm_start(f"vllm extraction of {target}"):
            self.llm = LLM(
                model=str(target),
                dtype=dtype,
                tensor_parallel_size=tensor_parallel_size,
                max_model_len=max_model_len,
                enforce_eager=enforce_eager,
                **({"gpu_memory_utilization": gpu_memory_utilization} if gpu_memory_utilization else {}),
                trust_remote_code=trust_remote_code(),
                # A cached prefix would skip the very forward pass whose states we want.
                enable_prefix_caching=False,
                speculative_config={
                    "method": "extract_hidden_states",
                    "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self._ids}},
                },
                kv_transfer_config={
                    "kv_connector": CONNECTOR,
                    "kv_connector_module_path": CONNECTOR_MODULE,
                    "kv_role": "kv_producer",
                    "kv_connector_extra_config": {"shared_storage_path": str(self._storage)},
                },
                **({"attention_backend": backend} if backend else {}),
                **({"worker_cls": worker} if (worker := one_process_worker(tensor_parallel_size)) else {}),
            )
        self.load_seconds = time.perf_counter() - start
        # After vLLM has started: its workers own the GPUs' memory split; the head takes what is left.
        self.lm_head_weight = teacher_head(lm_head, tensor_parallel_size)

    def capture(self, sequences: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
        """Per sequence: (aux [T, A, H], final [T, H] after the final norm), in the back-end's dtype."""
        return self.collect(sequences, self.forward(sequences))

    def forward(self, sequences: list[Tensor]) -> list[Any]:
        """The prefill of a capture (vLLM's outputs, naming one states file per request); `collect` reads
        the files back and norms the final state on the CPU, which extraction does in a worker thread
        while the next prefill runs."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        prompts = [{"prompt_token_ids": [int(t) for t in seq]} for seq in sequences]
        return self.llm.generate(prompts, params, use_tqdm=False)

    def collect(self, sequences: list[Tensor], outputs: list[Any]) -> list[tuple[Tensor, Tensor]]:
        """`forward`'s requests as capture returns them; their files are deleted once read."""
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        results = []
        for seq, out in zip(sequences, outputs, strict=True):
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if not path:
                raise RuntimeError(f"vLLM returned no hidden-states file for request {out.request_id}")
            data = load_hidden_states(path)  # waits on the writer's file lock
            cleanup_hidden_states(path)
            states, token_ids = data["hidden_states"], data["token_ids"]
            if not torch.equal(token_ids.long(), seq.long()):
                raise RuntimeError(f"{path}: token ids differ from the request's (a mixed-up file)")
            expected = (seq.numel(), len(self._ids))
            if tuple(states.shape[:2]) != expected:
                raise RuntimeError(f"{path}: states of shape {tuple(states.shape)}, expected {expected} x H")
            final = rms_norm(states[:, -1], self.norm_weight, self.norm_eps)
            results.append((states[:, self._aux_slots], final))
        return results

    def close(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if shutdown:
            shutdown()
        del self.llm
        shutil.rmtree(self._storage, ignore_errors=True)
