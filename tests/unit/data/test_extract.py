"""Capture, shards, token layout, vocab maps: the contracts between stages, on a tiny random Llama."""

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
from helpers.model import fp_tolerance

from draftsmith.backends.hf import capture_states, stop_at_eos
from draftsmith.core.data.batch_plan import token_batches
from draftsmith.core.data.chat import training_sequence
from draftsmith.core.data.shards import ShardWriter
from draftsmith.core.data.vocab import vocab_maps
from draftsmith.core.io.atomic import write_json
from draftsmith.core.model.layers import convert_layer_ids, default_aux_layers, validate_aux_layers
from draftsmith.core.planning.estimate import (
    NotEnoughDisk,
    check_free_disk,
    estimate_lines,
    predict_seconds,
    probe_batches,
    raw_state_bytes,
)
from draftsmith.stages.extract import ExtractSettings, disk_full, teacher_agreement
from draftsmith.stages.manifest import ManifestSettings, build_manifest
from draftsmith.stages.tokenize import TokenizeSettings, shard_bounds
from draftsmith.stages.vocab import build_vocab_map, select_draft_tokens


def settings(**values) -> ExtractSettings:
    """extract's settings: the schema's defaults, float32 compute, `values`."""
    return ExtractSettings.from_dict({"dtype": "float32", **values})


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


def test_probe_batches_spread_over_the_plan_within_budget():
    plan = [[10] * 8, [20] * 6, [40] * 4, [80] * 2, [160] * 1, [300] * 1]  # length-sorted, as token_batches
    assert probe_batches(plan, budget_tokens=10_000) == [1, 2, 4]  # short, middle and long rows
    assert probe_batches(plan, budget_tokens=200) == [2]  # the middle batch, then what the budget allows
    assert probe_batches(plan[:1], budget_tokens=0) == [0]  # always at least one batch


def test_predicted_time_follows_the_plans_shapes():
    """Per padded token, long rows cost more (attention): a shard of long rows must not be priced at
    the short rows' rate (the old probe timed two median samples one by one, off by 5x either way)."""
    timed = [
        {"length": 100, "padded": 800, "seconds": 0.8},  # 1 ms per padded token
        {"length": 1000, "padded": 2000, "seconds": 4.0},  # 2 ms
    ]
    plan = [[100] * 8, [550] * 2, [1000] * 2]
    got = predict_seconds(plan, timed)
    assert got["padded_tokens"] == 800 + 1100 + 2000
    assert got["seconds"] == pytest.approx(0.8 + 1100 * 1.5e-3 + 4.0)  # 1.5 ms: halfway in row length
    assert got["seconds_low"] == pytest.approx(3900 * 1e-3) and got["seconds_high"] == pytest.approx(
        3900 * 2e-3
    )
    assert got["seconds_low"] <= got["seconds"] <= got["seconds_high"]


def test_disk_check_gives_numbers_and_the_right_advice(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 10**9 - 5 * 10**6, 5 * 10**6))
    with pytest.raises(NotEnoughDisk) as err:
        check_free_disk(tmp_path, 8e6, "zstd-planes", "bfloat16")
    message = str(err.value)
    assert "5.0 MB free" in message and "about 8.0 MB with codec zstd-planes, bfloat16" in message
    assert "extract.codec" not in message  # the codec already in use is not advice
    assert "extract.storage_dtype: float8_e4m3fn" in message
    with pytest.raises(NotEnoughDisk, match="extract.codec: zstd-planes") as err:
        check_free_disk(tmp_path, 8e6, "none", "float8_e4m3fn")
    assert "storage_dtype" not in str(err.value)  # nor is the dtype already in use
    check_free_disk(tmp_path, 4e6, "none", "bfloat16")  # fits, with its 10% margin


def test_estimate_gives_exact_raw_bytes_for_both_storage_dtypes():
    """The motivating run: 17.3 M tokens x 4 layers x 7,168. bf16 is 2 bytes a value; float8 one byte a
    value plus a float32 scale per token and layer."""
    assert raw_state_bytes(17_300_000, 4, 7168, "bfloat16") == 17_300_000 * 4 * 7168 * 2 == 992_051_200_000
    assert raw_state_bytes(17_300_000, 4, 7168, "float8_e4m3fn") == 17_300_000 * 4 * (7168 + 4)
    lines, record = estimate_lines(17_300_000, 4, 7168, None, "float8_e4m3fn")
    text = "\n".join(lines)
    assert "bfloat16:        992.1 GB raw" in text and "float8_e4m3fn:   496.3 GB raw" in text
    assert record["raw_bytes"] == 496_302_400_000 and "compressed_bytes" not in record
    measured = {
        "tokens": 1000,
        "codec": "zstd-planes",
        "codec_ratio": {"bfloat16": 0.5, "float8_e4m3fn": 0.8},
    }
    lines, record = estimate_lines(17_300_000, 4, 7168, measured, "bfloat16", ratios_source="shard-0")
    assert record["compressed_bytes_by_dtype"] == {
        "bfloat16": 496_025_600_000,
        "float8_e4m3fn": 397_041_920_000,
    }
    assert record["compressed_bytes"] == 496_025_600_000  # the stored dtype's
    assert "x 0.800 -> about 397.0 GB with zstd-planes" in "\n".join(lines)
    assert lines[-1] == "codec ratios measured on 1,000 tokens of shard-0"


