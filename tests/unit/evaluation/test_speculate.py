"""Speculative decoding: index logic, losslessness against plain greedy, and acceptance accounting."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.model import fp_tolerance

from draftsmith.core.data.vocab import vocab_maps
from draftsmith.core.evaluation.methods import METHODS
from draftsmith.core.evaluation.speculate import (
    Eagle3Proposer,
    NgramProposer,
    SpecResult,
    SuffixProposer,
    acceptance_length,
    acceptance_stats,
    accepted_tokens,
    catch_up_inputs,
    extend_until_stop,
    first_difference,
    greedy_decode,
    ngram_propose,
    position_counts,
    rejection_sample,
    sample_decode,
    speculative_decode,
)
from draftsmith.core.model.drafter import DrafterConfig, Eagle3Drafter

VOCAB = 96
AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,  # spread-out logits: greedy argmax far from ties
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    cfg = DrafterConfig.from_target(target.config, draft_vocab_size=64, num_aux=len(AUX))
    d = Eagle3Drafter(cfg)
    draft_ids = torch.sort(torch.randperm(VOCAB)[:64]).values
    d.set_vocab_map(*vocab_maps(draft_ids, VOCAB))
    d.init_from_target(target.lm_head.weight, target.model.norm.weight)
    return d.float().eval()


def prompt(seed: int, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, length), generator=g)


PROMPTS = [(11, 1), (12, 5), (13, 17)]


# ----------------------------------------------------------------------------- pure functions


def test_acceptance_length():
    assert acceptance_length([5, 6, 7], [5, 6, 7, 8]) == 3
    assert acceptance_length([5, 6, 7], [5, 9, 7, 8]) == 1  # later agreement does not count
    assert acceptance_length([5, 6, 7], [4, 6, 7, 8]) == 0
    assert acceptance_length([], [3]) == 0
    with pytest.raises(ValueError):
        acceptance_length([1, 2], [1])


def test_accepted_tokens():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accepted_tokens([5, 6, 7], [5, 9, 1, 2]) == [5, 9]  # correction at the first mismatch
    assert accepted_tokens([5, 6, 7], [4, 6, 7, 8]) == [4]
    with pytest.raises(ValueError):
        accepted_tokens([5, 6], [5, 6])


def test_catch_up_inputs():
    # prompt of 4 tokens + first new token x: positions 0..3 pair with tokens 1..4 (x last)
    seq = [10, 11, 12, 13, 14]
    assert catch_up_inputs(seq, 0, 4) == ([0, 1, 2, 3], [11, 12, 13, 14])
    # after a verify that accepted 1 draft: cache had 4, aux for 2 positions (x, d1), correction appended
    seq = [10, 11, 12, 13, 14, 15, 16]
    assert catch_up_inputs(seq, 4, 2) == ([4, 5], [15, 16])
    with pytest.raises(ValueError):
        catch_up_inputs(seq, 4, 3)  # would need the token after the newest one
    with pytest.raises(ValueError):
        catch_up_inputs(seq, 3, 2)  # leaves the newest position-less token two behind


def test_position_counts():
    accepts, proposals = position_counts([0, 3, 1, 2], 3)
    assert proposals == [4, 4, 4]
    assert accepts == [3, 2, 1]
    with pytest.raises(ValueError):
        position_counts([4], 3)


def test_extend_until_stop():
    out: list[int] = []
    assert not extend_until_stop(out, [1, 2], 5, {9})
    assert extend_until_stop(out, [3, 9, 4], 5, {9}) and out == [1, 2, 3, 9]
    out = [1, 2, 3]
    assert extend_until_stop(out, [4, 5, 6], 5, {9}) and out == [1, 2, 3, 4, 5]
    out = []
    assert extend_until_stop(out, [7], 1, set()) and out == [7]


def test_first_difference_and_tau():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    r = SpecResult(tokens=[], steps=4, accepted=[0, 3, 1, 2], position_accepts=[3, 2, 1],
                   position_proposals=[4, 4, 4], seconds=0.0, num_draft_tokens=3)  # fmt: skip
    assert r.tau == pytest.approx(2.5) and r.mean_accepted == pytest.approx(1.5)
    assert r.acceptance_rates == pytest.approx([0.75, 0.5, 0.25])


# ----------------------------------------------------------------------------- fake proposers


class ReferenceProposer:
    """Proposes from a known continuation `ref` (prompt + greedy tokens); `correct(step, i)` decides
    whether draft i of a step is the reference token or a wrong one."""

    def __init__(self, ref: list[int], correct=lambda step, i: True):
        self.ref, self.correct = ref, correct
        self.reset()

    def reset(self, prompt_ids=()) -> None:
        self.last = -1
        self.step = 0
        self.expected: list[int] = []  # leading correct drafts per step

    def catch_up(self, aux, next_ids, positions) -> None:
        assert aux.shape[:2] == next_ids.shape == positions.shape
        assert positions[0, 0].item() == self.last + 1, "catch-up must continue where the last one ended"
        assert next_ids[0].tolist() == self.ref[positions[0, 0] + 1 : positions[0, -1] + 2]
        self.last = int(positions[0, -1])

    def propose(self, k: int) -> list[int]:
        base = self.last + 2  # last position t pairs with token t+1 -> drafts start at t+2
        out, lead = [], None
        for i in range(k):
            tok = self.ref[base + i]
            if not self.correct(self.step, i):
                tok = (tok + 1) % VOCAB
                lead = i if lead is None else lead
            out.append(tok)
        self.expected.append(k if lead is None else lead)
        self.step += 1
        return out


def reference(target, ids, n):
    return ids[0].tolist() + greedy_decode(target, ids, n, eos_ids=None)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_perfect_proposer_accepts_everything(target, k):
    ids = prompt(21, 6)
    steps = 4
    max_new = 1 + steps * (k + 1)  # the prefill token, then full chains that end exactly at the limit
    ref = reference(target, ids, max_new + k + 1)
    res = speculative_decode(
        target, ReferenceProposer(ref), None, AUX, ids, max_new, k, eos_ids=None, temperature=0.0
    )
    assert res.tokens == ref[ids.shape[1] :][:max_new]
    assert res.steps == steps and res.accepted == [k] * steps
    assert res.tau == k + 1
    assert res.acceptance_rates == [1.0] * k and res.position_proposals == [steps] * k


def test_wrong_proposer_accepts_nothing(target):
    ids, k, max_new = prompt(22, 4), 3, 12
    ref = reference(target, ids, max_new + k + 1)
    res = speculative_decode(
        target,
        ReferenceProposer(ref, lambda s, i: False),
        None,
        AUX,
        ids,
        max_new,
        k,
        eos_ids=None,
        temperature=0.0,
    )
    assert res.tokens == ref[ids.shape[1] :][:max_new]
    assert res.steps == max_new - 1 and res.tau == 1.0
    assert res.acceptance_rates == [0.0] * k


@pytest.mark.parametrize("k", [2, 4])
def test_partial_acceptance_accounting(target, k):
    rng = random.Random(k)
    decisions: dict[tuple[int, int], bool] = {}

    def correct(step, i):
        return decisions.setdefault((step, i), rng.random() < 0.7)

    ids, max_new = prompt(23, 7), 30
    ref = reference(target, ids, max_new + k + 1)
    proposer = ReferenceProposer(ref, correct)
    res = speculative_decode(target, proposer, None, AUX, ids, max_new, k, eos_ids=None, temperature=0.0)
    assert res.tokens == ref[ids.shape[1] :][:max_new]
    assert res.accepted == proposer.expected
    assert 0 < sum(res.accepted) < k * res.steps
    assert res.position_accepts == position_counts(proposer.expected, k)[0]
    # every step emits accepted + 1 tokens; only the last one may be cut by max_new_tokens
    emitted = 1 + sum(n + 1 for n in res.accepted)
    assert max_new <= emitted < max_new + k + 1


# ----------------------------------------------------------------------------- real drafter


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("seed,length", PROMPTS)
def test_speculative_equals_greedy(target, drafter, k, seed, length):
    ids, max_new = prompt(seed, length), 23
    plain = greedy_decode(target, ids, max_new, eos_ids=[])
    res = speculative_decode(
        target, drafter, target.get_input_embeddings(), AUX, ids, max_new, k, eos_ids=[], temperature=0.0
    )
    assert res.tokens == plain
    assert len(plain) == max_new  # max_new_tokens hit exactly
    assert res.steps >= 1 and len(res.accepted) == res.steps
    assert all(p == res.steps for p in res.position_proposals)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_stops_at_eos(target, drafter, k):
    for seed, length in PROMPTS:
        ids = prompt(seed, length)
        free = greedy_decode(target, ids, 40, eos_ids=[])
        # an eos that first appears mid-way through the continuation
        stop_at = next((i for i in range(3, len(free)) if free[i] not in free[:i]), None)
        if stop_at is None:
            continue
        eos = [free[stop_at], VOCAB - 1 if free[stop_at] != VOCAB - 1 else 0]
        eos = [e for e in eos if e not in free[:stop_at]]
        plain = greedy_decode(target, ids, 40, eos_ids=eos)
        assert plain == free[: stop_at + 1]
        res = speculative_decode(
            target, drafter, target.get_input_embeddings(), AUX, ids, 40, k, eos_ids=eos, temperature=0.0
        )
        assert res.tokens == plain
        return
    pytest.skip("no prompt produced a fresh token to use as eos")


def test_max_new_tokens_one(target, drafter):
    ids = prompt(5, 3)
    res = speculative_decode(
        target, drafter, target.get_input_embeddings(), AUX, ids, 1, 3, eos_ids=None, temperature=0.0
    )
    assert res.tokens == greedy_decode(target, ids, 1, eos_ids=None)
    assert res.steps == 0 and res.tau == 1.0


class CheckingProposer(Eagle3Proposer):
    """Checks the cached drafter against a fresh one fed the whole history at once, and records every
    aux state that was caught up, to compare with the target's hidden_states."""

    def reset(self, prompt_ids=()) -> None:
        super().reset(prompt_ids)
        self.history: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def catch_up(self, aux, next_ids, positions) -> None:
        self.history.append((aux, next_ids, positions))
        super().catch_up(aux, next_ids, positions)

    def propose(self, k: int) -> list[int]:
        before = self.kv.length
        out = super().propose(k)
        assert self.kv.length == before, "draft entries must be cropped from the drafter cache"
        fresh = Eagle3Proposer(self.drafter, self.embed)
        fresh.catch_up(*(torch.cat(parts, dim=1) for parts in zip(*self.history, strict=True)))
        # fp32, cached vs whole history: fc (3H) -> decoder layer (4 matmuls) -> lm_head; longest sum 3H
        depth, sums = 6, 3 * self.drafter.cfg.hidden_size
        tol = fp_tolerance(torch.float32, depth, sums, scale=fresh.logits.abs().max())
        torch.testing.assert_close(fresh.logits, self.logits, **tol)
        assert fresh.propose(k) == out
        assert out[:1] == super().propose(1)  # a shorter chain is a prefix
        return out


