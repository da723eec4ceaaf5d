"""The speculators export in speculators' own code: `Eagle3DraftModel.from_pretrained` (speculators 0.9.0,
on CPU with SDPA attention) loads results/drafter-speculators against the real default target as its
verifier and computes the same draft logits as draftsmith's drafter, step for step over several TTT steps.

speculators' forward returns only each step's top token; the logits are read with a forward hook on its
`lm_head` ([1, T, Vd] per step). Inputs are real: the target's aux hidden states of a chat prompt.
Tolerance: one fp32 decoder layer, the same weights bit for bit, different kernels (SDPA vs draftsmith's
explicit TTT attention) -> 1e-4 absolute on logits of magnitude ~1-10.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from draftsmith.core.data.vocab import vocab_maps
from draftsmith.core.export.formats import check_export, load_drafter, save_drafter
from draftsmith.core.model.drafter import TTTKV, DrafterConfig, Eagle3Drafter
from draftsmith.core.model.layers import capture_aux, default_aux_layers, stack_aux
from draftsmith.stages.export import export_engines

pytestmark = pytest.mark.slow
TTT_STEPS, DRAFT_VOCAB, ATOL = 4, 2048, 1e-4


def random_drafter(target_config, seed: int = 0) -> Eagle3Drafter:
    """A drafter shaped for the target, its weights random but away from their init (so a weight that
    fails to load, or a norm left at ones, changes the logits)."""
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target(target_config, DRAFT_VOCAB)
    model = Eagle3Drafter(cfg)
    ids = torch.sort(torch.randperm(cfg.target_vocab_size)[:DRAFT_VOCAB]).values
    model.set_vocab_map(*vocab_maps(ids, cfg.target_vocab_size))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def draftsmith_ttt_logits(
    drafter: Eagle3Drafter, embed: torch.nn.Embedding, aux: torch.Tensor, input_ids: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """The TTT unroll speculators' forward does: step j embeds the tokens shifted left by j (zero-padded),
    positions + j, the previous step's pre-norm state fed back. -> per step [1, T, Vd]."""
    T = input_ids.shape[1]
    positions = torch.arange(T)[None]
    kv = TTTKV()
    hidden = drafter.fuse(aux)  # [1, T, H]
    out = []
    for j in range(steps):
        ids = torch.cat([input_ids[:, j:], input_ids.new_zeros(1, j)], dim=1)
        logits, hidden = drafter(embed(ids), hidden, positions + j, kv)
        out.append(logits)
    return out


def test_speculators_loads_the_export_and_agrees(target_model: Path, tmp_path: Path) -> None:
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    target_config = AutoConfig.from_pretrained(target_model)
    aux_ids = default_aux_layers(target_config.num_hidden_layers)
    model = random_drafter(target_config)
    save_drafter(model, tmp_path / "drafter", aux_ids, str(target_model), dtype=torch.float32,
                 extra={"training": {"settings": {"ttt_steps": TTT_STEPS}}})  # fmt: skip
    target = AutoModelForCausalLM.from_pretrained(target_model, dtype=torch.float32).eval()
    embed = target.get_input_embeddings()
    outs = export_engines(
        tmp_path / "drafter", tmp_path / "drafter-sglang", tmp_path / "drafter-speculators",
        embed.weight.detach(), num_draft_tokens=None, verifier_architectures=target_config.architectures,
    )  # fmt: skip
    spec_dir = outs["speculators"]
    L, V = target_config.num_hidden_layers, target_config.vocab_size
    assert check_export(spec_dir, L, V, engine="speculators") == []

    # speculators' own loader: config class, model class, verifier weights (the target's embedding)
    spec_cfg = Eagle3SpeculatorConfig.from_pretrained(spec_dir)
    spec_cfg.transformer_layer_config._attn_implementation = "sdpa"  # flex attention has no CPU path
    spec = Eagle3DraftModel.from_pretrained(spec_dir, config=spec_cfg, dtype=torch.float32)
    spec.load_verifier_weights()
    spec.eval()
    assert torch.equal(spec.embed_tokens.weight, embed.weight)  # not zeros: the export carries it
    assert spec.target_layer_ids == aux_ids  # speculators counts "input to layer k", like the data
    assert spec.config.speculators_config.proposal_methods[0].speculative_tokens == TTT_STEPS
    for name, t in model.state_dict().items():  # every trained tensor arrived, bit for bit
        spec_name = name.replace("midlayer.", "layers.0.", 1)
        assert torch.equal(spec.state_dict()[spec_name], t), name

    # real inputs: the target's aux states on a chat prompt, the next tokens as draft inputs
    tokenizer = AutoTokenizer.from_pretrained(target_model)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three rivers in Europe and say where each one ends."}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    ids = tokenizer(text, return_tensors="pt").input_ids  # [1, T+1]
    with torch.no_grad(), capture_aux(target, aux_ids) as captured:
        target(ids)
    aux = stack_aux(captured, aux_ids)[:, :-1].flatten(2)  # [1, T, 3H], layers concatenated in id order
    input_ids = ids[:, 1:]  # [1, T]
    T = input_ids.shape[1]

    step_logits: list[torch.Tensor] = []
    handle = spec.lm_head.register_forward_hook(lambda _m, _i, out: step_logits.append(out.detach()))
    with torch.no_grad():
        draft_tokens = spec(
            hidden_states=aux, input_ids=input_ids, document_ids=torch.zeros(1, T, dtype=torch.long),
            position_ids=torch.arange(T)[None], ttt_steps=TTT_STEPS,
        )  # fmt: skip
    handle.remove()
    assert len(step_logits) == TTT_STEPS == len(draft_tokens)

    ours, _ = load_drafter(spec_dir)  # draftsmith reads the speculators checkpoint too
    with torch.no_grad():
        expected = draftsmith_ttt_logits(ours, embed, aux, input_ids, TTT_STEPS)
        original = draftsmith_ttt_logits(model, embed, aux, input_ids, TTT_STEPS)
    diffs = []
    for j in range(TTT_STEPS):
        torch.testing.assert_close(expected[j], original[j], rtol=0, atol=0)
        diffs.append(float((step_logits[j] - expected[j]).abs().max()))
    print(f"speculators vs draftsmith, max |logit diff| per TTT step over {T} positions: {diffs}")
    (tmp_path / "diffs.json").write_text(json.dumps(diffs))
    assert max(diffs) <= ATOL, diffs
    for j in range(TTT_STEPS):  # and speculators' own proposals are draftsmith's argmax (where not tied)
        top2 = expected[j].topk(2, dim=-1).values
        clear = (top2[..., 0] - top2[..., 1]) > 2 * ATOL
        assert torch.equal(draft_tokens[j][clear], expected[j].argmax(-1)[clear]), j
