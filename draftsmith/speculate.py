"""Speculative greedy decoding with a Hugging Face target and an EAGLE-3 drafter (batch size 1).

Index conventions (N = tokens known so far, prompt + generated; the last one is not yet in the target's
KV cache, so the target has features for positions 0..N-2):

    drafter entry at position t  <-  (target aux states at t, embedding of token t+1, position t)
    its output at t              ->  logits for token t+2, and the prenorm hidden state for the next step

One round, with the target cache holding c = N-1 positions and x = token N-1 the newest token:

    catch-up   feed the drafter the positions whose aux states the last target forward produced, paired
               with the token that follows each of them (`catch_up_inputs`); afterwards drafter and
               target caches both hold c positions. The last output proposes d_1 (token N).
    draft      chain k-1 more steps: hidden = previous prenorm, embedding of the token just drafted,
               position + 1. Then crop the drafter cache back to c: draft entries are recomputed from
               target features once accepted (as vLLM does).
    verify     one target forward over [x, d_1..d_k] at positions c..c+k; g_i = argmax at c+i predicts
               token N+i. n = `acceptance_length(d, g)` drafts are accepted, the target adds g_n
               (correction, or the bonus token when n == k). The target cache is cropped to c+n+1
               (x, d_1..d_n); their aux states feed the next catch-up.

tau (mean acceptance length) counts like vLLM: 1 + accepted drafts / verify steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from draftsmith.drafter import CacheKV, Eagle3Drafter
from draftsmith.layers import capture_aux, stack_aux

# ----------------------------------------------------------------------------- pure index logic


def acceptance_length(drafts: Sequence[int], target_argmax: Sequence[int]) -> int:
    """How many leading drafts the target agrees with. target_argmax[i] is the target's greedy token at
    the position of drafts[i] (the verify forward's argmax at the token before it)."""
    if len(target_argmax) < len(drafts):
        raise ValueError(
            f"need a target token for each of the {len(drafts)} drafts, got {len(target_argmax)}"
        )
    n = 0
    for d, g in zip(drafts, target_argmax, strict=False):
        if int(d) != int(g):
            break
        n += 1
    return n


def accepted_tokens(drafts: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """The tokens one verify step emits: the accepted drafts, then the target's own token at the first
    mismatch (or the bonus token after the last draft). target_argmax has len(drafts) + 1 entries."""
    if len(target_argmax) != len(drafts) + 1:
        raise ValueError(
            f"verify over {len(drafts)} drafts gives {len(drafts) + 1} target tokens, got {len(target_argmax)}"
        )
    n = acceptance_length(drafts, target_argmax)
    return [int(t) for t in drafts[:n]] + [int(target_argmax[n])]


def catch_up_inputs(tokens: Sequence[int], start: int, count: int) -> tuple[list[int], list[int]]:
    """Drafter catch-up for the `count` positions start..start+count-1 whose target aux states are new:
    (positions, next-token ids). Position t pairs with token t+1, so the newest token, which the target
    has not processed yet, is the last next-token and never a position."""
    if count < 1 or start < 0:
        raise ValueError(f"catch-up needs count >= 1 and start >= 0, got start={start} count={count}")
    if start + count != len(tokens) - 1:
        raise ValueError(
            f"catch-up over positions {start}..{start + count - 1} must end just before the newest token "
            f"(sequence length {len(tokens)})"
        )
    return list(range(start, start + count)), [int(t) for t in tokens[start + 1 : start + count + 1]]


def position_counts(accepted: Iterable[int], num_draft_tokens: int) -> tuple[list[int], list[int]]:
    """(accepts, proposals) per draft position: position i is accepted in a step when the first i+1
    drafts all were; every step proposes all k positions."""
    accepts, proposals = [0] * num_draft_tokens, [0] * num_draft_tokens
    for n in accepted:
        if not 0 <= n <= num_draft_tokens:
            raise ValueError(f"accepted count {n} outside 0..{num_draft_tokens}")
        for i in range(num_draft_tokens):
            proposals[i] += 1
            if i < n:
                accepts[i] += 1
    return accepts, proposals


def extend_until_stop(
    generated: list[int], new: Sequence[int], max_new_tokens: int, eos_ids: Iterable[int]
) -> bool:
    """Append `new` to `generated` in place, stopping after the first eos or at max_new_tokens.
    Returns True when decoding is finished."""
    eos = set(eos_ids)
    for t in new:
        if len(generated) >= max_new_tokens:
            return True
        generated.append(int(t))
        if int(t) in eos:
            return True
    return len(generated) >= max_new_tokens


# ----------------------------------------------------------------------------- results


@dataclass
class SpecResult:
    tokens: list[int]
    steps: int  # verify forwards of the target (the prefill is not one)
    accepted: list[int]  # accepted drafts per verify step
    position_accepts: list[int]  # per draft position i: steps whose first i+1 drafts were accepted
    position_proposals: list[int]  # per draft position i: steps that proposed it
    seconds: float
    num_draft_tokens: int

    @property
    def tau(self) -> float:
        """Mean acceptance length, vLLM style: 1 + accepted drafts / verify steps."""
        return 1.0 + sum(self.accepted) / self.steps if self.steps else 1.0

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted) / self.steps if self.steps else 0.0

    @property
    def acceptance_rates(self) -> list[float]:
        return [
            a / p if p else 0.0 for a, p in zip(self.position_accepts, self.position_proposals, strict=True)
        ]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(tau=self.tau, mean_accepted=self.mean_accepted, acceptance_rates=self.acceptance_rates)
        return d


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ----------------------------------------------------------------------------- proposers


class Proposer(Protocol):
    """Drafting behind one small interface, so tests can replace the drafter."""

    def reset(self) -> None: ...

    def catch_up(self, aux: Tensor, next_ids: Tensor, positions: Tensor) -> None:
        """aux [1, n, A, Ht] of positions [1, n], next_ids [1, n] = the token after each position."""
        ...

    def propose(self, k: int) -> list[int]:
        """k target-vocabulary ids continuing the sequence after the last caught-up position + 1."""
        ...


class Eagle3Proposer:
    """Chain drafting with an `Eagle3Drafter` and its own `CacheKV`."""

    def __init__(self, drafter: Eagle3Drafter, embed: nn.Module):
        self.drafter, self.embed = drafter, embed
        self.reset()

    def reset(self) -> None:
        self.kv = CacheKV()
        self.logits: Tensor | None = None  # [1, Vd] for the token after next_ids[-1]
        self.hidden: Tensor | None = None  # [1, 1, H] prenorm at the last position
        self.draft_logits: list[Tensor] = []
        self.position = -1

    def _embed(self, ids: Tensor) -> Tensor:
        return self.embed(ids).to(self.drafter.fc.weight.dtype)

    def catch_up(self, aux: Tensor, next_ids: Tensor, positions: Tensor) -> None:
        if positions[0, 0].item() != self.kv.length:
            raise RuntimeError(
                f"drafter cache holds {self.kv.length} positions, catch-up starts at {positions[0, 0]}"
            )
        dtype = self.drafter.fc.weight.dtype
        hidden = self.drafter.fuse(aux.flatten(-2).to(dtype))  # [1, n, H]
        logits, prenorm = self.drafter(self._embed(next_ids), hidden, positions, self.kv)
        self.logits, self.hidden = logits[:, -1], prenorm[:, -1:]
        self.position = int(positions[0, -1])

    def propose(self, k: int) -> list[int]:
        if self.logits is None:
            raise RuntimeError("propose() before catch_up()")
        keep = self.kv.length
        logits, hidden = self.logits, self.hidden
        out: list[int] = []
        self.draft_logits = []  # [1, Vd] per draft, for inspection
        for j in range(k):
            self.draft_logits.append(logits)
            token = self.drafter.draft_to_target(logits.argmax(-1))  # [1]
            out.append(int(token))
            if j == k - 1:
                break
            pos = torch.full((1, 1), self.position + 1 + j, dtype=torch.long, device=token.device)
            step_logits, hidden = self.drafter(self._embed(token.view(1, 1)), hidden, pos, self.kv)
            logits = step_logits[:, -1]
        self.kv.crop(keep)
        return out


# ----------------------------------------------------------------------------- decoding


def _eos_set(eos_ids: Iterable[int] | int | None) -> set[int]:
    if eos_ids is None:
        return set()
    if isinstance(eos_ids, int):
        return {eos_ids}
    return {int(i) for i in eos_ids}


def _new_cache(target: nn.Module):
    from transformers import DynamicCache

    return DynamicCache(config=target.config)


def _crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions of a HF cache (transformers 5: a negative crop removes tokens)."""
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise RuntimeError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
    if extra:
        cache.crop(-extra)


def _check_input(input_ids: Tensor, max_new_tokens: int) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [1, P] with P >= 1, got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


@torch.inference_mode()
def greedy_decode(
    target: nn.Module, input_ids: Tensor, max_new_tokens: int, eos_ids: Iterable[int] | int | None
) -> list[int]:
    """Plain greedy decoding, one token per target forward with the HF KV cache. The output includes
    the eos token that stops it."""
    _check_input(input_ids, max_new_tokens)
    eos = _eos_set(eos_ids)
    cache = _new_cache(target)
    out = target(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tokens: list[int] = []
    while True:
        x = int(out.logits[0, -1].argmax())
        if extend_until_stop(tokens, [x], max_new_tokens, eos):
            return tokens
        out = target(
            input_ids=torch.tensor([[x]], device=input_ids.device), past_key_values=cache, use_cache=True
        )


@torch.inference_mode()
def speculative_decode(
    target: nn.Module,
    drafter: Eagle3Drafter | Proposer,
    embed: nn.Module | None,
    aux_layer_ids: Sequence[int],
    input_ids: Tensor,
    max_new_tokens: int,
    num_draft_tokens: int,
    eos_ids: Iterable[int] | int | None,
) -> SpecResult:
    """Speculative greedy decoding (chain of `num_draft_tokens` drafts per target forward). Lossless:
    the tokens equal `greedy_decode`'s when the target runs in float32. `drafter` is an Eagle3Drafter
    (wrapped with `embed`, the target's input embedding) or any `Proposer`."""
    _check_input(input_ids, max_new_tokens)
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    k = num_draft_tokens
    if isinstance(drafter, Eagle3Drafter):
        if embed is None:
            raise ValueError("an Eagle3Drafter needs the target's input embedding (embed)")
        proposer: Proposer = Eagle3Proposer(drafter, embed)
    else:
        proposer = drafter
    proposer.reset()
    eos = _eos_set(eos_ids)
    device = input_ids.device
    ids = list(aux_layer_ids)

    start = time.perf_counter()
    cache = _new_cache(target)
    seq = [int(t) for t in input_ids[0].tolist()]
    generated: list[int] = []
    accepted: list[int] = []
    with capture_aux(target, ids) as captured:
        out = target(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        aux = stack_aux(captured, ids)  # [1, P, A, Ht]
        x = int(out.logits[0, -1].argmax())
        seq.append(x)
        done = extend_until_stop(generated, [x], max_new_tokens, eos)
        while not done:
            c0 = cache.get_seq_length() - aux.shape[1]  # first position of the new aux states
            positions, next_ids = catch_up_inputs(seq, c0, aux.shape[1])
            proposer.catch_up(
                aux,
                torch.tensor([next_ids], dtype=torch.long, device=device),
                torch.tensor([positions], dtype=torch.long, device=device),
            )
            drafts = [int(t) for t in proposer.propose(k)]
            if len(drafts) != k:
                raise RuntimeError(f"proposer returned {len(drafts)} drafts, expected {k}")

            c = cache.get_seq_length()  # == len(seq) - 1: x is not in the cache yet
            verify = torch.tensor([[x, *drafts]], dtype=torch.long, device=device)
            out = target(input_ids=verify, past_key_values=cache, use_cache=True)
            target_argmax = out.logits[0].argmax(-1).tolist()  # [k + 1]
            new = accepted_tokens(drafts, target_argmax)
            n = len(new) - 1
            accepted.append(n)
            _crop_cache(cache, c + n + 1)  # x, d_1..d_n are in; the new last token is not
            aux = stack_aux(captured, ids)[:, : n + 1]
            seq.extend(new)
            x = new[-1]
            done = extend_until_stop(generated, new, max_new_tokens, eos)
    seconds = time.perf_counter() - start
    accepts, proposals = position_counts(accepted, k)
    return SpecResult(
        tokens=generated,
        steps=len(accepted),
        accepted=accepted,
        position_accepts=accepts,
        position_proposals=proposals,
        seconds=seconds,
        num_draft_tokens=k,
    )
