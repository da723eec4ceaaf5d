"""Extract stage: one prefill per sample batch, capturing aux-layer inputs and the final normed state.

No lm_head runs in the capture pass. The teacher-agreement check (does argmax(lm_head(final[t]))
equal the trace's next token?) runs afterwards on the masked positions only: it is the check that
catches wrong layers, a missing final norm or a template mismatch before anyone trains.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from draftsmith.engines.hf import capture_states
from draftsmith.estimate import check_free_disk, estimate_lines, human_bytes, probe
from draftsmith.layers import default_aux_layers, validate_aux_layers
from draftsmith.shards import Sample, ShardWriter
from draftsmith.target import load_target
from draftsmith.tokens import load_tokens


def resolve_aux_layers(aux_layers: list[int] | None, num_layers: int) -> list[int]:
    return validate_aux_layers(aux_layers or default_aux_layers(num_layers), num_layers)


def token_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices, sorted by length, into batches whose padded size stays within batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[i] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def teacher_agreement(
    lm_head_weight: torch.Tensor, final: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[int, int]:
    """(agreeing, checked) over positions t whose next token t+1 is loss-masked.

    final [T, H] is the stored post-norm state; the target predicts token t+1 from it."""
    positions = torch.nonzero(loss_mask[1:]).squeeze(-1)  # t such that token t+1 is an assistant token
    if positions.numel() == 0:
        return 0, 0
    logits = final[positions].to(lm_head_weight.dtype) @ lm_head_weight.T  # [P, V]
    agree = (logits.argmax(-1) == input_ids[positions + 1]).sum().item()
    return int(agree), int(positions.numel())


def extract_shard(
    target: str,
    tokens_path: str,
    shard: int,
    out_path: str | None,
    aux_layers: list[int] | None,
    dtype: str,
    batch_tokens: int,
    codec: str = "zstd-planes",
    zstd_level: int = 1,
    threads: int | None = None,
) -> dict[str, Any]:
    """Extract one shard. `out_path=None` computes everything but writes nothing (for benchmarks)."""
    if threads:
        torch.set_num_threads(threads)
    tensors, meta = load_tokens(tokens_path)
    if shard >= len(meta["shards"]):
        raise ValueError(f"shard {shard} does not exist: {tokens_path} plans {len(meta['shards'])} shards")
    start, end = meta["shards"][shard]
    offsets = tensors["offsets"].tolist()
    model, _ = load_target(target, getattr(torch, dtype))
    layer_ids = resolve_aux_layers(aux_layers, model.config.num_hidden_layers)
    hidden = model.config.hidden_size
    lm_head = model.get_output_embeddings().weight.detach()
    lengths = [offsets[i + 1] - offsets[i] for i in range(start, end)]
    total_tokens = sum(lengths)

    def sample_tokens(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = offsets[start + i], offsets[start + i + 1]
        return tensors["input_ids"][a:b], tensors["loss_mask"][a:b]

    print(
        f"extract shard {shard}: samples {start}..{end - 1}, aux layers {layer_ids} (input convention) "
        f"+ final normed state, {dtype} compute, bf16 storage, codec {codec}",
        flush=True,
    )
    shortest = sorted(range(len(lengths)), key=lambda i: lengths[i])[len(lengths) // 2 :][:2]
    workdir = Path(out_path).parent if out_path else Path(tempfile.gettempdir())
    measured = probe(model, [sample_tokens(i) for i in shortest], layer_ids, codec, zstd_level, workdir)
    lines, estimate = estimate_lines(total_tokens, len(layer_ids) + 1, hidden, measured)
    for line in lines:
        print(f"extract shard {shard}: estimate: {line}", flush=True)
    if out_path:
        check_free_disk(Path(out_path).parent, estimate["compressed_bytes"])
    writer = (
        ShardWriter(out_path, {"aux_layer_ids": layer_ids, "layer_convention": "input"}, codec, zstd_level)
        if out_path
        else None
    )
    agree = checked = masked = 0
    t0 = time.perf_counter()
    bar = tqdm(
        total=total_tokens, desc=f"extract shard {shard}", unit="tok", unit_scale=True, dynamic_ncols=True
    )
    try:
        for batch in token_batches(lengths, batch_tokens):
            width = max(lengths[i] for i in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : lengths[i]] = sample_tokens(i)[0]
            aux, final = capture_states(model, ids, layer_ids)
            for row, i in enumerate(batch):
                input_ids, loss_mask = sample_tokens(i)
                n = lengths[i]
                sample = Sample(
                    meta["sample_ids"][start + i],
                    input_ids,
                    loss_mask.bool(),
                    aux[row, :n].to(torch.bfloat16),
                    final[row, :n].to(torch.bfloat16),
                )
                g, c = teacher_agreement(lm_head, sample.final, sample.input_ids, sample.loss_mask)
                agree, checked, masked = agree + g, checked + c, masked + int(sample.loss_mask.sum())
                if writer:
                    writer.add(sample)
            bar.update(sum(lengths[i] for i in batch))
            if writer:
                done = bar.n / total_tokens
                bar.set_postfix(
                    written=human_bytes(writer.bytes_written),
                    projected=human_bytes(writer.bytes_written / done),
                )
        seconds = time.perf_counter() - t0
        stats = {
            "shard": shard,
            "num_samples": len(lengths),
            "num_tokens": total_tokens,
            "num_masked_tokens": masked,
            "teacher_agree": agree,
            "teacher_checked": checked,
            "teacher_agreement": agree / checked if checked else None,
            "seconds": round(seconds, 2),
            "tokens_per_second": round(total_tokens / seconds, 1) if seconds > 0 else None,
            "estimate": estimate,
        }
        if writer:
            writer.close(
                {
                    "final": "post_final_norm",
                    "dtype": "bfloat16",
                    "template": meta["template"],
                    "stats": stats,
                }
            )
    except BaseException:
        if writer:
            writer.abort()
        raise
    finally:
        bar.close()
    stats["wall_seconds_with_write"] = round(time.perf_counter() - t0, 2)
    size = f", {human_bytes(Path(out_path).stat().st_size)} written" if out_path else ""
    print(
        f"extract shard {shard}: {total_tokens:,} tokens in {seconds:.1f}s ({stats['tokens_per_second']} tok/s), "
        f"teacher agreement {stats['teacher_agreement']:.4f} over {checked:,} positions{size}",
        flush=True,
    )
    return stats
