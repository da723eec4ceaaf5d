"""The EAGLE-3 drafter, in one file.

Shapes: B batch, T tokens, H drafter hidden size, Ht target hidden size, A number of aux layers,
Vd draft vocabulary, nh / nkv attention / key-value heads, d head dim.

The module and parameter names are exactly those of vLLM's `LlamaForCausalLMEagle3` checkpoints
(vllm/model_executor/models/llama_eagle3.py; SpecForge's `to_sglang` writes the same), so a state dict
exports without renaming:

    fc.weight                     [H, A*Ht]   fuses the target's aux hidden states
    midlayer.input_layernorm      [H]         on the token embedding
    midlayer.hidden_norm          [H]         on the fused / recurrent hidden state
    midlayer.self_attn.{q,k,v}_proj           input 2H = [embed ; hidden]
    midlayer.self_attn.o_proj, post_attention_layernorm, mlp.{gate,up,down}_proj
    norm.weight, lm_head.weight [Vd, H], d2t [Vd] int64 offsets, t2d [V] bool

Data flow of one step (vLLM's layer with norm_before_residual=False):
    residual = hidden
    x = cat(input_layernorm(embed), hidden_norm(hidden))          [B, T, 2H]
    residual = residual + attn(x);  x = mlp(post_attention_layernorm(residual))
    prenorm  = x + residual  -> the recurrent hidden state fed to the next draft step
    logits   = lm_head(norm(prenorm))

Attention goes through a small "KV" object so that the same layer serves training-time test (TTT) and
cached inference: see `TTTKV` and `CacheKV`.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.core.config.settings import schema_default
from draftsmith.core.model.kinds import KINDS, LEGACY_KIND, drafter_param_count, kind, new_drafter
from draftsmith.core.model.target import TargetHead, text_config

log = logging.getLogger(__name__)

# Keys of the `train.drafter` config section: each None = derived from the target.
SHAPE_KEYS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rope",
)
# The drafter rotates its whole head by 1-D token positions, whatever the target's layers do.
TARGET_ONLY_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
LAYER_INITS = ("fan_in", "normal")
# What a drafter is (train.drafter.kind): one record each in core/model/kinds.py.
# Keys of the `train.drafter` section that are not the layer's shape.
KIND_KEYS = ("kind", "num_layers", "mask_token_id")
MLA_HEAD_DIM = 128  # published MLA-target drafters (Kimi-K2.5): Llama-style heads of 128


@dataclass
class DrafterConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int
    kind: str  # a key of core/model/kinds.KINDS (train.drafter.kind)
    num_aux: int = 3
    # transformers' rope_parameters without rope_theta: {"rope_type": "llama3", "factor": 8.0, ...};
    # None = plain RoPE
    rope_scaling: dict[str, Any] | None = None
    num_layers: int = 1
    mask_token_id: int | None = None  # the token of the mask slots (peagle, dflash)

    @property
    def fc_norm(self) -> bool:
        """EAGLE 3.1: an RMSNorm on each aux state before `fc`."""
        return kind(self.kind).norms

    @property
    def norm_output(self) -> bool:
        """EAGLE 3.1: the post-norm state is the recurrent one (vLLM's `norm_output`)."""
        return kind(self.kind).norms

    @property
    def parallel(self) -> bool:
        """All k drafts in one drafter pass (P-EAGLE, DFlash) rather than k chained ones."""
        return kind(self.kind).masked

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        draft_vocab_size: int,
        num_aux: int = 3,
        shape: dict[str, Any] | None = None,
    ) -> DrafterConfig:
        """Shape the drafter for a target: `derived_shape` per family, then any non-None value of
        `shape` (the `train.drafter` config section) wins."""
        text = text_config(target_config)
        shape = dict(shape or {})
        unknown = sorted(set(shape) - set(SHAPE_KEYS) - set(KIND_KEYS))
        if unknown:
            raise ValueError(f"train.drafter: unknown keys {unknown}; known: {list(SHAPE_KEYS + KIND_KEYS)}")
        name = shape.pop("kind", None) or schema_default("train.drafter.kind")
        kind_fields = kind_settings(
            name, shape.pop("num_layers", None), shape.pop("mask_token_id", None), text
        )
        dims = derived_shape(text)
        dims.update({k: v for k, v in shape.items() if v is not None})
        if dims["hidden_size"] != text.hidden_size:
            raise ValueError(
                f"train.drafter.hidden_size={dims['hidden_size']} must equal the target's hidden_size "
                f"{text.hidden_size}: the drafter reads the target's token embeddings"
            )
        if dims["num_attention_heads"] % dims["num_key_value_heads"]:
            raise ValueError(
                f"train.drafter: num_attention_heads={dims['num_attention_heads']} is not a multiple of "
                f"num_key_value_heads={dims['num_key_value_heads']}"
            )
        theta, scaling = split_rope(dims.pop("rope"))
        cfg = cls(
            **dims,
            rms_norm_eps=float(text.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(text.max_position_embeddings),
            target_hidden_size=text.hidden_size,
            target_vocab_size=text.vocab_size,
            draft_vocab_size=draft_vocab_size,
            num_aux=num_aux,
            **kind_fields,
        )
        rope_init(cfg)  # an unknown rope_type or a missing key fails here, before any training
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> DrafterConfig:
        """From `to_dict`'s output (an export's draftsmith block, a checkpoint); one written before kinds
        existed has no kind and is EAGLE-3."""
        return cls(**{"kind": LEGACY_KIND, **fields})

    def rope_parameters(self) -> dict[str, Any]:
        """transformers / vLLM `rope_parameters` of this drafter."""
        return {"rope_theta": self.rope_theta, "rope_type": "default", **(self.rope_scaling or {})}


def kind_settings(name: str, num_layers: int | None, mask_token_id: int | None, text: Any) -> dict[str, Any]:
    """The kind fields of a DrafterConfig from the `train.drafter` keys (None = derived): one layer; the
    mask token of parallel kinds is the target vocabulary's last id (rarely a real next token; only its
    frozen embedding row is read: the learnt part of a mask slot is `mask_hidden` / the layers)."""
    record = kind(name)
    layers = num_layers or 1
    if layers != 1 and not record.layers:
        stacked = [k.name for k in KINDS.values() if k.layers]
        raise ValueError(
            f"train.drafter.num_layers={layers}: {name} trains one layer here; more are for {stacked}"
        )
    mask = None
    if record.masked:
        mask = int(text.vocab_size) - 1 if mask_token_id is None else int(mask_token_id)
        if not 0 <= mask < int(text.vocab_size):
            raise ValueError(f"train.drafter.mask_token_id={mask} is outside the target vocabulary")
    return {"kind": name, "num_layers": layers, "mask_token_id": mask}


def is_mla(config: Any) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): low-rank compressed keys/values."""
    return (
        getattr(config, "kv_lora_rank", None) is not None or getattr(config, "q_lora_rank", None) is not None
    )


def derived_shape(text: Any) -> dict[str, Any]:
    """Default drafter shape for a target's text config -> {SHAPE_KEYS: value}.

    Llama/Qwen-like: one layer of the target (what EAGLE-3 and SpecForge do). MLA: a Llama-style layer
    (vLLM's Llama-style drafter cannot reproduce latent attention) with the target's head count, heads of
    128, as many kv heads as heads, and 2/3 of the target's dense MLP width — Kimi-K2.5: 64 x 128 heads,
    MLP 18432 -> 12288, the shape of its published drafter.
    """
    hidden = text.hidden_size
    rope = dict(getattr(text, "rope_parameters", None) or {})
    rope.setdefault("rope_theta", float(getattr(text, "rope_theta", 10000.0)))
    for key in TARGET_ONLY_ROPE_KEYS:
        rope.pop(key, None)
    if is_mla(text):
        heads = text.num_attention_heads
        return {
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "head_dim": MLA_HEAD_DIM,
            "intermediate_size": _round_up(2 * text.intermediate_size // 3, 64),
            "rope": rope,
        }
    heads = text.num_attention_heads
    return {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or hidden // heads,
        "intermediate_size": text.intermediate_size,
        "rope": rope,
    }


def _round_up(x: int, multiple: int) -> int:
    return max(multiple, -(-x // multiple) * multiple)


def split_rope(rope: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """transformers' rope_parameters (or a legacy rope_scaling + rope_theta) -> (rope_theta, the
    scaling part {"rope_type": ..., ...} or None for plain RoPE)."""
    rope = dict(rope)
    theta = float(rope.pop("rope_theta", None) or 10000.0)
    kind = rope.pop("rope_type", None) or rope.get("type") or "default"
    rope.pop("type", None)  # the pre-v4.45 spelling of rope_type
    return theta, ({"rope_type": kind, **rope} if kind != "default" or rope else None)


def describe(cfg: DrafterConfig) -> str:
    """One line: the drafter's shape as the `train.drafter` keys name it."""
    rope = cfg.rope_scaling["rope_type"] if cfg.rope_scaling else "default"
    return (
        f"{cfg.kind}, hidden_size {cfg.hidden_size}, {cfg.num_attention_heads} heads x head_dim {cfg.head_dim}, "
        f"{cfg.num_key_value_heads} kv heads, intermediate_size {cfg.intermediate_size}, "
        f"rope {rope} (theta {cfg.rope_theta:g}), draft vocab {cfg.draft_vocab_size}"
    )


