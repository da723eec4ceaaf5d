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

A proposer may return fewer than k drafts, or none (n-gram prompt lookup without a match): a step
without drafts is a plain one-token target forward and, as in vLLM's counters, not a "draft".

Two figures, kept apart:
    tokens per target forward   output tokens / target forwards, every forward counted (the prefill and
                                every verify step, with or without a draft): what speculation saves, and
                                the one figure that compares methods. Plain decoding is 1.0.
    tau                         vLLM's mean acceptance length, 1 + accepted drafts / drafts, over the
                                verify steps that had a draft only. A method that drafts rarely (n-gram
                                lookup) looks better on tau than it is: the steps it had nothing to say
                                on are left out.
Target forwards are counted as output tokens - accepted drafts, which both engines know per prompt
(vLLM reports accepted drafts per request, not its steps): each forward emits one token of its own plus
the drafts it accepted.

With temperature > 0 the verify step is speculative *sampling* (Leviathan et al. 2023; Chen et al.
2023): draft i with draft probability q_i is accepted with probability min(1, p_i/q_i) under the target
probability p_i, else the step emits a token from norm(max(0, p_i - q_i)) and stops; after k accepted
drafts a bonus token comes from p_k. The output is distributed exactly as plain sampling from the target
(`rejection_sample`; tests/unit/evaluation/test_speculate.py checks it statistically). Deterministic drafts (greedy
EAGLE drafts, as vLLM makes them, or n-gram lookups) are the special case q_i = one-hot.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from draftsmith.core.data.chat import eos_token_ids
from draftsmith.core.model.drafter import CacheKV, Eagle3Drafter
from draftsmith.core.model.kinds import drafter_proposer
from draftsmith.core.model.layers import capture_aux, stack_aux

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


def position_counts(
    accepted: Iterable[int], num_draft_tokens: int, proposed: Iterable[int] | None = None
) -> tuple[list[int], list[int]]:
    """(accepts, proposals) per draft position over the steps that drafted: position i is accepted in a
    step when the first i+1 drafts all were, and proposed when the step drafted more than i tokens.
    `proposed` gives each step's draft count (default: every step drafts all k); steps with 0 drafts are
    skipped, as vLLM does not count them."""
    accepted = list(accepted)
    proposed = [num_draft_tokens] * len(accepted) if proposed is None else list(proposed)
    if len(proposed) != len(accepted):
        raise ValueError(f"{len(accepted)} accepted counts but {len(proposed)} draft counts")
    accepts, proposals = [0] * num_draft_tokens, [0] * num_draft_tokens
    for n, m in zip(accepted, proposed, strict=True):
        if not 0 <= m <= num_draft_tokens or not 0 <= n <= m:
            raise ValueError(
                f"accepted {n} of {m} drafts is outside 0 <= accepted <= drafts <= {num_draft_tokens}"
            )
        for i in range(m):
            proposals[i] += 1
            if i < n:
                accepts[i] += 1
    return accepts, proposals


def acceptance_stats(
    accepted: Sequence[int], proposed: Sequence[int], num_draft_tokens: int
) -> dict[str, Any]:
    """vLLM's spec-decode counters from per-step (accepted, drafted) counts: drafts (steps with at least
    one draft), draft_tokens, accepted_tokens, accepted_per_pos, and derived tau = 1 + accepted/drafts,
    per-position rate = accepted_per_pos / drafts, draft acceptance rate = accepted / draft_tokens."""
    accepts, _ = position_counts(accepted, num_draft_tokens, proposed)
    drafts = sum(1 for m in proposed if m > 0)
    draft_tokens, total = sum(proposed), sum(accepted)
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": total,
        "accepted_per_pos": accepts,
        "tau": 1.0 + total / drafts if drafts else 1.0,
        "acceptance_rate_per_position": [a / drafts if drafts else 0.0 for a in accepts],
        "draft_acceptance_rate": total / draft_tokens if draft_tokens else 0.0,
    }


