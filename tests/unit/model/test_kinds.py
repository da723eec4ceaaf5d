"""The EAGLE-3 family's kinds: EAGLE 3.1 (fc_norm, post-norm recurrence) and P-EAGLE (mask slots in one
pass), each against its definition written out, and exported as vLLM reads it."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.model import EXPORT_AUX_IDS, make_drafter
from helpers.training import objective

from draftsmith.core.data.loader import Batch
from draftsmith.core.evaluation.engines import speculative_config
from draftsmith.core.export.formats import check_export, load_drafter, save_drafter
from draftsmith.core.model.drafter import CacheKV, DrafterConfig
from draftsmith.core.model.kinds import drafter_proposer
from draftsmith.core.training.objective import ttt_loss

MASK_ID = 7


def batch(model, B: int = 2, T: int = 12, seed: int = 0) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """A random batch for `model` -> (batch, embedding [V, H], teacher weight [Vd, Ht])."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.target_vocab_size, (B, T), generator=g)
    lengths = torch.tensor([T, T - 3])[:B]
    loss_mask = torch.arange(T)[None] < lengths[:, None]
    aux = torch.randn(B, T, cfg.num_aux * cfg.target_hidden_size, generator=g)
    final = torch.randn(B, T, cfg.target_hidden_size, generator=g)
    embed = torch.randn(cfg.target_vocab_size, cfg.hidden_size, generator=g)
    teacher = torch.randn(cfg.draft_vocab_size, cfg.target_hidden_size, generator=g)
    return Batch(ids, loss_mask, lengths, aux, final), embed, teacher


def test_eagle31_fuses_each_aux_state_normed():
    model = make_drafter(kind="eagle3.1")
    cfg = model.cfg
    assert len(model.fc_norm) == cfg.num_aux
    aux = torch.randn(2, 5, cfg.num_aux * cfg.target_hidden_size)
    chunks = aux.split(cfg.target_hidden_size, dim=-1)
    expected = model.fc(torch.cat([n(c) for n, c in zip(model.fc_norm, chunks, strict=True)], dim=-1))
    torch.testing.assert_close(model.fuse(aux), expected)


def test_eagle31_feeds_back_the_post_norm_state():
    model = make_drafter(kind="eagle3.1")
    H = model.cfg.hidden_size
    embeds, hidden = torch.randn(1, 4, H), torch.randn(1, 4, H)
    positions = torch.arange(4)[None]
    logits, state = model(embeds, hidden, positions, CacheKV())
    prenorm = model.midlayer(embeds, hidden, positions, CacheKV())
    torch.testing.assert_close(state, model.norm(prenorm))
    torch.testing.assert_close(logits, model.lm_head(state))


def test_eagle3_kind_keeps_the_residual_state():
    model = make_drafter()
    H = model.cfg.hidden_size
    embeds, hidden = torch.randn(1, 4, H), torch.randn(1, 4, H)
    positions = torch.arange(4)[None]
    _, state = model(embeds, hidden, positions, CacheKV())
    torch.testing.assert_close(state, model.midlayer(embeds, hidden, positions, CacheKV()))
    assert not hasattr(model, "fc_norm") and not hasattr(model, "mask_hidden")


def test_peagle_one_step_is_eagle3():
    """With one draft position there are no mask slots: P-EAGLE's loss is EAGLE-3's on the same weights."""
    peagle = make_drafter(seed=3, kind="peagle", mask_token_id=MASK_ID)
    eagle = make_drafter(seed=3)
    eagle.load_state_dict({k: v for k, v in peagle.state_dict().items() if k != "mask_hidden"})
    b, embed, teacher = batch(eagle)
    one = objective(steps=1)
    torch.testing.assert_close(
        ttt_loss(peagle, embed, teacher, b, one)[0], ttt_loss(eagle, embed, teacher, b, one)[0]
    )


def test_peagle_trains_mask_hidden():
    """Later draft positions read fuse(mask_hidden): the loss reaches it."""
    model = make_drafter(seed=1, kind="peagle", mask_token_id=MASK_ID)
    b, embed, teacher = batch(model)
    loss, stats = ttt_loss(model, embed, teacher, b, objective(steps=3))
    assert torch.isfinite(loss) and len(stats.count) == 3
    loss.backward()
    assert model.mask_hidden.grad is not None and model.mask_hidden.grad.abs().sum() > 0


