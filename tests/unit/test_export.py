"""The vLLM-native drafter export: round trip, config fields, and the checks that catch broken exports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.drafter import DrafterConfig, Eagle3Drafter
from draftsmith.export import check_export, load_drafter, save_drafter
from draftsmith.vocab import vocab_maps

TARGET_LAYERS, TARGET_VOCAB, DRAFT_VOCAB = 8, 256, 96
AUX_IDS = [2, 4, 5]  # "input" convention


def make_drafter(seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        hidden_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        intermediate_size=80,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        target_hidden_size=40,
        target_vocab_size=TARGET_VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        num_aux=3,
    )
    model = Eagle3Drafter(cfg)
    ids = torch.sort(torch.randperm(TARGET_VOCAB)[:DRAFT_VOCAB]).values
    model.set_vocab_map(*vocab_maps(ids, TARGET_VOCAB))
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1 so a dropped tensor would show
            p.add_(0.01 * torch.randn_like(p))
    return model


@pytest.fixture
def export_dir(tmp_path: Path) -> Path:
    out = tmp_path / "drafter"
    save_drafter(make_drafter(), out, AUX_IDS, "targets/tiny", extra={"note": "test"})
    return out


def test_round_trip_equal(export_dir: Path) -> None:
    model = make_drafter()
    loaded, config = load_drafter(export_dir)
    assert loaded.cfg == model.cfg
    ref, got = model.state_dict(), loaded.state_dict()
    assert set(ref) == set(got)
    for name, t in ref.items():
        if t.is_floating_point():
            assert got[name].dtype == torch.float32
            torch.testing.assert_close(got[name], t.to(torch.bfloat16).float(), rtol=0, atol=0)
        else:
            assert torch.equal(got[name], t), name
    assert config["draftsmith"]["note"] == "test"
    # the same forward as the bf16-rounded original
    B, T = 2, 5
    embeds = torch.randn(B, T, model.cfg.hidden_size)
    hidden = torch.randn(B, T, model.cfg.hidden_size)
    pos = torch.arange(T).expand(B, T)
    rounded = make_drafter()
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    from draftsmith.drafter import CacheKV

    a = rounded(embeds, hidden, pos, CacheKV())[0]
    b = loaded(embeds, hidden, pos, CacheKV())[0]
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_weights_file_is_what_vllm_maps(export_dir: Path) -> None:
    tensors = load_file(str(export_dir / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors  # vLLM then shares the target's embedding
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["fc.weight"].shape == (48, 3 * 40)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (4 * 12, 2 * 48)
    assert tensors["lm_head.weight"].shape == (DRAFT_VOCAB, 48)
    assert tensors["t2d"].shape == (TARGET_VOCAB,)
    # every name lands on a vLLM parameter: "model." prefix unless lm_head, midlayer. -> layers.0.
    for name in tensors:
        assert name in ("d2t", "t2d", "lm_head.weight", "fc.weight", "norm.weight") or name.startswith(
            "midlayer."
        )


def test_config_fields(export_dir: Path) -> None:
    config = json.loads((export_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1
    assert config["vocab_size"] == TARGET_VOCAB and config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["target_hidden_size"] == 40 and config["hidden_size"] == 48
    assert config["num_aux_hidden_states"] == 3
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX_IDS
    assert config["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": AUX_IDS,
        "use_aux_hidden_state": True,
    }
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "tie_word_embeddings"):
        assert config[flag] is False
    assert config["draftsmith"]["aux_layer_convention"] == "input"
    assert config["draftsmith"]["target"] == "targets/tiny"
    # transformers parses it as a one-layer Llama config that keeps the EAGLE fields
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(export_dir)
    assert type(hf).__name__ == "LlamaConfig"
    assert hf.num_hidden_layers == 1 and hf.head_dim == 12 and hf.num_key_value_heads == 2
    assert hf.draft_vocab_size == DRAFT_VOCAB and hf.num_aux_hidden_states == 3
    assert hf.eagle_config["eagle_aux_hidden_state_layer_ids"] == AUX_IDS


def test_sglang_convention_ids(tmp_path: Path) -> None:
    save_drafter(make_drafter(), tmp_path / "d", AUX_IDS, "t", convention_engine="sglang")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert config["draftsmith"]["aux_layer_convention"] == "output"
    assert config["draftsmith"]["aux_layer_ids_input"] == AUX_IDS
    assert check_export(tmp_path / "d", TARGET_LAYERS, TARGET_VOCAB) == []


def test_check_export_passes_good(export_dir: Path) -> None:
    assert check_export(export_dir) == []
    assert check_export(export_dir, target_num_layers=TARGET_LAYERS, target_vocab_size=TARGET_VOCAB) == []


def _edit_weights(export_dir: Path, edit) -> None:
    path = export_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _edit_config(export_dir: Path, edit) -> None:
    path = export_dir / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _swap(t: dict, i: int, j: int) -> None:
    d2t = t["d2t"].clone()
    ids = torch.arange(d2t.numel()) + d2t
    ids[i], ids[j] = ids[j].clone(), ids[i].clone()
    t["d2t"] = ids - torch.arange(d2t.numel())


BROKEN = {
    "missing fc": (lambda t: t.pop("fc.weight"), None, "tensor fc.weight is missing"),
    "fc wrong shape": (
        lambda t: t.__setitem__("fc.weight", t["fc.weight"][:, :80].clone()),
        None,
        "fc.weight has shape",
    ),
    "qkv wrong shape": (
        lambda t: t.__setitem__(
            "midlayer.self_attn.k_proj.weight", torch.zeros(24, 48, dtype=torch.bfloat16)
        ),
        None,
        "k_proj.weight has shape",
    ),
    "lm_head wrong shape": (
        lambda t: t.__setitem__("lm_head.weight", torch.zeros(TARGET_VOCAB, 48, dtype=torch.bfloat16)),
        None,
        "lm_head.weight has shape",
    ),
    "missing d2t": (lambda t: t.pop("d2t"), None, "tensor d2t is missing"),
    "d2t not increasing": (lambda t: _swap(t, 3, 7), None, "not strictly increasing"),
    "d2t out of range": (
        lambda t: t["d2t"].__setitem__(-1, TARGET_VOCAB),
        None,
        "outside the target vocabulary",
    ),
    "t2d disagrees": (lambda t: t["t2d"].__setitem__(torch.nonzero(~t["t2d"])[0], True), None, "disagree"),
    "t2d wrong length": (lambda t: t.__setitem__("t2d", t["t2d"][:-1].clone()), None, "tensor t2d has shape"),
    "aux id out of range": (
        None,
        lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", [2, 4, 8]),
        "out of range",
    ),
    "aux count": (None, lambda c: c.__setitem__("num_aux_hidden_states", 4), "num_aux_hidden_states = 4"),
    "missing norm flag": (None, lambda c: c.pop("norm_before_fc"), "norm flag 'norm_before_fc' is missing"),
    "missing top-level ids": (
        None,
        lambda c: c.pop("eagle_aux_hidden_state_layer_ids"),
        "eagle_aux_hidden_state_layer_ids is missing",
    ),
    "wrong target vocab": (None, lambda c: c.__setitem__("vocab_size", 300), "vocab_size 300"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_check_export_reports_broken(export_dir: Path, case: str) -> None:
    edit_weights, edit_config, expected = BROKEN[case]
    if edit_weights:
        _edit_weights(export_dir, edit_weights)
    if edit_config:
        _edit_config(export_dir, edit_config)
    problems = check_export(export_dir, target_num_layers=TARGET_LAYERS, target_vocab_size=TARGET_VOCAB)
    assert any(expected in p for p in problems), problems


def test_aux_range_needs_target_layers(export_dir: Path) -> None:
    _edit_config(
        export_dir, lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", [0, 4, 5])
    )
    _edit_config(export_dir, lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [0, 4, 5]))
    # id 0 is the raw embedding, never a valid "input" aux id, whatever the target
    assert any("out of range" in p for p in check_export(export_dir))


def test_missing_files(tmp_path: Path, export_dir: Path) -> None:
    assert check_export(tmp_path / "nothing") == [f"{tmp_path / 'nothing' / 'config.json'} is missing"]
    broken = tmp_path / "noweights"
    shutil.copytree(export_dir, broken)
    (broken / "model.safetensors").unlink()
    assert any("model.safetensors is missing" in p for p in check_export(broken))
