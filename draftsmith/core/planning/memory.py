"""GPU memory each GPU stage will need, before any job runs: the model and the pre-flight plan.

Pure arithmetic over config values and the target's config.json (or its safetensors headers when the
weights are there); no torch, so the workflow can run it at parse time. `draftsmith plan` prints it;
rules/common.smk stops Snakemake with its one line when a stage cannot fit.

Per GPU stage:
  generate (vllm-server), extract (vllm), evaluate (vllm): the target's weights / tensor parallel, a
      reserve for vLLM's activations, CUDA graphs and NCCL buffers, and the KV cache of one sequence of
      the longest length the stage runs (vLLM refuses to start without it), within
      gpu_memory_utilization x the device's memory.
  evaluate (offline): the whole target on the first GPU, plus the drafter.
  train (per data-parallel rank): the drafter's fp32 weights, gradients and AdamW state, the frozen
      target tensors it reads, one pass's batch and the activations autograd keeps for the backward
      pass (`activation_bytes`, measured: bench/memory.py, tests/unit/planning/test_memory.py).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.core.config.config import STREAM_MODES
from draftsmith.core.data.context import sequence_tokens
from draftsmith.core.evaluation.cost import DEVICES
from draftsmith.core.evaluation.methods import METHODS
from draftsmith.core.io.devices import heads_error, server_arg

GB = 1e9  # what the tables print (the figures the issue and vendors quote)
GIB = 2**30

# What torch.cuda reports as total memory (GiB), per GPU model (draftsmith.core.evaluation.cost's device table);
# resources.gpu_memory_gib overrides.
GPU_PRESETS: dict[str, float] = {name: d.memory_gib for name, d in DEVICES.items() if d.memory_gib}
VLLM_RESERVE = 4 * GB  # vLLM's activation peak, CUDA graphs, NCCL buffers per GPU (beside weights + KV)
CUDA_CONTEXT = 1 * GB  # the CUDA context and kernels of a training process
ALLOCATOR_SLACK = 0.05  # fragmentation of torch's caching allocator, over the training figure
TRAIN_UTILIZATION = 0.95  # of the device a training process may plan for
DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "F32": 4,
    "BF16": 2,
    "F16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I8": 1,
    "U8": 1,
    "I32": 4,
    "I64": 8,
    "BOOL": 1,
}


# --------------------------------------------------------------------------------- the drafter's memory


@dataclass(frozen=True)
class DrafterShape:
    """What training memory depends on: drafter.DrafterConfig's dimensions."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    target_hidden_size: int
    num_aux: int = 3

    def params(self) -> int:
        """Trainable parameters (drafter.param_count, without importing torch)."""
        H, d = self.hidden_size, self.head_dim
        fc = self.num_aux * self.target_hidden_size * H
        attn = 2 * H * d * (self.num_attention_heads + 2 * self.num_key_value_heads)
        attn += self.num_attention_heads * d * H
        return fc + attn + 3 * H * self.intermediate_size + 4 * H + self.draft_vocab_size * H


@dataclass(frozen=True)
class Coefficients:
    """Bytes autograd keeps per token of a forward of `ttt_loss` (bf16 autocast, every position valid),
    as a function of the TTT step count s: per step, per hidden / attention / MLP / vocabulary unit, plus
    the keys of earlier steps every step's attention concatenates (s(s+1)/2), the shared mask (bytes per
    T^2 per step) and bf16 copies of the weights (copies per forward; per step when autocast was
    re-entered every step)."""

    hidden_per_step: float
    attn_per_step: float  # per num_attention_heads * head_dim
    attn_cat: float  # per num_attention_heads * head_dim * s(s+1)/2: the concatenated keys and values
    kv_per_step: float  # per num_key_value_heads * head_dim
    mlp_per_step: float  # per intermediate_size
    vocab_per_step: float  # per draft vocabulary entry ...
    p_per_step: float  # ... and copies of p (the teacher distribution) at p_bytes each
    hidden_once: float  # the fused aux states (fc)
    per_step: float  # index tensors
    mask_per_step: float  # per T^2 per step (the additive mask, [T, s*T] in the compute dtype)
    weight_copies_per_step: float  # bf16 copies (2 bytes/parameter) per TTT step ...
    weight_copies: float  # ... and per forward


# Measured on the CPU with bench/memory.py (36 random 1/64-scale shapes; least squares, then rounded to
# the tensors they are: e.g. the logits in bf16 = 2 bytes per vocabulary entry per step).
CURRENT = Coefficients(
    hidden_per_step=39.0,
    attn_per_step=5.0,
    attn_cat=4.0,
    kv_per_step=0.0,
    mlp_per_step=8.0,
    vocab_per_step=2.0,
    p_per_step=1.0,
    hidden_once=8.0,
    per_step=0.0,
    mask_per_step=2.0,
    weight_copies_per_step=0.0,
    weight_copies=0.5,  # fitted: not every weight's bf16 copy is kept
)
# With checkpoint_ttt: what the checkpoints keep (each step's input state, its keys and values, index
# tensors); the recomputation of one step in the backward pass comes on top (`activation_bytes`).
CHECKPOINTED = Coefficients(
    hidden_per_step=6.0,
    attn_per_step=0.0,
    attn_cat=0.0,
    kv_per_step=4.0,
    mlp_per_step=0.0,
    vocab_per_step=0.0,
    p_per_step=0.0,
    hidden_once=6.0,
    per_step=150.0,
    mask_per_step=2.0,
    weight_copies_per_step=0.0,
    weight_copies=0.0,
)
# Before issue 32 (autocast re-entered per step, fp32 p and log p), from the measurement at
# s = 7: 286 H + 142 heads*head_dim + 56 I + 56 Vd bytes per token + 14 T^2 + one copy per step.
BEFORE = Coefficients(
    hidden_per_step=286 / 7,
    attn_per_step=0.0,
    attn_cat=142 / 28,
    kv_per_step=0.0,
    mlp_per_step=8.0,
    vocab_per_step=8.0,  # fp32 p and log p
    p_per_step=0.0,
    hidden_once=0.0,
    per_step=0.0,
    mask_per_step=2.0,
    weight_copies_per_step=1.0,
    weight_copies=0.0,
)


