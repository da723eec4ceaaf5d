"""Shard codec benchmark: compression ratio and encode/decode MB/s of candidate codecs on real states,
and the two storage dtypes side by side.

    python -m bench.codec [--shard results/hidden/shard-0.safetensors] [--json results/bench/codec.json]

All candidates are lossless and run in this one process on the same bytes (the bf16 aux + final states
of one bfloat16 shard), single-threaded, each sample encoded and decoded on its own as a shard stores it
and the loader reads it; decode includes rebuilding the bf16 tensor. Ratio = compressed / raw. The last
three rows price the integrity checks: zstd's frame checksums, then the per-sample sha256 that every
read recomputes.

Storage dtypes (`extract.storage_dtype`): the same samples written as shards with the shipped codec in
bfloat16 and in float8_e4m3fn (ShardWriter, as extraction writes them), then read back with
ShardReader.read, as training reads them (positioned read, zstd with checksums, sha256, float8
dequantized to bf16), in alternating order over --rounds rounds (bench/harness.py), timed in the reading thread's CPU
seconds (wall time swings several-fold on a shared machine): each round's bf16 / float8 time ratio sees
the same spell of the machine, and the table gives their mean with a 95% bootstrap interval over rounds.
Read MB/s counts the bf16 states a read delivers (tokens x layers x hidden x 2 bytes) per CPU second,
the same for both. Bytes per token are the stored states' (the blob), exact.
"""

from __future__ import annotations

import gzip
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import click
import numpy as np
import torch
import zstandard

from bench import harness
from draftsmith.core.data.shards import (
    MANTISSA_LEVEL,
    STORAGE_DTYPES,
    PlaneEncoder,
    Sample,
    ShardReader,
    ShardWriter,
    bf16_bits,
    byte_planes,
    decode_sample,
    high_plane_params,
    iter_samples,
    read_header,
    read_shard_meta,
    sample_digest,
    split_slots,
    store,
)


def _planes_encoder(level: int, per_layer: bool, low_level: int | None = None) -> tuple[Callable, Callable]:
    """Byte planes, each a zstd frame; the low (mantissa) plane at low_level when given."""
    high = zstandard.ZstdCompressor(level=level)
    low = zstandard.ZstdCompressor(level=level if low_level is None else low_level)
    decomp = zstandard.ZstdDecompressor()

    def encode(states: torch.Tensor) -> list[bytes]:  # states [N, L, H]
        parts = [states[:, i] for i in range(states.shape[1])] if per_layer else [states]
        planes = [byte_planes(bf16_bits(part.contiguous())) for part in parts]
        return [f for h, lo in planes for f in (high.compress(h), low.compress(lo))]

    def decode(frames: list[bytes], shape: tuple[int, ...]) -> torch.Tensor:
        n_parts = len(frames) // 2
        per = int(np.prod(shape)) // n_parts
        pairs = np.empty((n_parts, per, 2), dtype=np.uint8)
        for i in range(n_parts):
            pairs[i, :, 1] = np.frombuffer(decomp.decompress(frames[2 * i]), dtype=np.uint8)
            pairs[i, :, 0] = np.frombuffer(decomp.decompress(frames[2 * i + 1]), dtype=np.uint8)
        out = torch.from_numpy(pairs).view(torch.bfloat16)
        if per_layer:  # [L, N*H] -> [N, L, H]
            return out.reshape(shape[1], shape[0], shape[2]).transpose(0, 1).contiguous()
        return out.reshape(shape)

    return encode, decode


def _bytes_codec(
    compress: Callable[[bytes], bytes], decompress: Callable[[bytes], bytes]
) -> tuple[Callable, Callable]:
    def encode(states: torch.Tensor) -> list[bytes]:
        return [compress(states.contiguous().view(torch.uint8).numpy().tobytes())]

    def decode(frames: list[bytes], shape: tuple[int, ...]) -> torch.Tensor:
        return torch.frombuffer(bytearray(decompress(frames[0])), dtype=torch.bfloat16).reshape(shape)

    return encode, decode