def test_estimate_by_hand_takes_codec_ratios_from_a_bf16_shard(tmp_path):
    from click.testing import CliRunner

    from draftsmith.cli import main
    from draftsmith.core.data.shards import Sample, write_shard

    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(f"s{i}", torch.arange(40), torch.ones(40, dtype=torch.bool),
               torch.randn(40, 3, 64, generator=g).bfloat16(), torch.randn(40, 64, generator=g).bfloat16())
        for i in range(3)
    ]  # fmt: skip
    bf16, fp8 = tmp_path / "bf16.safetensors", tmp_path / "fp8.safetensors"
    write_shard(bf16, samples, {}, codec="zstd-planes", level=1, storage_dtype="bfloat16")
    write_shard(fp8, samples, {}, codec="zstd-planes", storage_dtype="float8_e4m3fn", level=1)
    args = ["estimate", "--num-tokens", "17.3e6", "--hidden-size", "7168", "--layers", "4"]
    result = CliRunner().invoke(main, [*args, "--ratios-from", str(bf16)])
    assert result.exit_code == 0, result.output
    assert "992.1 GB raw" in result.output and "496.3 GB raw" in result.output
    assert f"codec ratios measured on 120 tokens of {bf16}" in result.output
    assert result.output.count("with zstd-planes") == 2
    # what each train.hidden_states mode costs (train.epochs: the schema's 6, or --epochs)
    compressed = re.search(r"x 0\.\d+ -> about ([\d.]+ GB) with zstd-planes\s+<- extract", result.output)[1]
    assert f"files:  {compressed} of shards on disk, 1 prefill" in result.output
    assert f"hybrid: {compressed} of cache shards while training (removed after), 1 prefill" in result.output
    assert "stream: 0 B on disk, 6 prefills: one per epoch" in result.output
    two = CliRunner().invoke(main, [*args, "--epochs", "2"])
    assert (
        "stream: 0 B on disk, 2 prefills" in two.output and "992.1 GB (uncompressed) of shards" in two.output
    )
    refused = CliRunner().invoke(main, [*args, "--ratios-from", str(fp8)])
    assert (
        refused.exit_code == 2
        and "stores float8_e4m3fn: the ratios need the states as computed" in refused.output
    )


def test_disk_full_is_recognised_through_the_writers_error():
    try:
        with open("/dev/full", "wb", buffering=0) as fh:
            fh.write(b"x")
    except OSError as full:
        wrapped = RuntimeError("writing shard-0.safetensors failed")
        wrapped.__cause__ = full
        assert disk_full(wrapped) and disk_full(full)
    assert not disk_full(RuntimeError("other")) and not disk_full(OSError(2, "missing"))


