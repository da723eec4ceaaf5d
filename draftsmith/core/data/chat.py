"""Chat rendering: training sequences exactly as the serving engine renders them, with loss masks.

A training sequence is the rendered prompt (the target's own chat template, generation prompt added)
followed by the response tokens the target produced; the loss mask is 1 on the response tokens only.
Using the generated token ids (not re-tokenised text) keeps teacher and trace identical token for token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any


def template_fingerprint(tokenizer: Any) -> str:
    """Short sha256 of the chat template text: a changed template must invalidate extracted data."""
    template = tokenizer.chat_template or ""
    if isinstance(template, dict):  # named templates
        template = "\n".join(f"{k}:{v}" for k, v in sorted(template.items()))
    return hashlib.sha256(template.encode("utf-8")).hexdigest()[:16]


def eos_token_ids(*sources: Any, required: bool = True) -> list[int]:
    """The end-of-sequence ids named by any mix of sources, sorted: a tokenizer or generation config
    (their `eos_token_id`, an int or a list), an int, a list of ints, or None (nothing). Models stop at
    any of them, so the union is the stop set. With `required`, naming none is an error."""
    ids: set[int] = set()
    for source in sources:
        value = getattr(source, "eos_token_id", source)
        if value is None:
            continue
        if isinstance(value, Iterable) and not isinstance(value, str):
            ids.update(int(i) for i in value)
        else:
            ids.add(int(value))
    if required and not ids:
        raise ValueError("neither the tokenizer nor the generation config names an eos token")
    return sorted(ids)


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` with the assistant generation prompt appended."""
    if tokenizer.chat_template is None:
        raise ValueError("the target's tokenizer has no chat template; draftsmith trains chat models only")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(i) for i in ids]


def training_sequence(prompt_ids: list[int], response_ids: list[int]) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask): prompt tokens unmasked (0), response tokens masked in (1)."""
    return list(prompt_ids) + list(response_ids), [0] * len(prompt_ids) + [1] * len(response_ids)


def assistant_message(response: str, reasoning: str | None = None) -> dict[str, str]:
    """An assistant turn as chat templates take it; thinking templates (Qwen3, DeepSeek-R1, ...) render
    `reasoning_content` in their own thinking format."""
    message = {"role": "assistant", "content": response}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def _render_full(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    return [int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)]


def render_with_response(
    tokenizer: Any, messages: list[dict[str, str]], response: str, reasoning: str | None = None
) -> tuple[list[int], list[int]]:
    """For traces without token ids (text only): render the whole conversation and mask what follows
    the prompt. Fails if the template does not render the prompt as a prefix of the full conversation,
    or drops the reasoning (the drafter would never see the thinking tokens the target generates)."""
    prompt = render_prompt(tokenizer, messages)
    full = _render_full(tokenizer, [*messages, assistant_message(response, reasoning)])
    if full[: len(prompt)] != prompt:
        raise ValueError("chat template renders the prompt differently inside the full conversation")
    if reasoning and full == _render_full(tokenizer, [*messages, assistant_message(response)]):
        raise ValueError(
            "the trace has reasoning but the chat template has no thinking format (it ignores "
            "`reasoning_content`); regenerate with an engine that returns token ids (vLLM), or use the "
            "target's own thinking template"
        )
    return full, [0] * len(prompt) + [1] * (len(full) - len(prompt))


def merge_turns(seqs: list[tuple[list[int], list[int]]]) -> tuple[tuple[list[int], list[int]], list[int]]:
    """Fold the sequences of a conversation's earlier turns into its last one.

    `seqs` holds one (ids, mask) per answered turn, in order. An earlier turn whose tokens are a prefix
    of the last sequence is already inside it: its mask is added there. A turn that is not (the template
    rewrote the history, e.g. dropped old reasoning, or the answer re-tokenises differently) must become
    a sequence of its own, so every trained token is one the serving engine saw in that position.
    Returns ((last ids, merged mask), indices of the earlier turns that did not nest).
    """
    last_ids, last_mask = seqs[-1]
    mask, separate = list(last_mask), []
    for k, (ids, turn_mask) in enumerate(seqs[:-1]):
        if last_ids[: len(ids)] == ids:
            mask[: len(ids)] = [a | b for a, b in zip(mask, turn_mask, strict=False)]
        else:
            separate.append(k)
    return (list(last_ids), mask), separate