def candidates() -> dict[str, tuple[Callable, Callable]]:
    out = {}
    for level in (1, 3, 9):
        c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        out[f"zstd-{level} (plain)"] = _bytes_codec(c.compress, d.decompress)
    out["gzip-6 (SpecForge)"] = _bytes_codec(lambda b: gzip.compress(b, 6), gzip.decompress)
    out["byte planes, all layers, zstd-1"] = _planes_encoder(1, per_layer=False)
    for level in (1, 3):
        out[f"byte planes per layer, zstd-{level}"] = _planes_encoder(level, per_layer=True)
    out[f"same, mantissa at zstd {MANTISSA_LEVEL}"] = _planes_encoder(1, True, MANTISSA_LEVEL)
    out["shipped, format 1 (no checksums)"] = _shipped_codec(checksums=False, digest=False)
    out["shipped + zstd frame checksums"] = _shipped_codec(digest=False)
    out["shipped + checksums + sample sha256"] = _shipped_codec()
    return out


def _shipped_codec(level: int = 1, checksums: bool = True, digest: bool = True) -> tuple[Callable, Callable]:
    """What ShardWriter writes and ShardReader decodes: with checksums and digest, exactly (zstd checks
    each frame's checksum, then the sample's sha256 is recomputed); without, to price them."""
    encoder, decomp = PlaneEncoder(level), zstandard.ZstdDecompressor()
    if not checksums:  # format 1's frames
        encoder.high = zstandard.ZstdCompressor(
            compression_params=_without_checksum(high_plane_params(level))
        )
        encoder.low = zstandard.ZstdCompressor(level=MANTISSA_LEVEL)
    ids, mask = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.uint8)

    def encode(states: torch.Tensor) -> list[bytes]:  # states [N, L, H]
        sample = Sample("bench", torch.zeros(0), torch.zeros(0), states[:, :-1], states[:, -1])
        return encoder.encode(store(sample, "bfloat16"))

    def decode(frames: list[bytes], shape: tuple[int, ...]) -> torch.Tensor:
        blob = np.frombuffer(b"".join(frames), dtype=np.uint8)
        ends = np.cumsum([len(f) for f in frames]).tolist()
        spans = [[start, end - start] for start, end in zip([0, *ends[:-1]], ends, strict=True)]
        index = [spans[i : i + 2] for i in range(0, len(spans), 2)]
        stored = decode_sample(blob, index, shape[0], shape[2], decomp, "bfloat16")  # [A + 1, T, H]
        if digest:
            sample_digest(ids, mask, stored)
        aux, final = split_slots(stored.bf16_bits())
        return torch.cat([aux, final[:, None]], dim=1)

    return encode, decode


def _without_checksum(params: zstandard.ZstdCompressionParameters) -> zstandard.ZstdCompressionParameters:
    return zstandard.ZstdCompressionParameters(
        window_log=params.window_log,
        chain_log=params.chain_log,
        hash_log=params.hash_log,
        search_log=params.search_log,
        min_match=params.min_match,
        target_length=params.target_length,
        strategy=params.strategy,
        write_checksum=False,
    )


def measure(
    samples: list[torch.Tensor], encode: Callable, decode: Callable, repeats: int
) -> dict[str, float]:
    """Each sample [T, A+1, H] encoded and decoded on its own, as a shard stores and the loader reads it."""
    raw = sum(x.numel() for x in samples) * 2
    enc_times, dec_times = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        frames = [encode(x) for x in samples]
        enc_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        back = [decode(f, tuple(x.shape)) for f, x in zip(frames, samples, strict=True)]
        dec_times.append(time.perf_counter() - t)
    for b, x in zip(back, samples, strict=True):
        if not torch.equal(b.view(torch.int16), x.view(torch.int16)):
            raise AssertionError("codec is not lossless")
    size = sum(len(f) for fs in frames for f in fs)
    return {
        "ratio": size / raw,
        "encode_mb_s": raw / min(enc_times) / 1e6,
        "decode_mb_s": raw / min(dec_times) / 1e6,
        "bytes_per_token": size / sum(x.shape[0] for x in samples),
    }


