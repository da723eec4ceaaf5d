"""Capture, shards, token layout, vocab maps: the contracts between stages, on a tiny random Llama."""

import json
import struct

import pytest
import torch
from safetensors import safe_open

from draftsmith.atomic import atomic_path, write_json
from draftsmith.chat import training_sequence
from draftsmith.engines.hf import capture_states, stop_at_eos
from draftsmith.extract import teacher_agreement, token_batches
from draftsmith.layers import convert_layer_ids, default_aux_layers, validate_aux_layers
from draftsmith.manifest import DataError, build_manifest, load_manifest, verify_manifest
from draftsmith.shards import HEADER_ROOM, Sample, ShardWriter, iter_samples, read_tokens, write_shard
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
        torch.testing.assert_close(final @ lm_head.T, logits, rtol=1e-5, atol=1e-5)


def test_right_padding_keeps_real_tokens_exact(tiny_llama):
    short = torch.randint(0, 256, (1, 5))
    padded = torch.cat([short, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    aux_a, final_a = capture_states(tiny_llama, short, [2, 4])
    aux_b, final_b = capture_states(tiny_llama, padded, [2, 4])
    torch.testing.assert_close(aux_a, aux_b[:, :5], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(final_a, final_b[:, :5], rtol=1e-6, atol=1e-6)


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


def _sample(i, n, hidden=8):
    return Sample(
        f"s{i}",
        torch.arange(n) + i,
        torch.tensor([0] * (n // 2) + [1] * (n - n // 2), dtype=torch.bool),
        torch.randn(n, 3, hidden).bfloat16(),
        torch.randn(n, hidden).bfloat16(),
    )


def _shard_meta(agree=9, checked=10):
    stats = {"num_samples": 2, "num_tokens": 9, "num_masked_tokens": 5, "teacher_agree": agree}
    stats |= {"teacher_checked": checked, "teacher_agreement": agree / checked}
    return {
        "aux_layer_ids": [1, 2, 3],
        "layer_convention": "input",
        "dtype": "bfloat16",
        "template": "t",
        "stats": stats,
    }


@pytest.mark.parametrize("codec", ["none", "zstd-planes"])
def test_shard_round_trip_is_lossless(tmp_path, codec):
    samples = [_sample(0, 4), _sample(1, 5)]
    samples[0].aux[0, 0, 0] = float("inf")  # extreme values survive the byte-plane split
    samples[1].final[2, 3] = -3.0e38
    path = tmp_path / "shard-0.safetensors"
    write_shard(path, samples, _shard_meta(), codec=codec)
    back = list(iter_samples(path))
    assert [s.id for s in back] == ["s0", "s1"]
    for a, b in zip(samples, back, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.aux, b.aux) and torch.equal(a.final, b.final)
        assert a.aux.shape == b.aux.shape and a.final.dtype == b.final.dtype == torch.bfloat16
    ids, mask, offsets = read_tokens(path)
    assert offsets.tolist() == [0, 4, 9] and ids.numel() == 9 and mask.sum() == 5


@pytest.mark.parametrize("codec", ["none", "zstd-planes"])
def test_shard_header_outgrowing_its_room_still_writes_the_same_tensors(tmp_path, codec):
    samples = [_sample(0, 4), _sample(1, 5)]
    in_place = tmp_path / "in-place.safetensors"
    write_shard(in_place, samples, _shard_meta(), codec=codec)
    rewritten = tmp_path / "rewritten.safetensors"
    writer = ShardWriter(rewritten, _shard_meta(), codec)
    for sample in samples:
        writer.add(sample)
    writer.close({"notes": "x" * (2 * HEADER_ROOM)})  # more than the room kept for the header
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in-place.safetensors", "rewritten.safetensors"]
    (in_place_header,) = struct.unpack("<Q", in_place.read_bytes()[:8])
    assert in_place_header >= HEADER_ROOM  # the header filled the room kept for it: nothing was copied
    assert {in_place.stat().st_mode & 0o777, rewritten.stat().st_mode & 0o777} == {0o644}
    contents = []
    for path in (in_place, rewritten):
        with safe_open(str(path), framework="pt") as f:  # plain safetensors reads both layouts
            contents.append({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    assert contents[0].keys() == contents[1].keys()
    for name, tensor in contents[0].items():
        assert torch.equal(tensor.view(torch.uint8), contents[1][name].view(torch.uint8)), name
    assert [s.id for s in iter_samples(rewritten)] == ["s0", "s1"]


def test_manifest_verify_and_refusal(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    write_json(target / "config.json", {"num_hidden_layers": 6, "hidden_size": 8, "vocab_size": 300})
    shard = tmp_path / "hidden" / "shard-0.safetensors"
    write_shard(shard, [_sample(0, 4), _sample(1, 5)], _shard_meta())
    out = tmp_path / "data_config.json"
    manifest = build_manifest([str(shard)], str(out), str(target), 0.8)
    assert manifest["num_tokens"] == 9 and manifest["layer_convention"] == "input"
    assert json.loads(out.read_text())["shards"][0]["path"] == "hidden/shard-0.safetensors"
    assert load_manifest(out)["shards"][0]["path"] == shard.resolve()
    assert verify_manifest(out) == []
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert any("sha256" in p for p in verify_manifest(out))
    write_shard(shard, [_sample(0, 4), _sample(1, 5)], _shard_meta(agree=5))
    with pytest.raises(DataError, match="teacher agreement below 0.8"):
        build_manifest([str(shard)], str(tmp_path / "other.json"), str(target), 0.8)
    with pytest.raises(DataError, match="missing"):
        load_manifest(tmp_path / "nope.json")


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert path.read_text() == "old"
    assert list(tmp_path.iterdir()) == [path]


def test_teacher_agreement_is_split_by_source_and_gated_on_regenerated_only(tiny_llama, tmp_path):
    """A greedy (regenerated) sample agrees fully, a text the model did not write does not: the
    extract stats keep both, the shard and manifest report both, and only the regenerated figure is
    gated, so a mix with original answers passes a 0.9 gate."""
    from draftsmith.engines.hf import HfExtractor
    from draftsmith.extract import _extract_loop

    torch.manual_seed(0)
    prompt = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        greedy = tiny_llama.generate(prompt, max_new_tokens=12, do_sample=False)[0]
    other = torch.cat([prompt[0], torch.randint(0, 256, (12,))])  # not the model's text
    mask = torch.tensor([0] * 8 + [1] * 12, dtype=torch.uint8)
    seqs = [greedy, other]
    shard = tmp_path / "hidden" / "shard-0.safetensors"
    writer = ShardWriter(shard, {"aux_layer_ids": [1, 2, 3], "layer_convention": "input"}, "none")
    stats = _extract_loop(
        HfExtractor(tiny_llama, [1, 2, 3]), writer, 0, [20, 20], lambda i: (seqs[i], mask), ["g", "o"],
        4096, ["regenerated", "original"],
    )  # fmt: skip
    by = stats["teacher_by_source"]
    assert by["regenerated"] == {"agree": 12, "checked": 12}  # positions whose next token is masked
    assert by["original"]["checked"] == 12 and by["original"]["agree"] < 6
    assert (stats["teacher_agree"], stats["teacher_checked"]) == (12, 12)  # gated: regenerated only
    meta = {
        "dtype": "bfloat16",
        "template": "t",
        "stats": stats,
        "sample_sources": ["regenerated", "original"],
    }
    writer.close(meta)
    target = tmp_path / "target"
    target.mkdir()
    write_json(target / "config.json", {"num_hidden_layers": 6, "hidden_size": 64, "vocab_size": 256})
    manifest = build_manifest([str(shard)], str(tmp_path / "data_config.json"), str(target), 0.9)
    assert manifest["teacher_agreement"] == 1.0
    assert manifest["teacher_agreement_by_source"]["regenerated"] == 1.0
    assert manifest["teacher_agreement_by_source"]["original"] < 0.6
    assert manifest["shards"][0]["teacher_agreement_by_source"] == manifest["teacher_agreement_by_source"]


@pytest.mark.slow
def test_sample_source_travels_from_traces_to_the_manifest(tmp_path):
    """Real target: a regenerated-looking trace and an original-answer trace -> tokens -> one shard ->
    manifest. The shard's metadata lists each sample's source; the manifest reports agreement per
    source and gates on the regenerated sample only."""
    from conftest import REPO

    from draftsmith.extract import extract_shard
    from draftsmith.shards import read_shard_meta
    from draftsmith.tokenize import tokenize_traces

    target = REPO / "resources" / "SmolLM2-135M-Instruct"
    if not (target / "config.json").is_file():
        pytest.skip("the default target is not materialised (resources/)")
    user = {"role": "user", "content": "Name a colour."}
    rows = [
        {"id": "r", "messages": [user], "response": "Blue.", "source": "regenerated"},
        {
            "id": "o",
            "messages": [user],
            "response": "Chartreuse, obviously, my friend.",
            "source": "original",
        },
    ]
    traces = tmp_path / "traces.jsonl"
    traces.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokens = tmp_path / "tokens.safetensors"
    tokenize_traces(str(target), str(traces), str(tokens), 1, 256)
    shard = tmp_path / "hidden" / "shard-0.safetensors"
    stats = extract_shard(
        str(target), str(tokens), 0, str(shard), None, "float32", 4096, "none", compile="off"
    )
    assert read_shard_meta(shard)["sample_sources"] == ["regenerated", "original"]
    assert set(stats["teacher_by_source"]) == {"regenerated", "original"}
    assert stats["teacher_checked"] == stats["teacher_by_source"]["regenerated"]["checked"] > 0
    manifest = build_manifest([str(shard)], str(tmp_path / "data_config.json"), str(target), 0.0)
    assert set(manifest["teacher_agreement_by_source"]) == {"regenerated", "original"}