class OracleMixProposer(CheckingProposer):
    """A random drafter is (almost) never accepted; to exercise multi-token catch-ups through the real
    drafter, replace a random number of leading drafts with the target's own continuation."""

    def __init__(self, drafter, embed, ref: list[int], seed: int):
        self.ref, self.rng, self.leads = ref, random.Random(seed), []
        super().__init__(drafter, embed)

    def propose(self, k: int) -> list[int]:
        out = super().propose(k)
        lead = self.rng.randint(0, k)
        self.leads.append(lead)
        base = self.position + 2
        return self.ref[base : base + lead] + out[lead:]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_drafter_cache_and_aux_bookkeeping(target, drafter, k):
    ids, max_new = prompt(31, 9), 40
    ref = reference(target, ids, max_new + k + 1)
    proposer = OracleMixProposer(drafter, target.get_input_embeddings(), ref, seed=k)
    res = speculative_decode(target, proposer, None, AUX, ids, max_new, k, eos_ids=None, temperature=0.0)
    assert res.tokens == ref[ids.shape[1] :][:max_new]
    assert all(n >= lead for n, lead in zip(res.accepted, proposer.leads, strict=True))
    assert any(n > 0 for n in res.accepted) and any(n < k for n in res.accepted)
    seq = torch.tensor([ids[0].tolist() + res.tokens])
    aux, next_ids, positions = (torch.cat(parts, dim=1) for parts in zip(*proposer.history, strict=True))
    n = positions.shape[1]
    assert positions[0].tolist() == list(range(n))
    assert next_ids[0].tolist() == seq[0, 1 : n + 1].tolist()
    with torch.no_grad():
        hs = target(seq[:, :n], output_hidden_states=True).hidden_states
    want = torch.stack([hs[i] for i in AUX], dim=2)
    # fp32, KV-cached verify steps vs one full forward: up to max(AUX) layers of 4 chained matmuls each,
    # longest sum the MLP's intermediate size (the attention spans fewer positions here)
    depth, sums = 4 * max(AUX), target.config.intermediate_size
    tol = fp_tolerance(torch.float32, depth, sums, scale=want.abs().max())
    torch.testing.assert_close(aux, want, **tol)


