"""The SGLang export against SGLang's own loading rules, reproduced from its source (sgl-project/sglang,
read at commit 03d5a77; SGLang itself needs CUDA kernels and a CUDA torch, so it cannot run here):

- python/sglang/srt/model_executor/model_runner.py (ModelRunner, where it calls
  `set_eagle3_layers_to_capture`): the target captures the ids in the draft config's
  `eagle_config["eagle_aux_hidden_state_layer_ids"]` (the nested list only).
- python/sglang/srt/models/llama.py, `LlamaForCausalLM.set_eagle3_layers_to_capture`:
  `layers_to_capture = [val + 1 for val in layer_ids]`; `LlamaModel.forward` appends
  `hidden_states + residual` (the input of layer i) before running layer i, for i in layer order.
- python/sglang/srt/models/llama_eagle3.py, `LlamaForCausalLMEagle3.load_weights`: `d2t` becomes
  `hot_token_id = d2t + arange`, `t2d` is skipped, q/k/v are stacked into `qkv_proj` and gate/up into
  `gate_up_proj`, a name is tried as is and then under `model.`, and a name matching no parameter is
  skipped without a word. `LlamaModel.__init__` there builds fc as 3 x target_hidden_size -> hidden_size;
  the decoder layer normalises `embeds` with input_layernorm and the hidden state with hidden_norm,
  concatenates [embeds, hidden], keeps the un-normed hidden state as the residual.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from draftsmith.core.data.vocab import vocab_maps
from draftsmith.core.export.formats import save_drafter
from draftsmith.core.model.drafter import CacheKV, DrafterConfig, Eagle3Drafter
from draftsmith.core.model.layers import capture_aux, stack_aux
from draftsmith.stages.export import export_engines

AUX_IDS = [1, 3, 4]  # "input" convention, what the drafter is trained on
DRAFT_VOCAB = 96


def sglang_layers_to_capture(draft_config: dict) -> list[int]:
    """ModelRunner + LlamaForCausalLM.set_eagle3_layers_to_capture."""
    layer_ids = (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if layer_ids is None:
        raise KeyError("SGLang would fall back to its default layers")
    return [val + 1 for val in layer_ids]


def sglang_aux(
    target: torch.nn.Module, input_ids: torch.Tensor, layers_to_capture: list[int]
) -> torch.Tensor:
    """LlamaModel.forward's capture: the input of each layer i in layers_to_capture, in layer order,
    concatenated -> [1, T, A*H] (what SGLang hands the drafter's fc)."""
    with torch.no_grad():
        hidden_states = target(input_ids, output_hidden_states=True).hidden_states  # [L+1] of [1, T, H]
    num_layers = len(target.model.layers)
    return torch.cat([hidden_states[i] for i in range(num_layers) if i in layers_to_capture], dim=-1)


def sglang_params(config: dict) -> dict[str, torch.Tensor]:
    """The parameters SGLang's LlamaForCausalLMEagle3 allocates for this config (NaN until loaded)."""
    H, Ht = config["hidden_size"], config.get("target_hidden_size", config["hidden_size"])
    d, nh, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    inter, m = config["intermediate_size"], "model.midlayer."
    shapes = {
        "model.fc.weight": (H, 3 * Ht),
        f"{m}self_attn.qkv_proj.weight": ((nh + 2 * nkv) * d, 2 * H),
        f"{m}self_attn.o_proj.weight": (H, nh * d),
        f"{m}mlp.gate_up_proj.weight": (2 * inter, H),
        f"{m}mlp.down_proj.weight": (H, inter),
        f"{m}input_layernorm.weight": (H,),
        f"{m}hidden_norm.weight": (H,),
        f"{m}post_attention_layernorm.weight": (H,),
        "model.norm.weight": (H,),
        "lm_head.weight": (config.get("draft_vocab_size") or config["vocab_size"], H),
    }
    return {k: torch.full(s, float("nan")) for k, s in shapes.items()}


def sglang_load_weights(
    config: dict, weights: dict[str, torch.Tensor]
) -> tuple[dict, torch.Tensor | None, list]:
    """LlamaForCausalLMEagle3.load_weights -> (params, hot_token_id, names skipped silently)."""
    params = sglang_params(config)
    nh, nkv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    inter = config["intermediate_size"]
    qkv_rows = {"q": (0, nh * d), "k": (nh * d, nkv * d), "v": ((nh + nkv) * d, nkv * d)}
    stacked = [
        (".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1),
    ]  # fmt: skip
    hot_token_id, skipped = None, []
    for name, w in weights.items():
        if "d2t" in name:
            hot_token_id = w + torch.arange(w.shape[0])
            continue
        if "t2d" in name:
            continue
        for param_name, weight_name, shard in stacked:
            if weight_name not in name:
                continue
            name = name.replace(weight_name, param_name)
            key = name if name in params else f"model.{name}"
            if key not in params:
                skipped.append(name)
            elif isinstance(shard, str):
                start, rows = qkv_rows[shard]
                params[key][start : start + rows] = w
            else:
                params[key][shard * inter : (shard + 1) * inter] = w
            break
        else:
            key = name if name in params else f"model.{name}"
            if key in params:
                params[key].copy_(w)
            else:
                skipped.append(name)
    return params, hot_token_id, skipped


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def sglang_draft_step(config: dict, p: dict, embeds: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """One prefill step of SGLang's LlamaModel (llama_eagle3.py) in plain torch -> draft logits [1, T, Vd].
    RoPE comes from transformers' Llama rotary embedding built from the export's config.json."""
    eps, m = config["rms_norm_eps"], "model.midlayer."
    nh, nkv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    T = embeds.shape[1]
    hidden = aux @ p["model.fc.weight"].T  # [1, T, H]
    residual = hidden
    x = torch.cat(
        [rms(embeds, p[f"{m}input_layernorm.weight"], eps), rms(hidden, p[f"{m}hidden_norm.weight"], eps)], -1
    )
    q, k, v = (x @ p[f"{m}self_attn.qkv_proj.weight"].T).split([nh * d, nkv * d, nkv * d], dim=-1)
    q, k, v = (t.view(1, T, -1, d).transpose(1, 2) for t in (q, k, v))
    rope = LlamaRotaryEmbedding(LlamaConfig(**{k_: v_ for k_, v_ in config.items() if k_ != "draftsmith"}))
    cos, sin = rope(v, torch.arange(T)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    h = attn.transpose(1, 2).reshape(1, T, nh * d) @ p[f"{m}self_attn.o_proj.weight"].T
    residual = residual + h
    gate, up = (
        rms(residual, p[f"{m}post_attention_layernorm.weight"], eps) @ p[f"{m}mlp.gate_up_proj.weight"].T
    ).chunk(2, -1)
    h = (F.silu(gate) * up) @ p[f"{m}mlp.down_proj.weight"].T
    return rms(h + residual, p["model.norm.weight"], eps) @ p["lm_head.weight"].T


@pytest.fixture
def exports(tiny_llama, tmp_path: Path) -> dict[str, Path]:
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(tiny_llama.config, DRAFT_VOCAB)
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab_map(*vocab_maps(torch.sort(torch.randperm(256)[:DRAFT_VOCAB]).values, 256))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_drafter(drafter, tmp_path / "drafter", AUX_IDS, "tiny", dtype=torch.float32)
    embedding = tiny_llama.get_input_embeddings().weight.detach()
    outs = export_engines(tmp_path / "drafter", tmp_path / "sglang", tmp_path / "spec", embedding, None)
    return {"vllm": tmp_path / "drafter", **outs, "drafter": drafter}


def test_sglang_captures_the_trained_layers(tiny_llama, exports) -> None:
    ids = torch.randint(0, 256, (1, 11))
    with torch.no_grad(), capture_aux(tiny_llama, AUX_IDS) as captured:
        tiny_llama(ids)
    trained = stack_aux(captured, AUX_IDS).flatten(2)  # what the drafter learnt from: [1, T, 3H]
    sglang_config = json.loads((exports["sglang"] / "config.json").read_text())
    assert sglang_layers_to_capture(sglang_config) == AUX_IDS
    assert torch.equal(sglang_aux(tiny_llama, ids, sglang_layers_to_capture(sglang_config)), trained)
    # the vLLM export served by SGLang: every capture one layer late (the bug this export fixes)
    vllm_config = json.loads((exports["vllm"] / "config.json").read_text())
    assert sglang_layers_to_capture(vllm_config) == [i + 1 for i in AUX_IDS]
    assert not torch.allclose(sglang_aux(tiny_llama, ids, sglang_layers_to_capture(vllm_config)), trained)


def test_sglang_loads_every_weight_and_drafts_the_same_tokens(tiny_llama, exports) -> None:
    config = json.loads((exports["sglang"] / "config.json").read_text())
    weights = load_file(str(exports["sglang"] / "model.safetensors"))
    params, hot_token_id, skipped = sglang_load_weights(config, weights)
    assert skipped == []  # SGLang would drop these without a word
    assert not any(bool(t.isnan().any()) for t in params.values())  # every parameter was loaded
    drafter = exports["drafter"]
    assert torch.equal(hot_token_id, drafter.draft_to_target(torch.arange(DRAFT_VOCAB)))
    # the same prefill step in SGLang's layout and in draftsmith's drafter
    ids = torch.randint(0, 256, (1, 9))
    aux = sglang_aux(tiny_llama, ids[:, :-1], sglang_layers_to_capture(config))
    embeds = tiny_llama.get_input_embeddings()(ids[:, 1:])
    with torch.no_grad():
        theirs = sglang_draft_step(config, params, embeds, aux)
        ours = drafter(embeds, drafter.fuse(aux), torch.arange(8)[None], CacheKV())[0]
    # fp32, one layer: a few ulps of logits ~1-10
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    assert torch.equal(hot_token_id[theirs.argmax(-1)], drafter.draft_to_target(ours.argmax(-1)))


def test_speculators_names_would_be_skipped_by_sglang(exports) -> None:
    """Why the SGLang export keeps `midlayer.*`: SGLang silently skips speculators' `layers.0.*`."""
    config = json.loads((exports["sglang"] / "config.json").read_text())
    weights = load_file(str(exports["speculators"] / "model.safetensors"))
    _, _, skipped = sglang_load_weights(config, weights)
    assert any(name.startswith("layers.0.") for name in skipped), skipped
