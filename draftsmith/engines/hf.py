"""The `transformers` engine: batched in-process generation and hidden-state capture."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from draftsmith.layers import capture_aux, stack_aux


@dataclass
class Generation:
    response_ids: list[int]  # generated tokens, including the stop token when one was produced
    finish_reason: str  # "stop" (an eos token) or "length" (max_new_tokens reached)


def stop_at_eos(tokens: list[int], eos_ids: set[int], pad_id: int | None) -> Generation:
    """Cut a generated row after its first eos token; strip right padding otherwise."""
    for i, tok in enumerate(tokens):
        if tok in eos_ids:
            return Generation(tokens[: i + 1], "stop")
    if pad_id is not None:
        while tokens and tokens[-1] == pad_id and pad_id not in eos_ids:
            tokens = tokens[:-1]
    return Generation(tokens, "length")


@torch.inference_mode()
def generate_batch(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: set[int],
    pad_id: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> list[Generation]:
    """Left-pad a batch of prompt ids and generate (greedy when temperature == 0)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p) :] = torch.tensor(p)
        attention[row, width - len(p) :] = 1
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {}
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention,
        max_new_tokens=max_new_tokens,
        eos_token_id=sorted(eos_ids),
        pad_token_id=pad_id,
        do_sample=temperature > 0,
        **{k: v for k, v in sampling.items() if k != "do_sample"},
    )
    return [stop_at_eos(row[width:].tolist(), eos_ids, pad_id) for row in out]


@torch.inference_mode()
def capture_states(model, input_ids: Tensor, aux_layer_ids: list[int]) -> tuple[Tensor, Tensor]:
    """One prefill of input_ids [B, T] (right padded) through the base model, no lm_head.

    Returns aux [B, T, A, H] (inputs to the aux layers) and final [B, T, H] (after the final norm, what
    lm_head consumes). Right padding needs no attention mask: causal attention keeps real tokens exact.
    """
    base = model.model
    with capture_aux(model, aux_layer_ids) as captured:
        final = base(input_ids=input_ids, use_cache=False).last_hidden_state
    return stack_aux(captured, aux_layer_ids), final
