"""The shard codec: lossless round trips, float8 storage within the bound its format implies, random
access, and damage caught by content, naming the shard and the sample."""

import json
import struct

import pytest
import torch
import zstandard
from safetensors import safe_open

from draftsmith.core.data.shards import (
    HEADER_ROOM,
    Sample,
    ShardError,
    ShardReader,
    ShardWriter,
    as_stored,
    iter_samples,
    read_header,
    read_sample,
    read_shard_meta,
    read_tokens,
    store,
    verify_shard,
    write_shard,
)

CODECS = ["none", "zstd-planes"]
FORMS = [(codec, dtype) for dtype in ("bfloat16", "float8_e4m3fn") for codec in CODECS]


def _sample(i: int, n: int, hidden: int = 8, seed: int = 0) -> Sample:
    g = torch.Generator().manual_seed(1000 * seed + i)
    return Sample(
        f"s{i}",
        torch.arange(n) + i,
        torch.tensor([0] * (n // 2) + [1] * (n - n // 2), dtype=torch.bool),
        torch.randn(n, 3, hidden, generator=g).bfloat16(),
        torch.randn(n, hidden, generator=g).bfloat16(),
    )


def _meta(**stats) -> dict:
    return {"aux_layer_ids": [1, 2, 3], "layer_convention": "input", "dtype": "bfloat16", "stats": stats}


def _equal(a: Sample, b: Sample) -> bool:
    return a.id == b.id and all(
        torch.equal(getattr(a, k), getattr(b, k)) for k in ("input_ids", "loss_mask", "aux", "final")
    )


def _fp8_reference(x: torch.Tensor) -> torch.Tensor:
    """What float8_e4m3fn storage must give back, computed by torch alone: per row (last dim) the
    smallest power of two s with absmax / s <= 448, then (x / s) rounded to e4m3 by torch, times s."""
    absmax = x.float().abs().amax(-1, keepdim=True)
    s = torch.exp2(torch.ceil(torch.log2(absmax / 448.0)))
    s = torch.where(absmax / s > 448.0, s * 2, s)  # log2 of a float may land a hair low
    s = torch.where(absmax == 0, torch.ones_like(s), s)
    return ((x.float() / s).to(torch.float8_e4m3fn).float() * s).bfloat16()


def _stored_equal(a: Sample, b: Sample, dtype: str) -> bool:
    """b is what a shard of `dtype` gives back for a."""
    if dtype == "bfloat16":
        return _equal(a, b)
    quantized = Sample(a.id, a.input_ids, a.loss_mask, _fp8_reference(a.aux), _fp8_reference(a.final))
    return _equal(quantized, b)


@pytest.mark.parametrize("codec", CODECS)
def test_shard_round_trip_is_lossless(tmp_path, codec):
    samples = [_sample(0, 4), _sample(1, 5)]
    samples[0].aux[0, 0, 0] = float("inf")  # extreme values survive the byte-plane split
    samples[1].final[2, 3] = -3.0e38
    path = tmp_path / "shard-0.safetensors"
    write_shard(path, samples, _meta(), codec=codec, level=1, storage_dtype="bfloat16")
    back = list(iter_samples(path))
    assert [s.id for s in back] == ["s0", "s1"]
    for a, b in zip(samples, back, strict=True):
        assert _equal(a, b)
        assert a.aux.shape == b.aux.shape and a.final.dtype == b.final.dtype == torch.bfloat16
    ids, mask, offsets = read_tokens(path)
    assert offsets.tolist() == [0, 4, 9] and ids.numel() == 9 and mask.sum() == 5


@pytest.mark.parametrize(("codec", "dtype"), FORMS)
def test_shard_reader_random_access(tmp_path, codec, dtype):
    """Sample i read alone, in any order, equals the written sample (float8: as stored), and max_tokens
    cuts it."""
    samples = [_sample(i, 10 + 3 * i) for i in range(5)]
    path = tmp_path / "shard-0.safetensors"
    write_shard(path, samples, _meta(), codec=codec, storage_dtype=dtype, level=1)
    with ShardReader(path) as reader:
        assert len(reader) == 5 and reader.codec == codec and reader.storage_dtype == dtype
        for i in reversed(range(5)):
            whole = reader.read(i)
            assert _stored_equal(samples[i], whole, dtype)
            cut = reader.read(i, 7)
            assert cut.num_tokens == 7 and torch.equal(cut.aux, whole.aux[:7])
            assert torch.equal(cut.final, whole.final[:7]) and torch.equal(
                cut.loss_mask, samples[i].loss_mask[:7]
            )
    assert _stored_equal(samples[3], read_sample(path, 3), dtype)


@pytest.mark.parametrize("codec", CODECS)
def test_float8_storage_returns_torchs_e4m3_rounding_times_a_power_of_two_scale(tmp_path, codec):
    """A float8 shard gives back, exactly, torch's own e4m3 rounding of x / s times s, s the row's power
    of two (as bf16: a code's 4 significant bits times a power of two fit), on values spanning the
    whole range: huge and tiny rows, zeros, subnormal codes, a row whose absmax is exactly 448 * 2^k."""
    g = torch.Generator().manual_seed(7)
    n, hidden = 9, 64
    aux = (torch.randn(n, 3, hidden, generator=g) * torch.logspace(-30, 30, n)[:, None, None]).bfloat16()
    final = (torch.randn(n, hidden, generator=g) * torch.logspace(-6, 2, hidden)).bfloat16()  # spans codes
    aux[0, 0] = 0.0  # a zero row
    aux[1, 1, :4] = torch.tensor([448.0, -448.0, 1e-3, 0.5])  # absmax exactly 448: scale 1
    aux[2, 2, 7] = -0.0
    sample = Sample("x", torch.arange(n), torch.ones(n, dtype=torch.bool), aux, final)
    path = tmp_path / "shard-0.safetensors"
    write_shard(path, [sample], _meta(), codec=codec, storage_dtype="float8_e4m3fn", level=1)
    back = read_sample(path, 0)
    assert back.aux.dtype == back.final.dtype == torch.bfloat16
    assert torch.equal(back.aux.view(torch.int16), _fp8_reference(aux).view(torch.int16))
    assert torch.equal(back.final.view(torch.int16), _fp8_reference(final).view(torch.int16))
    assert torch.equal(back.aux[1, 1, :2], torch.tensor([448.0, -448.0], dtype=torch.bfloat16))
    stored = store(sample, "float8_e4m3fn")
    assert stored.scales[1, 1] == 1.0 and ((stored.values & 0x78) == 0).any()  # subnormal codes occur


def test_float8_error_stays_within_the_bound_its_three_mantissa_bits_imply(tmp_path):
    """The tolerance follows from the format, not from a run: x / s is exact (s a power of two), so
    the only rounding is e4m3's to nearest. A normal e4m3 value has 3 mantissa bits: neighbours in a
    binade [2^e, 2^(e+1)) are 2^(e-3) apart, so |error| <= 2^(e-4) <= 2^-4 |x / s|. Below the smallest
    normal, 2^-6, codes are 2^-9 apart: |error| <= 2^-10 (times s). And s, the smallest power of two
    with absmax / s <= 448, keeps absmax / s above 224. The bound is also tight (some value's relative
    error exceeds half of it), so a coarser rounding would fail here."""
    g = torch.Generator().manual_seed(3)
    n, hidden = 64, 576
    # rows like a transformer's: a few large outlier channels over a bulk of small values
    aux = torch.randn(n, 3, hidden, generator=g) * torch.logspace(-2, 1, n)[:, None, None]
    aux[..., :3] *= 300.0
    final = torch.randn(n, hidden, generator=g)
    sample = Sample("x", torch.arange(n), torch.ones(n, dtype=torch.bool), aux.bfloat16(), final.bfloat16())
    path = tmp_path / "shard-0.safetensors"
    write_shard(path, [sample], _meta(), codec="zstd-planes", storage_dtype="float8_e4m3fn", level=1)
    back, stored = read_sample(path, 0), store(sample, "float8_e4m3fn")
    x = torch.cat([sample.aux.transpose(0, 1), sample.final[None]]).float()  # [A + 1, T, H], as stored
    x_hat = torch.cat([back.aux.transpose(0, 1), back.final[None]]).float()
    scale = torch.from_numpy(stored.scales)[..., None]  # [A + 1, T, 1]
    absmax = x.abs().amax(-1, keepdim=True)
    assert ((absmax / scale > 224) & (absmax / scale <= 448)).all()
    bound = torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * scale)
    error = (x_hat - x).abs()
    assert (error <= bound).all(), float((error / bound).max())
    normal = x.abs() >= 2.0**-6 * scale
    assert float((error[normal] / x.abs()[normal]).max()) > 2.0**-5  # tight: not a looser rounding


def test_float8_refuses_a_non_finite_state_naming_the_sample(tmp_path):
    bad = _sample(1, 4)
    bad.final[2, 3] = float("inf")
    with pytest.raises(RuntimeError, match="writing .*shard-0.safetensors failed") as err:
        write_shard(
            tmp_path / "shard-0.safetensors",
            [_sample(0, 4), bad],
            _meta(),
            storage_dtype="float8_e4m3fn",
            codec="none",
            level=1,
        )
    assert "sample s1: a hidden state is inf or nan" in str(err.value.__cause__)
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_float8_shard_with_codec_none_is_plain_safetensors_codes_and_scales(tmp_path):
    """Readable without draftsmith: F8_E4M3 codes and float32 scales, value = code * scale."""
    samples = [_sample(0, 4), _sample(1, 5)]
    path = tmp_path / "shard-0.safetensors"
    write_shard(path, samples, _meta(), codec="none", storage_dtype="float8_e4m3fn", level=1)
    with safe_open(str(path), framework="pt") as f:
        aux, aux_scales = f.get_tensor("aux_hidden_states"), f.get_tensor("aux_scales")
        final, final_scales = f.get_tensor("final_hidden_states"), f.get_tensor("final_scales")
    assert aux.dtype == final.dtype == torch.float8_e4m3fn and aux.shape == (9, 3, 8)
    assert aux_scales.dtype == torch.float32 and aux_scales.shape == (9, 3) and final_scales.shape == (9,)
    back = list(iter_samples(path))
    assert torch.equal(torch.cat([s.aux for s in back]).float(), aux.float() * aux_scales[..., None])
    assert torch.equal(torch.cat([s.final for s in back]).float(), final.float() * final_scales[:, None])
    assert read_shard_meta(path)["dtype"] == "float8_e4m3fn"
    # plain shards are half the size of bf16's (plus 4 bytes per row of H values)
    bf16 = tmp_path / "bf16.safetensors"
    state_bytes = write_shard(bf16, samples, _meta(), codec="none", level=1, storage_dtype="bfloat16")
    assert write_shard(
        tmp_path / "f8.safetensors", samples, _meta(), storage_dtype="float8_e4m3fn", codec="none", level=1
    ) == (state_bytes // 2 + 9 * 4 * 4)


@pytest.mark.parametrize("codec", CODECS)
def test_shard_header_outgrowing_its_room_still_writes_the_same_tensors(tmp_path, codec):
    samples = [_sample(0, 4), _sample(1, 5)]
    in_place = tmp_path / "in-place.safetensors"
    write_shard(in_place, samples, _meta(), codec=codec, level=1, storage_dtype="bfloat16")
    rewritten = tmp_path / "rewritten.safetensors"
    writer = ShardWriter(rewritten, _meta(), codec, level=1, storage_dtype="bfloat16")
    for sample in samples:
        writer.add(sample)
    writer.close({"notes": "x" * (2 * HEADER_ROOM)})  # more than the room kept for the header
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in-place.safetensors", "rewritten.safetensors"]
    (in_place_header,) = struct.unpack("<Q", in_place.read_bytes()[:8])
    assert in_place_header >= HEADER_ROOM  # the header filled the room kept for it: nothing was copied
    contents = []
    for path in (in_place, rewritten):
        with safe_open(str(path), framework="pt") as f:  # plain safetensors reads both layouts
            contents.append({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    assert contents[0].keys() == contents[1].keys()
    for name, tensor in contents[0].items():
        assert torch.equal(tensor.view(torch.uint8), contents[1][name].view(torch.uint8)), name
    assert [s.id for s in iter_samples(rewritten)] == ["s0", "s1"]
    assert verify_shard(in_place) == verify_shard(rewritten)


@pytest.mark.parametrize(("codec", "dtype"), FORMS)
def test_a_shard_compressed_by_several_threads_is_the_one_thread_shard(tmp_path, codec, dtype):
    """ShardWriter(threads=4) encodes samples in a pool: every sample decodes to the same tensors, the
    content digests are equal, and (each sample framed as one thread frames it, written in add() order)
    so are the files' bytes; the encoding threads' CPU time is counted."""
    samples = [_sample(i, 3 + 7 * i, hidden=64, seed=3) for i in range(12)]
    paths = {}
    for threads in (1, 4):
        paths[threads] = tmp_path / f"shard-{threads}.safetensors"
        writer = ShardWriter(paths[threads], _meta(), codec, level=1, storage_dtype=dtype, queue_size=2,
                             sample_ids=[s.id for s in samples], threads=threads)  # fmt: skip
        for sample in samples:
            writer.add(sample)
        writer.close()
        assert writer.cpu_seconds > 0
    one, four = (list(iter_samples(paths[t])) for t in (1, 4))
    assert [s.id for s in four] == [s.id for s in samples]
    for a, b, original in zip(one, four, samples, strict=True):
        assert _equal(a, b) and _stored_equal(original, b, dtype)
    assert verify_shard(paths[1]) == verify_shard(paths[4])
    assert paths[1].read_bytes() == paths[4].read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-1.safetensors", "shard-4.safetensors"]


def test_a_failing_sample_in_the_pool_fails_the_shard_naming_it(tmp_path):
    """An encoding thread's error reaches add() / close() as one thread's does; no file is left."""
    bad = _sample(2, 4)
    bad.aux[1, 0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="writing .*shard-0.safetensors failed") as err:
        write_shard(tmp_path / "shard-0.safetensors", [_sample(0, 4), _sample(1, 4), bad, _sample(3, 4)],
                    _meta(), codec="zstd-planes", level=1, storage_dtype="float8_e4m3fn", threads=3)  # fmt: skip
    assert "sample s2: a hidden state is inf or nan" in str(err.value.__cause__)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_content_digest_depends_on_the_tensors_only(tmp_path, dtype):
    """Same tensors -> same digest, whatever the timing stats, codec or level; other tensors -> other."""
    samples = [_sample(0, 6), _sample(1, 9)]
    digests, file_bytes = [], []
    for k, (codec, level, seconds) in enumerate(
        [("zstd-planes", 1, 1.5), ("zstd-planes", 3, 9.0), ("none", 1, 2.0)]
    ):
        path = tmp_path / f"shard-{k}.safetensors"
        write_shard(path, samples, _meta(seconds=seconds), codec=codec, level=level, storage_dtype=dtype)
        digests.append(verify_shard(path))
        assert read_shard_meta(path)["content_sha256"] == digests[-1]
        file_bytes.append(path.read_bytes())
    assert len(set(digests)) == 1 and len(set(file_bytes)) == 3  # the files differ, their content does not
    changed = [_sample(0, 6), _sample(1, 9)]
    changed[1].final[4, 2] *= 1.5  # one value, by more than float8 rounds away
    write_shard(
        tmp_path / "other.safetensors", changed, _meta(), codec="zstd-planes", storage_dtype=dtype, level=1
    )
    assert verify_shard(tmp_path / "other.safetensors") != digests[0]
    swapped = [samples[1], samples[0]]  # order is content: training's data position depends on it
    write_shard(
        tmp_path / "swapped.safetensors", swapped, _meta(), codec="zstd-planes", storage_dtype=dtype, level=1
    )
    assert verify_shard(tmp_path / "swapped.safetensors") != digests[0]
    other_dtype = {"bfloat16": "float8_e4m3fn", "float8_e4m3fn": "bfloat16"}[dtype]
    write_shard(
        tmp_path / "dtype.safetensors",
        samples,
        _meta(),
        codec="zstd-planes",
        storage_dtype=other_dtype,
        level=1,
    )
    assert verify_shard(tmp_path / "dtype.safetensors") != digests[0]


def test_zstd_frames_carry_content_checksums(tmp_path):
    path = tmp_path / "shard-0.safetensors"
    write_shard(path, [_sample(0, 6)], _meta(), codec="zstd-planes", level=1, storage_dtype="bfloat16")
    with ShardReader(path) as reader:
        blob = reader.read_tensor("blob").numpy().tobytes()
        frames = reader._index[0]
    for slot in frames:
        for offset, size in slot:
            params = zstandard.get_frame_parameters(blob[offset : offset + size])
            assert params.has_checksum, (slot, offset)


def _tensor_bytes(path, name: str) -> tuple[int, int]:
    """(first byte in the file, byte count) of one stored tensor."""
    data_start, entries, _ = read_header(path)
    a, b = entries[name]["data_offsets"]
    return data_start + a, b - a


def _flip(path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))  # same size: only the content can tell


@pytest.mark.parametrize(
    ("codec", "tensor", "dtype"),
    [
        ("zstd-planes", "blob", "bfloat16"),
        ("none", "aux_hidden_states", "bfloat16"),
        ("none", "final_hidden_states", "bfloat16"),
        ("zstd-planes", "input_ids", "bfloat16"),
        ("none", "loss_mask", "bfloat16"),
        ("zstd-planes", "blob", "float8_e4m3fn"),
        ("none", "aux_hidden_states", "float8_e4m3fn"),
        ("none", "aux_scales", "float8_e4m3fn"),
        ("none", "final_scales", "float8_e4m3fn"),
    ],
)
def test_every_flipped_bit_is_caught_naming_shard_and_sample(tmp_path, codec, tensor, dtype):
    """A flipped bit anywhere in a sample's stored bytes fails its read, naming the shard and the
    sample; the other samples still read. (Without checksums a flipped exponent bit of a high plane
    decoded to a value off by 4.0 and trained silently.)"""
    samples = [_sample(i, 5 + i, hidden=4) for i in range(3)]
    clean = tmp_path / "clean.safetensors"
    write_shard(clean, samples, _meta(), codec=codec, storage_dtype=dtype, level=1)
    start, size = _tensor_bytes(clean, tensor)
    with ShardReader(clean) as reader:
        first_of_1 = reader.offsets[1]
    # in sample 1's bytes: for token tensors rows of sample 1; for the blob a spread of its bytes
    if tensor == "blob":
        with ShardReader(clean) as reader:
            offsets = sorted({off for slot in reader._index[1] for off, _ in slot})
            end = max(off + n for slot in reader._index[1] for off, n in slot)
        spots = [start + o for o in range(offsets[0], end, max(1, (end - offsets[0]) // 25))]
    else:
        row = size // sum(s.num_tokens for s in samples)
        spots = [
            start + first_of_1 * row + j for j in range(0, samples[1].num_tokens * row, max(1, row // 3))
        ]
    assert len(spots) >= 5
    for spot in spots:
        for bit in (0, 6):
            damaged = tmp_path / "shard-7.safetensors"
            damaged.write_bytes(clean.read_bytes())
            _flip(damaged, spot, bit)
            with ShardReader(damaged) as reader:
                assert _stored_equal(samples[0], reader.read(0), dtype)
                assert _stored_equal(samples[2], reader.read(2), dtype)
                with pytest.raises(ShardError, match=r"shard-7\.safetensors: sample 1 \(s1\): ") as err:
                    reader.read(1)
            assert "re-extract" in str(err.value)
            with pytest.raises(ShardError, match=r"shard-7\.safetensors: sample 1 \(s1\)"):
                verify_shard(damaged)


@pytest.mark.parametrize("cut", [3, 100, -10, -1])
def test_truncated_shard_is_named_in_one_line(tmp_path, cut):
    path = tmp_path / "shard-3.safetensors"
    write_shard(path, [_sample(0, 6)], _meta(), codec="zstd-planes", level=1, storage_dtype="bfloat16")
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut > 0 else data[:cut])
    for read in (read_shard_meta, ShardReader, verify_shard, lambda p: list(iter_samples(p)), read_tokens):
        with pytest.raises(ShardError) as err:
            read(path)
        message = str(err.value)
        assert message.startswith(f"{path}: truncated") and "\n" not in message
        assert "rerun its extract job" in message


def test_older_shard_format_gets_a_clear_error(tmp_path):
    path = tmp_path / "shard-0.safetensors"
    write_shard(path, [_sample(0, 6)], _meta(), codec="zstd-planes", level=1, storage_dtype="bfloat16")
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["draftsmith_shard"])
    meta["version"] = 1
    header["__metadata__"]["draftsmith_shard"] = json.dumps(meta)
    blob = json.dumps(header).encode().ljust(n)
    path.write_bytes(data[:8] + blob + data[8 + n :])
    with pytest.raises(
        ShardError, match=r"shard-0.safetensors: shard format 1, this draftsmith reads formats 2 and 3"
    ):
        ShardReader(path)


def _rewrite_meta(path, **changes) -> None:
    """Change keys of a shard's draftsmith metadata in place (the header keeps its length)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["draftsmith_shard"])
    header["__metadata__"]["draftsmith_shard"] = json.dumps({**meta, **changes})
    path.write_bytes(data[:8] + json.dumps(header).encode().ljust(n) + data[8 + n :])


def test_format_2_shards_read_as_bf16_and_an_unknown_dtype_is_refused(tmp_path):
    """Format 3 only added float8: a format-2 shard (every one is bf16) reads unchanged."""
    samples = [_sample(0, 6)]
    path = tmp_path / "shard-0.safetensors"
    write_shard(path, samples, _meta(), codec="zstd-planes", level=1, storage_dtype="bfloat16")
    _rewrite_meta(path, version=2)
    assert _equal(read_sample(path, 0), samples[0]) and verify_shard(path)
    _rewrite_meta(path, dtype="float8_e5m2")
    with pytest.raises(ShardError, match=r"shard-0.safetensors: stores float8_e5m2, this draftsmith reads"):
        ShardReader(path)


def test_float8_storage_of_float8_states_is_exact():
    """Re-storing what a float8 shard returned (a subset copied into new shards) changes nothing: the
    row's largest value may round to 224 * s, and then s / 2 is the new scale, under which every value
    is twice an e4m3 value, again an e4m3 value."""
    g = torch.Generator().manual_seed(5)
    sample = _sample(0, 64, hidden=256)
    sample.aux.copy_(torch.randn(64, 3, 256, generator=g) * torch.logspace(-3, 3, 64)[:, None, None])
    once = as_stored(sample.aux, "float8_e4m3fn")
    assert torch.equal(as_stored(once, "float8_e4m3fn").view(torch.int16), once.view(torch.int16))
