"""`draftsmith estimate`: the extraction estimate (draftsmith/core/planning/estimate.py) measured before any job,
by probing a tokens file with the transformers back-end, or with codec ratios measured on an existing
shard.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import torch

from draftsmith.core.config.stage_args import BAD_INPUT, arg
from draftsmith.core.config.stage_settings import EstimateSettings
from draftsmith.core.data.shards import Sample, ShardError, ShardReader
from draftsmith.core.model.precision import compute_dtype
from draftsmith.core.planning.estimate import codec_ratios, estimate_lines, mode_lines, probe_plan

RATIO_TOKENS = 50_000  # tokens of a shard that shard_codec_ratios encodes: ratios settle well before


def estimate_on_tokens(tokens_path: str, target_path: str, settings: EstimateSettings) -> list[str]:
    """The estimate of a workflow's data: its extraction probed on the tokens file with the target."""
    s = settings
    measured, num_tokens, stored_layers, hidden_size = measure_on_tokens(
        tokens_path, target_path, s.aux_layers, compute_dtype(s.dtype), s.batch_tokens, s.codec, s.zstd_level
    )
    lines, result = estimate_lines(num_tokens, stored_layers, hidden_size, measured, s.storage_dtype)
    return lines + mode_lines(result, s.epochs)


def estimate_by_hand(
    num_tokens: int, stored_layers: int, hidden_size: int, ratios_from: str | None, settings: EstimateSettings
) -> list[str]:
    """The estimate for any model by its sizes, compressed by the ratios measured on the bfloat16 shard
    `ratios_from` when given (ShardError, ValueError: not such a shard)."""
    s = settings
    measured = shard_codec_ratios(ratios_from, s.codec, s.zstd_level) if ratios_from else None
    lines, result = estimate_lines(
        num_tokens, stored_layers, hidden_size, measured, s.storage_dtype, ratios_source=ratios_from
    )
    return lines + mode_lines(result, s.epochs)


def shard_codec_ratios(
    path: str | Path, codec: str, level: int, max_tokens: int = RATIO_TOKENS
) -> dict[str, Any]:
    """The codec's ratio per storage dtype, measured on the first samples (up to max_tokens) of a
    bfloat16 shard: {"tokens", "codec", "codec_ratio"}, as estimate_lines takes it."""
    with ShardReader(path) as reader:
        if reader.storage_dtype != "bfloat16":
            raise ValueError(
                f"{path} stores {reader.storage_dtype}: the ratios need the states as computed (a bfloat16 shard)"
            )
        samples: list[Sample] = []
        while len(samples) < len(reader) and sum(s.num_tokens for s in samples) < max_tokens:
            samples.append(reader.read(len(samples)))
    with tempfile.TemporaryDirectory() as scratch:
        ratios = codec_ratios(samples, codec, level, Path(scratch))
    return {"tokens": sum(s.num_tokens for s in samples), "codec": codec, "codec_ratio": ratios}


def measure_on_tokens(
    tokens_path: str,
    target_path: str,
    aux_layer_ids: list[int] | None,
    dtype: str,
    batch_tokens: int,
    codec: str,
    level: int,
) -> tuple[dict[str, Any], int, int, int]:
    """`probe` on a tokens file the way its extraction job would run it (the transformers back-end, the
    job's length-bucketed batches) -> (measured, tokens, stored layers (aux + final), hidden size)."""
    from draftsmith.backends.hf import HfExtractor
    from draftsmith.core.data.tokens import load_tokens
    from draftsmith.core.model.layers import resolve_aux_layers
    from draftsmith.core.model.target import load_target, text_config_dict

    tensors, _ = load_tokens(tokens_path)
    offsets = tensors["offsets"].tolist()
    model, _ = load_target(target_path, getattr(torch, dtype))
    num_layers = text_config_dict(target_path)["num_hidden_layers"]  # a wrapper's too (Kimi-K2.5)
    layer_ids = resolve_aux_layers(aux_layer_ids, num_layers)
    ids, mask = tensors["input_ids"], tensors["loss_mask"]
    rows = [(ids[a:b], mask[a:b]) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    extractor = HfExtractor(model, layer_ids)
    try:
        lengths = [len(row_ids) for row_ids, _ in rows]
        _, _, measured, _ = probe_plan(
            lengths, batch_tokens, rows.__getitem__, extractor.capture, codec, level, Path(tokens_path).parent
        )
    finally:
        extractor.close()
    return measured, int(offsets[-1]), len(layer_ids) + 1, model.config.hidden_size


@dataclasses.dataclass
class EstimatePaths:
    tokens: str | None = arg("--tokens", "tokens.safetensors from tokenize.", exists=True)
    target: str | None = arg("--target", "Target model folder.", kind="dir", exists=True)
    num_tokens: float | None = arg(
        "--num-tokens", "Without --tokens: the token count, e.g. 17.3e6.", kind="float"
    )
    hidden_size: int | None = arg(
        "--hidden-size", "Without --target: the hidden size, e.g. 7168.", kind="int"
    )
    stored_layers: int = arg("--layers", "Stored layers (aux + final).", kind="int", default=4)
    ratios_from: str | None = arg(
        "--ratios-from",
        "With --num-tokens: a bfloat16 shard whose states give the codec's ratios (another target's "
        "states compress differently; the output says where the ratios come from).",
        exists=True,
    )


Settings, Paths = EstimateSettings, EstimatePaths
EXITS = {ShardError: BAD_INPUT, ValueError: BAD_INPUT}


def run(paths: EstimatePaths, settings: EstimateSettings) -> list[str]:
    """Exact extraction size for bfloat16 and float8_e4m3fn storage (and, with --tokens and --target,
    the compressed sizes and the time measured on that data).

    \b
    From a workflow's data:   draftsmith estimate --tokens results/tokens.safetensors --target resources/...
    For any model, by hand:   draftsmith estimate --num-tokens 17.3e6 --hidden-size 7168 --layers 4
    ... compressed as a shard:  add --ratios-from results/hidden/shard-0.safetensors
    """
    if paths.tokens and paths.target:
        return estimate_on_tokens(paths.tokens, paths.target, settings)
    if paths.num_tokens and paths.hidden_size:
        num_tokens = int(paths.num_tokens)
        return estimate_by_hand(
            num_tokens, paths.stored_layers, paths.hidden_size, paths.ratios_from, settings
        )
    raise ValueError("give --tokens and --target, or --num-tokens and --hidden-size")
