"""The DFlash drafter: its training mask against the rule written out, the one-forward training loss
against a per-anchor recomputation, the proposer against a brute-force block written with explicit
scores, causal truncation (the first k drafts of a K-block are a k-block's), and the vLLM export's
config and tensor names."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from helpers.training import objective
from safetensors.torch import load_file

from draftsmith.core.data.loader import Batch
from draftsmith.core.data.vocab import vocab_maps
from draftsmith.core.evaluation.engines import speculative_config
from draftsmith.core.export.formats.vllm_dflash import load_dflash, save_dflash
from draftsmith.core.model.dflash import (
    DFlashDrafter,
    DFlashProposer,
    dflash_anchor_mask,
    dflash_block_mask,
    dflash_param_count,
    dflash_train_mask,
)
from draftsmith.core.model.drafter import DrafterConfig, apply_rope
from draftsmith.core.training.objective import DraftingLoss, ttt_step_targets
from draftsmith.core.training.objective_dflash import dflash_block_inputs, dflash_loss

V, VD, HT, A, MASK_ID = 64, 40, 24, 3, 7


def config(num_layers: int = 1, **over) -> DrafterConfig:
    base = dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256, target_hidden_size=HT,
        target_vocab_size=V, draft_vocab_size=VD, num_aux=A, kind="dflash", num_layers=num_layers,
        mask_token_id=MASK_ID,
    )  # fmt: skip
    return DrafterConfig(**{**base, **over})


def drafter(num_layers: int = 1, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(config(num_layers))
    ids = torch.sort(torch.randperm(V)[:VD]).values
    model.set_vocab_map(*vocab_maps(ids, V))
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1, weights larger: differences show
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def embedding(seed: int = 1) -> torch.nn.Embedding:
    torch.manual_seed(seed)
    return torch.nn.Embedding(V, 32)


def tiny_batch(seed: int = 2, lengths: tuple[int, ...] = (12, 9)) -> Batch:
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    aux, final = torch.randn(B, T, A * HT, generator=g), torch.randn(B, T, HT, generator=g)
    for b, n in enumerate(lengths):
        ids[b, n:] = 0
        aux[b, n:] = 0
        final[b, n:] = 0
        mask[b, 2:n] = True
    return Batch(ids, mask, torch.tensor(lengths), aux, final)


# ----------------------------------------------------------------------------- masks


def test_train_mask_is_the_rule_written_out() -> None:
    T, K = 5, 3
    expected = torch.zeros((K + 1) * T, (K + 2) * T, dtype=torch.bool)
    for i in range(K + 1):
        for t in range(T):
            for s in range(T):  # context keys: the anchor's prefix, itself included
                expected[i * T + t, s] = s <= t
            for j in range(K + 1):  # block keys: the same anchor's slots up to this one
                for u in range(T):
                    expected[i * T + t, T + j * T + u] = u == t and j <= i
    assert torch.equal(dflash_train_mask(T, K), expected)


def test_block_mask_sees_all_context_and_earlier_slots() -> None:
    mask = dflash_block_mask(4, 3)
    assert mask[:, :4].all()
    assert torch.equal(mask[:, 4:], torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))


def test_block_inputs_are_slot_major() -> None:
    ids = torch.arange(10, 15)[None]  # T = 5
    block, positions = dflash_block_inputs(ids, MASK_ID, 2, torch.arange(5))
    assert block.tolist() == [[11, 12, 13, 14, 14] + [MASK_ID] * 10]
    assert positions.tolist() == [[1, 2, 3, 4, 5, 2, 3, 4, 5, 6, 3, 4, 5, 6, 7]]
    block, positions = dflash_block_inputs(ids, MASK_ID, 2, torch.tensor([1, 3]))
    assert block.tolist() == [[12, 14] + [MASK_ID] * 4]
    assert positions.tolist() == [[2, 4, 3, 5, 4, 6]]


def test_anchor_mask_is_the_rule_for_some_anchors() -> None:
    T, K, anchors = 6, 2, [1, 2, 4]
    Na = len(anchors)
    expected = torch.zeros((K + 1) * Na, T + (K + 1) * Na, dtype=torch.bool)
    for i in range(K + 1):
        for a, t in enumerate(anchors):
            for s in range(T):
                expected[i * Na + a, s] = s <= t
            for j in range(K + 1):
                for b in range(Na):
                    expected[i * Na + a, T + j * Na + b] = a == b and j <= i
    assert torch.equal(dflash_anchor_mask(torch.tensor(anchors), T, K), expected)


# ----------------------------------------------------------------------------- the model


def test_param_count_and_names() -> None:
    model = DFlashDrafter(config(2))
    assert dflash_param_count(model.cfg) == sum(p.numel() for p in model.parameters())
    names = set(model.state_dict())
    assert "layers.1.self_attn.k_norm.weight" in names and "embed_tokens.weight" not in names
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="kind"):
        DFlashDrafter(config(kind="eagle3"))
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashDrafter(config(mask_token_id=None))
    with pytest.raises(ValueError, match="num_layers"):
        DFlashDrafter(config(num_layers=0))


def per_anchor(
    model: DFlashDrafter, embed: torch.Tensor, aux: torch.Tensor, ids: torch.Tensor, t: int, K: int
):
    """The block anchored after t computed alone: context of positions 0..t only, its K+1 slots."""
    context = model.context(aux[:, : t + 1], torch.arange(t + 1)[None])
    block = torch.tensor([[int(ids[0, min(t + 1, ids.shape[1] - 1)])] + [MASK_ID] * K])
    positions = torch.arange(t + 1, t + 2 + K)[None]
    return model(embed[block], positions, context, dflash_block_mask(t + 1, K + 1))[0]  # [K+1, H]


@pytest.mark.parametrize("num_layers", [1, 2])
def test_training_forward_equals_each_block_alone(num_layers: int) -> None:
    model, embed = drafter(num_layers), embedding().weight.detach()
    batch = tiny_batch(lengths=(10,))
    K, T = 3, 10
    ids, positions = dflash_block_inputs(batch.input_ids, MASK_ID, K, torch.arange(T))
    with torch.no_grad():
        context = model.context(batch.aux, torch.arange(T)[None])
        h = model(embed[ids], positions, context, dflash_train_mask(T, K))
        for t in (0, 4, 8):
            alone = per_anchor(model, embed, batch.aux, batch.input_ids, t, K)
            slots = torch.stack([h[0, i * T + t] for i in range(K + 1)])
            torch.testing.assert_close(slots, alone, rtol=1e-5, atol=1e-5)


def test_loss_is_finite_and_learns() -> None:
    torch.manual_seed(0)
    model = drafter().train()
    embed, teacher = embedding().weight.detach(), torch.randn(VD, HT)
    batch, obj = tiny_batch(), objective(steps=3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        loss, stats = dflash_loss(model, embed, teacher, batch, obj)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    # the stats count what ttt_loss counts: valid positions per draft position, from the same targets
    assert stats.count == obj.step_counts(batch)
    assert stats.tokens == int(batch.lengths.sum())
    assert stats.loss(obj.step_weights) == pytest.approx(losses[-1], rel=1e-4, abs=1e-3)


def test_loss_equals_each_block_scored_alone() -> None:
    """dflash_loss (blocks of the trained anchors only, in one forward) against its definition: each
    trained (sample, anchor, slot) recomputed alone and scored with the soft cross-entropy."""
    model, embed, teacher = drafter(num_layers=2), embedding().weight.detach(), torch.randn(VD, HT)
    batch, obj, K = tiny_batch(lengths=(12, 9)), objective(steps=3), 3
    with torch.no_grad():
        loss, stats = dflash_loss(model, embed, teacher, batch, obj)
        total, sums = 0.0, [0.0] * K
        for j in range(K):
            valid, _, _ = ttt_step_targets(batch.loss_mask, batch.lengths, j, obj.mask_offset)
            for b, t in valid.nonzero().tolist():
                h = per_anchor(model, embed, batch.aux[b : b + 1], batch.input_ids[b : b + 1], t, K)[j + 1]
                p = torch.softmax(batch.final[b, t + 1 + j] @ teacher.T, -1)
                ce = float(-(p * torch.log_softmax(model.lm_head(h), -1)).sum())
                sums[j] += ce
                total += obj.step_weights[j] * ce / int(valid.sum())
    assert float(loss) == pytest.approx(total, rel=1e-5)
    assert stats.loss_sum == pytest.approx(sums, rel=1e-5)


def test_loss_refuses_the_lk_losses() -> None:
    with pytest.raises(ValueError, match="not for dflash"):
        dflash_loss(
            drafter(), embedding().weight, torch.randn(VD, HT), tiny_batch(), objective(lk_loss="alpha")
        )


def test_drafting_loss_without_a_batch_is_zero() -> None:
    module = DraftingLoss(drafter(), embedding().weight.detach(), torch.randn(VD, HT), loss=dflash_loss)
    loss, stats = module(None, objective(steps=3))
    assert float(loss) == 0.0 and stats.count == [0, 0, 0]
    loss, stats = module(tiny_batch(), objective(steps=3))
    assert loss.requires_grad and stats.count[0] > 0


# ----------------------------------------------------------------------------- the proposer


def brute_force_logits(model: DFlashDrafter, embed: torch.Tensor, aux: torch.Tensor, bonus: int, k: int):
    """Draft logits [k, Vd] of the block after the last of aux's positions, with every score written out: per
    layer the context keys of all positions, the block's keys, one explicit softmax per slot."""
    cfg, n = model.cfg, aux.shape[1]
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    c = model.hidden_norm(model.fc(aux[0]))  # [n, H]
    x = embed[torch.tensor([bonus] + [MASK_ID] * k)]  # [k+1, H]
    ctx_pos, blk_pos = torch.arange(n), torch.arange(n, n + k + 1)

    def rope(v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # v [N, heads, d]
        cos, sin = model.rotary(pos[None], v.dtype)
        return apply_rope(v.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)

    for layer in model.layers:
        attn = layer.self_attn
        y = layer.input_layernorm(x)
        q = rope(attn.q_norm(attn.q_proj(y).view(-1, nh, d)), blk_pos)
        keys = torch.cat([rope(attn.k_norm(attn.k_proj(c).view(-1, nkv, d)), ctx_pos),
                          rope(attn.k_norm(attn.k_proj(y).view(-1, nkv, d)), blk_pos)])  # fmt: skip
        values = torch.cat([attn.v_proj(c).view(-1, nkv, d), attn.v_proj(y).view(-1, nkv, d)])
        out = torch.zeros(k + 1, nh, d)
        for i in range(k + 1):
            for head in range(nh):
                g = head // (nh // nkv)
                seen = n + i + 1  # every context key and the slots 0..i
                scores = keys[:seen, g] @ q[i, head] / math.sqrt(d)
                out[i, head] = torch.softmax(scores, 0) @ values[:seen, g]
        x = x + attn.o_proj(out.reshape(k + 1, nh * d))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.norm(x))[1:]


