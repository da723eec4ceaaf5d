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

import math
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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
    num_aux: int = 3

    @classmethod
    def from_target(cls, target_config: Any, draft_vocab_size: int, num_aux: int = 3) -> DrafterConfig:
        """Size the drafter like one layer of the target (what EAGLE-3 and SpecForge do)."""
        rope = getattr(target_config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"target uses rope_type={rope_type!r}; only the default RoPE is supported")
        theta = rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))
        heads = target_config.num_attention_heads
        return cls(
            hidden_size=target_config.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target_config, "num_key_value_heads", heads),
            head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
            intermediate_size=target_config.intermediate_size,
            rms_norm_eps=float(target_config.rms_norm_eps),
            rope_theta=float(theta),
            max_position_embeddings=int(target_config.max_position_embeddings),
            target_hidden_size=target_config.hidden_size,
            target_vocab_size=target_config.vocab_size,
            draft_vocab_size=draft_vocab_size,
            num_aux=num_aux,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """positions [B, T] -> cos, sin [B, 1, T, d] (HF's rotate-half layout)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq  # [B, T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


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
    is exactly what a cached drafter sees at inference.
    """

    def __init__(self) -> None:
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.keys.append(k)
        self.values.append(v)
        return ttt_attention(q, self.keys, self.values)


def ttt_attention(q: Tensor, keys: list[Tensor], values: list[Tensor]) -> Tensor:
    """q [B, nh, T, d]; keys/values: one [B, nkv, T, d] per TTT step so far (step 0 first).

    Scores: step 0 -> causal [B, nh, T, T]; each later step -> the diagonal q·k at the same position
    [B, nh, T, 1]. One softmax over all of them.
    """
    n_rep = q.shape[1] // keys[0].shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    T = q.shape[2]
    k0, v0 = _repeat_kv(keys[0], n_rep), _repeat_kv(values[0], n_rep)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, T, T]
    s0 = s0.masked_fill(~causal, float("-inf"))
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
        if self.k is not None:
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
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, positions: Tensor, kv: KV) -> Tensor:
        B, T, _ = x.shape  # x: [B, T, 2H]
        q = self.q_proj(x).view(B, T, self.nh, self.d).transpose(1, 2)  # [B, nh, T, d]
        k = self.k_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)  # [B, nkv, T, d]
        v = self.v_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, self.d, self.theta, q.dtype)
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


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # target_id = draft_id + d2t[draft_id]; t2d marks target ids that have a draft id
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.target_vocab_size, dtype=torch.bool))
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

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

    def fuse(self, aux: Tensor) -> Tensor:
        """aux [B, T, A*Ht] (aux layers concatenated in id order) -> [B, T, H]."""
        return self.fc(aux)

    def forward(self, embeds: Tensor, hidden: Tensor, positions: Tensor, kv: KV) -> tuple[Tensor, Tensor]:
        """embeds [B, T, H] of the *next* tokens, hidden [B, T, H] (fused aux or the previous step's
        output), positions [B, T] -> (draft logits [B, T, Vd], recurrent hidden [B, T, H])."""
        prenorm = self.midlayer(embeds, hidden, positions, kv)
        return self.lm_head(self.norm(prenorm)), prenorm