def test_bad_arguments(target, drafter):
    embed = target.get_input_embeddings()
    with pytest.raises(ValueError):
        speculative_decode(target, drafter, embed, AUX, prompt(1, 3), 5, 0, eos_ids=None, temperature=0.0)
    with pytest.raises(ValueError):
        speculative_decode(target, drafter, None, AUX, prompt(1, 3), 5, 2, eos_ids=None, temperature=0.0)
    with pytest.raises(ValueError):
        greedy_decode(target, prompt(1, 3), 0, eos_ids=None)


def test_chain_step_inputs(drafter, target):
    """Draft step j feeds (embedding of draft j, prenorm of step j-1) at the next position, attending to
    the caught-up cache and the earlier drafts (vLLM's chain: positions += 1 per step)."""
    from draftsmith.core.model.drafter import CacheKV

    torch.manual_seed(3)
    embed = target.get_input_embeddings()
    n, ht = 6, target.config.hidden_size
    aux = torch.randn(1, n, len(AUX), ht)
    next_ids = torch.randint(0, VOCAB, (1, n))
    positions = torch.arange(n)[None]
    proposer = Eagle3Proposer(drafter, embed)
    proposer.catch_up(aux, next_ids, positions)
    drafts = proposer.propose(3)
    assert proposer.kv.length == n

    kv = CacheKV()
    with torch.no_grad():
        logits, hidden = drafter(embed(next_ids), drafter.fuse(aux.flatten(-2)), positions, kv)
        logits, hidden = logits[:, -1:], hidden[:, -1:]
        expected, expected_logits = [], []
        for j in range(3):
            expected_logits.append(logits[:, -1])
            tok = drafter.draft_to_target(logits[0, -1].argmax())
            expected.append(int(tok))
            logits, hidden = drafter(embed(tok.view(1, 1)), hidden, torch.tensor([[n + j]]), kv)
    assert drafts == expected
    for got, want in zip(proposer.draft_logits, expected_logits, strict=True):
        torch.testing.assert_close(got, want)