def write_as(samples: list[Sample], path: Path, dtype: str, level: int = 1) -> dict[str, float]:
    """Write the samples as extraction does (zstd-planes, `dtype`): state bytes and the writer's CPU s."""
    writer = ShardWriter(
        path, {}, "zstd-planes", level, sample_ids=[s.id for s in samples], storage_dtype=dtype
    )
    for sample in samples:
        writer.add(sample)
    writer.close()
    return {"state_bytes": read_header(path)[1]["blob"]["shape"][0], "writer_cpu_seconds": writer.cpu_seconds}


def read_all(path: Path) -> float:
    """CPU seconds of the reading thread to read every sample of a shard as training does
    (ShardReader.read, one thread). CPU time, not wall time: on a shared machine wall time swings
    several-fold between rounds (other jobs), while the work a read costs does not."""
    with ShardReader(path) as reader:
        start = time.thread_time()
        for i in range(len(reader)):
            reader.read(i)
        return time.thread_time() - start


def fp8_code_planes(samples: list[Sample]) -> dict[str, float]:
    """Bytes per token of the float8 code planes under the shipped settings and stock zstd levels (the
    scales are 4 bytes a row either way): is the shipped choice the right one for codes too?"""
    planes = [store(s, "float8_e4m3fn").values.reshape(-1, s.num_tokens * s.final.shape[-1]) for s in samples]
    tokens = sum(s.num_tokens for s in samples)
    compressors = {
        "shipped (min_match 7, small hash)": zstandard.ZstdCompressor(compression_params=high_plane_params(1))
    }
    compressors |= {f"zstd-{level}": zstandard.ZstdCompressor(level=level) for level in (1, 3, 9)}
    return {
        name: sum(len(c.compress(plane)) for p in planes for plane in p) / tokens
        for name, c in compressors.items()
    }


def compare_storage(samples: list[Sample], rounds: int) -> dict[str, dict]:
    """bfloat16 vs float8_e4m3fn shards of the same samples: bytes per token (exact) and read MB/s,
    read in alternating order, with per-round ratios."""
    tokens = sum(s.num_tokens for s in samples)
    layers, hidden = samples[0].aux.shape[1] + 1, samples[0].final.shape[-1]
    delivered = tokens * layers * hidden * 2  # bf16 bytes a full read returns, either dtype
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as scratch:
        paths = {dtype: Path(scratch) / f"{dtype}.safetensors" for dtype in STORAGE_DTYPES}
        for dtype, path in paths.items():
            written = write_as(samples, path, dtype)
            out[dtype] = {
                "state_bytes": written["state_bytes"],
                "bytes_per_token": written["state_bytes"] / tokens,
                "ratio_to_raw_bf16": written["state_bytes"] / delivered,
                "write_cpu_mb_s": delivered / written["writer_cpu_seconds"] / 1e6,
            }
        for dtype in STORAGE_DTYPES:  # a warm-up read each: page cache, zstd contexts, tables
            read_all(paths[dtype])
        reads = harness.alternating_rounds(
            {d: lambda d=d: read_all(paths[d]) for d in STORAGE_DTYPES}, rounds
        )
    for dtype, seconds in reads.items():
        out[dtype]["read_seconds"] = seconds
        out[dtype]["read_mb_s"] = delivered / harness.median(seconds) / 1e6
    base, fp8 = out["bfloat16"], out["float8_e4m3fn"]
    speed = harness.paired_ratios(base["read_seconds"], fp8["read_seconds"])  # fp8 MB/s / bf16's
    mean, low, high = harness.bootstrap_interval(speed)
    ratios = {
        "bytes": fp8["state_bytes"] / base["state_bytes"],
        "read_speed": mean,
        "read_speed_low": low,
        "read_speed_high": high,
        "read_speed_rounds": speed,
    }
    return {"tokens": tokens, "layers": layers, "hidden": hidden, **out, "float8_over_bf16": ratios}