def param_count(cfg: DrafterConfig) -> int:
    """Trainable + frozen parameters of Eagle3Drafter(cfg) (buffers d2t/t2d excluded)."""
    H, d = cfg.hidden_size, cfg.head_dim
    fc = cfg.num_aux * cfg.target_hidden_size * H
    attn = (
        2 * H * d * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + cfg.num_attention_heads * d * H
    )
    mlp = 3 * H * cfg.intermediate_size
    # EAGLE 3.1's fc_norm weights, or P-EAGLE's mask_hidden: one [A x Ht] vector either way
    kind_extra = cfg.num_aux * cfg.target_hidden_size if cfg.fc_norm or cfg.parallel else 0
    return fc + attn + mlp + 4 * H + cfg.draft_vocab_size * H + kind_extra


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 like HF/vLLM, then cast back.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_init(cfg: DrafterConfig) -> tuple[Tensor, float]:
    """-> (inv_freq [d/2] fp32, attention scaling of cos/sin), from transformers' own RoPE functions.

    Static, like vLLM's rotary caches: `dynamic` is evaluated at max_position_embeddings * factor
    (vLLM's DynamicNTKScalingRotaryEmbedding), `longrope` uses its long factors when
    max_position_embeddings exceeds the original context (vLLM's choice at engine start).
    """
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = cfg.rope_parameters()
    config = LlamaConfig(
        hidden_size=cfg.num_attention_heads * cfg.head_dim,
        num_attention_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=dict(params),
    )
    rope_type = params["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {rope_type!r} is not one of {['default', *ROPE_INIT_FUNCTIONS]}")
    seq_len = None
    if rope_type == "dynamic":
        seq_len = int(cfg.max_position_embeddings * params["factor"])
    elif rope_type == "longrope":
        seq_len = cfg.max_position_embeddings
    try:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)
    except KeyError as err:
        raise ValueError(f"rope_type {rope_type!r} needs the rope parameter {err}") from None
    return inv_freq.float(), float(scaling)