# ----------------------------------------------------------------------------- variable drafts, n-gram


def test_position_counts_with_short_and_empty_drafts():
    # steps drafted 3, 0, 2, 1 tokens and accepted 2, 0, 2, 0
    accepts, proposals = position_counts([2, 0, 2, 0], 3, proposed=[3, 0, 2, 1])
    assert proposals == [3, 2, 1] and accepts == [2, 2, 0]
    with pytest.raises(ValueError):
        position_counts([2], 3, proposed=[1])  # more accepted than drafted
    stats = acceptance_stats([2, 0, 2, 0], [3, 0, 2, 1], 3)
    # vLLM: the step without drafts is not a draft; tau = 1 + accepted / drafts
    assert stats["drafts"] == 3 and stats["draft_tokens"] == 6 and stats["accepted_tokens"] == 4
    assert stats["tau"] == pytest.approx(1 + 4 / 3)
    assert stats["accepted_per_pos"] == [2, 2, 0]
    assert stats["acceptance_rate_per_position"] == pytest.approx([2 / 3, 2 / 3, 0.0])
    assert stats["draft_acceptance_rate"] == pytest.approx(4 / 6)


@pytest.mark.parametrize(
    "tokens,k,expected",
    [
        ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),  # suffix [1, 2] seen at 0
        ([5, 6, 7, 5, 6, 8, 5, 6], 3, [7, 5, 6]),  # two earlier matches: the earliest wins
        ([1, 2, 9, 3, 1, 2, 7, 0, 3, 1, 2], 3, [7, 0, 3]),  # the longer match [3, 1, 2] beats [1, 2] at 0
        ([4, 4, 4, 4], 3, [4]),  # overlapping match; only one token follows it
        ([1, 2, 3, 1, 2], 1, [3]),
        ([1, 2, 3, 4], 3, []),  # no repeated bigram
        ([7, 7], 3, []),  # shorter than min_n + 1: nothing earlier to match
        ([3], 2, []),
    ],
)
def test_ngram_propose_matches_vllm_rules(tokens, k, expected):
    assert ngram_propose(tokens, 2, 4, k) == expected


