"""The `transformers` back-end: batched in-process generation (`HfChatBackend`) and hidden-state capture
(`HfExtractor`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from draftsmith.backends.common import Answer, oversized, oversized_failure
from draftsmith.core.data.chat import eos_token_ids
from draftsmith.core.model.layers import capture_aux, decoder_layers, stack_aux
from draftsmith.core.model.precision import compute_dtype


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


class TokenTicker:
    """A transformers stopping criterion that never stops: it reports the tokens of each decoding step
    that stop_at_eos will keep (rows whose earlier tokens hold no eos), for a progress bar."""

    def __init__(self, on_tokens: Callable[[int], None], eos_ids: set[int], prompt_width: int):
        self.on_tokens, self.width = on_tokens, prompt_width
        self.eos = torch.tensor(sorted(eos_ids), dtype=torch.long)

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs: Any) -> Tensor:
        earlier = input_ids[:, self.width : -1]  # [B, n-1] generated before this step
        live = ~torch.isin(earlier, self.eos.to(input_ids.device)).any(dim=1)
        self.on_tokens(int(live.sum()))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.inference_mode()
def generate_batch(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: set[int],
    pad_id: int,
    temperature: float,
    top_p: float,
    on_tokens: Callable[[int], None] | None = None,
) -> list[Generation]:
    """Left-pad a batch of prompt ids and generate (greedy when temperature == 0); on_tokens(n) hears
    after each decoding step how many rows produced a token that counts (not after their eos)."""
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
        stopping_criteria=[TokenTicker(on_tokens, eos_ids, width)] if on_tokens else None,
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
    """The transformers extraction back-end: the base model (no lm_head) with forward pre-hooks on the aux
    layers, held for the back-end's lifetime, one right-padded batch per forward pass.

    `compile()` puts the decoder layers under `torch.compile`: on CPU, eager bf16 spends most of its
    time in unfused elementwise kernels (RMSNorm, rotary, SiLU, residual adds), which inductor fuses;
    see bench/extract.py for the measured effect and the one-off compile cost.
    """

    name = "transformers"

    def __init__(self, model, aux_layer_ids: list[int]):
        self.model = model
        self.device = next(model.parameters()).device  # the job's first GPU, or the CPU
        self.aux_layer_ids = list(aux_layer_ids)
        self.lm_head_weight = self.model.get_output_embeddings().weight.detach()
        self.compiled = False
        self._hooks = contextlib.ExitStack()
        self._captured = self._hooks.enter_context(capture_aux(self.model, self.aux_layer_ids))

    @classmethod
    def from_target(
        cls, target: str, aux_layer_ids: list[int], dtype: str = "bfloat16", device: str = "cpu"
    ) -> HfExtractor:
        from draftsmith.core.model.target import load_target_model

        model = load_target_model(target, getattr(torch, dtype))
        return cls(model.to(device), aux_layer_ids)

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

    def capture(self, sequences: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
        """Per sequence: (aux [T, A, H], final [T, H]) in the compute dtype; final is after the norm."""
        return self.collect(sequences, self.forward(sequences))

    @torch.inference_mode()
    def forward(self, sequences: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """The forward pass of a capture: (final [B, W, H], aux [B, W, H] per aux layer); `collect`
        splits them per sequence (extraction does that in a worker thread while the next forward runs)."""
        self._captured.clear()
        ids = pad_right(sequences).to(self.device)
        final = self.model.model(input_ids=ids, use_cache=False).last_hidden_state
        return final, [self._captured[k] for k in self.aux_layer_ids]

    @torch.inference_mode()
    def collect(
        self, sequences: list[Tensor], raw: tuple[Tensor, list[Tensor]]
    ) -> list[tuple[Tensor, Tensor]]:
        """`forward`'s batch as capture returns it."""
        final, aux = raw
        # the writer compresses on the CPU: one copy per tensor of the batch (none on a CPU)
        final, aux = final.cpu(), [a.cpu() for a in aux]
        out = []
        for row, seq in enumerate(sequences):
            n = seq.numel()
            out.append((torch.stack([a[row, :n] for a in aux], dim=1), final[row, :n]))
        return out

    def close(self) -> None:
        self._hooks.close()