@pytest.mark.parametrize("num_layers", [1, 2])
def test_proposer_equals_brute_force_and_truncates(num_layers: int) -> None:
    model, embed = drafter(num_layers, seed=3), embedding()
    g = torch.Generator().manual_seed(4)
    aux = torch.randn(1, 9, A, HT, generator=g)
    ids = torch.randint(0, V, (1, 10), generator=g)
    proposer = DFlashProposer(model, embed)
    proposer.reset(ids[0, :1].tolist())
    with torch.no_grad():
        # two catch-ups, as after a prefill and a verify step: positions 0..5, then 6..8
        proposer.catch_up(aux[:, :6], ids[:, 1:7], torch.arange(6)[None])
        proposer.catch_up(aux[:, 6:], ids[:, 7:10], torch.arange(6, 9)[None])
        drafts = proposer.propose(4)
        expected = brute_force_logits(model, embed.weight, aux.flatten(-2), int(ids[0, 9]), 4)
        torch.testing.assert_close(proposer.block_logits(4), expected, rtol=1e-5, atol=1e-5)
        assert drafts == model.draft_to_target(expected.argmax(-1)).tolist()
        # causal blocks: the first k drafts of a 4-block are the k-block's
        for k in (1, 2, 3):
            assert proposer.propose(k) == drafts[:k]
        full = proposer.block_logits(4)
        for k in (1, 2, 3):
            torch.testing.assert_close(proposer.block_logits(k), full[:k], rtol=1e-5, atol=1e-5)
    assert proposer.length == 9  # the block's keys are not kept
    with pytest.raises(RuntimeError, match="catch-up starts"):
        proposer.catch_up(aux[:, :1], ids[:, 1:2], torch.tensor([[3]]))