def test_ngram_propose_caps_the_match_at_max_n():
    # the 5-token suffix repeats, but max_n = 2 looks only at [8, 9]: earliest [8, 9] is at 0
    seq = [8, 9, 1, 5, 6, 7, 8, 9, 2, 5, 6, 7, 8, 9]
    assert ngram_propose(seq, 2, 2, 2) == [1, 5]
    assert ngram_propose(seq, 2, 5, 2) == [2, 5]  # [5, 6, 7, 8, 9] at 3 -> followed by 2, 5
    with pytest.raises(ValueError):
        ngram_propose(seq, 3, 2, 1)


def test_ngram_speculation_is_lossless_and_counts_like_vllm(target):
    # a repetitive prompt, so lookups find matches and some steps have none
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9, 5, 6]])
    max_new = 30
    plain = greedy_decode(target, ids, max_new, eos_ids=[])
    res = speculative_decode(
        target, NgramProposer(2, 4), None, [], ids, max_new, 3, eos_ids=[], temperature=0.0
    )
    assert res.tokens == plain
    assert res.drafts >= 1 and any(m == 0 for m in res.drafted)  # steps without a match exist
    assert res.drafts == sum(1 for m in res.drafted if m > 0) < res.steps
    assert all(n <= m for n, m in zip(res.accepted, res.drafted, strict=True))
    assert res.tau == pytest.approx(1 + sum(res.accepted) / res.drafts)
    # the proposer saw the whole sequence, prompt included
    seq = ids[0].tolist() + res.tokens
    prop = NgramProposer(2, 4)
    prop.reset(ids[0].tolist())
    assert prop.tokens == seq[: ids.shape[1]]


def test_suffix_speculation_is_lossless_and_drafts_from_the_sequence_itself(target):
    """Suffix decoding through Arctic Inference's tree (the calls vLLM's proposer makes): lossless, and
    it drafts what followed the sequence's end earlier in the prompt or in its own output."""
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9, 5, 6]])
    max_new = 30
    plain = greedy_decode(target, ids, max_new, eos_ids=[])
    proposer = SuffixProposer(
        max_tree_depth=24, max_spec_factor=1.0, min_token_prob=0.1, max_cached_requests=0
    )
    res = speculative_decode(target, proposer, None, [], ids, max_new, 3, eos_ids=[], temperature=0.0)
    assert res.tokens == plain
    assert res.drafts >= 1 and all(0 <= m <= 3 for m in res.drafted)
    assert (
        proposer.tokens == ids[0].tolist() + plain[:-1] or proposer.tokens[: ids.shape[1]] == ids[0].tolist()
    )
    # a fresh request: the pattern 5, 6 was followed by 7 in the prompt, so it is drafted
    fresh = METHODS["suffix"].offline_proposer({"max_cached_requests": 0})
    fresh.reset([5, 6, 7, 8, 5, 6, 7, 8, 5, 6])
    assert fresh.propose(2)[:1] == [7]
    # a second prompt starts its own request: nothing of the first is cached with max_cached_requests 0
    fresh.reset([1, 2, 3])
    assert fresh.propose(3) == []


