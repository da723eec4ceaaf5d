"""The vLLM-native drafter export: round trip, config fields, and the checks that catch broken exports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.model import EXPORT_AUX_IDS, EXPORT_DRAFT_VOCAB, EXPORT_TARGET_VOCAB, make_drafter
from safetensors.torch import load_file, save_file

from draftsmith.core.data.vocab import vocab_maps
from draftsmith.core.export.formats import check_export, load_drafter, save_drafter
from draftsmith.core.model.drafter import DrafterConfig, Eagle3Drafter

TARGET_LAYERS = 8


@pytest.fixture
def export_dir(tmp_path: Path) -> Path:
    out = tmp_path / "drafter"
    save_drafter(make_drafter(), out, EXPORT_AUX_IDS, "targets/tiny", extra={"note": "test"})
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
    from draftsmith.core.model.drafter import CacheKV

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
    assert tensors["lm_head.weight"].shape == (EXPORT_DRAFT_VOCAB, 48)
    assert tensors["t2d"].shape == (EXPORT_TARGET_VOCAB,)
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
    assert config["vocab_size"] == EXPORT_TARGET_VOCAB and config["draft_vocab_size"] == EXPORT_DRAFT_VOCAB
    assert config["target_hidden_size"] == 40 and config["hidden_size"] == 48
    assert config["num_aux_hidden_states"] == 3
    assert config["eagle_aux_hidden_state_layer_ids"] == EXPORT_AUX_IDS
    assert config["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": EXPORT_AUX_IDS,
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
    assert hf.draft_vocab_size == EXPORT_DRAFT_VOCAB and hf.num_aux_hidden_states == 3
    assert hf.eagle_config["eagle_aux_hidden_state_layer_ids"] == EXPORT_AUX_IDS


def test_sglang_convention_ids(tmp_path: Path) -> None:
    save_drafter(make_drafter(), tmp_path / "d", EXPORT_AUX_IDS, "t", convention_engine="sglang")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert config["draftsmith"]["aux_layer_convention"] == "output"
    assert config["draftsmith"]["aux_layer_ids_input"] == EXPORT_AUX_IDS
    assert check_export(tmp_path / "d", TARGET_LAYERS, EXPORT_TARGET_VOCAB) == []


def test_check_export_passes_good(export_dir: Path) -> None:
    assert check_export(export_dir) == []
    assert (
        check_export(export_dir, target_num_layers=TARGET_LAYERS, target_vocab_size=EXPORT_TARGET_VOCAB) == []
    )


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
        lambda t: t.__setitem__("lm_head.weight", torch.zeros(EXPORT_TARGET_VOCAB, 48, dtype=torch.bfloat16)),
        None,
        "lm_head.weight has shape",
    ),
    "missing d2t": (lambda t: t.pop("d2t"), None, "tensor d2t is missing"),
    "d2t not increasing": (lambda t: _swap(t, 3, 7), None, "not strictly increasing"),
    "d2t out of range": (
        lambda t: t["d2t"].__setitem__(-1, EXPORT_TARGET_VOCAB),
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
    problems = check_export(
        export_dir, target_num_layers=TARGET_LAYERS, target_vocab_size=EXPORT_TARGET_VOCAB
    )
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


# ------------------------------------------------------------------------------ one export per engine


@pytest.fixture
def engine_export(tmp_path: Path) -> Path:
    """A vLLM export every engine can take: speculators sizes fc from the drafter's own hidden size."""
    out = tmp_path / "drafter"
    save_drafter(
        make_drafter(target_hidden_size=48), out, EXPORT_AUX_IDS, "targets/tiny", extra={"note": "test"}
    )
    return out


def test_speculators_refuses_a_narrower_target(tmp_path: Path, export_dir: Path) -> None:
    with pytest.raises(ValueError, match="speculators sizes fc from the drafter hidden size 48"):
        _export_all(tmp_path, export_dir)