def target_forwards(tokens: int, accepted: int) -> int:
    """Target forwards that produced `tokens` output tokens with `accepted` accepted drafts: each forward
    (the prefill or a verify step, with or without drafts) emits one token of its own plus the drafts it
    accepted. Drafts accepted past a stop (eos, max_new_tokens) are counted as vLLM counts them."""
    if tokens < 0 or accepted < 0:
        raise ValueError(f"need tokens >= 0 and accepted >= 0, got {tokens} and {accepted}")
    return max(tokens - accepted, 1 if tokens else 0)


def tokens_per_forward(tokens: int, forwards: int) -> float:
    """Output tokens per target forward (1.0 for plain decoding; 1.0 with nothing decoded)."""
    return tokens / forwards if forwards > 0 else 1.0


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
    proposed: list[int] | None = None  # drafts per verify step (None: k in every step)

    @property
    def drafted(self) -> list[int]:
        return [self.num_draft_tokens] * self.steps if self.proposed is None else self.proposed

    @property
    def drafts(self) -> int:
        """Verify steps that had at least one draft (vLLM's spec_decode_num_drafts)."""
        return sum(1 for m in self.drafted if m > 0)

    @property
    def tau(self) -> float:
        """Mean acceptance length, vLLM style: 1 + accepted drafts / drafts."""
        return 1.0 + sum(self.accepted) / self.drafts if self.drafts else 1.0

    @property
    def forwards(self) -> int:
        """Target forwards, every step counted (`target_forwards`)."""
        return target_forwards(len(self.tokens), sum(self.accepted))

    @property
    def tokens_per_forward(self) -> float:
        return tokens_per_forward(len(self.tokens), self.forwards)

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted) / self.drafts if self.drafts else 0.0

    @property
    def acceptance_rates(self) -> list[float]:
        """Per draft position: accepted / drafts (vLLM's per-position acceptance rate)."""
        return [a / self.drafts if self.drafts else 0.0 for a in self.position_accepts]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            tau=self.tau,
            mean_accepted=self.mean_accepted,
            acceptance_rates=self.acceptance_rates,
            forwards=self.forwards,
            tokens_per_forward=self.tokens_per_forward,
        )
        return d


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ----------------------------------------------------------------------------- sampling


def sample_from(probs: Tensor, generator: torch.Generator | None) -> int:
    """One draw from a probability vector [V], on the CPU whatever the target's device: the seeded
    generators are CPU ones, and the same seed then draws the same token on a GPU."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def target_probs(logits: Tensor, temperature: float) -> Tensor:
    """softmax(logits / temperature) in float32 (the sampling distribution of plain decoding)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def rejection_sample(
    p: Tensor, q: Tensor | None, drafts: Sequence[int], generator: torch.Generator | None
) -> list[int]:
    """The tokens one speculative-sampling verify step emits.

    p [m+1, V]: the target's sampling distribution at the position of each draft and one past the last;
    q [m, V]: the distribution each draft was drawn from (None: deterministic drafts, q_i = one-hot).
    Draft i is accepted with probability min(1, p_i(d)/q_i(d)); the first rejected one is replaced by a
    draw from norm(max(0, p_i - q_i)) and ends the step; after m acceptances a bonus token comes from p_m.
    Every emitted token is then distributed as under plain sampling from p (lossless in distribution).
    """
    m = len(drafts)
    if p.shape[0] != m + 1 or (q is not None and q.shape[0] != m):
        raise ValueError(f"{m} drafts need p [m+1, V] and q [m, V], got {list(p.shape)} and "
                         f"{None if q is None else list(q.shape)}")  # fmt: skip
    out: list[int] = []
    for i, d in enumerate(int(t) for t in drafts):
        if q is None:
            qi = torch.zeros_like(p[i])
            qi[d] = 1.0
        else:
            qi = q[i].to(p.device, p.dtype)
        if not qi[d] > 0:
            raise ValueError(f"draft {i} (token {d}) has draft probability 0: it cannot have been drawn")
        u = torch.rand((), generator=generator, dtype=torch.float64)
        if u * float(qi[d]) < float(p[i, d]):  # u < p/q, i.e. accept with probability min(1, p/q)
            out.append(d)
            continue
        residual = (p[i] - qi).clamp(min=0)
        # total 0 only when p == q, where rejection has probability 0; fall back to p for rounding
        out.append(sample_from(residual if float(residual.sum()) > 0 else p[i], generator))
        return out
    out.append(sample_from(p[m], generator))
    return out