def test_extract_shard_reuses_the_probed_batches(tmp_path, tiny_llama):
    """The estimate's probed batches are written, not recomputed: every sample is in the shard once,
    in plan order, with the states of a single-sequence capture; the stats hold estimate and actual."""
    import json

    from safetensors.torch import save_file

    from draftsmith.backends.hf import HfExtractor
    from draftsmith.core.data.shards import iter_samples, verify_shard
    from draftsmith.stages.extract import extract_shard

    target = tmp_path / "target"
    tiny_llama.save_pretrained(target)
    lengths = [7, 30, 12, 25, 9, 18, 40, 15]
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
    meta = {"sample_ids": [f"s{i}" for i in range(8)], "template": "t", "shards": [[0, 8]]}
    save_file(
        {
            "input_ids": torch.cat(ids),
            "loss_mask": torch.ones(sum(lengths), dtype=torch.uint8),
            "offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        },
        str(tmp_path / "tokens.safetensors"),
        metadata={"draftsmith_tokens": json.dumps(meta)},
    )
    out = tmp_path / "hidden" / "shard-0.safetensors"
    extractor = HfExtractor(tiny_llama, [1, 3])  # the tiny target has no tokenizer to load from a folder
    tokens = str(tmp_path / "tokens.safetensors")
    stats = extract_shard(
        str(target), tokens, 0, str(out), settings(aux_layers=[1, 3], batch_tokens=60), extractor=extractor
    )
    extractor.close()
    assert (
        stats["estimate"]["seconds_low"] <= stats["estimate"]["seconds"] <= stats["estimate"]["seconds_high"]
    )
    assert len(stats["estimate"]["probe_batches"]) >= 1 and stats["probe_seconds"] > 0
    assert stats["file_bytes"] == out.stat().st_size
    plan = [i for batch in token_batches(lengths, 60) for i in batch]
    samples = list(iter_samples(out))
    assert [s.id for s in samples] == [f"s{i}" for i in plan]  # each once, in plan order
    for s in samples:
        aux, final = capture_states(tiny_llama, ids[int(s.id[1:])][None], [1, 3])
        assert torch.equal(s.input_ids, ids[int(s.id[1:])])
        torch.testing.assert_close(
            s.aux.float(), aux[0].bfloat16().float(), rtol=2**-7, atol=0
        )  # bf16 storage
        torch.testing.assert_close(s.final.float(), final[0].bfloat16().float(), rtol=2**-7, atol=0)
    assert len(verify_shard(out)) == 64


def test_extract_shard_stores_float8_as_the_bf16_states_round_trip(tmp_path, tiny_llama):
    """The same shard extracted in both storage dtypes: the float8 shard holds exactly the float8 round
    trip of the bf16 shard's states, in half the state bytes (plus scales), and both estimates give
    bytes for both dtypes."""
    from safetensors.torch import save_file

    from draftsmith.backends.hf import HfExtractor
    from draftsmith.core.data.shards import as_stored, iter_samples, read_header, read_shard_meta
    from draftsmith.stages.extract import extract_shard

    target = tmp_path / "target"
    tiny_llama.save_pretrained(target)
    lengths = [9, 21, 14]
    g = torch.Generator().manual_seed(1)
    meta = {"sample_ids": ["a", "b", "c"], "template": "t", "shards": [[0, 3]]}
    save_file(
        {
            "input_ids": torch.randint(0, 256, (sum(lengths),), generator=g),
            "loss_mask": torch.ones(sum(lengths), dtype=torch.uint8),
            "offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        },
        str(tmp_path / "tokens.safetensors"),
        metadata={"draftsmith_tokens": json.dumps(meta)},
    )
    extractor = HfExtractor(tiny_llama, [1, 3])
    stats, shards = {}, {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        shards[dtype] = tmp_path / dtype / "shard-0.safetensors"
        stats[dtype] = extract_shard(
            str(target), str(tmp_path / "tokens.safetensors"), 0, str(shards[dtype]),
            settings(aux_layers=[1, 3], batch_tokens=30, storage_dtype=dtype), extractor=extractor,
        )  # fmt: skip
    extractor.close()
    assert read_shard_meta(shards["float8_e4m3fn"])["dtype"] == "float8_e4m3fn"
    for exact, stored in zip(
        iter_samples(shards["bfloat16"]), iter_samples(shards["float8_e4m3fn"]), strict=True
    ):
        assert torch.equal(as_stored(exact.aux, "float8_e4m3fn"), stored.aux)
        assert torch.equal(as_stored(exact.final, "float8_e4m3fn"), stored.final)
    for dtype, estimate in ((d, stats[d]["estimate"]) for d in stats):
        assert estimate["storage_dtype"] == dtype
        assert estimate["raw_bytes_by_dtype"] == {
            "bfloat16": 44 * 3 * 64 * 2, "float8_e4m3fn": 44 * 3 * (64 + 4)
        }  # fmt: skip
        assert set(estimate["compressed_bytes_by_dtype"]) == {"bfloat16", "float8_e4m3fn"}
    blob = {d: read_header(path)[1]["blob"]["shape"][0] for d, path in shards.items()}  # state bytes
    assert blob["float8_e4m3fn"] < 0.75 * blob["bfloat16"]


def test_teacher_agreement_is_split_by_source_and_gated_on_regenerated_only(tiny_llama, tmp_path):
    """A greedy (regenerated) sample agrees fully, a text the model did not write does not: the
    extract stats keep both, the shard and manifest report both, and only the regenerated figure is
    gated, so a mix with original answers passes a 0.9 gate."""
    from draftsmith.backends.hf import HfExtractor
    from draftsmith.stages.extract import _extract_loop

    torch.manual_seed(0)
    prompt = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        greedy = tiny_llama.generate(prompt, max_new_tokens=12, do_sample=False)[0]
    other = torch.cat([prompt[0], torch.randint(0, 256, (12,))])  # not the model's text
    mask = torch.tensor([0] * 8 + [1] * 12, dtype=torch.uint8)
    seqs = [greedy, other]
    shard = tmp_path / "hidden" / "shard-0.safetensors"
    writer = ShardWriter(
        shard,
        {"aux_layer_ids": [1, 2, 3], "layer_convention": "input"},
        "none",
        sample_ids=["g", "o"],
        level=1,
        storage_dtype="bfloat16",
    )
    stats = _extract_loop(
        HfExtractor(tiny_llama, [1, 2, 3]), writer, 0, [20, 20], lambda i: (seqs[i], mask), ["g", "o"],
        [[0, 1]], {}, ["regenerated", "original"],
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
    manifest = build_manifest(
        [str(shard)],
        str(tmp_path / "data_config.json"),
        str(target),
        ManifestSettings(min_teacher_agreement=0.9),
    )
    assert manifest["teacher_agreement"] == 1.0
    assert manifest["teacher_agreement_by_source"]["regenerated"] == 1.0
    assert manifest["teacher_agreement_by_source"]["original"] < 0.6
    assert manifest["shards"][0]["teacher_agreement_by_source"] == manifest["teacher_agreement_by_source"]


def _tokens_file(
    where: Path, lengths: list[int], shards: list[list[int]] | None = None, seed: int = 0
) -> str:
    """A tokens file of random sequences of these lengths, every token loss-masked: `where` itself, or
    tokens.safetensors in the folder `where`; one shard unless `shards` ([start, end) sample ranges)."""
    from draftsmith.core.data.tokens import write_tokens

    path = where / "tokens.safetensors" if where.is_dir() else where
    g = torch.Generator().manual_seed(seed)
    meta = {
        "sample_ids": [f"s{i}" for i in range(len(lengths))],
        "template": "t",
        "max_seq_len": max(lengths),
        "shards": shards or [[0, len(lengths)]],
    }
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    write_tokens(
        path, torch.randint(0, 256, (sum(lengths),), generator=g).tolist(), [1] * sum(lengths), offsets, meta
    )
    return str(path)


@pytest.mark.parametrize("storage_dtype", ["bfloat16", "float8_e4m3fn"])
def test_pipelined_extraction_writes_the_sequential_shard(tmp_path, tiny_llama, storage_dtype):
    """Batch k's CPU-side work beside batch k+1's forward changes nothing: the shard's bytes (all but
    the header's timing stats) and its teacher counts are the sequential loop's."""
    from draftsmith.backends.hf import HfExtractor
    from draftsmith.core.data.shards import read_header
    from draftsmith.stages.extract import extract_shard

    target = tmp_path / "target"
    tiny_llama.save_pretrained(target)
    tokens = _tokens_file(tmp_path, [7, 30, 12, 25, 9, 18, 40, 15, 22, 5, 33, 11])
    extractor = HfExtractor(tiny_llama, [1, 3])
    stats, data, meta = {}, {}, {}
    for pipeline in (False, True):
        out = tmp_path / str(pipeline) / "shard-0.safetensors"
        stats[pipeline] = extract_shard(
            str(target), tokens, 0, str(out),
            settings(aux_layers=[1, 3], batch_tokens=50, storage_dtype=storage_dtype), extractor=extractor,
            pipeline=pipeline,
        )  # fmt: skip
        data_start, entries, meta[pipeline] = read_header(out)
        data[pipeline] = (entries, out.read_bytes()[data_start:])  # every tensor, states included
    extractor.close()
    assert stats[True]["pipeline"] and not stats[False]["pipeline"]
    assert stats[True]["forward_seconds"] > 0 and stats[True]["post_seconds"] > 0
    assert data[True] == data[False]
    for m in meta.values():
        m.pop("stats")
    assert meta[True] == meta[False]
    keys = ("teacher_agree", "teacher_checked", "teacher_by_source", "num_masked_tokens")
    assert {k: stats[True][k] for k in keys} == {k: stats[False][k] for k in keys}


def test_pipelined_loop_runs_the_cpu_side_work_beside_the_next_forward():
    """A back-end whose forward and collect each take 50 ms (sleeping, as a GPU forward leaves the CPU
    free): sequential, 8 batches take 8 x 100 ms; pipelined, the collects hide behind the forwards."""
    import time

    from draftsmith.stages.extract import _extract_loop

    class Slow:
        lm_head_weight = torch.eye(8)

        def forward(self, sequences):
            time.sleep(0.05)
            return [(torch.zeros(s.numel(), 1, 8), torch.zeros(s.numel(), 8)) for s in sequences]

        def collect(self, sequences, raw):
            time.sleep(0.05)
            return raw

    seq, mask = torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.uint8)
    stats = {
        pipeline: _extract_loop(
            Slow(),
            None,
            0,
            [4] * 8,
            lambda i: (seq, mask),
            [str(i) for i in range(8)],
            [[i] for i in range(8)],
            {},
            pipeline=pipeline,
        )  # fmt: skip
        for pipeline in (False, True)
    }
    assert stats[False]["seconds"] >= 0.8 and stats[True]["forward_seconds"] >= 0.4
    assert stats[True]["seconds"] < 0.75 * stats[False]["seconds"]  # ideally 0.45 s of 0.8 s
    assert stats[True]["teacher_checked"] == stats[False]["teacher_checked"] == 8 * 3


def test_a_failing_write_stops_extraction_with_the_sequential_loops_error(tmp_path, tiny_llama, monkeypatch):
    """An error in the worker's part (the writer's add; a full disk in the writer thread) is raised by
    extract_shard as the sequential loop raises it, at most one forward later, and leaves no file."""
    import errno

    from draftsmith.backends.hf import HfExtractor
    from draftsmith.core.data.shards import ShardWriter
    from draftsmith.stages.extract import extract_shard

    target = tmp_path / "target"
    tiny_llama.save_pretrained(target)
    tokens = _tokens_file(tmp_path, [7, 30, 12, 25, 9, 18, 40, 15, 22, 5, 33, 11])
    extractor = HfExtractor(tiny_llama, [1, 3])
    forwards = []
    forward = extractor.forward
    monkeypatch.setattr(extractor, "forward", lambda seqs: forwards.append(len(seqs)) or forward(seqs))
    add = ShardWriter.add

    def failing_add(self, sample):
        if len(self.ids) == 6:
            raise ValueError("sample s: cannot be written")
        add(self, sample)

    def full(self, *encoded):
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "hidden" / "shard-0.safetensors"
    errors, calls = {}, {}
    for pipeline in (False, True):
        forwards.clear()
        monkeypatch.setattr(ShardWriter, "add", failing_add)
        with pytest.raises(ValueError) as failed:
            extract_shard(
                str(target), tokens, 0, str(out), settings(aux_layers=[1, 3], batch_tokens=50), extractor=extractor,
                pipeline=pipeline,
            )  # fmt: skip
        calls[pipeline] = len(forwards)
        assert not out.exists() and list(out.parent.iterdir()) == []
        monkeypatch.setattr(ShardWriter, "add", add)
        monkeypatch.setattr(ShardWriter, "_write", full)
        with pytest.raises(NotEnoughDisk) as full_disk:
            extract_shard(
                str(target), tokens, 0, str(out), settings(aux_layers=[1, 3], batch_tokens=50), extractor=extractor,
                pipeline=pipeline,
            )  # fmt: skip
        assert not out.exists() and list(out.parent.iterdir()) == []
        monkeypatch.undo()
        monkeypatch.setattr(extractor, "forward", lambda seqs: forwards.append(len(seqs)) or forward(seqs))
        errors[pipeline] = [(type(e.value), str(e.value).split(" free")[0]) for e in (failed, full_disk)]
    extractor.close()
    assert errors[True] == errors[False]
    assert errors[False][0] == (ValueError, "sample s: cannot be written")
    assert calls[False] < len(token_batches([7, 30, 12, 25, 9, 18, 40, 15, 22, 5, 33, 11], 50))
    assert calls[False] <= calls[True] <= calls[False] + 1  # the worker's error stops the next forward


@pytest.mark.slow
def test_sample_source_travels_from_traces_to_the_manifest(tmp_path, target_model):
    """Real target: a regenerated-looking trace and an original-answer trace -> tokens -> one shard ->
    manifest. The shard's metadata lists each sample's source; the manifest reports agreement per
    source and gates on the regenerated sample only."""

    from draftsmith.core.data.shards import read_shard_meta
    from draftsmith.stages.extract import extract_shard
    from draftsmith.stages.tokenize import tokenize_traces

    target = target_model
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
    tokenize_traces(str(target), str(traces), str(tokens), TokenizeSettings(num_shards=1, max_seq_len=256))
    shard = tmp_path / "hidden" / "shard-0.safetensors"
    stats = extract_shard(
        str(target), str(tokens), 0, str(shard), settings(batch_tokens=4096, codec="none", compile="off")
    )
    assert read_shard_meta(shard)["sample_sources"] == ["regenerated", "original"]
    assert set(stats["teacher_by_source"]) == {"regenerated", "original"}
    assert stats["teacher_checked"] == stats["teacher_by_source"]["regenerated"]["checked"] > 0
    manifest = build_manifest(
        [str(shard)],
        str(tmp_path / "data_config.json"),
        str(target),
        ManifestSettings(min_teacher_agreement=0.0),
    )
    assert set(manifest["teacher_agreement_by_source"]) == {"regenerated", "original"}


# ------------------------------------------------------------------ on the job's device (GPU path)


def test_teacher_check_runs_on_the_jobs_gpu():
    from draftsmith.backends.vllm_extract import teacher_device

    assert teacher_device(gpus=8, cuda_available=True) == "cuda"
    assert teacher_device(gpus=0, cuda_available=True) == "cpu"  # a CPU job on a GPU node
    assert teacher_device(gpus=1, cuda_available=False) == "cpu"


def test_teacher_check_moves_the_states_to_the_heads_device_and_dtype():
    """States (bf16, read from vLLM's files on the host) go to lm_head's device and dtype; the count is
    the same in either dtype where the winner is clear (a margin beyond bf16's rounding of logits of up
    to ~16: 2^-8 x 16 x a few)."""
    from draftsmith.stages.extract import count_agreeing

    torch.manual_seed(0)
    head = torch.randn(50, 16)
    states = torch.randn(1100, 16).to(torch.bfloat16)  # more rows than one 512-row chunk
    top = (states.float() @ head.T).max(-1).indices
    next_ids = top.clone()
    next_ids[::3] = (next_ids[::3] + 1) % 50
    margin = (states.float() @ head.T).topk(2).values.diff().abs().squeeze(-1) > 0.5
    expected = int(((next_ids == top) & margin).sum())
    assert count_agreeing(head, states[margin], next_ids[margin]) == expected
    assert count_agreeing(head.to(torch.bfloat16), states[margin], next_ids[margin]) == expected


def test_vllm_engine_gets_the_jobs_gpus_eager_setting_and_memory_share(monkeypatch):
    import draftsmith.backends.vllm_extract as vx
    from draftsmith.stages.extract import make_extractor

    made = []
    monkeypatch.setattr(vx, "VllmExtractor", lambda *a, **kw: made.append((a, kw)))
    make_extractor("vllm", "T", [2], "bfloat16", 8, 2048, None, False, 0.8)
    make_extractor("vllm", "T", [2], "float32", 0, 2048, None, True, 0.8)
    (gpu_args, gpu), (_, cpu) = made
    assert gpu_args == ("T", [2], "bfloat16")
    assert (gpu["tensor_parallel_size"], gpu["enforce_eager"], gpu["gpu_memory_utilization"]) == (
        8,
        False,
        0.8,
    )
    assert (cpu["tensor_parallel_size"], cpu["enforce_eager"], cpu["gpu_memory_utilization"]) == (
        1,
        True,
        None,
    )


def test_transformers_backend_runs_on_the_jobs_gpu_not_the_cpu(monkeypatch, tiny_llama):
    """resources.extract.gpus > 0 with the transformers back-end: the target on the job's first GPU (it
    loaded on the CPU while the job held the GPUs); GPUs CUDA cannot see (fake ones): the CPU as before.
    Its captures come back on the CPU, where the writer compresses them."""
    from draftsmith.backends.hf import HfExtractor
    from draftsmith.stages.extract import make_extractor

    devices = []
    monkeypatch.setattr(HfExtractor, "from_target", lambda t, ids, dtype, device: devices.append(device))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    make_extractor("transformers", "T", [2], "bfloat16", 1, 2048, None, True, 0.8)
    make_extractor("transformers", "T", [2], "float32", 0, 2048, None, True, 0.8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    make_extractor("transformers", "T", [2], "float32", 2, 2048, None, True, 0.8)
    assert devices == ["cuda", "cpu", "cpu"]
    extractor = HfExtractor(tiny_llama, [1, 3])
    ((aux, final),) = extractor.capture([torch.arange(7)])
    assert extractor.device.type == "cpu" and aux.device.type == final.device.type == "cpu"
    assert aux.shape == (7, 2, 64) and final.shape == (7, 64)


# ---- the extraction job: engines, queue, stash ------------------------------------------------------------


def test_queue_order_takes_the_largest_shards_first():
    from draftsmith.stages.extract import queue_order

    assert queue_order([5, 9, 9, 1, 7], [0, 2, 3, 4, 1]) == [
        1,
        2,
        4,
        0,
        3,
    ]


def test_shard_queue_hands_each_shard_to_one_engine_once():
    from draftsmith.stages.extract import ShardQueue

    queue = ShardQueue([3, 0, 2, 1])
    taken = [queue.take() for _ in range(6)]
    assert taken == [3, 0, 2, 1, None, None]


def test_engine_devices_split_the_jobs_visible_gpus():
    from draftsmith.stages.extract import engine_devices

    assert engine_devices(["4", "5", "6", "7"], 4, 2, 2) == ["4,5", "6,7"]
    assert engine_devices(None, 8, 1, 8) == [str(i) for i in range(8)]
    assert engine_devices(["GPU-a", "GPU-b"], 2, 2, 1) == ["GPU-a,GPU-b"]
    with pytest.raises(ValueError, match="resources.extract.gpus: 4 engines of 2 GPUs need 8 devices"):
        engine_devices(["0", "1"], 8, 2, 4)


def test_the_job_runs_the_layout_the_memory_plan_prints(tmp_path):
    """job_layout (what the job runs) against memory.plan (what `draftsmith plan` prints) on one config:
    the same engines x GPUs, whatever the device's memory."""
    from draftsmith.core.config.config import with_defaults
    from draftsmith.core.planning.memory import plan_config
    from draftsmith.stages.extract import job_layout

    target = tmp_path / "target"
    target.mkdir()
    write_json(
        target / "config.json",
        {"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 128256, "num_attention_heads": 32,
         "num_key_value_heads": 8, "intermediate_size": 14336, "max_position_embeddings": 8192},
    )  # fmt: skip
    for gib, tensor_parallel in ((80, 0), (16, 0), (24, 0), (80, 2)):
        config = with_defaults(
            {
                "target": {"model": str(target), "dtype": "bfloat16", "gguf_wheel": None},
                "extract": {"backend": "vllm", "max_seq_len": 4096},
                "resources": {
                    "gpu_memory_gib": gib,
                    "extract": {"gpus": 8, "tensor_parallel": tensor_parallel},
                },
            }
        )
        (need,) = [n for n in plan_config(config, gib * 2**30) if n.stage == "extract"]
        layout = job_layout(
            str(target), "bfloat16", "vllm", 8, 4096, 0.9, tensor_parallel, {"gpu_memory_gib": gib}
        )
        assert layout == (need.gpus, need.engines), gib
    assert job_layout(str(target), "bfloat16", "transformers", 8, 4096, 0.9, 0, {}) == (1, 1)
    assert job_layout(str(target), "bfloat16", "vllm", 0, 4096, 0.9, 0, {}) == (1, 1)


def test_stash_key_changes_with_what_decides_the_bytes_only(tmp_path):
    from draftsmith.stages.extract import RESULT_KEYS, stash_key

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    tokens = tmp_path / "tokens.safetensors"
    tokens.write_bytes(b"tokens")
    settings = {key: 1 for key in RESULT_KEYS}
    key = stash_key(tokens, target, "bfloat16", settings)
    assert key == stash_key(tokens, target, "bfloat16", {**settings, "threads": 9})  # not a result setting
    assert key != stash_key(tokens, target, "float32", settings)
    assert key != stash_key(tokens, target, "bfloat16", {**settings, "batch_tokens": 2})
    tokens.write_bytes(b"tokens 2")
    assert key != stash_key(tokens, target, "bfloat16", settings)
    tokens.write_bytes(b"tokens")
    assert key == stash_key(tokens, target, "bfloat16", settings)  # content, not the file's mtime
    (target / "model.safetensors").write_bytes(b"w")  # other weights at the same path
    assert key != stash_key(tokens, target, "bfloat16", settings)


def test_stash_key_is_the_targets_content_not_its_path(tmp_path):
    """A copied run (or target) reuses its stashed shards: the key holds the target's config.json digest
    and weight files' names and sizes (run_cache.target_identity), not its absolute path or mtimes."""
    from draftsmith.stages.extract import RESULT_KEYS, stash_key

    target = tmp_path / "a" / "target"
    target.mkdir(parents=True)
    (target / "config.json").write_text('{"hidden_size": 8}')
    (target / "model.safetensors").write_bytes(b"weights")
    tokens = tmp_path / "tokens.safetensors"
    tokens.write_bytes(b"tokens")
    settings = {key: 1 for key in RESULT_KEYS}
    key = stash_key(tokens, target, "bfloat16", settings)
    copy = tmp_path / "b" / "target"
    shutil.copytree(target, copy)  # new path, new mtimes
    os.utime(copy / "model.safetensors", ns=(1, 1))
    assert stash_key(tokens, copy, "bfloat16", settings) == key
    (copy / "config.json").write_text('{"hidden_size": 9}')
    assert stash_key(tokens, copy, "bfloat16", settings) != key


def test_prepare_stash_keeps_only_intact_sealed_shards_of_the_key(tmp_path):
    from draftsmith.core.io.digests import seal, sidecar
    from draftsmith.stages.extract import prepare_stash

    root = tmp_path / ".done"
    stash = root / "k1"
    stash.mkdir(parents=True)
    for k in range(4):
        (stash / f"shard-{k}.safetensors").write_bytes(b"x" * (k + 1))
    seal([stash / f"shard-{k}.safetensors" for k in (0, 1, 3)], "extract")  # shard 2 died before its seal
    (stash / "new").write_bytes(b"yyyy")
    (stash / "new").rename(stash / "shard-3.safetensors")  # same size, new inode, other bytes: seal fails
    (stash / ".shard-2.safetensors.abc.data").write_bytes(b"partial")
    (stash / ".engine-x").mkdir()
    (root / "k0").mkdir()
    (root / "k0" / "shard-0.safetensors").write_bytes(b"old settings")
    found, reused = prepare_stash(root, "k1", 4)
    assert found == stash and reused == [0, 1]
    assert sorted(p.name for p in root.iterdir()) == ["k1"]
    kept = {"shard-0.safetensors", "shard-1.safetensors"}
    assert {p.name for p in stash.iterdir()} == kept | {sidecar(stash / n).name for n in kept}


def test_extract_shards_loads_once_stashes_and_reuses_what_a_killed_run_finished(
    tmp_path, tiny_llama, monkeypatch
):
    """One engine load for every shard; each output a hard link of its sealed stashed shard; a rerun
    after Snakemake deleted the outputs extracts only the shard whose stash did not survive, with the
    same content as before."""
    import draftsmith.stages.extract as ex
    from draftsmith.backends.hf import HfExtractor
    from draftsmith.core.data.shards import verify_shard
    from draftsmith.core.io.atomic import shared_mode
    from draftsmith.core.io.digests import intact

    target = tmp_path / "target"
    tiny_llama.save_pretrained(target)
    tokens = tmp_path / "tokens.safetensors"
    _tokens_file(tokens, [7, 30, 12, 25, 9, 18], [[0, 2], [2, 4], [4, 6]])
    loads, extracted = [], []
    monkeypatch.setattr(  # the tiny target has no tokenizer to load from a folder
        ex,
        "make_extractor",
        lambda backend, target, layer_ids, *a, **k: loads.append(1) or HfExtractor(tiny_llama, layer_ids),
    )
    shard = ex.extract_shard
    monkeypatch.setattr(
        ex, "extract_shard", lambda t, tok, k, *a, **kw: extracted.append(k) or shard(t, tok, k, *a, **kw)
    )
    outs = [tmp_path / "hidden" / f"shard-{k}.safetensors" for k in range(3)]

    def run() -> list[int]:
        return ex.extract_shards(
            str(target),
            str(tokens),
            [str(p) for p in outs],
            settings(aux_layers=[1, 3], batch_tokens=60, compile="off"),
        )

    assert run() == []
    assert loads == [1] and sorted(extracted) == [0, 1, 2]
    (stash,) = (tmp_path / "hidden" / ".done").iterdir()
    digests = [verify_shard(p) for p in outs]
    for k, out in enumerate(outs):
        stashed = stash / f"shard-{k}.safetensors"
        assert out.stat().st_ino == stashed.stat().st_ino and intact(stashed)
        assert oct(out.stat().st_mode & 0o777) == oct(shared_mode())
    inode0 = outs[0].stat().st_ino
    # Snakemake deletes a failed job's outputs; shard 1's stash did not survive the kill
    for out in outs:
        out.unlink()
    (stash / "shard-1.safetensors").unlink()
    (stash / ".shard-1.safetensors.x.data").write_bytes(b"partial")
    loads.clear(), extracted.clear()
    assert run() == [0, 2]
    assert loads == [1] and extracted == [1]
    assert outs[0].stat().st_ino == inode0  # reused, not rewritten
    assert [verify_shard(p) for p in outs] == digests
    assert not [p for p in stash.iterdir() if p.name.startswith(".shard-1.safetensors.x")]
    # everything stashed: no engine is loaded at all
    for out in outs:
        out.unlink()
    loads.clear(), extracted.clear()
    assert run() == [0, 1, 2] and loads == [] and extracted == []
    assert [verify_shard(p) for p in outs] == digests


def test_each_engine_takes_its_share_of_the_jobs_threads_and_compresses_with_it(
    tmp_path, tiny_llama, monkeypatch
):
    """resources.extract.threads is the job's (the rule's --threads): its engines share it, 32 threads over
    8 engines of 1 GPU taking 4 each (never fewer than 1), and an engine's shard writer encodes with its
    share (a pool: one zstd thread alone keeps up with ~0.4 GB/s, a GPU's prefill yields ~1 GB/s; issue 43
    item 9)."""
    import draftsmith.stages.extract as ex
    from draftsmith.backends.hf import HfExtractor

    target = tmp_path / "target"
    tiny_llama.save_pretrained(target)
    tokens = tmp_path / "tokens.safetensors"
    _tokens_file(tokens, [7, 30, 12, 25, 9, 18, 11, 5], [[k, k + 1] for k in range(8)])
    outs = [str(tmp_path / "hidden" / f"shard-{k}.safetensors") for k in range(8)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setattr(ex, "job_layout", lambda *a, **k: (1, 8))  # the plan's layout for an 8B target
    engines = []

    class Recorded(Exception):
        pass

    def processes(queue, devices, kw):
        engines.append((devices, kw["settings"].threads, kw["settings"].gpus))
        raise Recorded

    monkeypatch.setattr(ex, "run_engine_processes", processes)
    for job_threads, engine_threads in ((32, 4), (12, 1), (4, 1), (None, None)):
        s = settings(aux_layers=[1, 3], backend="vllm", gpus=8, vllm_eager=False, threads=job_threads,
                     scratch=str(tmp_path / "s"))  # fmt: skip
        with pytest.raises(Recorded):
            ex.extract_shards(str(target), str(tokens), outs, s)
        assert engines.pop() == ([str(i) for i in range(8)], engine_threads, 1), job_threads
    writers = []

    class Writer(ShardWriter):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            writers.append(self.threads)

    monkeypatch.setattr(ex, "ShardWriter", Writer)
    before = torch.get_num_threads()
    try:
        for engine_threads, pool in ((3, 3), (None, 1)):
            s = settings(aux_layers=[1, 3], batch_tokens=60, compile="off", threads=engine_threads)
            ex.extract_shard(
                str(target), str(tokens), 1, outs[1], s, extractor=HfExtractor(tiny_llama, [1, 3])
            )
            assert writers.pop() == pool
    finally:
        torch.set_num_threads(before)


def test_extract_shards_refuses_a_shard_count_the_tokens_do_not_plan(tmp_path):
    from draftsmith.stages.extract import extract_shards

    tokens = tmp_path / "tokens.safetensors"
    _tokens_file(tokens, [5, 6], [[0, 1], [1, 2]])
    with pytest.raises(
        ValueError, match=r"extract.num_shards: 3 shard files asked for, but .* plans 2 shards"
    ):
        extract_shards(str(tmp_path), str(tokens), ["a", "b", "c"], settings(batch_tokens=60))


def test_a_full_disk_says_what_the_shard_needs(tmp_path, tiny_llama, monkeypatch):
    """The disk-full message states a real figure: the estimate when the disk filled while writing, the
    uncompressed states when it filled while probing (before the estimate): never "about 0 B"."""
    import errno

    import draftsmith.stages.extract as extract
    from draftsmith.backends.hf import HfExtractor
    from draftsmith.core.io.units import human_bytes
    from draftsmith.core.planning.estimate import raw_state_bytes

    target = tmp_path / "target"
    tiny_llama.save_pretrained(target)
    lengths = [7, 30, 12, 25, 9, 18, 40, 15]
    tokens = _tokens_file(tmp_path, lengths)
    out = tmp_path / "hidden" / "shard-0.safetensors"
    s = settings(aux_layers=[1, 3], batch_tokens=50)
    raw = raw_state_bytes(sum(lengths), 3, tiny_llama.config.hidden_size, s.storage_dtype)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    probe = extract.probe_plan
    messages = []
    for while_probing in (True, False):
        with monkeypatch.context() as patch:

            def probed(*args, **kwargs):
                planned = probe(*args, **kwargs)
                patch.setattr(ShardWriter, "_write", full)  # the probe wrote its samples; the shard cannot
                return planned

            patch.setattr(extract, "probe_plan", full if while_probing else probed)
            extractor = HfExtractor(tiny_llama, [1, 3])
            with pytest.raises(NotEnoughDisk) as err:
                extract.extract_shard(str(target), tokens, 0, str(out), s, extractor=extractor)
            extractor.close()
        messages.append(str(err.value))
    assert f"the shard needs up to {human_bytes(raw)}, its states uncompressed)" in messages[0]
    assert "the shard needs about " in messages[1], messages[1]
    needed = messages[1].split("the shard needs about ")[1].split(")")[0]
    assert needed != "0 B" and needed[0].isdigit(), messages[1]
    assert not out.exists()


def test_vllm_states_go_to_node_local_scratch_not_results(tmp_path, tiny_llama, monkeypatch):
    """The vllm back-end's per-request states folder (its connector's storage path) lies under
    resources.extract.scratch, not under results/ (Lustre without flock, NFS round trips); it is removed
    after the job, and a killed earlier job's folder (its process gone) is removed at the next start."""
    import draftsmith.stages.extract as ex
    from draftsmith.backends.hf import HfExtractor

    target = tmp_path / "target"
    tiny_llama.save_pretrained(target)
    tokens = tmp_path / "tokens.safetensors"
    _tokens_file(tokens, [7, 30, 12, 25], [[0, 2], [2, 4]])
    scratch = tmp_path / "scratch"
    stale = scratch / f"{ex.SCRATCH_PREFIX}999999999-x"
    stale.mkdir(parents=True)
    storage = []

    def extractor(backend, target, layer_ids, dtype, gpus, max_len, storage_dir, *rest):
        storage.append(Path(storage_dir))
        assert storage[-1].is_dir() and not stale.exists()
        return HfExtractor(tiny_llama, layer_ids)

    monkeypatch.setattr(ex, "make_extractor", extractor)
    outs = [tmp_path / "results" / "hidden" / f"shard-{k}.safetensors" for k in range(2)]
    s = settings(aux_layers=[1, 3], batch_tokens=60, compile="off", backend="vllm", scratch=str(scratch))
    ex.extract_shards(str(target), str(tokens), [str(p) for p in outs], s)
    (folder,) = storage
    assert folder.parent == scratch and not folder.is_relative_to(tmp_path / "results")
    assert list(scratch.iterdir()) == []  # the job's folder is gone with it
    assert ex.scratch_root(None) == Path(tempfile.gettempdir())


def test_extraction_runs_where_the_results_file_system_refuses_flock(tmp_path, tiny_llama, monkeypatch):
    """results/ on a file system without flock (Lustre mounted so: flock fails with ENOLCK, as a stand-in
    makes every lock under results/ fail here): the job's engine locks each of vLLM's per-request states
    files as the connector does (a lock file beside it, flock LOCK_EX) in node-local scratch, so the
    shards are written; the same lock under results/ fails as vLLM's first request would."""
    import errno
    import fcntl

    import draftsmith.stages.extract as ex
    from draftsmith.backends.hf import HfExtractor
    from draftsmith.core.data.shards import verify_shard

    results = tmp_path / "results"
    flock = fcntl.flock

    def no_flock_under_results(fd, operation):
        if Path(os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")).is_relative_to(
            results
        ):
            raise OSError(errno.ENOLCK, "No locks available")
        return flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", no_flock_under_results)
    target = tmp_path / "target"
    tiny_llama.save_pretrained(target)
    tokens = tmp_path / "tokens.safetensors"
    _tokens_file(tokens, [7, 30, 12, 25], [[0, 2], [2, 4]])
    locked = []

    def lock_states_file(folder: Path) -> None:  # the connector's _submit_async_write, per request
        fd = os.open(folder / "req-0.safetensors.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            locked.append(folder)
        finally:
            os.close(fd)

    def extractor(backend, target, layer_ids, dtype, gpus, max_len, storage_dir, *rest):
        lock_states_file(Path(storage_dir))
        return HfExtractor(tiny_llama, layer_ids)

    monkeypatch.setattr(ex, "make_extractor", extractor)
    outs = [results / "hidden" / f"shard-{k}.safetensors" for k in range(2)]
    s = settings(
        aux_layers=[1, 3], batch_tokens=60, compile="off", backend="vllm", scratch=str(tmp_path / "scratch")
    )
    ex.extract_shards(str(target), str(tokens), [str(p) for p in outs], s)
    assert len(locked) == 1 and not locked[0].is_relative_to(results)
    assert all(verify_shard(p) for p in outs)
    with pytest.raises(OSError) as err:  # the stand-in bites: vLLM's states under results/ would fail
        lock_states_file(outs[0].parent)
    assert err.value.errno == errno.ENOLCK


def test_a_scratch_folder_without_room_for_the_in_flight_states_is_refused_in_one_line(tmp_path, monkeypatch):
    """Kimi-K2.5's 3 aux layers + final (7,168 wide, bf16): 57 KB a token; 8,192-token batches, two in flight
    per engine: 0.94 GB for one engine. A folder with less is refused naming it and both figures."""
    import draftsmith.stages.extract as ex

    tokens, need = ex.in_flight_states(8192, 100, 1, 4, 7168, "bfloat16")
    assert (tokens, need) == (16384, 16384 * 57344)
    assert ex.in_flight_states(8192, 20000, 2, 4, 7168, "bfloat16")[0] == 80000  # a longer sample alone
    monkeypatch.setattr(ex.shutil, "disk_usage", lambda p: shutil_usage(free=500_000_000))
    with pytest.raises(ex.NotEnoughDisk) as err:
        ex.check_scratch_room(tmp_path, tokens, need)
    assert str(err.value) == (
        f"resources.extract.scratch: {tmp_path} has 0.50 GB free, but vLLM's states of the 16,384 tokens in "
        "flight need 0.94 GB: name a larger node-local folder"
    )
    monkeypatch.setattr(ex.shutil, "disk_usage", lambda p: shutil_usage(free=10**10))
    ex.check_scratch_room(tmp_path, tokens, need)


def shutil_usage(free: int):
    import shutil

    return shutil._ntuple_diskusage(total=2 * free, used=free, free=free)


def sleeping_engine(queue, starting, finished, pid_file: str, **kw) -> None:
    """A stand-in engine that hangs on its first shard (as a stuck collective does), with a child process
    of its own (as vLLM's workers)."""
    import subprocess
    import time

    starting(queue.take())
    child = subprocess.Popen(["sleep", "300"])
    Path(pid_file).write_text(str(child.pid))
    time.sleep(300)


def failing_engine(queue, starting, finished, **kw) -> None:
    """A stand-in engine that finishes its first shard and fails on its second."""
    first = queue.take()
    starting(first)
    finished(first)
    starting(queue.take())
    raise ValueError("no such layer")


def test_a_failing_engine_is_named_with_its_shard_in_one_line():
    import draftsmith.stages.extract as ex

    with pytest.raises(ex.EngineFailed) as err:
        ex.run_engine_processes(ex.ShardQueue([4, 3]), [""], {"settings": settings()}, runner=failing_engine)
    assert str(err.value) == (
        "extraction engine 0 of 1 (CUDA devices none) failed: shard 3: ValueError: no such layer; the shards "
        "finished are stashed and a rerun reuses them"
    )


def test_a_hung_engine_is_killed_with_its_processes_naming_it_and_its_shard(tmp_path):
    import draftsmith.stages.extract as ex

    queue = ex.ShardQueue([2, 0, 1])
    pid_file = tmp_path / "child.pid"
    t0 = time.monotonic()
    with pytest.raises(ex.EngineFailed) as err:
        kw = {"settings": settings(idle_timeout_s=8), "pid_file": str(pid_file)}
        ex.run_engine_processes(queue, [""], kw, runner=sleeping_engine)
    assert time.monotonic() - t0 < 120
    assert str(err.value).startswith(
        "extraction engine 0 of 1 (CUDA devices none) failed: shard 2: no shard started or finished in 8 s "
        "(resources.extract.idle_timeout_s): hung, killed with its processes"
    )
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _running(child):
        time.sleep(0.1)
    assert not _running(child)


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie awaiting its reaper is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
