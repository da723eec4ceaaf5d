"""Miniature twins of the real target families, built at test time with transformers (random weights).

Each keeps what makes its family different: Llama-3.x's `llama3` RoPE, Qwen3's wide heads and thinking
template, Qwen3-MoE's experts, DeepSeek-V3's MLA + MoE (kv_lora_rank 512 and qk_rope_head_dim 64: the
only MLA head size vLLM's CPU kernel accepts; `noaux_tc` / `sigmoid` routing as the real configs carry,
without which vLLM builds a router without its bias), and Kimi-K2.5's multimodal wrapper (settings under
`text_config`, weights under `language_model.`, sharded with an index).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN = 256
LAYERS = 4

LLAMA3_ROPE = {
    "rope_type": "llama3",
    # Llama-3's 500000 leaves every rescaled frequency nearly still over a test's 100 tokens; at 100
    # most of them turn within it, so the scaling visibly shapes attention
    "rope_theta": 100.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # most frequencies scaled; crossed by every test sequence
}
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 32.0,  # = max_position_embeddings / original, as transformers expects
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
# Qwen3's template in miniature: reasoning_content rendered as <think>...</think> before the answer
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and m.get('reasoning_content') %}"
    "<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def config(family: str, vocab_size: int = 512, **over):
    """transformers config of a tiny target of `family` (llama3, qwen3, qwen3_moe, deepseek_v3)."""
    from transformers import AutoConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        **over,
    )
    if family == "llama3":
        return AutoConfig.for_model(
            "llama", **common, intermediate_size=512, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE
        )
    if family == "qwen3":
        return AutoConfig.for_model(
            "qwen3", **common, intermediate_size=512, num_key_value_heads=2, head_dim=128
        )
    if family == "qwen3_moe":
        return AutoConfig.for_model(
            "qwen3_moe", **common, intermediate_size=512, num_key_value_heads=2, head_dim=64,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=1,
        )  # fmt: skip
    if family == "deepseek_v3":
        cfg = AutoConfig.for_model(
            "deepseek_v3", **common, intermediate_size=768, num_key_value_heads=4,
            kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
            rope_parameters=DEEPSEEK_YARN,
        )  # fmt: skip
        cfg.topk_method, cfg.scoring_func = "noaux_tc", "sigmoid"
        return cfg
    raise ValueError(family)


def model(family: str, vocab_size: int = 512, seed: int = 0, **over):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(config(family, vocab_size, **over), dtype=torch.float32)
    return m.eval()


def save(family: str, folder: Path, vocab_size: int = 512, tokenizer_from: Path | None = None, **over):
    """A tiny target of `family` saved as an HF folder (single safetensors file) -> the model. With
    `tokenizer_from` (a model folder), its tokenizer files are copied in."""
    m = model(family, vocab_size, **over)
    m.save_pretrained(folder)
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, folder)
    return m


def copy_tokenizer(src: Path, folder: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, folder / name)


def write_sharded(folder: Path, shards: list[dict[str, torch.Tensor]], config: dict) -> None:
    """config.json + model-0000k-of-0000n.safetensors + model.safetensors.index.json."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(shards)
    weight_map = {}
    for k, tensors in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{n:05d}.safetensors"
        save_file({t: v.contiguous() for t, v in tensors.items()}, str(folder / name))
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def save_kimi(
    folder: Path, vocab_size: int = 512, tokenizer_from: Path | None = None, **over
) -> tuple[torch.nn.Module, list[str]]:
    """A Kimi-K2.5-shaped folder around a DeepSeek-V3 twin: wrapper config, `language_model.` names, a
    vision tower, three shards (embedding | layers + vision | final norm + lm_head) -> (the text model,
    the shard files). With `tokenizer_from` (a model folder), its tokenizer files are copied in."""
    m = model("deepseek_v3", vocab_size, **over)
    text = m.config.to_dict()
    wrapper = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
        "text_config": text,
        "vision_config": {"hidden_size": 32},
        "tie_word_embeddings": False,
    }
    sd = {f"language_model.{k}": v for k, v in m.state_dict().items()}
    first = {k: v for k, v in sd.items() if k.endswith("embed_tokens.weight")}
    last = {k: v for k, v in sd.items() if k.endswith((".model.norm.weight", "lm_head.weight"))}
    middle = {k: v for k, v in sd.items() if k not in first and k not in last}
    middle["vision_tower.patch_embed.weight"] = torch.randn(32, 3, 2, 2)
    write_sharded(folder, [first, middle, last], wrapper)
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, folder)
    return m, [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]


THINK_TOKENS = {3: "<think>", 4: "</think>", 5: "<tool_call>", 6: "</tool_call>"}


def thinking_tokenizer(src: Path, folder: Path) -> None:
    """SmolLM2's tokenizer (from the model folder `src`) with four unused special ids renamed to
    Qwen3's single-token markers and THINKING_TEMPLATE as its chat template, written into `folder`."""
    tok = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    renamed = {}
    for added in tok["added_tokens"]:
        if added["id"] in THINK_TOKENS:
            renamed[added["content"]] = THINK_TOKENS[added["id"]]
            added["content"] = THINK_TOKENS[added["id"]]
    vocab = tok["model"]["vocab"]
    tok["model"]["vocab"] = {renamed.get(k, k): v for k, v in vocab.items()}
    (folder / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (folder / "chat_template.jinja").write_text(THINKING_TEMPLATE, encoding="utf-8")