# ----------------------------------------------------------------------------- proposers


class Proposer(Protocol):
    """Drafting behind one small interface, so tests can replace the drafter."""

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start a new sequence with these prompt tokens."""
        ...

    def catch_up(self, aux: Tensor, next_ids: Tensor, positions: Tensor) -> None:
        """aux [1, n, A, Ht] of positions [1, n], next_ids [1, n] = the token after each position."""
        ...

    def propose(self, k: int) -> list[int]:
        """Up to k target-vocabulary ids continuing the sequence after the last caught-up position + 1."""
        ...


class Eagle3Proposer:
    """Chain drafting with an `Eagle3Drafter` and its own `CacheKV`.

    `propose` drafts greedily (argmax), as vLLM does also when sampling; `propose_sampled` can instead
    draw each draft from the drafter's softmax and return those distributions for `rejection_sample`.
    """

    def __init__(self, drafter: Eagle3Drafter, embed: nn.Module):
        self.drafter, self.embed = drafter, embed
        self.reset()

    def reset(self, prompt_ids: Sequence[int] = ()) -> None:
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

    def _chain(self, k: int, pick) -> list[int]:
        """k chained drafts; pick(draft logits [1, Vd]) -> draft-vocabulary id [1]."""
        if self.logits is None:
            raise RuntimeError("propose() before catch_up()")
        keep = self.kv.length
        logits, hidden = self.logits, self.hidden
        out: list[int] = []
        self.draft_logits = []  # [1, Vd] per draft, for inspection and sampling
        for j in range(k):
            self.draft_logits.append(logits)
            token = self.drafter.draft_to_target(pick(logits))  # [1]
            out.append(int(token))
            if j == k - 1:
                break
            pos = torch.full((1, 1), self.position + 1 + j, dtype=torch.long, device=token.device)
            step_logits, hidden = self.drafter(self._embed(token.view(1, 1)), hidden, pos, self.kv)
            logits = step_logits[:, -1]
        self.kv.crop(keep)
        return out

    def propose(self, k: int) -> list[int]:
        return self._chain(k, lambda logits: logits.argmax(-1))

    def propose_sampled(
        self, k: int, temperature: float, generator: torch.Generator | None
    ) -> tuple[list[int], Tensor]:
        """k drafts each drawn from softmax(draft logits / temperature) -> (drafts, q [k, V_target]):
        the draft distributions spread onto the target vocabulary (0 outside the draft vocabulary)."""
        drafts = self._chain(
            k, lambda logits: torch.multinomial(target_probs(logits[0], temperature), 1, generator=generator)
        )
        device = self.drafter.d2t.device
        target_ids = self.drafter.draft_to_target(
            torch.arange(self.drafter.cfg.draft_vocab_size, device=device)
        )
        q = torch.zeros(k, self.drafter.cfg.target_vocab_size, device=device)
        for j, logits in enumerate(self.draft_logits):
            q[j, target_ids] = target_probs(logits[0], temperature).to(q.device)
        return drafts, q


class PEagleProposer(Eagle3Proposer):
    """Parallel drafting (P-EAGLE) with the same drafter layer: the first draft comes from the catch-up
    pass (vLLM's bonus slot), the other k-1 from ONE pass over k-1 mask slots (the mask token, hidden
    fuse(mask_hidden)) at the next positions against the cache. vLLM runs catch-up and mask slots as one
    forward; attention is causal, so the two passes here give the same drafts."""

    def _chain(self, k: int, pick) -> list[int]:
        if self.logits is None:
            raise RuntimeError("propose() before catch_up()")
        self.draft_logits = [self.logits]  # [1, Vd] per draft
        if k > 1:
            keep, device = self.kv.length, self.drafter.d2t.device
            assert self.drafter.cfg.mask_token_id is not None  # a peagle config has one
            ids = torch.full((1, k - 1), self.drafter.cfg.mask_token_id, dtype=torch.long, device=device)
            positions = self.position + 1 + torch.arange(k - 1, device=device)[None]  # [1, k-1]
            hidden = self.drafter.fused_mask().expand(1, k - 1, -1)  # [1, k-1, H]
            logits, _ = self.drafter(self._embed(ids), hidden, positions, self.kv)  # [1, k-1, Vd]
            self.kv.crop(keep)
            self.draft_logits += list(logits[0, :, None].unbind(0))
        return [int(self.drafter.draft_to_target(pick(logits))) for logits in self.draft_logits]


def ngram_propose(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup exactly as vLLM's `ngram` method: find the longest n-gram (min_n <= n <= max_n) that
    ends the sequence and also occurs earlier, take its earliest occurrence, and propose the (up to) k
    tokens that followed it; [] when there is no match."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
    seq = [int(t) for t in tokens]
    total = len(seq)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = seq[total - n :]
        # an earlier occurrence starts at s <= total - n - 1 (it may overlap the suffix itself)
        for s in range(total - n):
            if seq[s : s + n] == suffix:
                return seq[s + n : s + n + k]
    return []


class NgramProposer:
    """n-gram prompt lookup (vLLM's `ngram` method) as a Proposer: no model, no aux states."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []

    @classmethod
    def from_settings(cls, lookup: dict[str, Any]) -> NgramProposer:
        """From evaluate.ngram_lookup (min, max: vLLM's prompt_lookup_min / prompt_lookup_max)."""
        return cls(int(lookup["min"]), int(lookup["max"]))

    def reset(self, prompt_ids: Sequence[int] = ()) -> None:
        self.tokens = [int(t) for t in prompt_ids]

    def catch_up(self, aux: Tensor, next_ids: Tensor, positions: Tensor) -> None:
        # next_ids[t] is the token at position t+1: extend the known sequence up to the newest token
        start = int(positions[0, 0]) + 1
        new = [int(t) for t in next_ids[0].tolist()]
        if start > len(self.tokens):
            raise RuntimeError(f"n-gram proposer knows {len(self.tokens)} tokens, catch-up starts at {start}")
        self.tokens[start:] = new

    def propose(self, k: int) -> list[int]:
        return ngram_propose(self.tokens, self.min_n, self.max_n, k)


class SuffixProposer:
    """Suffix decoding (vLLM's `suffix` method) as a Proposer, through the same Arctic Inference
    `SuffixDecodingCache` calls vLLM's proposer makes: a request starts with its prompt, each step adds
    the newly generated tokens to its response, and the drafts continue the sequence's last
    `max_tree_depth` tokens. With `max_cached_requests` > 0 earlier prompts' responses stay in a global
    tree, so results depend on the order prompts are decoded in (vLLM batches them; here one by one)."""

    def __init__(
        self,
        max_tree_depth: int,
        max_spec_factor: float,
        min_token_prob: float,
        max_cached_requests: int,
    ):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(
            max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests
        )
        self.max_tree_depth, self.max_spec_factor, self.min_token_prob = (
            max_tree_depth,
            max_spec_factor,
            min_token_prob,
        )
        self.tokens: list[int] = []
        self.prompt_len = 0
        self.request = 0

    @classmethod
    def from_settings(cls, suffix_decoding: dict[str, Any]) -> SuffixProposer:
        """From evaluate.suffix_decoding (its keys are this class's arguments, as vLLM's suffix_decoding_*)."""
        return cls(**suffix_decoding)

    def reset(self, prompt_ids: Sequence[int] = ()) -> None:
        if self.request in self.cache.active_requests:
            self.cache.stop_request(self.request)  # its response joins the global tree (if it keeps any)
        self.request += 1
        self.tokens = [int(t) for t in prompt_ids]
        self.prompt_len = len(self.tokens)
        self.cache.start_request(self.request, np.asarray(self.tokens, dtype=np.int32))

    def catch_up(self, aux: Tensor, next_ids: Tensor, positions: Tensor) -> None:
        start = int(positions[0, 0]) + 1
        new = [int(t) for t in next_ids[0].tolist()]
        if start > len(self.tokens):
            raise RuntimeError(f"suffix proposer knows {len(self.tokens)} tokens, catch-up starts at {start}")
        known = len(self.tokens)
        self.tokens[start:] = new
        fresh = self.tokens[max(known, self.prompt_len) :]  # tokens generated since the last step
        if fresh:
            self.cache.add_active_response(self.request, fresh)

    def propose(self, k: int) -> list[int]:
        pattern = np.asarray(self.tokens[-self.max_tree_depth :], dtype=np.int32)
        draft = self.cache.speculate(
            self.request,
            pattern,
            max_spec_tokens=k,
            max_spec_factor=self.max_spec_factor,
            min_token_prob=self.min_token_prob,
        )
        return [int(t) for t in draft.token_ids][:k]


class HybridProposer:
    """Suffix decoding where its tree has a draft, the EAGLE-3 drafter where it has none (TensorRT-LLM's
    `Eagle3DecodingConfig(use_sa_spec=True)` idea, with Arctic Inference's suffix trees): the drafter
    catches up on every step (its cache must follow the sequence) but drafts only on the steps the tree
    left empty. `sources` records which drafted each step ("suffix" or "drafter")."""

    def __init__(self, suffix: SuffixProposer, drafter: Eagle3Proposer):
        self.suffix, self.drafter = suffix, drafter
        self.sources: list[str] = []

    def reset(self, prompt_ids: Sequence[int] = ()) -> None:
        self.suffix.reset(prompt_ids)
        self.drafter.reset(prompt_ids)
        self.sources = []

    def catch_up(self, aux: Tensor, next_ids: Tensor, positions: Tensor) -> None:
        self.suffix.catch_up(aux, next_ids, positions)
        self.drafter.catch_up(aux, next_ids, positions)

    def propose(self, k: int) -> list[int]:
        drafts = self.suffix.propose(k)
        if drafts:
            self.sources.append("suffix")
            return drafts
        self.sources.append("drafter")
        return self.drafter.propose(k)


# ----------------------------------------------------------------------------- decoding


def _new_cache(target: Any):  # a transformers causal LM (its `config`)
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
    return sample_decode(target, input_ids, max_new_tokens, eos_ids, temperature=0.0)


@torch.inference_mode()
def sample_decode(
    target: nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    eos_ids: Iterable[int] | int | None,
    temperature: float,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Plain decoding, one token per target forward: greedy at temperature 0, else sampling from
    softmax(logits / temperature). The output includes the eos token that stops it."""
    _check_input(input_ids, max_new_tokens)
    eos = set(eos_token_ids(eos_ids, required=False))
    cache = _new_cache(target)
    out = target(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tokens: list[int] = []
    while True:
        logits = out.logits[0, -1]
        x = (
            int(logits.argmax())
            if temperature <= 0
            else sample_from(target_probs(logits, temperature), generator)
        )
        if extend_until_stop(tokens, [x], max_new_tokens, eos):
            return tokens
        out = target(
            input_ids=torch.tensor([[x]], device=input_ids.device), past_key_values=cache, use_cache=True
        )


def _aux(captured: dict[int, Tensor], ids: list[int], length: int) -> Tensor:
    """The last forward's aux states [1, T, A, Ht]; a proposer without a model (n-gram) takes none and
    gets an empty [1, T, 0, 0] that still carries the position count."""
    return stack_aux(captured, ids) if ids else torch.zeros(1, length, 0, 0)


def _propose(
    proposer: Proposer, k: int, temperature: float, generator: torch.Generator | None, draft_sampling: str
) -> tuple[list[int], Tensor | None]:
    """(drafts, q): greedy/deterministic drafts have q None; sampled drafts carry their distributions."""
    if temperature > 0 and draft_sampling == "sample":
        sampled = getattr(proposer, "propose_sampled", None)
        if sampled is None:
            raise ValueError(f"{type(proposer).__name__} cannot sample drafts; use draft_sampling='greedy'")
        drafts, q = sampled(k, temperature, generator)
        return [int(t) for t in drafts], q
    return [int(t) for t in proposer.propose(k)], None


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
    temperature: float,
    generator: torch.Generator | None = None,
    draft_sampling: str = "greedy",
) -> SpecResult:
    """Speculative decoding (a chain of up to `num_draft_tokens` drafts per target forward).

    temperature 0: greedy, lossless token for token (the tokens equal `greedy_decode`'s when the target
    runs in float32). temperature > 0: speculative sampling (`rejection_sample`), distributed exactly as
    `sample_decode`; drafts are greedy (vLLM's default) or, with draft_sampling="sample", drawn from the
    drafter. `drafter` is an Eagle3Drafter (wrapped with `embed`, the target's input embedding) or any
    `Proposer`.
    """
    _check_input(input_ids, max_new_tokens)
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    if draft_sampling not in ("greedy", "sample"):
        raise ValueError(f"draft_sampling must be 'greedy' or 'sample', got {draft_sampling!r}")
    k = num_draft_tokens
    if isinstance(drafter, Eagle3Drafter):
        if embed is None:
            raise ValueError("an Eagle3Drafter needs the target's input embedding (embed)")
        proposer: Proposer = drafter_proposer(drafter, embed)  # as vLLM serves its kind
    else:
        proposer = drafter
    seq = [int(t) for t in input_ids[0].tolist()]
    proposer.reset(seq)
    eos = set(eos_token_ids(eos_ids, required=False))
    device = input_ids.device
    ids = list(aux_layer_ids)

    def first_token(logits: Tensor) -> int:
        return (
            int(logits.argmax())
            if temperature <= 0
            else sample_from(target_probs(logits, temperature), generator)
        )

    start = time.perf_counter()
    cache = _new_cache(target)
    generated: list[int] = []
    accepted: list[int] = []
    proposed: list[int] = []
    with capture_aux(target, ids) as captured:
        out = target(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        aux = _aux(captured, ids, input_ids.shape[1])  # [1, P, A, Ht]
        x = first_token(out.logits[0, -1])
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
            drafts, q = _propose(proposer, k, temperature, generator, draft_sampling)
            if len(drafts) > k:
                raise RuntimeError(f"proposer returned {len(drafts)} drafts, at most {k} allowed")

            c = cache.get_seq_length()  # == len(seq) - 1: x is not in the cache yet
            verify = torch.tensor([[x, *drafts]], dtype=torch.long, device=device)
            out = target(input_ids=verify, past_key_values=cache, use_cache=True)
            if temperature <= 0:
                new = accepted_tokens(drafts, out.logits[0].argmax(-1).tolist())  # [m + 1] argmaxes
            else:
                new = rejection_sample(target_probs(out.logits[0], temperature), q, drafts, generator)
            n = len(new) - 1
            accepted.append(n)
            proposed.append(len(drafts))
            _crop_cache(cache, c + n + 1)  # x, d_1..d_n are in; the new last token is not
            aux = _aux(captured, ids, verify.shape[1])[:, : n + 1]
            seq.extend(new)
            x = new[-1]
            done = extend_until_stop(generated, new, max_new_tokens, eos)
    seconds = time.perf_counter() - start
    accepts, proposals = position_counts(accepted, k, proposed)
    return SpecResult(
        tokens=generated,
        steps=len(accepted),
        accepted=accepted,
        position_accepts=accepts,
        position_proposals=proposals,
        seconds=seconds,
        num_draft_tokens=k,
        proposed=proposed,
    )
