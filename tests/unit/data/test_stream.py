"""train.hidden_states stream: the states a stream feeds the trainer are, bit for bit at the storage dtype,
what the extract stage writes into shards for the same samples (core/data/stream.py)."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers.data import flip_state_bit, make_stream_manifest, make_tiny_data, write_sample_tokens
from helpers.training import checkpoints_of, cli_train, settings
from safetensors.torch import load_file

from draftsmith.backends.hf import HfExtractor
from draftsmith.core.data.loader import BatchSettings, collate
from draftsmith.core.data.shards import ShardReader, verify_shard
from draftsmith.core.data.stream import StateCache, StreamedData, StreamSpec, TeacherDisagrees
from draftsmith.core.io.digests import intact
from draftsmith.stages import extract as ex
from draftsmith.stages.extract import ExtractSettings
from draftsmith.stages.train import train

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


class Counting:
    """An engine that counts the samples it captured."""

    def __init__(self, model):
        self.inner, self.captured = HfExtractor(model, AUX), 0
        self.lm_head_weight = self.inner.lm_head_weight

    def capture(self, sequences):
        self.captured += len(sequences)
        return self.inner.capture(sequences)

    def close(self):
        self.inner.close()


def digests_of(paths) -> dict[str, str]:
    out = {}
    for path in paths:
        with ShardReader(path) as reader:
            out |= dict(zip(reader.ids, reader.digests, strict=True))
    return out


def test_hybrid_caches_epoch_0_and_later_epochs_read_it(tmp_path, tiny_llama, monkeypatch):
    """hybrid: epoch 0 (and validation) capture and write one cache shard per shard of the plan, sealed
    and verified, each sample with the digest extraction records; epoch 1 reads the cache, captures
    nothing, and gets the same bits. A job started again on the cache (after a kill) verifies it and
    never loads the engine; a damaged cache shard is captured and written again."""
    model = tiny_llama.to(torch.bfloat16)
    tokens, files = extracted(tmp_path, model, monkeypatch, "bfloat16")
    cache_dir = tmp_path / "cache"
    meta = {"aux_layer_ids": AUX, "layer_convention": "input"}

    def open_data(engines: list) -> StreamedData:
        data = StreamedData(
            tokens,
            lambda: engines.append(Counting(model)) or engines[-1],
            StreamSpec("bfloat16", 60, 0.0),
            batching(),
        )
        data.use_cache(StateCache(cache_dir, len(SHARDS), meta, "zstd-planes", 1))
        return data

    def check(data: StreamedData, plan: list[list[int]], split: str) -> None:
        refs = data.train if split == "train" else data.val
        for indices, batch in zip(plan, data.batches(plan, split), strict=True):
            expected = collate([files[refs[i].id] for i in indices])
            assert all(
                torch.equal(getattr(batch, n), getattr(expected, n)) for n in ("aux", "final", "input_ids")
            )

    engines: list = []
    data = open_data(engines)
    check(data, data.epoch_batches(0), "train")
    check(data, data.val_batches(), "val")
    cached = [cache_dir / f"shard-{k}.safetensors" for k in range(len(SHARDS))]
    assert all(intact(p) for p in cached)
    hidden = sorted((tmp_path / "hidden").glob("shard-*.safetensors"))
    extracted_digests = digests_of(hidden)
    assert digests_of(cached).items() <= extracted_digests.items()  # the same sample digests
    captured = engines[0].captured
    check(data, data.epoch_batches(1), "train")
    assert engines[0].captured == captured and data.stats()["cache_bytes"] > 0
    data.close()

    engines = []
    data = open_data(engines)  # the job again, e.g. resumed after a kill -9
    check(data, data.epoch_batches(2), "train")
    assert engines == []
    data.close()
    flip_state_bit(cached[1])
    engines = []
    data = open_data(engines)
    check(data, data.epoch_batches(2), "train")
    assert engines and engines[0].captured > 0 and verify_shard(cached[1])
    data.close()


# ------------------------------------------------------------------------------- training on a stream


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return make_tiny_data(tmp_path_factory.mktemp("stream-data"))


def test_training_on_a_stream_measures_the_teacher_and_learns(data, tmp_path):
    """`train` on a stream manifest: the engine (transformers, on the CPU) captures every epoch, the
    summary says what it prefilled and the teacher agreement it measured (greedy traces: high)."""
    manifest = make_stream_manifest(data, tmp_path)
    summary = train(
        manifest,
        data["vocab"],
        tmp_path / "drafter",
        tmp_path / "ck",
        tmp_path / "m.jsonl",
        settings(epochs=3),
    )
    hidden = summary["hidden_states"]
    assert hidden["hidden_states"] == "stream" and hidden["teacher_agreement"] > 0.9, hidden
    tokens = sum(s.num_tokens for s in data["samples"])
    assert hidden["prefilled_tokens"] >= 3 * tokens * 0.7  # about one prefill per epoch (+ validation's)
    val = [
        r
        for r in [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
        if r["kind"] == "val"
    ]
    assert len(val) == 3 and val[-1]["loss"] < val[0]["loss"]
    assert (tmp_path / "drafter" / "model.safetensors").is_file()


def test_hybrid_training_prefills_once_and_removes_its_cache(data, tmp_path):
    """hybrid: epoch 0 captures (and validation what it alone reads), later epochs read the cache; the
    cache is removed once training is done, kept with resources.train.keep_hidden_cache."""
    manifest = make_stream_manifest(data, tmp_path, "hybrid")
    tokens = sum(s.num_tokens for s in data["samples"])
    for keep in (False, True):
        root = tmp_path / f"keep-{keep}"
        summary = train(manifest, data["vocab"], root / "drafter", root / "ck", root / "m.jsonl",
                        settings(epochs=3, keep_hidden_cache=keep))  # fmt: skip
        hidden = summary["hidden_states"]
        assert hidden["hidden_states"] == "hybrid" and hidden["teacher_agreement"] > 0.9, hidden
        assert hidden["prefilled_tokens"] <= tokens and hidden["cache_bytes"] > 0, hidden  # one prefill
        assert bool(list((root / "ck").glob("run-*/hidden/shard-*.safetensors"))) == keep


@pytest.mark.parametrize("mode", ["stream", "hybrid"])
def test_a_killed_streamed_run_resumes_to_identical_weights(data, tmp_path, mode):
    """SIGKILL a real `draftsmith train` on a stream (or hybrid) once a mid-run checkpoint exists and rerun
    it: the engine is started again (hybrid: what the cache holds is verified and read) and the run
    continues at its (epoch, batch) to the weights of an uninterrupted run, bit for bit."""
    manifest = make_stream_manifest(data, tmp_path, mode)
    s = settings(epochs=4, checkpoint_every=3)
    full = train(manifest, data["vocab"], tmp_path / "full" / "drafter", tmp_path / "full" / "checkpoints",
                 tmp_path / "full" / "metrics.jsonl", s)  # fmt: skip
    killed = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = cli_train(manifest, data["vocab"], killed, s)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not checkpoints_of(killed):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    out = proc.communicate()[0].decode(errors="replace")
    assert proc.returncode == -signal.SIGKILL, f"finished before the kill:\n{out[-3000:]}"
    assert not (killed / "drafter").exists()
    rerun = subprocess.run(command, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    summary = json.loads((killed / "drafter" / "train_summary.json").read_text())
    assert summary["resumed_from_step"] is not None and summary["steps"] == full["steps"]
    a = load_file(str(tmp_path / "full" / "drafter" / "model.safetensors"))
    b = load_file(str(killed / "drafter" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_a_streams_epoch_is_shuffled_as_files_shuffles_within_windows_of_whole_units():
    """The stream plans windows of whole capture units (memory: one window's states) holding at least
    pack_window training samples; each window shuffled and packed as `files` plans an epoch, so a batch
    mixes units and lengths do not run longest-first through the epoch."""
    from draftsmith.core.data.stream import unit_windows

    units = [[0, 1, 2], [3, 4], [5], [6, 7, 8, 9]]
    position = {i: i for i in range(10) if i != 4}  # 4 is a validation sample
    assert unit_windows([2, 0, 3, 1], units, position, 4) == [[5, 0, 1, 2], [6, 7, 8, 9], [3]]
    assert unit_windows([0, 1, 2, 3], units, position, 100) == [[0, 1, 2, 3, 5, 6, 7, 8, 9]]
    assert unit_windows([1], units, {}, 1) == []


def test_data_of_one_window_streams_in_the_batches_files_would_train(tmp_path):
    """At most pack_window training samples: the stream's epoch plan is the files plan of the same
    samples, batch for batch (equal data, equal order); more: windows of whole units."""
    from draftsmith.core.data.loader import StreamingData

    tokens = tokens_file(tmp_path / "tokens.safetensors")
    spec = StreamSpec("bfloat16", 60, 0.0)
    for window in (64, 2):
        settings = batching(pack_window=window)
        data = StreamedData(tokens, lambda: None, spec, settings)
        files = StreamingData([], data.train, data.val, settings)
        plans = [(data.epoch_batches(e), files.epoch_batches(e)) for e in range(3)]
        assert all(sorted(i for b in ours for i in b) == list(range(len(data.train))) for ours, _ in plans)
        assert all(ours == theirs for ours, theirs in plans) == (len(data.train) <= window)