class Rotary:
    """cos/sin of the drafter's RoPE; inv_freq stays fp32 whatever dtype the model is cast to."""

    def __init__(self, cfg: DrafterConfig):
        self.inv_freq, self.scaling = rope_init(cfg)  # [d/2], float

    def __call__(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, d] (HF's rotate-half layout)."""
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)  # [B, T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, d]
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class KV(Protocol):
    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, nh, T, d], k/v [B, nkv, T, d] of the new tokens -> attention output [B, nh, T, d]."""
        ...


def _repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


class TTTKV:
    """Training-time test attention (EAGLE-3 reference `cnets.py`, SpecForge `cache_hidden`).

    Step 0 runs over the whole sequence with a causal mask. At step j > 0, position t stands for the
    j-th draft token after t: it sees the step-0 keys at positions <= t (the accepted prefix, computed
    from target features) and its own keys of steps 1..j at the same t (the earlier draft tokens), which
    is exactly what a cached drafter sees at inference. `prefix_lag=True` hides the step-0 keys at
    t-j+1..t from step j as SpecForge's trainer does (a training-only variant: see `ttt_attention`).

    With the forward's step count known (`steps`), the accepted view builds its mask once, for the last
    step, and gives each step a view of its first columns: autograd then keeps one mask for all steps
    (one per step otherwise: 7 steps at 8,192 tokens hold 7.2 GB of fp32 masks instead of 1.9 GB).
    """

    def __init__(self, prefix_lag: bool = False, steps: int | None = None) -> None:
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.prefix_lag, self.steps = prefix_lag, steps
        self.bias: Tensor | None = None  # [T, steps * T] additive: 0 where seen, -inf where masked

    def ensure_bias(self, T: int, dtype: torch.dtype, device: torch.device) -> None:
        """Build the accepted view's mask now (attend builds it at step 1 otherwise), in rows of
        `aligned_width` elements: CUDA's memory-efficient SDPA copies a mask whose row stride is not a
        multiple of 8 into a padded one on every call (steps x T is mostly not: +2.7 GB at 8K tokens and
        7 steps); a view of a wider allocation has the same values and an aligned stride."""
        if self.bias is None and not self.prefix_lag and self.steps is not None:
            full = ttt_mask(T, self.steps, 0, device)
            wide = torch.zeros(T, aligned_width(full.shape[1]), dtype=dtype, device=device)
            self.bias = wide[:, : full.shape[1]].masked_fill_(~full, float("-inf"))

    def with_past(self, keys: Sequence[Tensor], values: Sequence[Tensor]) -> TTTKV:
        """A new view holding these earlier steps' keys and values and this one's mask: a TTT step as a
        function of its inputs (activation checkpointing runs it again in the backward pass)."""
        view = TTTKV(self.prefix_lag, self.steps)
        view.keys, view.values, view.bias = list(keys), list(values), self.bias
        return view

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.keys.append(k)
        self.values.append(v)
        n, T = len(self.keys), q.shape[2]
        if self.prefix_lag or self.steps is None or n == 1:
            return ttt_attention(q, self.keys, self.values, n - 1 if self.prefix_lag else 0)
        self.ensure_bias(T, q.dtype, q.device)
        assert self.bias is not None  # ensure_bias built it
        return ttt_attention(q, self.keys, self.values, mask=self.bias[:, : n * T])


MASK_ALIGN = 8  # elements: torch's preprocess_mask (aten/src/ATen/native/transformers/attention.cpp)


def aligned_width(n: int, align: int | None = None) -> int:
    """`n` rounded up to a multiple of `align` (default MASK_ALIGN): the row stride of the TTT mask."""
    align = MASK_ALIGN if align is None else align
    return -(-n // align) * align


def ttt_prefix_mask(T: int, lag: int, device: torch.device | None = None) -> Tensor:
    """[T, T] bool: query t sees step-0 key s where s <= t - lag (lag 0: the causal mask)."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril(diagonal=-lag)