def test_the_hybrid_drafts_with_the_tree_else_the_drafter_losslessly(target, drafter):
    from draftsmith.core.evaluation.speculate import Eagle3Proposer, HybridProposer

    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9, 5, 6]])
    plain = greedy_decode(target, ids, 30, eos_ids=[])
    hybrid = HybridProposer(
        METHODS["suffix"].offline_proposer({}), Eagle3Proposer(drafter, target.get_input_embeddings())
    )
    res = speculative_decode(target, hybrid, None, AUX, ids, 30, 3, eos_ids=[], temperature=0.0)
    assert res.tokens == plain
    assert len(hybrid.sources) == res.steps and set(hybrid.sources) <= {"suffix", "drafter"}
    # the drafter drafts every step the tree left empty: every step drafted something
    assert "drafter" in hybrid.sources and res.drafts == res.steps


# ----------------------------------------------------------------------------- speculative sampling


def chi_square(counts: list[int], probs: list[float]) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom, cells with expected count < 5 merged into one."""
    n = sum(counts)
    stat, merged_c, merged_e, cells = 0.0, 0, 0.0, 0
    for c, p in zip(counts, probs, strict=True):
        e = n * p
        if e < 5:
            merged_c, merged_e = merged_c + c, merged_e + e
            continue
        stat += (c - e) ** 2 / e
        cells += 1
    if merged_e > 0:
        stat += (merged_c - merged_e) ** 2 / merged_e
        cells += 1
    return stat, cells - 1


def chi_square_critical(df: int, z: float = 3.29) -> float:
    """Upper 0.9995 quantile of chi-square(df) (Wilson-Hilferty); a fixed-seed test far from flaky."""
    a = 2 / (9 * df)
    return df * (1 - a + z * a**0.5) ** 3


def assert_distributed_as(samples: list[int], probs: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).tolist()
    stat, df = chi_square(counts, probs.tolist())
    assert stat < chi_square_critical(df), f"chi-square {stat:.1f} >= {chi_square_critical(df):.1f} (df {df})"


def test_chi_square_detects_a_biased_sampler():
    """The test above has power: samples from q (what an always-accepting verifier emits) fail it."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    with pytest.raises(AssertionError):
        assert_distributed_as(torch.multinomial(q, 4000, replacement=True, generator=g).tolist(), p)
    assert_distributed_as(torch.multinomial(p, 4000, replacement=True, generator=g).tolist(), p)


@pytest.mark.parametrize("sampled_drafts", [True, False])
def test_rejection_sample_is_distributed_as_the_target(sampled_drafts):
    """Per position: the emitted token ~ p_0; and after an accepted first draft, the next ~ p_1."""
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.45, 0.25, 0.15, 0.1, 0.05], [0.05, 0.1, 0.2, 0.3, 0.35], [0.2] * 5])
    q = torch.tensor([[0.1, 0.4, 0.3, 0.1, 0.1], [0.3, 0.3, 0.2, 0.1, 0.1]])
    first, second, accepted_any = [], [], 0
    for _ in range(6000):
        if sampled_drafts:
            drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
            out = rejection_sample(p, q, drafts, g)
        else:  # deterministic drafts (greedy EAGLE, n-gram): q is one-hot
            drafts = [1, 4]
            out = rejection_sample(p, None, drafts, g)
        assert 1 <= len(out) <= 3 and out[:-1] == drafts[: len(out) - 1]
        first.append(out[0])
        if len(out) >= 2:
            second.append(out[1])
            accepted_any += 1
    assert_distributed_as(first, p[0])
    assert accepted_any > 500
    assert_distributed_as(second, p[1])


def test_rejection_sample_rejects_impossible_drafts():
    p = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    with pytest.raises(ValueError, match="draft probability 0"):
        rejection_sample(p, torch.tensor([[1.0, 0.0]]), [1], None)
    with pytest.raises(ValueError):
        rejection_sample(p, None, [0, 1], None)  # 2 drafts need 3 rows of p


SMALL_V = 8


