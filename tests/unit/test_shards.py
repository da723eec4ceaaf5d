"""The shard codec: lossless round trips, random access, and damage caught by content, naming the shard
and the sample."""

import json
import struct

import pytest
import torch
import zstandard
from safetensors import safe_open

from draftsmith.shards import (
    HEADER_ROOM,
    Sample,
    ShardError,
    ShardReader,
    ShardWriter,
    iter_samples,
    read_header,
    read_sample,
    read_shard_meta,
    read_tokens,
    verify_shard,
    write_shard,
)

CODECS = ["none", "zstd-planes"]


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


@pytest.mark.parametrize("codec", CODECS)
def test_shard_round_trip_is_lossless(tmp_path, codec):
    samples = [_sample(0, 4), _sample(1, 5)]
    samples[0].aux[0, 0, 0] = float("inf")  # extreme values survive the byte-plane split
    samples[1].final[2, 3] = -3.0e38
    path = tmp_path / "shard-0.safetensors"
    write_shard(path, samples, _meta(), codec=codec)
    back = list(iter_samples(path))
    assert [s.id for s in back] == ["s0", "s1"]
    for a, b in zip(samples, back, strict=True):
        assert _equal(a, b)
        assert a.aux.shape == b.aux.shape and a.final.dtype == b.final.dtype == torch.bfloat16
    ids, mask, offsets = read_tokens(path)
    assert offsets.tolist() == [0, 4, 9] and ids.numel() == 9 and mask.sum() == 5


@pytest.mark.parametrize("codec", CODECS)
def test_shard_reader_random_access(tmp_path, codec):
    """Sample i read alone, in any order, equals the written sample, and max_tokens cuts it."""
    samples = [_sample(i, 10 + 3 * i) for i in range(5)]
    path = tmp_path / "shard-0.safetensors"
    write_shard(path, samples, _meta(), codec=codec)
    with ShardReader(path) as reader:
        assert len(reader) == 5 and reader.codec == codec
        for i in reversed(range(5)):
            assert _equal(reader.read(i), samples[i])
            cut = reader.read(i, 7)
            assert cut.num_tokens == 7 and torch.equal(cut.aux, samples[i].aux[:7])
            assert torch.equal(cut.final, samples[i].final[:7]) and torch.equal(
                cut.loss_mask, samples[i].loss_mask[:7]
            )
    assert _equal(read_sample(path, 3), samples[3])


@pytest.mark.parametrize("codec", CODECS)
def test_shard_header_outgrowing_its_room_still_writes_the_same_tensors(tmp_path, codec):
    samples = [_sample(0, 4), _sample(1, 5)]
    in_place = tmp_path / "in-place.safetensors"
    write_shard(in_place, samples, _meta(), codec=codec)
    rewritten = tmp_path / "rewritten.safetensors"
    writer = ShardWriter(rewritten, _meta(), codec)
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


def test_content_digest_depends_on_the_tensors_only(tmp_path):
    """Same tensors -> same digest, whatever the timing stats, codec or level; other tensors -> other."""
    samples = [_sample(0, 6), _sample(1, 9)]
    digests, file_bytes = [], []
    for k, (codec, level, seconds) in enumerate(
        [("zstd-planes", 1, 1.5), ("zstd-planes", 3, 9.0), ("none", 1, 2.0)]
    ):
        path = tmp_path / f"shard-{k}.safetensors"
        write_shard(path, samples, _meta(seconds=seconds), codec=codec, level=level)
        digests.append(verify_shard(path))
        assert read_shard_meta(path)["content_sha256"] == digests[-1]
        file_bytes.append(path.read_bytes())
    assert len(set(digests)) == 1 and len(set(file_bytes)) == 3  # the files differ, their content does not
    changed = [_sample(0, 6), _sample(1, 9)]
    changed[1].final.view(torch.int16)[4, 2] += 1  # one ulp in one value
    write_shard(tmp_path / "other.safetensors", changed, _meta(), codec="zstd-planes")
    assert verify_shard(tmp_path / "other.safetensors") != digests[0]
    swapped = [samples[1], samples[0]]  # order is content: training's data position depends on it
    write_shard(tmp_path / "swapped.safetensors", swapped, _meta(), codec="zstd-planes")
    assert verify_shard(tmp_path / "swapped.safetensors") != digests[0]


def test_zstd_frames_carry_content_checksums(tmp_path):
    path = tmp_path / "shard-0.safetensors"
    write_shard(path, [_sample(0, 6)], _meta(), codec="zstd-planes")
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
    ("codec", "tensor"),
    [
        ("zstd-planes", "blob"),
        ("none", "aux_hidden_states"),
        ("none", "final_hidden_states"),
        ("zstd-planes", "input_ids"),
        ("none", "loss_mask"),
    ],
)
def test_every_flipped_bit_is_caught_naming_shard_and_sample(tmp_path, codec, tensor):
    """A flipped bit anywhere in a sample's stored bytes fails its read, naming the shard and the
    sample; the other samples still read. (Without checksums a flipped exponent bit of a high plane
    decoded to a value off by 4.0 and trained silently.)"""
    samples = [_sample(i, 5 + i, hidden=4) for i in range(3)]
    clean = tmp_path / "clean.safetensors"
    write_shard(clean, samples, _meta(), codec=codec)
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
                assert _equal(reader.read(0), samples[0]) and _equal(reader.read(2), samples[2])
                with pytest.raises(ShardError, match=r"shard-7\.safetensors: sample 1 \(s1\): ") as err:
                    reader.read(1)
            assert "re-extract" in str(err.value)
            with pytest.raises(ShardError, match=r"shard-7\.safetensors: sample 1 \(s1\)"):
                verify_shard(damaged)


@pytest.mark.parametrize("cut", [3, 100, -10, -1])
def test_truncated_shard_is_named_in_one_line(tmp_path, cut):
    path = tmp_path / "shard-3.safetensors"
    write_shard(path, [_sample(0, 6)], _meta(), codec="zstd-planes")
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
    write_shard(path, [_sample(0, 6)], _meta(), codec="zstd-planes")
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["draftsmith_shard"])
    meta["version"] = 1
    header["__metadata__"]["draftsmith_shard"] = json.dumps(meta)
    blob = json.dumps(header).encode().ljust(n)
    path.write_bytes(data[:8] + blob + data[8 + n :])
    with pytest.raises(
        ShardError, match=r"shard-0.safetensors: shard format 1, this draftsmith reads format 2"
    ):
        ShardReader(path)
