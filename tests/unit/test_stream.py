"""train.hidden_states stream: the states a stream feeds the trainer are, bit for bit at the storage dtype,
what the extract stage writes into shards for the same samples (core/stream.py)."""

from pathlib import Path

import pytest
import torch
from helpers import write_sample_tokens

from draftsmith.backends.hf import HfExtractor
from draftsmith.core.loader import BatchSettings, collate
from draftsmith.core.shards import ShardReader
from draftsmith.core.stream import StreamedData, StreamSpec, TeacherDisagrees
from draftsmith.stages import extract as ex
from draftsmith.stages.extract import ExtractSettings

AUX = [1, 3]
LENGTHS = [7, 30, 12, 25, 9, 18, 22, 14, 5, 27, 16, 11]
SHARDS = [[0, 5], [5, 12]]


def tokens_file(path: Path, seed: int = 0) -> Path:
    """Random samples of the tiny Llama's vocabulary, the second half of each loss-masked, two shards."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]
    masks = [[0] * (n // 2) + [1] * (n - n // 2) for n in LENGTHS]
    write_sample_tokens(path, ids, masks, SHARDS)
    return path


def batching(**over) -> BatchSettings:
    values = {"batch_tokens": 90, "max_seq_len": 20, "val_fraction": 0.25, "seed": 3, "pack_window": 4}
    return BatchSettings.from_dict({**values, "loader_threads": 1, **over})


def extracted(tmp_path: Path, model, monkeypatch, storage_dtype: str) -> tuple[Path, dict]:
    """The extract stage's shards of tokens_file by `model` (batch_tokens 60: several samples per
    forward) -> (tokens, sample id -> the sample as training reads it from the shard, cut to 20 tokens)."""
    target = tmp_path / "target"
    model.save_pretrained(target)
    tokens = tokens_file(tmp_path / "tokens.safetensors")
    monkeypatch.setattr(ex, "make_extractor", lambda backend, t, ids, *a, **k: HfExtractor(model, ids))
    outs = [tmp_path / "hidden" / f"shard-{k}.safetensors" for k in range(len(SHARDS))]
    settings = ExtractSettings.from_dict(
        {
            "dtype": "bfloat16",
            "aux_layers": AUX,
            "batch_tokens": 60,
            "compile": "off",
            "storage_dtype": storage_dtype,
        }
    )
    ex.extract_shards(str(target), str(tokens), [str(p) for p in outs], settings)
    files = {}
    for out in outs:
        with ShardReader(out) as reader:
            files |= {reader.ids[i]: reader.read(i, 20) for i in range(len(reader))}
    return tokens, files


@pytest.mark.parametrize("storage_dtype", ["bfloat16", "float8_e4m3fn"])
def test_stream_feeds_what_files_stores_bit_for_bit(tmp_path, tiny_llama, monkeypatch, storage_dtype):
    """Every batch of two epochs and of validation, streamed, equals the batch collated from the shards'
    samples, to the bit; each epoch trains every training sample once, captured again (one prefill per
    epoch); the engine is loaded once, at the first capture. In bf16 a sample's states depend on the
    width of the forward it shares (other capture batches fail this test): the stream captures in the
    extract stage's batches."""
    model = tiny_llama.to(torch.bfloat16)
    tokens, files = extracted(tmp_path, model, monkeypatch, storage_dtype)
    loads = []
    data = StreamedData(
        tokens,
        lambda: loads.append(1) or HfExtractor(model, AUX),
        StreamSpec(storage_dtype, 60, 0.0),
        batching(),
    )
    assert loads == []  # planning needs no engine (the untrained drafter's export never loads one)
    assert data.train and data.val
    for split, plans in (
        ("train", [data.epoch_batches(0), data.epoch_batches(1)]),
        ("val", [data.val_batches()]),
    ):
        refs = data.train if split == "train" else data.val
        for plan in plans:
            assert sorted(i for b in plan for i in b) == list(range(len(refs)))  # each sample once
            for indices, batch in zip(plan, data.batches(plan, split), strict=True):
                expected = collate([files[refs[i].id] for i in indices])
                for name in ("input_ids", "loss_mask", "lengths", "aux", "final"):
                    assert torch.equal(getattr(batch, name), getattr(expected, name)), (split, name)
    stats = data.stats()
    assert loads == [1] and stats["teacher_checked"] > 0
    assert stats["prefilled_tokens"] > sum(LENGTHS)  # every unit once at least, training's again per epoch
    data.close()
    assert data.engine is None


def test_a_streamed_epoch_plan_is_a_pure_function_of_seed_and_epoch(tmp_path, tiny_llama):
    """A resumed run (after a kill -9) continues at (epoch, batch) of the same plan: the position is all a
    checkpoint needs; the plan differs between epochs and seeds."""
    tokens = tokens_file(tmp_path / "tokens.safetensors")

    def plan(seed: int, epoch: int) -> list[list[int]]:
        data = StreamedData(tokens, lambda: None, StreamSpec("bfloat16", 60, 0.0), batching(seed=seed))
        return data.epoch_batches(epoch)

    assert plan(3, 1) == plan(3, 1)
    assert plan(3, 0) != plan(3, 1) or plan(4, 0) != plan(3, 0)


def test_a_stream_whose_teacher_disagrees_stops(tmp_path, tiny_llama):
    """Random traces: the target's argmax does not reproduce them, as wrong layers or a wrong norm would
    not; the stream refuses to go on, naming the key to lower."""
    tokens = tokens_file(tmp_path / "tokens.safetensors")
    data = StreamedData(
        tokens, lambda: HfExtractor(tiny_llama, AUX), StreamSpec("bfloat16", 60, 0.9), batching()
    )
    with pytest.raises(TeacherDisagrees, match="extract.min_teacher_agreement 0.9"):
        for _ in data.batches(data.epoch_batches(0), "train"):
            pass