# ----------------------------------------------------------------------------- the generate back-end


def length_batches(lengths: list[int], batch_size: int, batch_tokens: int | None = None) -> list[list[int]]:
    """Indices grouped into batches of similar length (less padding, same results): at most
    `batch_size` rows, and at most `batch_tokens` padded tokens (rows x the longest) so a few very long
    prompts do not pad a whole batch to their width. A row longer than the budget gets a batch alone."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        last = batches[-1] if batches else None
        if (
            last is not None
            and len(last) < batch_size
            and (batch_tokens is None or (len(last) + 1) * lengths[i] <= batch_tokens)
        ):  # sorted: lengths[i] is the widest
            last.append(i)
        else:
            batches.append([i])
    return batches


class HfChatBackend:
    """The target in this process; batches of similar length, each advancing all its conversations one
    turn at a time (greedy, or sampled with seed + batch number)."""

    startup_seconds: float | None = None

    def __init__(
        self, model: Any, tokenizer: Any, settings: Any, render: Callable[[list[dict]], list[int]], name: str
    ):
        self._model, self.tokenizer, self.settings, self.render = model, tokenizer, settings, render
        self.model = name  # recorded in every trace

    @classmethod
    def open(cls, settings: Any, target: str, render: Callable[[list[dict]], list[int]]) -> HfChatBackend:
        from draftsmith.core.model.target import load_target

        model, tokenizer = load_target(target, getattr(torch, compute_dtype(settings.dtype)))
        return cls(model, tokenizer, settings, render, str(target))

    def close(self) -> None:
        self._model = None  # free the weights before the stage writes its outputs

    stopped: str | None = None  # in-process generation has no endpoint to lose

    def results(self, convs: list[Any], on_tokens: Callable[[int], None]) -> Iterator[tuple[Any, Any]]:
        settings, model, tokenizer, render = self.settings, self._model, self.tokenizer, self.render
        eos = set(eos_token_ids(tokenizer, model.generation_config))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
        context_len = getattr(model.config, "max_position_embeddings", None)
        first = [render(c.context()) for c in convs]
        widths = [len(ids) + settings.max_new_tokens for ids in first]
        for b, batch in enumerate(length_batches(widths, settings.batch_size, settings.batch_tokens)):
            torch.manual_seed(settings.seed + b)
            active = [convs[i] for i in batch]
            while active:
                ids = [render(c.context()) for c in active]
                keep = []
                for c, p in zip(active, ids, strict=True):
                    if oversized(len(p), settings.max_new_tokens, settings.max_prompt_tokens, context_len):
                        yield c, oversized_failure(len(c.answers), len(p), settings, context_len)
                    else:
                        keep.append((c, p))
                if not keep:
                    break
                gens = generate_batch(
                    model,
                    [p for _, p in keep],
                    settings.max_new_tokens,
                    eos,
                    pad,
                    settings.temperature,
                    settings.top_p,
                    on_tokens,
                )
                active = []
                for (c, p), gen in zip(keep, gens, strict=True):
                    text_ids = [t for t in gen.response_ids if t not in eos]
                    c.prompt_ids.append(p)
                    c.answers.append(
                        Answer(
                            text=tokenizer.decode(text_ids, skip_special_tokens=True),
                            reasoning=None,
                            finish_reason=gen.finish_reason,
                            prompt_tokens=len(p),
                            completion_tokens=len(gen.response_ids),
                            prompt_ids=p,
                            response_ids=gen.response_ids,
                        )
                    )
                    if c.done:
                        yield c, None
                    else:
                        active.append(c)
