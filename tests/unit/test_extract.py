"""Capture, shards, token layout, vocab maps: the contracts between stages, on a tiny random Llama."""

import pytest
import torch
from conftest import fp_tolerance

from draftsmith.chat import training_sequence
from draftsmith.engines.hf import capture_states, stop_at_eos
from draftsmith.extract import teacher_agreement, token_batches
from draftsmith.layers import convert_layer_ids, default_aux_layers, validate_aux_layers
from draftsmith.tokenize import shard_bounds
from draftsmith.vocab import build_vocab_map, select_draft_tokens, vocab_maps


def test_hooks_capture_exactly_hf_hidden_states(tiny_llama):
    ids = torch.randint(0, 256, (2, 11))
    layers = [1, 3, 5]
    aux, final = capture_states(tiny_llama, ids, layers)
    with torch.no_grad():
        ref = tiny_llama(ids, output_hidden_states=True).hidden_states
    for slot, k in enumerate(layers):
        torch.testing.assert_close(aux[:, :, slot], ref[k], rtol=0, atol=0)
    # the last HF hidden state is after the final norm: that is what we store as "final"
    torch.testing.assert_close(final, ref[-1], rtol=0, atol=0)


def test_stored_final_state_reproduces_the_logits(tiny_llama):
    ids = torch.randint(0, 256, (1, 9))
    _, final = capture_states(tiny_llama, ids, [2])
    with torch.no_grad():
        logits = tiny_llama(ids).logits
        lm_head = tiny_llama.get_output_embeddings().weight
        # fp32, one matmul over the hidden size, in two batch shapes
        tol = fp_tolerance(torch.float32, 1, tiny_llama.config.hidden_size, scale=logits.abs().max())
        torch.testing.assert_close(final @ lm_head.T, logits, **tol)


def test_right_padding_keeps_real_tokens_exact(tiny_llama):
    short = torch.randint(0, 256, (1, 5))
    padded = torch.cat([short, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    aux_a, final_a = capture_states(tiny_llama, short, [2, 4])
    aux_b, final_b = capture_states(tiny_llama, padded, [2, 4])
    # fp32, two batch shapes through every layer (4 chained matmuls each, longest sum intermediate)
    cfg = tiny_llama.config
    tol = fp_tolerance(torch.float32, 4 * cfg.num_hidden_layers, cfg.intermediate_size, final_a.abs().max())
    torch.testing.assert_close(aux_a, aux_b[:, :5], **tol)
    torch.testing.assert_close(final_a, final_b[:, :5], **tol)


def test_teacher_agreement_counts_masked_next_tokens(tiny_llama):
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        greedy = tiny_llama.generate(ids, max_new_tokens=6, do_sample=False)[0]
        _, final = capture_states(tiny_llama, greedy[None], [2])
    mask = torch.tensor([0] * 12 + [1] * 6, dtype=torch.bool)
    lm_head = tiny_llama.get_output_embeddings().weight
    agree, checked = teacher_agreement(lm_head, final[0], greedy, mask)
    assert (agree, checked) == (6, 6)  # greedy continuation: every next token is the argmax
    shuffled = greedy.clone()
    shuffled[12:] = (shuffled[12:] + 1) % 256
    agree, checked = teacher_agreement(lm_head, final[0], shuffled, mask)
    assert checked == 6 and agree <= 1


def test_layer_conventions():
    assert default_aux_layers(30) == [2, 15, 27]
    assert convert_layer_ids([2, 15, 27], "input", "output") == [1, 14, 26]
    assert convert_layer_ids([1, 14, 26], "output", "input") == [2, 15, 27]
    with pytest.raises(ValueError, match="out of range"):
        validate_aux_layers([2, 30], 30)
    with pytest.raises(ValueError, match="repeat"):
        validate_aux_layers([2, 2], 30)


def test_vocab_maps_round_trip():
    counts = torch.tensor([0, 5, 5, 1, 9, 0, 2, 0])
    ids = select_draft_tokens(counts, 4)
    assert ids.tolist() == [1, 2, 4, 6]  # top counts; the tie 1 vs 2 both kept, 6 beats 3
    d2t, t2d = vocab_maps(ids, 8)
    assert (torch.arange(4) + d2t).tolist() == ids.tolist()
    assert torch.nonzero(t2d).squeeze(-1).tolist() == ids.tolist()
    result = build_vocab_map(torch.tensor([4, 4, 4, 1, 2, 7]), 8, 2)
    assert result["coverage"] == pytest.approx(4 / 6)  # token 4 (x3) and the lower-id tie 1
    padded = select_draft_tokens(torch.tensor([0, 0, 3, 0]), 3)
    assert padded.tolist() == [0, 1, 2]  # unseen ids pad, lowest first


def test_shard_bounds_balance_tokens():
    assert shard_bounds([5, 5, 5, 5, 100, 1], 2) == [(0, 4), (4, 6)]
    assert shard_bounds([1] * 7, 3) == [(0, 2), (2, 5), (5, 7)]
    bounds = shard_bounds([10, 1, 1, 1], 4)
    assert bounds == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="cannot fill"):
        shard_bounds([1, 2], 3)


def test_token_batches_respect_budget():
    lengths = [5, 100, 7, 6, 50]
    batches = token_batches(lengths, 20)
    assert sorted(i for b in batches for i in b) == list(range(5))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 20


def test_training_sequence_masks_only_the_answer():
    ids, mask = training_sequence([1, 2, 3], [7, 8, 2])
    assert ids == [1, 2, 3, 7, 8, 2] and mask == [0, 0, 0, 1, 1, 1]


def test_stop_at_eos():
    assert stop_at_eos([5, 6, 2, 0, 0], {2}, 0).response_ids == [5, 6, 2]
    gen = stop_at_eos([5, 6, 7], {2}, 0)
    assert gen.finish_reason == "length" and gen.response_ids == [5, 6, 7]