def ttt_mask(T: int, steps: int, lag: int = 0, device: torch.device | None = None) -> Tensor:
    """[T, steps * T] bool over the keys of `steps` TTT steps laid end to end (step 0 first): query t
    sees the step-0 keys of `ttt_prefix_mask(T, lag)` and, of every later step, only its own position."""
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([ttt_prefix_mask(T, lag, device), *[eye] * (steps - 1)], dim=1)


def ttt_attention(
    q: Tensor, keys: list[Tensor], values: list[Tensor], lag: int = 0, mask: Tensor | None = None
) -> Tensor:
    """q [B, nh, T, d]; keys/values: one [B, nkv, T, d] per TTT step so far (step 0 first); mask: the
    steps' `ttt_mask` (bool) or its additive form when the caller has it already.

    Query t attends to the step-0 keys at positions <= t - lag and to each later step's key at t, all in
    one softmax (see `ttt_attention_reference` for the same maths written out). The keys of all steps
    go end to end into one scaled_dot_product_attention under `ttt_mask`, so the fused kernels (flash
    on CPU, memory-efficient on CUDA) never hold the [B, nh, T, T] scores: the largest extra tensor is
    the mask, [T, steps * T] whatever the batch and head count. Step 0 alone is plain causal attention.
    """
    n_rep = q.shape[1] // keys[0].shape[1]
    k = torch.cat([_repeat_kv(k, n_rep) for k in keys], dim=2)  # [B, nh, steps * T, d]
    v = torch.cat([_repeat_kv(v, n_rep) for v in values], dim=2)
    if len(keys) == 1 and lag == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if mask is None:
        mask = ttt_mask(q.shape[2], len(keys), lag, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def ttt_attention_reference(q: Tensor, keys: list[Tensor], values: list[Tensor], lag: int = 0) -> Tensor:
    """`ttt_attention` with every score materialised (the implementation before the fused one; what the
    tests pin it to and bench/train.py measures it against).

    Scores: step 0 -> [B, nh, T, T] under `ttt_prefix_mask(T, lag)`; each later step -> the diagonal
    q·k at the same position [B, nh, T, 1]. One softmax over all of them, in fp32.
    """
    n_rep = q.shape[1] // keys[0].shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    T = q.shape[2]
    k0, v0 = _repeat_kv(keys[0], n_rep), _repeat_kv(values[0], n_rep)
    s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, T, T]
    s0 = s0.masked_fill(~ttt_prefix_mask(T, lag, q.device), float("-inf"))
    diag = [((q * _repeat_kv(k, n_rep)).sum(-1, keepdim=True) * scale) for k in keys[1:]]  # [B, nh, T, 1]
    probs = torch.softmax(torch.cat([s0, *diag], dim=-1).float(), dim=-1).to(q.dtype)
    out = probs[..., :T] @ v0
    for i, v in enumerate(values[1:]):
        out = out + probs[..., T + i : T + i + 1] * _repeat_kv(v, n_rep)
    return out


