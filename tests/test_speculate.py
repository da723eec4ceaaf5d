"""Speculative decoding: index logic, losslessness against plain greedy, and acceptance accounting."""

from __future__ import annotations

import random

import pytest
import torch

from draftsmith.drafter import DrafterConfig, Eagle3Drafter
from draftsmith.speculate import (
    Eagle3Proposer,
    SpecResult,
    acceptance_length,
    accepted_tokens,
    catch_up_inputs,
    extend_until_stop,
    first_difference,
    greedy_decode,
    position_counts,
    speculative_decode,
)
from draftsmith.vocab import vocab_maps

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

    def reset(self) -> None:
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
    res = speculative_decode(target, ReferenceProposer(ref), None, AUX, ids, max_new, k, eos_ids=None)
    assert res.tokens == ref[ids.shape[1] :][:max_new]
    assert res.steps == steps and res.accepted == [k] * steps
    assert res.tau == k + 1
    assert res.acceptance_rates == [1.0] * k and res.position_proposals == [steps] * k


def test_wrong_proposer_accepts_nothing(target):
    ids, k, max_new = prompt(22, 4), 3, 12
    ref = reference(target, ids, max_new + k + 1)
    res = speculative_decode(
        target, ReferenceProposer(ref, lambda s, i: False), None, AUX, ids, max_new, k, eos_ids=None
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
    res = speculative_decode(target, proposer, None, AUX, ids, max_new, k, eos_ids=None)
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
    res = speculative_decode(target, drafter, target.get_input_embeddings(), AUX, ids, max_new, k, eos_ids=[])
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
        res = speculative_decode(target, drafter, target.get_input_embeddings(), AUX, ids, 40, k, eos_ids=eos)
        assert res.tokens == plain
        return
    pytest.skip("no prompt produced a fresh token to use as eos")


def test_max_new_tokens_one(target, drafter):
    ids = prompt(5, 3)
    res = speculative_decode(target, drafter, target.get_input_embeddings(), AUX, ids, 1, 3, eos_ids=None)
    assert res.tokens == greedy_decode(target, ids, 1, eos_ids=None)
    assert res.steps == 0 and res.tau == 1.0


class CheckingProposer(Eagle3Proposer):
    """Checks the cached drafter against a fresh one fed the whole history at once, and records every
    aux state that was caught up, to compare with the target's hidden_states."""

    def reset(self) -> None:
        super().reset()
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
        torch.testing.assert_close(fresh.logits, self.logits, rtol=1e-4, atol=1e-5)
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
    res = speculative_decode(target, proposer, None, AUX, ids, max_new, k, eos_ids=None)
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
    torch.testing.assert_close(aux, torch.stack([hs[i] for i in AUX], dim=2), rtol=1e-4, atol=1e-5)


def test_bad_arguments(target, drafter):
    embed = target.get_input_embeddings()
    with pytest.raises(ValueError):
        speculative_decode(target, drafter, embed, AUX, prompt(1, 3), 5, 0, eos_ids=None)
    with pytest.raises(ValueError):
        speculative_decode(target, drafter, None, AUX, prompt(1, 3), 5, 2, eos_ids=None)
    with pytest.raises(ValueError):
        greedy_decode(target, prompt(1, 3), 0, eos_ids=None)


def test_chain_step_inputs(drafter, target):
    """Draft step j feeds (embedding of draft j, prenorm of step j-1) at the next position, attending to
    the caught-up cache and the earlier drafts (vLLM's chain: positions += 1 per step)."""
    from draftsmith.drafter import CacheKV

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


# ----------------------------------------------------------------------------- evaluate end to end

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture()
def eval_setup(tmp_path, monkeypatch, target, drafter):
    """A saved tiny target with a character-level chat tokenizer, a prompts file, and a stand-in
    `draftsmith.export` whose load_drafter returns the in-memory drafter."""
    import json
    import sys
    import types

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 .,?!:\n")
    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="[UNK]")
    fast.chat_template = CHAT_TEMPLATE
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    fast.save_pretrained(target_dir)

    prompts = tmp_path / "heldout.jsonl"
    rows = [
        {"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}: why?"}]} for i in range(3)
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))

    export_config = {
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [a - 1 for a in AUX]},
        "draftsmith": {"aux_layer_convention": "output"},
    }
    fake = types.ModuleType("draftsmith.export")
    fake.load_drafter = lambda path, dtype=torch.float32: (drafter, export_config)
    monkeypatch.setitem(sys.modules, "draftsmith.export", fake)
    return target_dir, prompts, tmp_path / "eval"


def test_evaluate_writes_summary_plot_and_gates(eval_setup, capsys):
    import json

    from draftsmith.evaluate import GateFailed, evaluate

    target_dir, prompts, out = eval_setup
    summary = evaluate(target_dir, "drafter", prompts, out, num_prompts=2, max_new_tokens=12,
                       num_draft_tokens=3, min_tau=1.0, threads=1)  # fmt: skip
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert (out / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["num_prompts"] == 2 and [r["id"] for r in summary["per_prompt"]] == ["p0", "p1"]
    assert summary["aux_layer_ids"] == AUX and summary["lossless"] and summary["gate_passed"]
    assert len(summary["acceptance_rate_per_position"]) == 3 and summary["tau"] >= 1.0
    assert summary["speedup"] > 0 and summary["plain"]["tokens"] == summary["speculative"]["tokens"]
    assert "tau" in capsys.readouterr().out

    (out / "summary.json").unlink()
    with pytest.raises(GateFailed, match=r"tau 1\.\d+ is below the gate min_tau=3.5.*data_config.json"):
        evaluate(target_dir, "drafter", prompts, out, 1, 8, 3, min_tau=3.5, threads=1)
    assert not json.loads((out / "summary.json").read_text())["gate_passed"]


def test_evaluate_fails_hard_when_not_lossless(eval_setup, monkeypatch):
    import draftsmith.evaluate as ev

    real = ev.speculative_decode

    def corrupt(*args, **kw):
        res = real(*args, **kw)
        if len(res.tokens) > 4:
            res.tokens[4] = (res.tokens[4] + 1) % VOCAB
        return res

    monkeypatch.setattr(ev, "speculative_decode", corrupt)
    target_dir, prompts, out = eval_setup
    with pytest.raises(ev.NotLossless, match=r"prompt 'p0' differs at generated position 4"):
        ev.evaluate(target_dir, "drafter", prompts, out, 2, 10, 2, min_tau=1.0, threads=1)
