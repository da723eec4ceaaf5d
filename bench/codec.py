"""Shard codec benchmark: compression ratio and encode/decode MB/s of candidate codecs on real states.

    python bench/codec.py [--shard results/hidden/shard-0.safetensors] [--json results/bench/codec.json]

All candidates are lossless and run in this one process on the same bytes (the bf16 aux + final states
of one shard), single-threaded, each sample encoded and decoded on its own as a shard stores it and the
loader reads it; decode includes rebuilding the bf16 tensor. Ratio = compressed / raw. The last three
rows price the integrity checks: zstd's frame checksums, then the per-sample sha256 that every read
recomputes.
"""

from __future__ import annotations

import gzip
import time
from collections.abc import Callable

import click
import numpy as np
import torch
import zstandard

from draftsmith.atomic import write_json
from draftsmith.shards import (
    MANTISSA_LEVEL,
    PlaneEncoder,
    Sample,
    bf16_bits,
    byte_planes,
    decode_sample,
    high_plane_params,
    iter_samples,
    sample_digest,
    split_slots,
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
        return encoder.encode(sample)

    def decode(frames: list[bytes], shape: tuple[int, ...]) -> torch.Tensor:
        blob = np.frombuffer(b"".join(frames), dtype=np.uint8)
        ends = np.cumsum([len(f) for f in frames]).tolist()
        spans = [[start, end - start] for start, end in zip([0, *ends[:-1]], ends, strict=True)]
        index = [spans[i : i + 2] for i in range(0, len(spans), 2)]
        slots = decode_sample(blob, index, shape[0], shape[2], decomp)  # [A + 1, T, H]
        if digest:
            sample_digest(ids, mask, slots)
        aux, final = split_slots(slots)
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


@click.command()
@click.option(
    "--shard", default="results/hidden/shard-0.safetensors", show_default=True, type=click.Path(exists=True)
)
@click.option("--json", "json_path", default="results/bench/codec.json", show_default=True)
@click.option("--repeats", default=3, show_default=True)
def main(shard: str, json_path: str, repeats: int) -> None:
    torch.set_num_threads(1)
    samples = list(iter_samples(shard))
    states = [torch.cat([s.aux, s.final[:, None]], dim=1).contiguous() for s in samples]  # [T, A+1, H] each
    tokens, layers, hidden = sum(x.shape[0] for x in states), states[0].shape[1], states[0].shape[2]
    print(
        f"{shard}: {len(states)} samples, {tokens:,} tokens x {layers} layers x {hidden} = "
        f"{tokens * layers * hidden * 2 / 1e6:.1f} MB raw bf16; one frame set per sample, one thread"
    )
    rows = {}
    print(f"{'codec':36s} {'ratio':>6s} {'B/token':>8s} {'enc MB/s':>9s} {'dec MB/s':>9s}")
    for name, (enc, dec) in candidates().items():
        r = measure(states, enc, dec, repeats)
        rows[name] = r
        print(
            f"{name:36s} {r['ratio']:6.3f} {r['bytes_per_token']:8.0f} {r['encode_mb_s']:9.0f} {r['decode_mb_s']:9.0f}"
        )
    write_json(
        json_path,
        {"shard": shard, "samples": len(states), "tokens": tokens, "layers": layers, "codecs": rows},
    )
    print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