def _export_all(tmp_path: Path, engine_export: Path, **kw) -> tuple[Path, Path]:
    from draftsmith.stages.export import export_engines

    embedding = torch.randn(EXPORT_TARGET_VOCAB, 48, generator=torch.Generator().manual_seed(1))
    kw.setdefault("num_draft_tokens", None)  # the trained TTT steps
    outs = export_engines(engine_export, tmp_path / "sglang", tmp_path / "speculators", embedding, **kw)
    return outs["sglang"], outs["speculators"]


def test_engine_exports_hold_the_same_tensors(tmp_path: Path, engine_export: Path) -> None:
    sglang, spec = _export_all(tmp_path, engine_export)
    native = load_file(str(engine_export / "model.safetensors"))
    assert load_file(str(sglang / "model.safetensors")).keys() == native.keys()
    for name, t in load_file(str(sglang / "model.safetensors")).items():
        assert torch.equal(t, native[name]) and t.dtype == native[name].dtype, name
    spec_tensors = load_file(str(spec / "model.safetensors"))
    assert not any(k.startswith("midlayer.") for k in spec_tensors)
    # speculators' loader fills a missing embed_tokens with zeros, so its form carries the target's
    assert spec_tensors["embed_tokens.weight"].shape == (EXPORT_TARGET_VOCAB, 48)
    assert spec_tensors["embed_tokens.weight"].dtype == torch.bfloat16
    for name, t in native.items():
        spec_name = name.replace("midlayer.", "layers.0.", 1)
        assert torch.equal(spec_tensors[spec_name], t), name
    for path, engine in ((engine_export, "vllm"), (sglang, "sglang"), (spec, "speculators")):
        assert check_export(path, TARGET_LAYERS, EXPORT_TARGET_VOCAB, engine=engine) == [], engine
        assert check_export(path, TARGET_LAYERS, EXPORT_TARGET_VOCAB) == [], engine  # the engine it declares
        for name in ("config.json", "model.safetensors"):
            assert (path / name).stat().st_mode & 0o777 == 0o644
    _edit_weights(spec, lambda t: t.pop("embed_tokens.weight"))
    problems = check_export(spec, TARGET_LAYERS, EXPORT_TARGET_VOCAB)
    assert any("speculators' loader would leave it at zeros" in p for p in problems), problems


def test_sglang_export_ids_are_one_lower(tmp_path: Path, engine_export: Path) -> None:
    sglang, _ = _export_all(tmp_path, engine_export)
    config = json.loads((sglang / "config.json").read_text())
    # SGLang reads eagle_config only and adds 1: [1, 3, 4] + 1 = the trained inputs [2, 4, 5]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in EXPORT_AUX_IDS]
    assert config["draftsmith"]["aux_layer_convention"] == "output"
    assert config["draftsmith"]["aux_layer_ids_input"] == EXPORT_AUX_IDS
    assert config["tie_word_embeddings"] is False and config["draft_vocab_size"] == EXPORT_DRAFT_VOCAB


