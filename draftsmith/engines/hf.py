"""The `transformers` engine: batched in-process generation and hidden-state capture."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from draftsmith.layers import capture_aux, decoder_layers, stack_aux


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


def pad_right(sequences: list[Tensor], pad_id: int = 0) -> Tensor:
    """[B, max T] int64, each row a sequence followed by pad_id (causal attention never looks right)."""
    ids = torch.full((len(sequences), max(s.numel() for s in sequences)), pad_id, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : seq.numel()] = seq
    return ids


class HfExtractor:
    """The transformers extraction engine: the base model (no lm_head) with forward pre-hooks on the aux
    layers, held for the engine's lifetime, one right-padded batch per forward pass.

    `compile()` puts the decoder layers under `torch.compile`: on CPU, eager bf16 spends most of its
    time in unfused elementwise kernels (RMSNorm, rotary, SiLU, residual adds), which inductor fuses;
    see bench/extract.py for the measured effect and the one-off compile cost.
    """

    name = "transformers"

    def __init__(self, model, aux_layer_ids: list[int]):
        self.model = model
        self.aux_layer_ids = list(aux_layer_ids)
        self.lm_head_weight = self.model.get_output_embeddings().weight.detach()
        self.compiled = False
        self._hooks = contextlib.ExitStack()
        self._captured = self._hooks.enter_context(capture_aux(self.model, self.aux_layer_ids))

    @classmethod
    def from_target(cls, target: str, aux_layer_ids: list[int], dtype: str = "bfloat16") -> HfExtractor:
        from draftsmith.target import load_target

        model, _ = load_target(target, getattr(torch, dtype))
        return cls(model, aux_layer_ids)

    def compile(self) -> float:
        """Compile the decoder layers' and the final norm's forward, then warm them up; returns seconds.

        All decoder layers run the same code, so one compiled graph serves all of them (minutes less
        than compiling the whole model); the hooks stay outside, in eager mode."""
        start = time.perf_counter()
        for module in [*decoder_layers(self.model), self.model.model.norm]:
            module.forward = torch.compile(module.forward, dynamic=True)
        self.compiled = True
        # Shapes that leave every graph this job needs compiled: a static first one, a dynamic one,
        # and batch 1, which dynamo specialises (size-1 dimensions always compile apart).
        for batch, length in ((2, 64), (3, 72), (1, 40)):
            self.capture([torch.arange(length) + 100] * batch)
        return time.perf_counter() - start

    @torch.inference_mode()
    def capture(self, sequences: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
        """Per sequence: (aux [T, A, H], final [T, H]) in the compute dtype; final is after the norm."""
        self._captured.clear()
        final = self.model.model(input_ids=pad_right(sequences), use_cache=False).last_hidden_state
        aux = [self._captured[k] for k in self.aux_layer_ids]  # each [B, W, H]
        out = []
        for row, seq in enumerate(sequences):
            n = seq.numel()
            out.append((torch.stack([a[row, :n] for a in aux], dim=1), final[row, :n]))
        return out

    def close(self) -> None:
        self._hooks.close()