def test_proposer_samples_drafts_with_their_distributions() -> None:
    model, embed = drafter(), embedding()
    proposer = DFlashProposer(model, embed)
    proposer.reset([1])
    with torch.no_grad():
        proposer.catch_up(torch.randn(1, 4, A, HT), torch.randint(0, V, (1, 4)), torch.arange(4)[None])
        drafts, q = proposer.propose_sampled(3, 0.8, torch.Generator().manual_seed(0))
    assert len(drafts) == 3 and q.shape == (3, V)
    torch.testing.assert_close(q.sum(-1), torch.ones(3))
    assert all(bool(model.t2d[d]) and float(q[j, d]) > 0 for j, d in enumerate(drafts))


# ----------------------------------------------------------------------------- the export


def test_export_config_and_tensors(tmp_path) -> None:
    model = drafter(num_layers=1)
    aux_ids = [2, 4, 5]  # input convention
    out = save_dflash(model, tmp_path / "d", aux_ids, "/targets/t", "vllm", {"training": {"settings": {"ttt_steps": 3}}},
                      torch.float32)  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "mask_token_id": MASK_ID,
        "target_layer_ids": [1, 3, 4],
        "causal": True,
    }
    assert "eagle_aux_hidden_state_layer_ids" not in config  # would win over target_layer_ids in vLLM
    assert (config["num_hidden_layers"], config["head_dim"], config["block_size"]) == (1, 8, 4)
    assert (config["vocab_size"], config["draft_vocab_size"], config["target_hidden_size"]) == (V, VD, HT)
    assert config["hidden_act"] == "silu" and config["rope_parameters"]["rope_theta"] == 10000.0
    assert config["draftsmith"]["aux_layer_ids_input"] == aux_ids
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(model.state_dict())
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    assert shapes["fc.weight"] == (32, A * HT) and shapes["hidden_norm.weight"] == (32,)
    assert shapes["layers.0.self_attn.q_norm.weight"] == shapes["layers.0.self_attn.k_norm.weight"] == (8,)
    attn = "layers.0.self_attn"
    assert shapes[f"{attn}.q_proj.weight"] == (32, 32) and shapes[f"{attn}.k_proj.weight"] == (16, 32)
    assert shapes["lm_head.weight"] == (VD, 32) and shapes["d2t"] == (VD,)
    assert tensors["d2t"].dtype == torch.int64
    loaded, _ = load_dflash(out)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert loaded.cfg == model.cfg


def test_export_refuses_a_drafter_of_another_kind(tmp_path) -> None:
    model = drafter()
    model.cfg = replace(model.cfg, kind="eagle3")
    with pytest.raises(ValueError, match="kind"):
        save_dflash(model, tmp_path / "d", [2, 4, 5], "/t", "vllm", None, torch.float32)


def test_vllm_speculative_config_for_dflash(tmp_path) -> None:
    """A DFlash export is measured as the trained drafter and served by vLLM's method dflash (its kind's
    vllm_fields), whatever folder it is in."""
    out = save_dflash(drafter(), tmp_path / "d", [2, 4, 5], "/t", "vllm", None, torch.float32)
    assert speculative_config("eagle3", str(out), 3) == {
        "method": "dflash",
        "model": str(out),
        "num_speculative_tokens": 3,
    }
    with pytest.raises(ValueError, match="drafter folder"):
        speculative_config("eagle3", None, 3)