def activation_bytes(
    shape: DrafterShape,
    tokens: int,
    seq_len: int,
    steps: int,
    checkpoint_ttt: bool,
    p_bytes: int = 2,
    coefficients: Coefficients | None = None,
) -> float:
    """Bytes kept for the backward pass of one forward over `tokens` tokens (padded) of samples up to
    `seq_len` long, `steps` TTT steps. p_bytes: the teacher distribution's bytes per entry (2 on CUDA
    under bf16, where it is kept in the teacher's dtype; 4 elsewhere). With checkpoint_ttt, the peak of
    the backward pass: what the checkpoints keep plus one step recomputed (the last, the largest)."""
    if checkpoint_ttt and coefficients is None:
        kept = _bytes(CHECKPOINTED, shape, tokens, seq_len, steps, p_bytes)
        last = _bytes(CURRENT, shape, tokens, seq_len, steps, p_bytes) - _bytes(
            CURRENT, shape, tokens, seq_len, steps - 1, p_bytes
        )
        return kept + last
    return _bytes(coefficients or CURRENT, shape, tokens, seq_len, steps, p_bytes)


def _bytes(
    c: Coefficients, shape: DrafterShape, tokens: int, seq_len: int, steps: int, p_bytes: int
) -> float:
    s = steps
    nhd = shape.num_attention_heads * shape.head_dim
    kvd = shape.num_key_value_heads * shape.head_dim
    per_token = (
        s * c.hidden_per_step * shape.hidden_size
        + s * c.attn_per_step * nhd
        + s * (s + 1) / 2 * c.attn_cat * nhd
        + s * c.kv_per_step * kvd
        + s * c.mlp_per_step * shape.intermediate_size
        + s * (c.vocab_per_step + c.p_per_step * p_bytes) * shape.draft_vocab_size
        + c.hidden_once * shape.hidden_size
        + s * c.per_step
    )
    mask = c.mask_per_step * s * seq_len**2 if s > 1 else 0.0
    copies = 2 * shape.params() * (c.weight_copies + c.weight_copies_per_step * s)
    return per_token * tokens + mask + copies


