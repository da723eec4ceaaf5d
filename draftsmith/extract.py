"""Extract stage: one prefill per sample batch, capturing aux-layer inputs and the final normed state.

No lm_head runs in the capture pass. The teacher-agreement check (does argmax(lm_head(final[t]))
equal the trace's next token?) runs afterwards on the masked positions only: it is the check that
catches wrong layers, a missing final norm or a template mismatch before anyone trains.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from draftsmith.engines.hf import capture_states
from draftsmith.layers import default_aux_layers, validate_aux_layers
from draftsmith.shards import Sample, write_shard
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
    out_path: str,
    aux_layers: list[int] | None,
    dtype: str,
    batch_tokens: int,
    codec: str = "zstd-planes",
    zstd_level: int = 1,
    threads: int | None = None,
) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    tensors, meta = load_tokens(tokens_path)
    if shard >= len(meta["shards"]):
        raise ValueError(f"shard {shard} does not exist: {tokens_path} plans {len(meta['shards'])} shards")
    start, end = meta["shards"][shard]
    offsets = tensors["offsets"].tolist()
    model, _ = load_target(target, getattr(torch, dtype))
    num_layers = model.config.num_hidden_layers
    layer_ids = resolve_aux_layers(aux_layers, num_layers)
    lm_head = model.get_output_embeddings().weight.detach()
    lengths = [offsets[i + 1] - offsets[i] for i in range(start, end)]
    total_tokens = sum(lengths)
    print(
        f"extract shard {shard}: samples {start}..{end - 1}, {total_tokens} tokens, aux layers {layer_ids} "
        f"(input convention) + final normed state, {dtype}",
        flush=True,
    )
    samples: dict[int, Sample] = {}
    agree = checked = 0
    t0 = time.perf_counter()
    bar = tqdm(
        total=total_tokens, desc=f"extract shard {shard}", unit="tok", unit_scale=True, dynamic_ncols=True
    )
    for batch in token_batches(lengths, batch_tokens):
        width = max(lengths[i] for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            a, b = offsets[start + i], offsets[start + i + 1]
            ids[row, : b - a] = tensors["input_ids"][a:b]
        aux, final = capture_states(model, ids, layer_ids)
        for row, i in enumerate(batch):
            a, b = offsets[start + i], offsets[start + i + 1]
            n = b - a
            sample = Sample(
                meta["sample_ids"][start + i],
                tensors["input_ids"][a:b],
                tensors["loss_mask"][a:b].bool(),
                aux[row, :n].to(torch.bfloat16).clone(),
                final[row, :n].to(torch.bfloat16).clone(),
            )
            g, c = teacher_agreement(lm_head, sample.final, sample.input_ids, sample.loss_mask)
            agree, checked = agree + g, checked + c
            samples[i] = sample
            bar.update(n)
    bar.close()
    seconds = time.perf_counter() - t0
    stats = {
        "shard": shard,
        "num_samples": len(samples),
        "num_tokens": total_tokens,
        "num_masked_tokens": int(sum(s.loss_mask.sum().item() for s in samples.values())),
        "teacher_agree": agree,
        "teacher_checked": checked,
        "teacher_agreement": agree / checked if checked else None,
        "seconds": round(seconds, 2),
        "tokens_per_second": round(total_tokens / seconds, 1) if seconds > 0 else None,
    }
    shard_meta = {
        "aux_layer_ids": layer_ids,
        "layer_convention": "input",
        "final": "post_final_norm",
        "dtype": "bfloat16",
        "template": meta["template"],
        "stats": stats,
    }
    write_shard(
        out_path, [samples[i] for i in range(len(samples))], shard_meta, codec=codec, level=zstd_level
    )
    print(
        f"extract shard {shard}: {total_tokens} tokens in {seconds:.1f}s ({stats['tokens_per_second']} tok/s), "
        f"teacher agreement {stats['teacher_agreement']:.4f} over {checked} positions, "
        f"{Path(out_path).stat().st_size / 1e6:.1f} MB",
        flush=True,
    )
    return stats