@pytest.fixture(scope="module")
def small_pair():
    """A target with an 8-token vocabulary (distributions can be enumerated) and a random drafter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=SMALL_V, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      initializer_range=0.4, tie_word_embeddings=False)  # fmt: skip
    tgt = LlamaForCausalLM(cfg).float().eval()
    torch.manual_seed(6)
    d = Eagle3Drafter(DrafterConfig.from_target(cfg, draft_vocab_size=SMALL_V, num_aux=len(AUX)))
    d.set_vocab_map(*vocab_maps(torch.arange(SMALL_V), SMALL_V))
    d.init_from_target(tgt.lm_head.weight, tgt.model.norm.weight)
    return tgt, d.float().eval()


def exact_marginals(target, prompt: list[int], temperature: float, n: int) -> list[torch.Tensor]:
    """Exact distributions of generated tokens 1..n under plain sampling, by enumerating prefixes."""
    marginals = []
    prefixes, weights = [[]], torch.ones(1)
    with torch.no_grad():
        for _ in range(n):
            ids = torch.tensor([prompt + pre for pre in prefixes])
            probs = torch.softmax(target(ids).logits[:, -1].double() / temperature, -1)  # [P, V]
            joint = weights[:, None] * probs
            marginals.append(joint.sum(0))
            prefixes = [pre + [t] for pre in prefixes for t in range(SMALL_V)]
            weights = joint.flatten()
    return marginals


class TargetGreedyProposer:
    """Deterministic drafts (q one-hot, the n-gram / greedy-EAGLE case) that the target often accepts:
    its own greedy chain."""

    def __init__(self, target):
        self.target = target

    def reset(self, prompt_ids=()) -> None:
        self.tokens = list(prompt_ids)

    def catch_up(self, aux, next_ids, positions) -> None:
        self.tokens[int(positions[0, 0]) + 1 :] = next_ids[0].tolist()

    def propose(self, k: int) -> list[int]:
        seq = list(self.tokens)
        with torch.no_grad():
            for _ in range(k):
                seq.append(int(self.target(torch.tensor([seq])).logits[0, -1].argmax()))
        return seq[len(self.tokens) :]


@pytest.fixture()
def one_thread():
    """Tiny forwards in a loop: a second thread only adds spin-waiting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("drafts", ["sampled from the drafter", "deterministic"])
def test_speculative_sampling_matches_plain_sampling(small_pair, drafts, one_thread):
    """End to end through the target (and the real drafter): the first three generated tokens of
    speculative sampling (k = 2) follow the target's exact distribution at each position."""
    tgt, d = small_pair
    prompt, temperature, runs = [1, 5, 2, 7], 1.3, 500
    exact = exact_marginals(tgt, prompt, temperature, 3)
    g = torch.Generator().manual_seed(11)
    ids = torch.tensor([prompt])
    if drafts == "deterministic":
        proposer, embed, aux, mode = TargetGreedyProposer(tgt), None, [], "greedy"
    else:
        proposer, embed, aux, mode = d, tgt.get_input_embeddings(), AUX, "sample"
    outs, accepted = [], 0
    for _ in range(runs):
        res = speculative_decode(tgt, proposer, embed, aux, ids, 3, 2, eos_ids=None, temperature=temperature,
                                 generator=g, draft_sampling=mode)  # fmt: skip
        assert len(res.tokens) == 3
        outs.append(res.tokens)
        accepted += sum(res.accepted)
    assert accepted > 40, "too few accepted drafts to exercise the accept branch"
    for pos in range(3):
        assert_distributed_as([o[pos] for o in outs], exact[pos])


def test_sample_decode(small_pair, one_thread):
    tgt, _ = small_pair
    ids = torch.tensor([[1, 5, 2, 7]])
    assert sample_decode(tgt, ids, 6, None, temperature=0.0) == greedy_decode(tgt, ids, 6, None)
    exact = exact_marginals(tgt, [1, 5, 2, 7], 1.3, 2)
    g = torch.Generator().manual_seed(3)
    outs = [sample_decode(tgt, ids, 2, None, temperature=1.3, generator=g) for _ in range(500)]
    assert_distributed_as([o[1] for o in outs], exact[1])