def brute_force_drafts(model, embed, aux, tokens, k):
    """P-EAGLE's drafts by their definition: one causal forward over the accepted prefix (token x_{t+1},
    aux state at t) followed by k-1 mask slots (mask token, fuse(mask_hidden)) at the next positions."""
    n = aux.shape[1]
    H = model.cfg.hidden_size
    hidden = torch.cat([model.fuse(aux), model.fused_mask().expand(1, k - 1, H)], dim=1)
    ids = torch.cat([tokens, torch.full((1, k - 1), model.cfg.mask_token_id)], dim=1)
    positions = torch.arange(n + k - 1)[None]
    logits, _ = model(embed(ids), hidden, positions, CacheKV())
    picks = logits[0, n - 1 :].argmax(-1)
    return [int(model.draft_to_target(p)) for p in picks]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_peagle_proposer_is_one_causal_pass(k):
    torch.manual_seed(0)
    model = make_drafter(seed=2, kind="peagle", mask_token_id=MASK_ID).eval()
    cfg = model.cfg
    embed = torch.nn.Embedding(cfg.target_vocab_size, cfg.hidden_size)
    n = 6
    aux = torch.randn(1, n, cfg.num_aux * cfg.target_hidden_size)
    tokens = torch.randint(0, cfg.target_vocab_size, (1, n))
    proposer = drafter_proposer(model, embed)
    with torch.no_grad():
        # caught up in two pieces, as decoding does; the cache then holds n positions
        proposer.catch_up(
            aux[:, :4, None].unflatten(-1, (cfg.num_aux, -1)).squeeze(2), tokens[:, :4], torch.arange(4)[None]
        )
        proposer.catch_up(
            aux[:, 4:, None].unflatten(-1, (cfg.num_aux, -1)).squeeze(2),
            tokens[:, 4:],
            torch.arange(4, n)[None],
        )
        drafts = proposer.propose(k)
        assert proposer.kv.length == n  # the mask slots are not kept
        assert drafts == brute_force_drafts(model, embed, aux, tokens, k)
        assert proposer.propose(k + 1)[:k] == drafts  # causal: a longer draft starts with the shorter one


def test_kind_settings_from_the_drafter_section():
    from transformers import LlamaConfig

    target = LlamaConfig(
        hidden_size=64, num_attention_heads=4, intermediate_size=96, vocab_size=300, num_hidden_layers=4
    )
    cfg = DrafterConfig.from_target(target, 100, 3, {"kind": "peagle"})
    assert (cfg.kind, cfg.mask_token_id, cfg.num_layers) == ("peagle", 299, 1)
    assert DrafterConfig.from_target(target, 100, 3, {}).kind == "eagle3"
    with pytest.raises(ValueError, match="num_layers"):
        DrafterConfig.from_target(target, 100, 3, {"kind": "eagle3", "num_layers": 2})
    with pytest.raises(ValueError, match="mask_token_id"):
        DrafterConfig.from_target(target, 100, 3, {"kind": "peagle", "mask_token_id": 300})


@pytest.mark.parametrize("kind", ["eagle3.1", "peagle"])
def test_export_as_vllm_reads_it(tmp_path, kind):
    model = make_drafter(seed=4, kind=kind, mask_token_id=MASK_ID if kind == "peagle" else None)
    out = save_drafter(model, tmp_path / kind, EXPORT_AUX_IDS, "targets/tiny", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert check_export(out) == []
    assert (config["fc_norm"], config["norm_output"]) == (
        (True, True) if kind == "eagle3.1" else (False, False)
    )
    assert config["norm_before_fc"] is False and config["norm_before_residual"] is False
    spec = speculative_config("eagle3", str(out), 3)
    if kind == "peagle":
        assert config["mask_token_id"] == MASK_ID
        assert spec["parallel_drafting"] is True
    else:
        assert "mask_token_id" not in config and "parallel_drafting" not in spec
    loaded, _ = load_drafter(out)
    assert loaded.cfg.kind == kind
    for name, t in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], t, msg=name)


def test_foreign_eagle31_export_is_read_as_eagle31(tmp_path):
    """An export without draftsmith's block (another trainer's) with vLLM's EAGLE 3.1 flags loads as
    EAGLE 3.1; one flag alone is a layer draftsmith does not implement and is refused."""
    out = save_drafter(
        make_drafter(kind="eagle3.1"), tmp_path / "d", EXPORT_AUX_IDS, "t", dtype=torch.float32
    )
    config = json.loads((out / "config.json").read_text())
    del config["draftsmith"]
    (out / "config.json").write_text(json.dumps(config))
    assert load_drafter(out)[0].cfg.kind == "eagle3.1"
    config["norm_output"] = False
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="norm flags"):
        load_drafter(out)


@pytest.mark.parametrize("kind", ["eagle3.1", "peagle"])
def test_engine_forms_only_where_the_engine_serves_the_kind(tmp_path, kind):
    """EAGLE 3.1's speculators form carries its flags (vLLM's reader of that format copies them); a form
    draftsmith has not checked for a kind is a folder with a note, not weights an engine would misread."""
    from draftsmith.core.export.formats import load_drafter
    from draftsmith.stages.export import export_engines
    from draftsmith.stages.export.stage import NOT_WRITTEN

    model = make_drafter(5, 48, kind=kind, mask_token_id=MASK_ID if kind == "peagle" else None)
    vllm_dir = save_drafter(model, tmp_path / "drafter", EXPORT_AUX_IDS, "targets/tiny", dtype=torch.float32)
    embedding = torch.randn(model.cfg.target_vocab_size, model.cfg.hidden_size)
    outs = export_engines(vllm_dir, tmp_path / "sglang", tmp_path / "spec", embedding, None)
    assert (tmp_path / "sglang" / NOT_WRITTEN).is_file() and "sglang" not in outs
    if kind == "eagle3.1":
        config = json.loads((outs["speculators"] / "config.json").read_text())
        assert (config["fc_norm"], config["norm_output"]) == (True, True)
        assert check_export(outs["speculators"]) == []
        assert load_drafter(outs["speculators"])[0].cfg.kind == "eagle3.1"
    else:
        assert (tmp_path / "spec" / NOT_WRITTEN).is_file() and outs == {}