class CacheKV:
    """KV cache for inference: new tokens attend causally to everything cached before them."""

    def __init__(self) -> None:
        self.k: Tensor | None = None  # [B, nkv, S, d]
        self.v: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def crop(self, length: int) -> None:
        if self.k is not None and self.v is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        past = self.length
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        n_new, total = q.shape[2], self.k.shape[2]
        n_rep = q.shape[1] // k.shape[1]
        # new token i (absolute position past+i) may see keys 0..past+i
        mask = torch.ones(n_new, total, dtype=torch.bool, device=q.device).tril(diagonal=past)
        return F.scaled_dot_product_attention(
            q, _repeat_kv(self.k, n_rep), _repeat_kv(self.v, n_rep), attn_mask=mask
        )


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rotary = Rotary(cfg)
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, positions: Tensor, kv: KV) -> Tensor:
        B, T, _ = x.shape  # x: [B, T, 2H]
        q = self.q_proj(x).view(B, T, self.nh, self.d).transpose(1, 2)  # [B, nh, T, d]
        k = self.k_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)  # [B, nkv, T, d]
        v = self.v_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)
        cos, sin = self.rotary(positions, q.dtype)
        out = kv.attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds: Tensor, hidden: Tensor, positions: Tensor, kv: KV) -> Tensor:
        residual = hidden  # norm_before_residual=False: the residual is the un-normed hidden state
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        residual = residual + self.self_attn(x, positions, kv)
        return residual + self.mlp(self.post_attention_layernorm(residual))  # pre-final-norm state


class DraftHead(nn.Module):
    """What every drafter kind shares around its layers: the draw of its linear layers, an lm_head over the
    draft vocabulary with the target's ids (d2t / t2d buffers) and a final norm, both startable from the
    target's. The module sets `cfg`, `lm_head`, `norm` and calls `register_vocab_map` in its constructor."""

    cfg: DrafterConfig
    lm_head: nn.Linear
    norm: RMSNorm
    d2t: Tensor
    t2d: Tensor

    def register_vocab_map(self) -> None:
        # target_id = draft_id + d2t[draft_id]; t2d marks target ids that have a draft id
        self.register_buffer("d2t", torch.zeros(self.cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(self.cfg.target_vocab_size, dtype=torch.bool))

    def init_linears(self, layer_init: str) -> None:
        """Draw every linear layer's weights: "normal" N(0, 0.02) (the EAGLE reference); "fan_in" torch's
        default U(-1/sqrt(fan_in), 1/sqrt(fan_in)), which SpecForge's drafter keeps."""
        if layer_init not in LAYER_INITS:
            raise ValueError(f"layer_init={layer_init!r} must be one of {list(LAYER_INITS)}")
        for module in self.modules():
            if isinstance(module, nn.Linear):
                if layer_init == "normal":
                    nn.init.normal_(module.weight, std=0.02)
                else:
                    module.reset_parameters()

    def init_from_target(self, lm_head_weight: Tensor, final_norm_weight: Tensor) -> None:
        """Start lm_head and norm from the target's (EAGLE-3 reference and SpecForge do the same)."""
        draft_ids = self.draft_to_target(torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device))
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_weight[draft_ids])
            self.norm.weight.copy_(final_norm_weight)

    def set_vocab_map(self, d2t: Tensor, t2d: Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]