@dataclass(frozen=True)
class TrainPlan:
    """One training process's memory (bytes) by part; `total` is what the plan compares."""

    tokens_per_pass: int
    seq_len: int
    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def train_memory(
    shape: DrafterShape,
    target_vocab_size: int,
    *,
    batch_tokens: int,
    max_seq_len: int,
    world: int,
    ttt_steps: int,
    micro_batch_tokens: int,
    checkpoint_ttt: bool,
    lk_loss: str,
    cuda: bool = True,
    coefficients: Coefficients | None = None,
    share_tokens: int | None = None,
) -> TrainPlan:
    """Memory of one data-parallel rank of `world`. Its share of a batch: at most batch_tokens / world
    plus one sample (loader.rank_shares), all of it in one pass or passes of micro_batch_tokens (a
    longer sample is a pass of its own). share_tokens overrides the share (the plan before issue 32)."""
    if share_tokens is None:
        share_tokens = batch_tokens if world == 1 else -(-batch_tokens // world) + max_seq_len
    tokens = (
        share_tokens if micro_batch_tokens <= 0 else min(share_tokens, max(micro_batch_tokens, max_seq_len))
    )
    seq_len = min(max_seq_len, tokens)
    params = shape.params()
    Ht, A = shape.target_hidden_size, shape.num_aux
    parts = {
        "drafter weights, gradients, AdamW": 16.0 * params,
        "frozen target tensors": 4.0 * Ht * (target_vocab_size + shape.draft_vocab_size)
        + (4.0 * Ht * target_vocab_size if lk_loss != "none" else 0.0),
        # the pass's aux + final states as stored (bf16) and the fp32 copy of the aux states fc reads
        "batch": tokens * Ht * (2.0 * (A + 1) + 4.0 * A),
        "activations": activation_bytes(
            shape, tokens, seq_len, ttt_steps, checkpoint_ttt, 2 if cuda else 4, coefficients
        ),
    }
    subtotal = sum(parts.values())
    parts["CUDA context, allocator slack"] = CUDA_CONTEXT + ALLOCATOR_SLACK * subtotal
    return TrainPlan(tokens, seq_len, parts)


# ---------------------------------------------------------------------------------------- the target


@dataclass(frozen=True)
class TargetSize:
    """The target's weights (bytes, as loaded) and the KV cache bytes per token of all its layers."""

    weight_bytes: float
    source: str  # "safetensors headers" or "config.json"
    hidden_size: int
    vocab_size: int
    num_layers: int
    kv_heads: int  # 0 for latent attention (one latent per layer, replicated on every GPU)
    kv_bytes_per_head_token: float  # per layer and token: per kv head, or the latent's for MLA
    max_position_embeddings: int
    tied: bool
    dtype_bytes: float = 2.0  # of the config's dtype (what the weights would take unquantized per parameter)
    attention_heads: int = 0  # query heads (0: unknown, no constraint on the tensor-parallel size)
    expert_bytes: float = (
        0.0  # of weight_bytes, the routed experts' (split over the GPUs by expert parallelism)
    )

    @property
    def mla_moe(self) -> bool:
        """Latent attention (one KV latent per layer, replicated at any TP) and routed experts: the
        targets vLLM serves data-parallel in attention with expert parallelism (DeepSeek-V3, Kimi)."""
        return self.kv_heads == 0 and self.expert_bytes > 0

    def kv_bytes_per_token(self, tp: int) -> float:
        """KV cache bytes of one token on each of `tp` tensor-parallel GPUs (vLLM: kv heads split over
        the GPUs, at least one each; a latent is replicated)."""
        heads = max(1, self.kv_heads // tp) if self.kv_heads else 1
        return self.num_layers * heads * self.kv_bytes_per_head_token


def _int(cfg: dict[str, Any], *keys: str, default: int = 0) -> int:
    for key in keys:
        if cfg.get(key) is not None:
            return int(cfg[key])
    return default


def _expert_bytes_per_param(cfg: dict[str, Any], dtype_bytes: float) -> tuple[float, float]:
    """(bytes per routed-expert parameter, bytes per other linear parameter) from quantization_config:
    compressed-tensors int4/int8 groups (Kimi-K2.5: routed experts in int4, groups of 32 with bf16
    scales), fp8 (every linear layer, block scales), else the dtype."""
    q = cfg.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        return 1.0, 1.0
    for group in (q.get("config_groups") or {}).values():
        weights = (group or {}).get("weights") or {}
        bits = weights.get("num_bits")
        if bits:
            size = weights.get("group_size") or 128
            return bits / 8 + 2 / size, dtype_bytes
    return dtype_bytes, dtype_bytes


def target_size(
    config: dict[str, Any], folder: str | Path | None = None, dtype: str | None = None
) -> TargetSize:
    """The target's size from its config.json (a wrapper's text_config merged over the top level, as
    config.text_config_json gives it); with `folder` holding safetensors shards, the weights' bytes
    come from their headers instead (exact, quantized formats included; a multi-token-prediction layer
    past num_hidden_layers, which vLLM loads only for its own speculation, left out)."""
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
        if not config.get(k)
    ]
    if missing:
        raise ValueError(f"target config.json has no {', '.join(missing)}: no GPU memory plan")
    H = _int(config, "hidden_size")
    L = _int(config, "num_hidden_layers")
    V = _int(config, "vocab_size")
    nh = _int(config, "num_attention_heads")
    nkv = _int(config, "num_key_value_heads", default=nh)
    d = _int(config, "head_dim", default=H // nh if nh else 0)
    tied = bool(config.get("tie_word_embeddings", False))
    dtype_bytes = DTYPE_BYTES.get(
        str(dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16"), 2
    )
    mla = config.get("kv_lora_rank") is not None
    if mla:
        kv_heads, kv_unit = 0, (int(config["kv_lora_rank"]) + _int(config, "qk_rope_head_dim")) * 2.0
    else:
        kv_heads, kv_unit = nkv, 2 * d * 2.0  # keys and values, bf16 (vLLM's kv cache dtype "auto")
    weights = safetensors_bytes(folder, L) if folder is not None else None
    source = "safetensors headers"
    arithmetic, experts = _config_parts(config, dtype_bytes)
    if weights is None:
        weights, source = arithmetic, "config.json"
    experts *= weights / arithmetic if arithmetic else 0.0  # the experts' share of what is on disk
    return TargetSize(
        weight_bytes=weights,
        source=source,
        hidden_size=H,
        vocab_size=V,
        num_layers=L,
        kv_heads=kv_heads,
        kv_bytes_per_head_token=kv_unit,
        max_position_embeddings=_int(config, "max_position_embeddings", default=4096),
        tied=tied,
        dtype_bytes=dtype_bytes,
        attention_heads=nh,
        expert_bytes=experts,
    )


def _config_parts(cfg: dict[str, Any], dtype_bytes: float) -> tuple[float, float]:
    """(weight bytes, of them the routed experts') by arithmetic over config.json: attention (grouped-query
    or latent), dense and MoE MLPs (routed + shared experts, router), norms, embedding and head."""
    H, L, V = _int(cfg, "hidden_size"), _int(cfg, "num_hidden_layers"), _int(cfg, "vocab_size")
    nh = _int(cfg, "num_attention_heads")
    nkv = _int(cfg, "num_key_value_heads", default=nh)
    d = _int(cfg, "head_dim", default=H // nh if nh else 0)
    expert_b, linear_b = _expert_bytes_per_param(cfg, dtype_bytes)
    if cfg.get("kv_lora_rank") is not None:
        nope, rope, vd = _int(cfg, "qk_nope_head_dim"), _int(cfg, "qk_rope_head_dim"), _int(cfg, "v_head_dim")
        qr, kvr = _int(cfg, "q_lora_rank"), int(cfg["kv_lora_rank"])
        q = H * qr + qr * nh * (nope + rope) if qr else H * nh * (nope + rope)
        attn = q + H * (kvr + rope) + kvr * nh * (nope + vd) + nh * vd * H
    else:
        attn = H * d * (nh + 2 * nkv) + nh * d * H
    experts = _int(cfg, "n_routed_experts", "num_experts", "num_local_experts")
    moe_i = _int(cfg, "moe_intermediate_size", default=_int(cfg, "intermediate_size"))
    shared = _int(cfg, "n_shared_experts")
    shared_i = _int(cfg, "shared_expert_intermediate_size", default=shared * moe_i)
    dense = 3 * H * _int(cfg, "intermediate_size")
    linear = expert = 0.0
    for layer in range(L):
        linear += attn
        if experts and _is_moe_layer(cfg, layer):
            expert += experts * 3 * H * moe_i
            linear += 3 * H * shared_i + H * experts
        else:
            linear += dense
    norms = L * 2 * H + H
    embed = V * H * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return expert * expert_b + linear * linear_b + (norms + embed) * dtype_bytes, expert * expert_b


def _is_moe_layer(cfg: dict[str, Any], layer: int) -> bool:
    if layer < _int(cfg, "first_k_dense_replace"):
        return False
    if layer in (cfg.get("mlp_only_layers") or []):
        return False
    if "decoder_sparse_step" in cfg:  # Qwen-MoE
        return (layer + 1) % (_int(cfg, "decoder_sparse_step") or 1) == 0
    return layer % (_int(cfg, "moe_layer_freq", default=1) or 1) == 0  # DeepSeek-V3 / Kimi


_LAYER = re.compile(r"layers\.(\d+)\.")


def safetensors_bytes(folder: str | Path | None, num_layers: int) -> float | None:
    """Bytes of every tensor in the folder's *.safetensors (headers only: 8 bytes of length, then JSON),
    layers numbered num_layers or above (multi-token prediction) left out; None without shards."""
    if folder is None:
        return None
    files = sorted(Path(folder).glob("*.safetensors"))
    index = Path(folder) / "model.safetensors.index.json"
    if not files and index.is_file():
        # before the download: the index's total (multi-token-prediction layers included: an upper bound)
        total = (json.loads(index.read_text(encoding="utf-8")).get("metadata") or {}).get("total_size")
        return float(total) if total else None
    if not files:
        return None
    total = 0.0
    for path in files:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            m = _LAYER.search(name)
            if m and int(m.group(1)) >= num_layers:
                continue
            begin, end = info["data_offsets"]
            total += end - begin
    return total


# ------------------------------------------------------------------------------------------ the device


def detect_gpu_memory_gib() -> float | None:
    """The first GPU's memory as nvidia-smi reports it (MiB -> GiB); None without nvidia-smi (no torch:
    this runs at the workflow's parse time)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or not lines:
        return None
    try:
        return float(lines[0]) / 1024
    except ValueError:
        return None


def device_memory(resources: dict[str, Any], detect: bool = True) -> tuple[float | None, str]:
    """(bytes per GPU, how it was known): resources.gpu_memory_gib, else resources.gpu_model's preset,
    else nvidia-smi on this machine; (None, why) when none says."""
    gib = resources.get("gpu_memory_gib")
    if gib:
        return float(gib) * GIB, f"resources.gpu_memory_gib {gib:g}"
    model = resources.get("gpu_model")
    if model:
        return GPU_PRESETS[model] * GIB, f"resources.gpu_model {model}"
    found = detect_gpu_memory_gib() if detect else None
    if found:
        return found * GIB, f"nvidia-smi ({found:.1f} GiB)"
    return None, "unknown (set resources.gpu_model or resources.gpu_memory_gib)"


# -------------------------------------------------------------------------------------------- the plan


@dataclass
class StageNeed:
    """One GPU stage's need per GPU against its budget."""

    stage: str
    gpus: int
    parts: dict[str, float]
    budget: float | None  # bytes this stage may use per GPU (None: the device is unknown)
    setting: str  # what to change when it does not fit
    notes: list[str] = field(default_factory=list)
    engines: int = 1  # data-parallel copies, each on `gpus` GPUs (vLLM stages)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else self.total <= self.budget


def _vllm_need(
    stage: str,
    size: TargetSize,
    tp: int,
    seq_len: int,
    utilization: float,
    memory: float | None,
    setting: str,
    extra: dict[str, float] | None = None,
    state_bytes_per_token: float = 0.0,
    expert_parallel: int = 0,
) -> StageNeed:
    """state_bytes_per_token: vLLM's hidden-state cache during extraction (hidden_state_bytes_per_token),
    held beside the KV cache for every token of a sequence in flight. expert_parallel: the EP size (TP x
    DP) the routed experts are split over (0: none); the rest of the weights is split over TP only."""
    kv = size.kv_bytes_per_token(tp) * seq_len
    states = state_bytes_per_token * seq_len
    if expert_parallel:
        weights = {
            f"target weights but experts / TP {tp}": (size.weight_bytes - size.expert_bytes) / tp,
            f"routed experts / EP {expert_parallel}": size.expert_bytes / expert_parallel,
        }
    else:
        weights = {f"target weights / TP {tp}": size.weight_bytes / tp}
    parts = {
        **weights,
        "vLLM activations, CUDA graphs": VLLM_RESERVE,
        f"KV cache, one {seq_len:,}-token sequence": kv,
        **({f"hidden-state cache, one {seq_len:,}-token sequence": states} if states else {}),
        **(extra or {}),
    }
    budget = None if memory is None else utilization * memory
    need = StageNeed(stage, tp, parts, budget, setting)
    if budget is not None:
        room = budget - need.total + kv + states
        what = "KV + hidden-state room" if states else "KV room"
        need.notes.append(
            f"{what} {max(room, 0) / GB:.1f} GB = {max(room, 0) / max(kv + states, 1):.1f} such sequences"
        )
    return need


def hidden_state_bytes_per_token(size: TargetSize, captured_layers: int) -> float:
    """vLLM's hidden-state cache per token during extraction: the captured layers (aux + final) x hidden
    size x the dtype's bytes, on every GPU of the engine (the states are whole on each rank). Kimi-K2.5:
    4 x 7168 x 2 = 57 KB a token, +82% over its 70 KB of MLA KV; +25-67% on the GQA targets."""
    return captured_layers * size.hidden_size * size.dtype_bytes


def largest_head_split(size: TargetSize, gpus: int) -> int:
    """The most GPUs per engine, dividing `gpus`, that vLLM accepts for this target's heads (1 always is)."""
    return max(
        t
        for t in range(1, gpus + 1)
        if gpus % t == 0 and not heads_error(t, size.attention_heads, size.kv_heads)
    )


def engine_layout(
    size: TargetSize,
    gpus: int,
    seq_len: int,
    utilization: float,
    memory: float | None,
    tensor_parallel: int,
    in_flight: int = 1,
    state_bytes_per_token: float = 0.0,
    expert_parallel_ok: bool = False,
) -> tuple[int, int]:
    """(GPUs per vLLM engine, engines) for a job with `gpus` GPUs: data parallel over all of them.
    `tensor_parallel` > 0 is taken as given (it must divide `gpus`); 0 = the fewest GPUs, a power of two
    dividing `gpus`, whose budget holds the weights' share, vLLM's reserve and the KV cache of the
    engine's share of the `in_flight` requests at `seq_len` tokens each (a split that would leave each
    engine too little KV to batch its requests is no gain); all of them when the device's memory is
    unknown or nothing smaller fits (the plan then says whether that does). Only splits of the target's
    attention heads vLLM accepts are chosen (6 GPUs for 32 heads: 3 engines of 2 at most; heads_error);
    an explicit tensor_parallel that vLLM would refuse is workflow.startup.tensor_parallel_errors' to refuse at
    start. No GPUs: one CPU engine.
    expert_parallel_ok (a server: one DP group): for an MLA MoE target, one GPU per engine with the experts
    split over all of them (data-parallel attention, expert parallelism; uses_expert_parallel) where that
    holds more sequences than the tensor-parallel layout, whose every GPU keeps every sequence's latent."""
    if gpus <= 0:
        return 1, 1
    if tensor_parallel:
        if gpus % tensor_parallel:
            raise ValueError(
                f"tensor_parallel {tensor_parallel} does not divide the job's {gpus} GPUs into engines"
            )
        return tensor_parallel, gpus // tensor_parallel
    most = largest_head_split(size, gpus)  # "all of them", as far as the heads split
    if memory is None:
        return most, gpus // most
    chosen = _tensor_parallel_layout(
        size, gpus, most, seq_len, utilization, memory, in_flight, state_bytes_per_token
    )
    if expert_parallel_ok and size.mla_moe and gpus > 1:
        tp_seqs = sequences_held(size, *chosen, seq_len, utilization, memory)
        if sequences_held(size, 1, gpus, seq_len, utilization, memory) > tp_seqs:
            return 1, gpus
    return chosen


def uses_expert_parallel(size: TargetSize, tp: int, engines: int) -> bool:
    """Whether a layout of `engines` x `tp` GPUs runs data-parallel attention with expert parallelism
    (--enable-expert-parallel): an MLA MoE target over more than one engine."""
    return size.mla_moe and engines > 1


def sequences_held(
    size: TargetSize, tp: int, engines: int, seq_len: int, utilization: float, memory: float
) -> float:
    """Sequences of `seq_len` tokens the layout's KV cache holds in all (0 when it does not fit): per
    engine, the room left after weights and vLLM's reserve over one sequence's KV on each of its GPUs."""
    ep = tp * engines if uses_expert_parallel(size, tp, engines) else 0
    need = _vllm_need("", size, tp, seq_len, utilization, memory, "", expert_parallel=ep)
    kv = size.kv_bytes_per_token(tp) * seq_len
    if need.budget is None or not need.fits:
        return 0.0
    return engines * (need.budget - need.total + kv) / max(kv, 1)


def _tensor_parallel_layout(
    size: TargetSize,
    gpus: int,
    most: int,
    seq_len: int,
    utilization: float,
    memory: float,
    in_flight: int,
    state_bytes_per_token: float,
) -> tuple[int, int]:
    """engine_layout's tensor-parallel choice: the fewest GPUs (a power of two, a split of the heads vLLM
    accepts) that hold the weights and the engine's share of the requests; else `most`."""
    tp = 1
    while tp < most:
        share = math.ceil(in_flight / (gpus // tp))
        need = _vllm_need(
            "",
            size,
            tp,
            seq_len * share,
            utilization,
            memory,
            "",
            state_bytes_per_token=state_bytes_per_token,
        )
        if gpus % tp == 0 and not heads_error(tp, size.attention_heads, size.kv_heads) and need.fits:
            return tp, gpus // tp
        tp *= 2
    return most, gpus // most


def generate_layout(
    server_args: list[Any], resources: dict[str, Any], size: TargetSize, memory: float | None
) -> tuple[int, int]:
    """(GPUs per engine, engines) of the generation server, from generate.server_args and
    resources.generate: the plan prints it and the job starts it, so both call this. --tensor-parallel-size
    (or -tp) in server_args, else resources.generate.tensor_parallel, else engine_layout's choice for the
    requests in flight at --max-model-len (default: the target's context)."""
    given = server_arg(server_args, "--tensor-parallel-size") or server_arg(server_args, "-tp")
    seq = int(server_arg(server_args, "--max-model-len") or size.max_position_embeddings)
    util = float(server_arg(server_args, "--gpu-memory-utilization") or resources["gpu_memory_utilization"])
    tensor_parallel = int(given or resources["tensor_parallel"])
    in_flight = int(resources["concurrency"])
    return engine_layout(
        size,
        int(resources["gpus"]),
        seq,
        util,
        memory,
        tensor_parallel,
        in_flight=in_flight,
        expert_parallel_ok=True,  # one server: its engines are one DP group
    )


def extract_layout(
    extract: dict[str, Any], resources: dict[str, Any], size: TargetSize, memory: float | None
) -> tuple[int, int]:
    """(GPUs per engine, engines) of the extraction job, from the `extract` config section and
    `resources.extract`: the plan prints it and the job runs it, so both call this. The vllm back-end
    is data parallel over the job's GPUs (engine_layout); transformers is one in-process engine."""
    if extract["backend"] != "vllm":
        return 1, 1
    return engine_layout(
        size,
        int(resources["gpus"]),
        int(extract["max_seq_len"]),
        float(resources["gpu_memory_utilization"]),
        memory,
        int(resources["tensor_parallel"]),
        state_bytes_per_token=hidden_state_bytes_per_token(size, captured_layers(extract, size)),
    )


def captured_layers(extract: dict[str, Any], size: TargetSize) -> int:
    """Layers whose states extraction captures: the aux layers (default three) and the final state."""
    aux = extract.get("aux_layers")
    return (len(aux) if aux else 3) + 1


def generate_need(
    server_args: list[Any], resources: dict[str, Any], size: TargetSize, memory: float | None
) -> StageNeed:
    """The generation server's line of the plan (generate_layout's layout): the plan prints it and the
    job checks it again before the server loads the target."""
    util = float(server_arg(server_args, "--gpu-memory-utilization") or resources["gpu_memory_utilization"])
    seq = int(server_arg(server_args, "--max-model-len") or size.max_position_embeddings)
    tp, engines = generate_layout(server_args, resources, size, memory)
    ep = tp * engines if uses_expert_parallel(size, tp, engines) else 0
    need = _vllm_need(
        "generate",
        size,
        tp,
        seq,
        util,
        memory,
        f"resources.generate.{'gpus' if tp == resources['gpus'] else 'tensor_parallel'} "
        "(GPUs per engine) or --max-model-len in generate.server_args",
        expert_parallel=ep,
    )
    need.engines = engines
    if ep:
        need.notes.append(
            f"data-parallel attention with expert parallelism (--data-parallel-size {engines} "
            "--enable-expert-parallel): each GPU keeps its own sequences' latent KV, not every one's"
        )
    if memory is not None and size.mla_moe:
        need.notes.append(
            f"sequences held in all: {sequences_held(size, tp, engines, seq, util, memory):.0f}"
        )
    return need


def extract_need(
    extract: dict[str, Any], resources: dict[str, Any], size: TargetSize, memory: float | None
) -> StageNeed:
    """The vLLM extraction's line of the plan (extract_layout's layout): the plan prints it and the job
    checks it again before its engines load the target."""
    util = float(resources["gpu_memory_utilization"])
    tp, engines = extract_layout(extract, resources, size, memory)
    need = _vllm_need(
        "extract",
        size,
        tp,
        int(extract["max_seq_len"]),
        util,
        memory,
        f"resources.extract.{'gpus' if tp == resources['gpus'] else 'tensor_parallel'} "
        "(GPUs per engine) or extract.max_seq_len",
        state_bytes_per_token=hidden_state_bytes_per_token(size, captured_layers(extract, size)),
    )
    need.engines = engines
    head = size.vocab_size * size.hidden_size * 2.0
    if memory is not None and head > (1 - util) * memory:
        need.notes.append(
            f"the teacher check's lm_head ({head / GB:.1f} GB) does not fit beside vLLM on the first "
            "GPU: it runs on the CPU (lower resources.extract.gpu_memory_utilization to keep it there)"
        )
    return need


def train_need(
    train: dict[str, Any],
    resources: dict[str, Any],
    size: TargetSize,
    shape: DrafterShape,
    memory: float | None,
    *,
    coefficients: Coefficients | None = None,
    share_tokens: int | None = None,
) -> StageNeed:
    """The training line of the plan (one rank of resources.gpus): the plan prints it and the train job
    checks it again on its own GPUs before it loads the target's head or builds the drafter."""
    world = int(resources["gpus"])
    need = train_memory(
        shape,
        size.vocab_size,
        batch_tokens=int(train["batch_tokens"]),
        max_seq_len=int(train["max_seq_len"]),
        world=world,
        ttt_steps=int(train["ttt_steps"]),
        micro_batch_tokens=int(resources["micro_batch_tokens"]),
        checkpoint_ttt=bool(resources["checkpoint_ttt"]),
        lk_loss=str(train["lk_loss"]),
        coefficients=coefficients,
        share_tokens=share_tokens,
    )
    parts = dict(need.parts)
    parts[f"activations ({need.tokens_per_pass:,} tokens per pass)"] = parts.pop("activations")
    budget = None if memory is None else TRAIN_UTILIZATION * memory
    setting = "resources.train.micro_batch_tokens (smaller passes) or resources.train.checkpoint_ttt: true"
    return StageNeed("train", world, parts, budget, setting)


def stream_engine_share(trainer_bytes: float, memory: float) -> float:
    """train.hidden_states stream / hybrid, engine and trainer on one GPU: the engine's share of the device
    (vLLM's gpu_memory_utilization), what TRAIN_UTILIZATION of it leaves after the trainer's planned need."""
    return max(TRAIN_UTILIZATION - trainer_bytes / memory, 0.0)


def stream_train_needs(
    config: dict[str, Any],
    size: TargetSize,
    shape: DrafterShape,
    memory: float | None,
    *,
    coefficients: Coefficients | None = None,
    share_tokens: int | None = None,
) -> list[StageNeed]:
    """The train job's two lines when it captures the states itself (train.hidden_states stream / hybrid):
    its extraction engine and its trainer. resources.train.engine_gpus 0: every GPU of the job holds an
    engine of its own (one GPU, capturing that rank's samples) beside a trainer rank, the engine at the
    share the trainer leaves (stream_engine_share); N > 0: one engine tensor parallel over the first N GPUs
    (at resources.extract.gpu_memory_utilization, as the extract job runs it), the trainer on the rest."""
    res = config["resources"]["train"]
    gpus, engine_gpus = int(res["gpus"]), int(res["engine_gpus"])
    ext = config["extract"]
    seq = int(ext["max_seq_len"])
    states = hidden_state_bytes_per_token(size, captured_layers(ext, size))
    trainer = train_need(
        config["train"],
        {**res, "gpus": gpus - engine_gpus if engine_gpus else gpus},
        size,
        shape,
        memory,
        coefficients=coefficients,
        share_tokens=share_tokens,
    )
    if ext["backend"] != "vllm":  # transformers: the whole target in the train process, on its first GPU
        parts = {"target weights (transformers)": size.weight_bytes, "activations": VLLM_RESERVE}
        budget = None if memory is None else max(TRAIN_UTILIZATION * memory - trainer.total, 0.0)
        setting = "extract.backend vllm (an engine of its own GPUs: resources.train.engine_gpus)"
        trainer.stage = "train: trainer (beside the engine on the first GPU)"
        return [StageNeed("train: engine (transformers, first GPU)", 1, parts, budget, setting), trainer]
    if engine_gpus:
        util = float(config["resources"]["extract"]["gpu_memory_utilization"])
        setting = "resources.train.engine_gpus (the engine's GPUs) or extract.max_seq_len"
        engine = _vllm_need(
            "train: engine", size, engine_gpus, seq, util, memory, setting, state_bytes_per_token=states
        )
        trainer.stage = "train: trainer"
        return [engine, trainer]
    share = None if memory is None else stream_engine_share(trainer.total, memory)
    setting = (
        "resources.train.engine_gpus (the engine on GPUs of its own), resources.train.micro_batch_tokens "
        "or extract.max_seq_len"
    )
    engine = _vllm_need(
        "train: engine (each GPU)", size, 1, seq, share or 0.0, memory, setting, state_bytes_per_token=states
    )
    engine.gpus = gpus
    trainer.stage = "train: trainer (each GPU)"
    if memory is not None and share is not None:
        engine.notes.insert(
            0,
            f"vLLM's gpu_memory_utilization {share:.2f}: {TRAIN_UTILIZATION:.0%} of the device less the "
            f"trainer's {trainer.total / GB:.1f} GB",
        )
        trainer.budget = max(TRAIN_UTILIZATION * memory - engine.total, 0.0)
        trainer.notes.append(f"beside the engine's {engine.total / GB:.1f} GB on the same GPU")
    return [engine, trainer]


def evaluate_need(
    size: TargetSize, tp: int, seq_len: int, utilization: float, memory: float | None, drafter_bytes: float
) -> StageNeed:
    """The vLLM evaluation's line of the plan: the plan prints it for prompts up to extract.max_seq_len,
    the job checks it again at its prompts' own length before an engine loads."""
    return _vllm_need(
        "evaluate (vLLM)",
        size,
        tp,
        seq_len,
        utilization,
        memory,
        "resources.evaluate.gpus (tensor parallel)",
        {"drafter (bf16)": drafter_bytes},
    )


def plan(
    config: dict[str, Any],
    size: TargetSize,
    shape: DrafterShape | None,
    memory: float | None,
    *,
    coefficients: Coefficients | None = None,
    share_tokens: int | None = None,
) -> list[StageNeed]:
    """The need per GPU of every GPU stage of a validated config (schema defaults filled in): stages
    without GPUs are left out. `shape`: the drafter's (None: no train stage figure)."""
    res = config["resources"]
    needs: list[StageNeed] = []
    gen = config["generate"]
    if res["generate"]["gpus"] > 0 and gen["backend"] == "vllm-server":
        needs.append(generate_need(gen.get("server_args") or [], res["generate"], size, memory))
    ext = config["extract"]
    streamed = config["train"]["hidden_states"] in STREAM_MODES  # no extract job: the train job captures
    if res["extract"]["gpus"] > 0 and not streamed:
        if ext["backend"] == "vllm":
            needs.append(extract_need(ext, res["extract"], size, memory))
        else:
            parts = {"target weights (one GPU)": size.weight_bytes, "activations, CUDA context": VLLM_RESERVE}
            needs.append(StageNeed("extract", 1, parts, memory, "extract.backend vllm (tensor parallel)"))
    tr = config["train"]
    if res["train"]["gpus"] > 0 and shape is not None and streamed:
        needs += stream_train_needs(
            config, size, shape, memory, coefficients=coefficients, share_tokens=share_tokens
        )
    elif res["train"]["gpus"] > 0 and shape is not None:
        needs.append(
            train_need(
                tr, res["train"], size, shape, memory, coefficients=coefficients, share_tokens=share_tokens
            )
        )
    ev = config["evaluate"]
    if res["evaluate"]["gpus"] > 0:
        tp = res["evaluate"]["gpus"]
        drafter = 2.0 * shape.params() if shape is not None else 0.0
        if ev.get("vllm"):
            # as the evaluation sizes its engines (context.sequence_tokens), for prompts up to extract.max_seq_len
            seq = sequence_tokens(
                int(config["extract"]["max_seq_len"]), int(ev["max_new_tokens"]), int(ev["num_draft_tokens"])
            )
            util = float(res["evaluate"]["gpu_memory_utilization"])
            needs.append(evaluate_need(size, tp, seq, util, memory, drafter))
        if ev.get("offline"):
            parts = {  # draftsmith's decoder runs in float32
                "target weights, float32 (first GPU)": size.weight_bytes * 4 / size.dtype_bytes,
                "drafter (float32)": 2 * drafter,
                "activations, KV, CUDA context": VLLM_RESERVE,
            }
            needs.append(
                StageNeed("evaluate (offline)", 1, parts, memory, "evaluate.offline: false (vLLM measures)")
            )
    return needs


def refusal(needs: list[StageNeed], device: str) -> str | None:
    """One line naming the first stage that does not fit, its figure and what to change; None if all fit."""
    for need in needs:
        if need.fits is False and need.budget is not None:  # fits is False: the budget is known
            return (
                f"{need.stage} needs {need.total / GB:.1f} GB per GPU but has {need.budget / GB:.1f} GB "
                f"({device}): change {need.setting}, or use GPUs with more memory"
            )
    return None


def table(needs: list[StageNeed], device: str) -> str:
    """The plan as text: one line per stage (total, budget, verdict), its parts below."""
    lines = [f"GPU memory per GPU ({device}):"]
    for need in needs:
        verdict = {True: "fits", False: "DOES NOT FIT", None: "device unknown"}[need.fits]
        budget = f" of {need.budget / GB:.1f} GB" if need.budget is not None else ""
        layout = f"{need.engines} engines x {need.gpus} GPUs" if need.engines > 1 else f"x{need.gpus}"
        lines.append(f"  {need.stage} {layout}: {need.total / GB:.1f} GB{budget}: {verdict}")
        for name, value in need.parts.items():
            lines.append(f"      {value / GB:8.1f} GB  {name}")
        lines += [f"      {note}" for note in need.notes]
    return "\n".join(lines)


def drafter_shape(config: dict[str, Any], target: dict[str, Any], num_aux: int) -> DrafterShape:
    """The drafter's shape as drafter.derived_shape gives it for a target config.json (plain JSON) and
    train.drafter's explicit values, without transformers."""
    H = _int(target, "hidden_size")
    nh = _int(target, "num_attention_heads")
    if target.get("kv_lora_rank") is not None or target.get("q_lora_rank") is not None:
        dims = {
            "num_attention_heads": nh,
            "num_key_value_heads": nh,
            "head_dim": 128,  # drafter.MLA_HEAD_DIM
            "intermediate_size": max(64, math.ceil(2 * _int(target, "intermediate_size") // 3 / 64) * 64),
        }
    else:
        dims = {
            "num_attention_heads": nh,
            "num_key_value_heads": _int(target, "num_key_value_heads", default=nh),
            "head_dim": _int(target, "head_dim", default=H // nh if nh else 0),
            "intermediate_size": _int(target, "intermediate_size"),
        }
    given = config["train"].get("drafter") or {}
    dims.update({k: int(v) for k, v in given.items() if k in dims and v is not None})
    return DrafterShape(
        hidden_size=H,
        draft_vocab_size=int(config["vocab"]["size"]),
        target_hidden_size=H,
        num_aux=num_aux,
        **dims,
    )


def config_target(
    config: dict[str, Any], target_config: dict[str, Any] | None = None
) -> tuple[TargetSize, dict[str, Any]]:
    """(the target's size, its config.json) for a validated config: the config.json from the target's
    folder (or `target_config`), its safetensors headers when the weights are there. Raises ValueError
    naming a missing config.json."""
    from draftsmith.core.config.config import is_hub_target, target_folder, text_config_json
    from draftsmith.core.io.hub import plan_folder

    folder = Path(target_folder(config["target"]))
    if target_config is None:
        if not (folder / "config.json").is_file() and is_hub_target(config["target"]):
            # before the download: the Hub target's config.json and index (hub.plan_folder)
            folder = plan_folder(config["target"]["model"], config["target"].get("revision")) or folder
        if not (folder / "config.json").is_file():
            raise ValueError(f"target.model: no config.json in {folder} yet: no GPU memory plan")
        target_config = text_config_json(folder)
    size = target_size(target_config, folder if folder.is_dir() else None, config["target"].get("dtype"))
    return size, target_config


def plan_config(
    config: dict[str, Any],
    memory: float | None,
    target_config: dict[str, Any] | None = None,
    **kw: Any,
) -> list[StageNeed]:
    """`plan` for a validated config: the target's config.json from its folder (or `target_config`),
    its safetensors headers when the weights are there. Raises ValueError naming a missing config.json."""
    size, target_config = config_target(config, target_config)
    aux = config["extract"].get("aux_layers")
    shape = drafter_shape(config, target_config, len(aux) if aux else 3)
    return plan(config, size, shape, memory, **kw)


def uses_gpus(config: dict[str, Any]) -> bool:
    """Whether any stage asks for GPUs (resources.<stage>.gpus > 0)."""
    return any(
        isinstance(v, dict) and int(v.get("gpus") or 0) > 0 for v in config.get("resources", {}).values()
    )


def plan_files(
    config_files: list[str],
    target_config: str | None,
    gpu_model: str | None,
    gpu_memory_gib: float | None,
    hidden_states: Callable[[dict[str, Any]], str] | None = None,
) -> tuple[list[str], str | None]:
    """`draftsmith plan`: the lines to print for the config merged from `config_files` (as snakemake
    --configfile merges them), the target's config.json from the folder `target_config` when given, on
    the device `gpu_model` / `gpu_memory_gib` when given; and the refusal when a stage cannot fit. Raises
    ValueError for an invalid config or a target without config.json. `hidden_states`: the mode the
    workflow would run for the config (train.hidden_states auto resolved; default: as written)."""
    from draftsmith.core.config.config import (
        config_errors,
        merged_config_files,
        text_config_json,
        with_defaults,
    )

    config = with_defaults(merged_config_files(config_files))
    errors = config_errors(config)
    if errors:
        raise ValueError("invalid configuration: " + "; ".join(errors))
    if gpu_model:
        config["resources"]["gpu_model"] = gpu_model
    if gpu_memory_gib:
        config["resources"]["gpu_memory_gib"] = gpu_memory_gib
    memory, device = device_memory(config["resources"])
    if target_config:
        config["target"]["model"] = target_config
    given = text_config_json(target_config) if target_config else None
    if hidden_states is not None:
        config["train"]["hidden_states"] = hidden_states(config)
    needs = plan_config(config, memory, given)
    if not needs:
        return ["no stage asks for GPUs (resources.<stage>.gpus): nothing to plan"], None
    timing = runtime_line(config, config_target(config, given)[0])
    return [table(needs, device), *([timing] if timing else [])], refusal(needs, device)


# ------------------------------------------------------------------------------ the evaluation's time

# Loading a target into vLLM: the motivating run's 24.5 min for Kimi-K2.5's ~594 GB on one 8-GPU node, i.e.
# ~0.40 GB/s from the filesystem (what the node reads, whatever the GPU count).
LOAD_BYTES_PER_S = 0.40e9
# Per engine beside the weights: process start, torch.compile and CUDA-graph capture (vLLM's compile cache,
# kept between the job's engines, shortens the later ones; the first is counted for each).
ENGINE_START_S = 180.0
# One decode step of the evaluation's batch, with room (a large MoE at TP 8 steps in ~30-60 ms).
DECODE_STEP_S = 0.1


def evaluation_engines(config: dict[str, Any]) -> dict[str, int]:
    """vLLM engine loads of each evaluation job: the pre-flight (plain decoding and each free method) and
    the evaluation (each trained drafter; the pre-flight's runs are kept and reused, the untrained
    drafter never runs in vLLM), each with the re-measures of a shorter chosen k that may follow: per
    method at most one per held-out set and per shorter k."""
    ev = config["evaluate"]
    free = sum(bool(ev.get(m.measure)) for m in METHODS.values() if m.free and m.measure)
    k = int(ev["num_draft_tokens"])
    sets = max(1, len(ev.get("heldout_sets") or {}))
    again = min(sets, k - 1) if ev.get("remeasure_chosen_k") and ev.get("serving") else 0
    drafters = 1
    return {"preflight": 1 + free + free * again, "evaluate": drafters + (drafters + free) * again}


def evaluation_minutes(config: dict[str, Any], size: TargetSize) -> dict[str, float]:
    """Minutes of each evaluation job (evaluation_engines): loads x (weights / LOAD_BYTES_PER_S +
    ENGINE_START_S + max_new_tokens decode steps). Both jobs run under resources.evaluate.runtime."""
    per_engine = (
        size.weight_bytes / LOAD_BYTES_PER_S
        + ENGINE_START_S
        + int(config["evaluate"]["max_new_tokens"]) * DECODE_STEP_S
    )
    return {job: n * per_engine / 60 for job, n in evaluation_engines(config).items()}


def runtime_line(config: dict[str, Any], size: TargetSize) -> str | None:
    """The plan's line on the evaluation's time against resources.evaluate.runtime (None without GPUs)."""
    if int(config["resources"]["evaluate"]["gpus"]) <= 0 or not config["evaluate"].get("vllm"):
        return None
    minutes = evaluation_minutes(config, size)
    engines = evaluation_engines(config)
    need = max(minutes.values())
    runtime = float(config["resources"]["evaluate"]["runtime"])
    verdict = "covers it" if runtime >= need else "TOO SHORT: raise resources.evaluate.runtime"
    jobs = ", ".join(f"{job} {engines[job]} engine loads ~{minutes[job]:.0f} min" for job in minutes)
    return f"evaluation time (estimate): {jobs}; resources.evaluate.runtime {runtime:.0f} min {verdict}"