def test_speculators_config_fields(tmp_path: Path, engine_export: Path) -> None:
    _, spec = _export_all(
        tmp_path, engine_export, num_draft_tokens=4, verifier_architectures=["LlamaForCausalLM"]
    )
    config = json.loads((spec / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert (
        config["eagle_aux_hidden_state_layer_ids"] == EXPORT_AUX_IDS
    )  # speculators counts "input to layer k"
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert (
        layer["hidden_size"] == 48 and layer["head_dim"] == 12 and layer["vocab_size"] == EXPORT_TARGET_VOCAB
    )
    assert layer["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert layer["num_aux_hidden_states"] == 3
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert config[flag] is False  # vLLM defaults norm_before_residual to True for this format
    method = config["speculators_config"]["proposal_methods"][0]
    assert method["speculative_tokens"] == 4 and method["proposal_type"] == "greedy"
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": "targets/tiny",
        "architectures": ["LlamaForCausalLM"],
    }
    assert config["draftsmith"]["note"] == "test"  # the draftsmith block travels


def test_load_drafter_reads_speculators_checkpoints(tmp_path: Path, engine_export: Path) -> None:
    _, spec = _export_all(tmp_path, engine_export)
    ref, _ = load_drafter(engine_export)
    got, config = load_drafter(spec)
    assert got.cfg == ref.cfg
    for name, t in ref.state_dict().items():
        assert torch.equal(got.state_dict()[name], t), name
    # a foreign speculators checkpoint (no draftsmith block) is rebuilt from speculators' fields alone
    del config["draftsmith"]
    (spec / "config.json").write_text(json.dumps(config))
    foreign, _ = load_drafter(spec)
    assert foreign.cfg == ref.cfg
    assert torch.equal(foreign.fc.weight, ref.fc.weight)


def test_load_drafter_refuses_norm_variants(tmp_path: Path, engine_export: Path) -> None:
    _, spec = _export_all(tmp_path, engine_export)
    _edit_config(spec, lambda c: c.__setitem__("norm_before_residual", True))
    with pytest.raises(ValueError, match="norm_before_residual"):
        load_drafter(spec)


def test_export_refuses_unsorted_or_repeated_ids(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not in increasing order"):
        save_drafter(make_drafter(), tmp_path / "a", [4, 2, 5], "t")
    with pytest.raises(ValueError, match="repeat a layer"):
        save_drafter(make_drafter(), tmp_path / "b", [2, 2, 5], "t")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_check_export_refuses_unsorted_ids(engine_export: Path, tmp_path: Path, engine: str) -> None:
    path = engine_export if engine == "vllm" else _export_all(tmp_path, engine_export)[0]
    ids = json.loads((path / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    unsorted = [ids[1], ids[0], ids[2]]
    _edit_config(path, lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", unsorted))
    _edit_config(path, lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", unsorted))
    problems = check_export(path, TARGET_LAYERS, EXPORT_TARGET_VOCAB, engine=engine)
    assert any("not in increasing order" in p for p in problems), problems
    assert any("drafter was trained on [2, 4, 5]" in p for p in problems), problems


def test_check_export_names_the_wrong_engine(tmp_path: Path, engine_export: Path) -> None:
    sglang, spec = _export_all(tmp_path, engine_export)
    # the vLLM export served by SGLang: every layer one off
    problems = check_export(engine_export, TARGET_LAYERS, EXPORT_TARGET_VOCAB, engine="sglang")
    assert any("'input' convention; sglang reads them as 'output'" in p for p in problems), problems
    assert any("captures the inputs of layers [3, 5, 6]" in p for p in problems), problems
    problems = check_export(sglang, TARGET_LAYERS, EXPORT_TARGET_VOCAB, engine="vllm")
    assert any("'output' convention; vllm reads them as 'input'" in p for p in problems), problems
    assert any("speculators' format" in p for p in check_export(spec, engine="vllm"))
    assert any("not in speculators' format" in p for p in check_export(engine_export, engine="speculators"))


def test_check_export_sglang_rules(tmp_path: Path, engine_export: Path) -> None:
    sglang, _ = _export_all(tmp_path, engine_export)
    _edit_weights(
        sglang, lambda t: t.__setitem__("layers.0.mlp.up_proj.weight", t.pop("midlayer.mlp.up_proj.weight"))
    )
    _edit_config(sglang, lambda c: c.__setitem__("tie_word_embeddings", True))
    _edit_config(sglang, lambda c: c.pop("eagle_config"))
    problems = check_export(sglang, TARGET_LAYERS, EXPORT_TARGET_VOCAB)
    assert any("SGLang silently skips names" in p for p in problems), problems
    assert any("SGLang would use the embedding as lm_head" in p for p in problems), problems
    assert any(
        "eagle_config.eagle_aux_hidden_state_layer_ids is missing (SGLang reads only it)" in p
        for p in problems
    )


SPECULATORS_BROKEN = {
    "missing norm flag": (lambda c: c.pop("norm_before_residual"), "norm flag 'norm_before_residual' is missing"),
    "no verifier": (lambda c: c["speculators_config"].pop("verifier"), "verifier.name_or_path"),
    "no layer config": (lambda c: c.pop("transformer_layer_config"), "transformer_layer_config is missing"),
    "aux count": (
        lambda c: c["transformer_layer_config"].pop("num_aux_hidden_states"),
        None,  # 3 ids and vLLM's assumed 3: fine
    ),
    "rope": (lambda c: [c["transformer_layer_config"].pop(k) for k in ("rope_parameters", "rope_theta")],
             "rope_theta is missing"),
    "hidden sizes": (lambda c: c.__setitem__("target_hidden_size", 40), "speculators sizes fc from hidden_size"),
    "output ids": (lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [1, 3, 4]), "trained on [2, 4, 5]"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(SPECULATORS_BROKEN))
def test_check_export_speculators_rules(tmp_path: Path, engine_export: Path, case: str) -> None:
    _, spec = _export_all(tmp_path, engine_export)
    edit, expected = SPECULATORS_BROKEN[case]
    _edit_config(spec, edit)
    problems = check_export(spec, TARGET_LAYERS, EXPORT_TARGET_VOCAB)
    if expected is None:
        assert problems == []
    else:
        assert any(expected in p for p in problems), problems


def _full_vocab_drafter() -> Eagle3Drafter:
    model = make_drafter(target_hidden_size=48)
    cfg = DrafterConfig(**{**model.cfg.to_dict(), "draft_vocab_size": EXPORT_TARGET_VOCAB})
    full = Eagle3Drafter(cfg)
    full.set_vocab_map(*vocab_maps(torch.arange(EXPORT_TARGET_VOCAB), EXPORT_TARGET_VOCAB))
    return full


def test_full_size_draft_vocabulary_has_no_vocab_map(tmp_path: Path) -> None:
    model = _full_vocab_drafter()
    save_drafter(model, tmp_path / "d", EXPORT_AUX_IDS, "t")
    assert "d2t" not in load_file(str(tmp_path / "d" / "model.safetensors"))  # vLLM has no parameter for it
    assert check_export(tmp_path / "d", TARGET_LAYERS, EXPORT_TARGET_VOCAB) == []
    loaded, _ = load_drafter(tmp_path / "d")
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)
    _, spec = _export_all(tmp_path, tmp_path / "d")
    assert "d2t" not in load_file(str(spec / "model.safetensors"))
    # a d2t written anyway fails vLLM's load: reported
    _edit_weights(
        tmp_path / "d", lambda t: t.__setitem__("d2t", torch.zeros(EXPORT_TARGET_VOCAB, dtype=torch.int64))
    )
    problems = check_export(tmp_path / "d", TARGET_LAYERS, EXPORT_TARGET_VOCAB)
    assert any("allocates no draft-to-target map" in p for p in problems), problems


def test_draft_vocabulary_larger_than_target_is_refused(tmp_path: Path) -> None:
    model = make_drafter()
    model.cfg = DrafterConfig(**{**model.cfg.to_dict(), "draft_vocab_size": EXPORT_TARGET_VOCAB + 1})
    with pytest.raises(ValueError, match="exceeds the target vocabulary"):
        save_drafter(model, tmp_path / "d", EXPORT_AUX_IDS, "t")


def test_draft_positions_warning() -> None:
    from draftsmith.core.evaluation.engines import draft_positions_warning, trained_ttt_steps

    assert draft_positions_warning(3, 3) is None and draft_positions_warning(5, None) is None
    assert "draft positions 4..5 were never trained" in draft_positions_warning(5, 3)
    assert trained_ttt_steps({"draftsmith": {"training": {"settings": {"ttt_steps": 7}}}}) == 7
    assert trained_ttt_steps({}) is None


def test_cli_export_and_check(tmp_path: Path, engine_export: Path) -> None:
    from click.testing import CliRunner
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftsmith.cli import main

    shape = {"hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12}
    target_cfg = LlamaConfig(
        vocab_size=EXPORT_TARGET_VOCAB, num_hidden_layers=TARGET_LAYERS, intermediate_size=80, **shape
    )
    LlamaForCausalLM(target_cfg).save_pretrained(tmp_path / "target")

    _edit_config(
        engine_export, lambda c: c["draftsmith"].__setitem__("training", {"settings": {"ttt_steps": 2}})
    )
    run = CliRunner().invoke
    args = [
        "export",
        "--drafter",
        engine_export,
        "--out-sglang",
        tmp_path / "s",
        "--out-speculators",
        tmp_path / "p",
        "--target",
        tmp_path / "target",
    ]
    result = run(main, [str(a) for a in [*args, "--num-draft-tokens", 3]])
    assert result.exit_code == 0, result.output
    assert "num_draft_tokens 3 exceeds the 2 TTT steps" in result.output
    spec = json.loads((tmp_path / "p" / "config.json").read_text())
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    target_embed = load_file(str(tmp_path / "target" / "model.safetensors"))["model.embed_tokens.weight"]
    spec_embed = load_file(str(tmp_path / "p" / "model.safetensors"))["embed_tokens.weight"]
    assert torch.equal(spec_embed, target_embed.to(torch.bfloat16))
    for folder, engine in (("s", "sglang"), ("p", "speculators")):
        result = run(main, ["check-export", str(tmp_path / folder), "--engine", engine])
        assert result.exit_code == 0 and f"export OK for {engine}" in result.output, result.output
    result = run(main, ["check-export", str(engine_export), "--engine", "sglang"])
    assert result.exit_code == 1 and "sglang reads them as 'output'" in result.output
    _edit_weights(engine_export, lambda t: t.pop("fc.weight"))
    result = run(main, [str(a) for a in args])
    assert result.exit_code == 2 and "not a valid vLLM export" in result.output, result.output


# ------------------------------------------------------------------------------ check-export on damaged input


def _check_export_cli(*args: str):
    from click.testing import CliRunner

    from draftsmith.cli import main

    return CliRunner().invoke(main, ["check-export", *map(str, args)])


def _one_line(result) -> str:
    """The command's error, asserted to be one line and no traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def _target(tmp_path: Path, config) -> Path:
    folder = tmp_path / "target"
    folder.mkdir(exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_check_export_on_a_truncated_safetensors_is_one_line_exit_2(export_dir: Path) -> None:
    weights = export_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-500])
    result = _check_export_cli(export_dir)
    assert result.exit_code == 2
    assert f"{weights} is not a readable safetensors file (" in _one_line(result)


def test_check_export_on_a_config_that_is_a_list_is_one_line_exit_2(export_dir: Path) -> None:
    (export_dir / "config.json").write_text("[1, 2]")
    result = _check_export_cli(export_dir)
    assert result.exit_code == 2
    assert f"{export_dir / 'config.json'} is not a JSON object of settings (a list)" in _one_line(result)


def test_check_export_names_a_size_written_as_a_string(export_dir: Path) -> None:
    """It once printed "hidden_size: 48 vs 48"."""
    _edit_config(export_dir, lambda c: c.update(hidden_size="48"))
    result = _check_export_cli(export_dir)
    assert result.exit_code == 2
    assert "config.json: hidden_size is '48' (str), expected an integer" in _one_line(result)
    assert check_export(export_dir) == [
        f"{export_dir / 'config.json'}: hidden_size is '48' (str), expected an integer"
    ]


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        (None, "config.json is missing: not a Hugging Face model folder"),
        ({"vocab_size": EXPORT_TARGET_VOCAB}, "config.json: no integer 'num_hidden_layers'"),
        ({"num_hidden_layers": TARGET_LAYERS}, "config.json: no integer 'vocab_size'"),
        ([1], "not a JSON object of settings (a list)"),
    ],
    ids=["no-config", "no-layers", "no-vocab", "a-list"],
)
def test_check_export_with_a_target_it_cannot_read_is_one_line_exit_2(
    tmp_path, export_dir, config, fragment
) -> None:
    result = _check_export_cli(export_dir, "--target", _target(tmp_path, config))
    assert result.exit_code == 2
    line = _one_line(result)
    assert line.startswith(f"error: --target: {tmp_path / 'target' / 'config.json'}") and fragment in line, (
        line
    )


def test_check_export_with_a_good_target_still_passes(tmp_path, export_dir) -> None:
    target = _target(tmp_path, {"num_hidden_layers": TARGET_LAYERS, "vocab_size": EXPORT_TARGET_VOCAB})
    result = _check_export_cli(export_dir, "--target", target)
    assert result.exit_code == 0, result.output