def print_storage(result: dict) -> None:
    tokens = result["tokens"]
    print(f"\nstorage dtypes, shipped codec (zstd-planes), {tokens:,} tokens, read as training reads:")
    print(
        f"{'storage':15s} {'B/token':>8s} {'of raw bf16':>11s} {'read MB/CPU s':>14s} {'write MB/CPU s':>15s}"
    )
    for dtype in STORAGE_DTYPES:
        r = result[dtype]
        print(
            f"{dtype:15s} {r['bytes_per_token']:8.0f} {r['ratio_to_raw_bf16']:11.3f} {r['read_mb_s']:14.0f} "
            f"{r['write_cpu_mb_s']:15.0f}"
        )
    q = result["float8_over_bf16"]
    print(
        f"float8 / bf16: bytes {q['bytes']:.3f}; read speed {q['read_speed']:.2f}x "
        f"[{q['read_speed_low']:.2f}, {q['read_speed_high']:.2f}] (95%, {len(q['read_speed_rounds'])} paired rounds)"
    )
    print(
        "float8 code planes, bytes per token:",
        ", ".join(f"{k} {v:.0f}" for k, v in result["fp8_code_planes"].items()),
    )


@click.command()
@click.option(
    "--shard", default="results/hidden/shard-0.safetensors", show_default=True, type=click.Path(exists=True)
)
@click.option("--json", "json_path", default=str(harness.result_path("codec")), show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--rounds", default=10, show_default=True, help="Paired read rounds of the storage dtypes.")
@click.option(
    "--storage-only", is_flag=True, help="Only the storage-dtype comparison (skip the codec candidates)."
)
def main(shard: str, json_path: str, repeats: int, rounds: int, storage_only: bool) -> None:
    torch.set_num_threads(1)
    load_before = harness.load_average()
    if read_shard_meta(shard).get("dtype", "bfloat16") != "bfloat16":
        raise click.UsageError(f"{shard} is not a bfloat16 shard: the codecs need the states as computed")
    samples = list(iter_samples(shard))
    states = [torch.cat([s.aux, s.final[:, None]], dim=1).contiguous() for s in samples]  # [T, A+1, H] each
    tokens, layers, hidden = sum(x.shape[0] for x in states), states[0].shape[1], states[0].shape[2]
    print(
        f"{shard}: {len(states)} samples, {tokens:,} tokens x {layers} layers x {hidden} = "
        f"{tokens * layers * hidden * 2 / 1e6:.1f} MB raw bf16; one frame set per sample, one thread"
    )
    rows = {}
    if not storage_only:
        print(f"{'codec':36s} {'ratio':>6s} {'B/token':>8s} {'enc MB/s':>9s} {'dec MB/s':>9s}")
        for name, (enc, dec) in candidates().items():
            r = measure(states, enc, dec, repeats)
            rows[name] = r
            print(
                f"{name:36s} {r['ratio']:6.3f} {r['bytes_per_token']:8.0f} {r['encode_mb_s']:9.0f} {r['decode_mb_s']:9.0f}"
            )
    storage = compare_storage(samples, rounds)
    storage["fp8_code_planes"] = fp8_code_planes(samples)
    print_storage(storage)
    harness.write_result(
        {
            "shard": shard,
            "samples": len(states),
            "tokens": tokens,
            "layers": layers,
            "codecs": rows,
            "storage": storage,
            "machine": harness.machine(load_before),
        },
        json_path,
    )


if __name__ == "__main__":
    main()
