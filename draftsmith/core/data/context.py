"""How long the evaluation's sequences are: from its own prompts, not a fixed 2048 tokens.

vLLM refuses a prompt at its max_model_len after the engine has loaded (the whole batch fails), and stops
a prompt + answer that reaches it early: a measurement cut short. So the evaluation's engines are sized
from the longest encoded prompt, and a prompt that cannot fit the target's own context is refused at
start, naming its file and line. Torch-free: the workflow's parse reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

# vLLM's scheduler keeps a request below max_model_len - 1 and shortens the draft of a request whose
# draft slots would pass it: a measurement near the end of an answer would then differ from the offline
# decoder's, which never shortens. Parallel drafting (P-EAGLE) fills up to 2k slots past the sequence (k
# catch-up and k mask slots), so room for 2k, and one slot more.
DRAFT_MARGIN = 1
# A chat template's own tokens per message (role headers, separators) and for the generation prompt: a
# generous bound, for the byte-length test below (SmolLM2's: 5 per message, Llama-3's: 5, Kimi's: 4).
TEMPLATE_TOKENS = 64


def sequence_tokens(prompt_tokens: int, max_new_tokens: int, num_draft_tokens: int) -> int:
    """Token slots one request needs in vLLM: its prompt, its whole answer, room for a parallel draft."""
    return prompt_tokens + max_new_tokens + 2 * num_draft_tokens + DRAFT_MARGIN


def evaluation_model_len(prompt_lengths: Iterable[int], max_new_tokens: int, num_draft_tokens: int) -> int:
    """vLLM's max_model_len for an evaluation batch: the longest prompt's need (sequence_tokens)."""
    return sequence_tokens(max(prompt_lengths, default=0), max_new_tokens, num_draft_tokens)


def token_bound(messages: Sequence[dict[str, Any]]) -> int:
    """An upper bound on a prompt's tokens without its tokenizer: every token of a byte-level (or byte
    fallback) vocabulary covers at least one UTF-8 byte, plus the template's own tokens."""
    text = sum(len(str(m.get("content") or "").encode("utf-8")) for m in messages)
    return text + TEMPLATE_TOKENS * (len(messages) + 1)


def context_errors(
    key: str,
    places: Sequence[str],
    lengths: Sequence[int],
    max_new_tokens: int,
    num_draft_tokens: int,
    limit: int,
    limit_name: str,
) -> list[str]:
    """One line per prompt (at `places[i]`, "file:LINE", of `lengths[i]` tokens) whose request cannot fit
    `limit` tokens (limit_name says whose: the target's max_position_embeddings, the plan's)."""
    errors = []
    for place, tokens in zip(places, lengths, strict=True):
        need = sequence_tokens(tokens, max_new_tokens, num_draft_tokens)
        if need > limit:
            errors.append(
                f"{key}: {place}: the prompt is {tokens:,} tokens; with evaluate.max_new_tokens "
                f"{max_new_tokens} and {num_draft_tokens} draft positions it needs {need:,} of the "
                f"{limit:,} the target holds ({limit_name}): shorten or drop it"
            )
    return errors
