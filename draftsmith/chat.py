"""Chat rendering: training sequences exactly as the serving engine renders them, with loss masks.

A training sequence is the rendered prompt (the target's own chat template, generation prompt added)
followed by the response tokens the target produced; the loss mask is 1 on the response tokens only.
Using the generated token ids (not re-tokenised text) keeps teacher and trace identical token for token.
"""

from __future__ import annotations

import hashlib
from typing import Any


def template_fingerprint(tokenizer: Any) -> str:
    """Short sha256 of the chat template text: a changed template must invalidate extracted data."""
    template = tokenizer.chat_template or ""
    if isinstance(template, dict):  # named templates
        template = "\n".join(f"{k}:{v}" for k, v in sorted(template.items()))
    return hashlib.sha256(template.encode("utf-8")).hexdigest()[:16]


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


def render_with_response(
    tokenizer: Any, messages: list[dict[str, str]], response: str
) -> tuple[list[int], list[int]]:
    """For traces without token ids (text only): render the whole conversation and mask what follows
    the prompt. Fails if the template does not render the prompt as a prefix of the full conversation."""
    prompt = render_prompt(tokenizer, messages)
    out = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": response}], add_generation_prompt=False, tokenize=True
    )
    full = [int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)]
    if full[: len(prompt)] != prompt:
        raise ValueError("chat template renders the prompt differently inside the full conversation")
    return full, [0] * len(prompt) + [1] * (len(full) - len(prompt))