class Eagle3Drafter(DraftHead, nn.Module):
    """EAGLE-3 and the kinds that keep its layer: EAGLE 3.1 (`fc_norm`, post-norm recurrence) and P-EAGLE
    (`mask_hidden`: the learnt aux state of every mask slot, in the concatenated aux space vLLM reads)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        if kind(cfg.kind).load("model") is not Eagle3Drafter:
            raise ValueError(f"Eagle3Drafter cannot be a {cfg.kind!r} drafter")
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        if cfg.fc_norm:  # vLLM: fc_norm.{i}.weight [Ht], one per aux state, in aux-id order
            self.fc_norm = nn.ModuleList(
                RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux)
            )
        if cfg.parallel:  # P-EAGLE; vLLM: mask_hidden [1, A*Ht]; small draw so mask slots start distinct
            self.mask_hidden = nn.Parameter(torch.randn(1, cfg.num_aux * cfg.target_hidden_size) * 0.02)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_vocab_map()
        self.init_linears("normal")

    def fuse(self, aux: Tensor) -> Tensor:
        """aux [B, T, A*Ht] (aux layers concatenated in id order) -> [B, T, H]."""
        if self.cfg.fc_norm:
            chunks = aux.chunk(self.cfg.num_aux, dim=-1)  # A x [B, T, Ht]
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(aux)

    def fused_mask(self) -> Tensor:
        """P-EAGLE: the hidden state of every mask slot, fuse(mask_hidden) -> [1, 1, H] (vLLM computes it
        once at load)."""
        return self.fuse(self.mask_hidden[None])

    def recurrent(self, prenorm: Tensor) -> Tensor:
        """The state fed to the next draft step: the post-norm one for EAGLE 3.1, else the residual sum."""
        return self.norm(prenorm) if self.cfg.norm_output else prenorm

    def forward(self, embeds: Tensor, hidden: Tensor, positions: Tensor, kv: KV) -> tuple[Tensor, Tensor]:
        """embeds [B, T, H] of the *next* tokens, hidden [B, T, H] (fused aux or the previous step's
        output), positions [B, T] -> (draft logits [B, T, Vd], recurrent hidden [B, T, H])."""
        prenorm = self.midlayer(embeds, hidden, positions, kv)
        return self.lm_head(self.norm(prenorm)), self.recurrent(prenorm)


class DrafterInit(Protocol):
    """The settings a drafter's initial weights follow (train.TrainSettings has them)."""

    seed: int
    drafter: dict[str, Any]
    layer_init: str
    head_init: str


def build_drafter(
    target: TargetHead,
    d2t: Tensor,
    t2d: Tensor,
    num_aux: int,
    settings: DrafterInit,
    device: torch.device | str,
) -> tuple[DraftHead, Tensor, Tensor]:
    """-> (the drafter of the kind settings.drafter names at its initial weights, in train mode; the frozen
    target embedding [V, Ht]; the teacher weight [Vd, Ht] = the target's lm_head rows of the draft ids),
    on device.

    The initial weights are a function of settings.seed: every data-parallel rank builds the same
    drafter. settings.drafter shapes it; layer_init "normal" draws every linear N(0, 0.02), "fan_in" keeps
    torch's default U(+-1/sqrt(fan_in)); head_init "target" then copies lm_head rows and the final norm
    from the target, "random" keeps the drafter's own draw (SpecForge)."""
    cfg = DrafterConfig.from_target(target.config, d2t.numel(), num_aux, settings.drafter)
    log.info("drafter: %s, %.1f M parameters", describe(cfg), drafter_param_count(cfg) / 1e6)
    random.seed(settings.seed)
    torch.manual_seed(settings.seed)
    drafter = new_drafter(cfg)
    if settings.layer_init != "normal":  # the constructor's draw is "normal"
        drafter.init_linears(settings.layer_init)
    drafter.set_vocab_map(d2t, t2d)
    if settings.head_init == "target":
        drafter.init_from_target(target.lm_head, target.norm)
    drafter.to(device).train()
    embed = target.embed.to(device)  # frozen, not part of the drafter
    draft_ids = torch.arange(cfg.draft_vocab_size) + d2t  # target id of each draft id
    return drafter, embed, target.lm_head[draft_ids].to(device)
