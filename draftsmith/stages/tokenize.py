"""Tokenize stage: traces -> training sequences (ids + loss mask) in one file, plus the shard plan.

The file is `tokens.safetensors` (its format: draftsmith/core/data/tokens.py); each extract job takes its
contiguous block of samples (shard_bounds).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from draftsmith.core.config.stage_args import BAD_INPUT, arg
from draftsmith.core.config.stage_settings import TokenizeSettings
from draftsmith.core.data.chat import (
    merge_turns,
    render_prompt,
    render_with_response,
    template_fingerprint,
    training_sequence,
)
from draftsmith.core.data.tokens import write_tokens
from draftsmith.core.model.target import check_target_dir, load_tokenizer

log = logging.getLogger(__name__)


def shard_bounds(token_counts: list[int], num_shards: int) -> list[tuple[int, int]]:
    """Split samples into `num_shards` contiguous [start, end) blocks of about equal token count.

    Every shard gets at least one sample when there are enough samples; boundaries depend only on the
    counts, so the same data always shards the same way.
    """
    n = len(token_counts)
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    if n < num_shards:
        raise ValueError(f"{n} samples cannot fill {num_shards} shards; lower extract.num_shards")
    total = sum(token_counts)
    bounds, start, cum = [], 0, 0
    for k in range(1, num_shards):
        goal = total * k / num_shards
        end = start + 1  # at least one sample per shard
        cum += token_counts[start]
        while end < n - (num_shards - k) and cum + token_counts[end] / 2 <= goal:
            cum += token_counts[end]
            end += 1
        bounds.append((start, end))
        start = end
    bounds.append((start, n))
    return bounds


def turn_contexts(messages: list[dict], n_turns: int) -> list[list[dict]]:
    """The prompt messages of each answered turn of a multi-turn trace: every assistant message in
    `messages` is a regenerated answer (see generate.py), so turn k was asked with messages[:index_k]."""
    points = [i for i, m in enumerate(messages) if m["role"] == "assistant"] + [len(messages)]
    if len(points) != n_turns:
        raise ValueError(f"{n_turns - 1} earlier turns recorded but {len(points) - 1} assistant messages")
    return [messages[:i] for i in points]


def trace_sequences(tokenizer: Any, row: dict[str, Any]) -> list[tuple[str, list[int], list[int]]]:
    """(sample id, input_ids, loss_mask) for one trace: the exact served tokens when the trace has them,
    else the text re-rendered with the target's template (reasoning in its thinking format). Earlier
    turns of a multi-turn trace are masked too (merged into the conversation where they nest)."""
    answers = [*row.get("turns", []), row]
    contexts = turn_contexts(row["messages"], len(answers)) if "turns" in row else [row["messages"]]
    seqs = []
    for k, (answer, messages) in enumerate(zip(answers, contexts, strict=True)):
        if "response_token_ids" in answer:
            prompt = render_prompt(tokenizer, messages)
            if answer.get("prompt_token_ids") not in (None, prompt):
                raise ValueError(f"turn {k}: prompt renders to other tokens than at generation time")
            seqs.append(training_sequence(prompt, answer["response_token_ids"]))
        else:
            seqs.append(
                render_with_response(tokenizer, messages, answer["response"], answer.get("reasoning"))
            )
    (ids, mask), separate = merge_turns(seqs)
    # Turns that did not nest into the conversation (template rewrote history) become their own samples.
    return [(row["id"], ids, mask)] + [(f"{row['id']}#turn{k}", *seqs[k]) for k in separate]


def tokenize_traces(
    target: str, traces_path: str, out_path: str, settings: TokenizeSettings
) -> dict[str, Any]:
    num_shards, max_seq_len = settings.num_shards, settings.max_seq_len
    tokenizer = load_tokenizer(check_target_dir(target))
    fingerprint = template_fingerprint(tokenizer)
    ids_all, mask_all, offsets, sample_ids, sample_sources = [], [], [0], [], []
    truncated, dropped = 0, []
    with open(traces_path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            row = parse_trace_line(line, traces_path, line_no)
            where = f"{traces_path}:{line_no} (id {row.get('id')!r})"
            if row.get("template") not in (None, fingerprint):
                raise ValueError(
                    f"{where}: generated with chat template {row['template']} but the target's is {fingerprint}; "
                    "regenerate the traces (the drafter must see what the serving engine renders)"
                )
            try:
                sequences = trace_sequences(tokenizer, row)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
            for sample_id, ids, mask in sequences:
                if len(ids) > max_seq_len:
                    ids, mask, truncated = ids[:max_seq_len], mask[:max_seq_len], truncated + 1
                if sum(mask) == 0:  # nothing to learn (empty answer or prompt fills max_seq_len)
                    dropped.append(sample_id)
                    log.warning("%s: sample %r dropped: no answer token within max_seq_len", where, sample_id)
                    continue
                ids_all.extend(ids)
                mask_all.extend(mask)
                offsets.append(len(ids_all))
                sample_ids.append(sample_id)
                sample_sources.append(row.get("source", "regenerated"))
    counts = [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    bounds = shard_bounds(counts, num_shards)
    meta = {
        "sample_ids": sample_ids,
        "sample_sources": sample_sources,
        "template": fingerprint,
        "target": str(target),
        "max_seq_len": max_seq_len,
        "shards": [list(b) for b in bounds],
    }
    write_tokens(out_path, ids_all, mask_all, offsets, meta)
    summary: dict[str, Any] = {
        "samples": len(sample_ids),
        "tokens": len(ids_all),
        "masked_tokens": int(sum(mask_all)),
        "truncated": truncated,
        "dropped": len(dropped),
        "samples_by_source": {k: sample_sources.count(k) for k in sorted(set(sample_sources))},
        "shard_tokens": [sum(counts[a:b]) for a, b in bounds],
    }
    if truncated:
        log.warning("%d samples were cut at max_seq_len = %d tokens", truncated, max_seq_len)
    log.info(
        "tokenize: %d samples, %d tokens (%d answer tokens), %d truncated, %d dropped; shards of %s tokens",
        summary["samples"], summary["tokens"], summary["masked_tokens"], truncated, len(dropped),
        ", ".join(str(n) for n in summary["shard_tokens"]),
    )  # fmt: skip
    return summary


def parse_trace_line(line: str, path: str | Path, line_no: int) -> dict[str, Any]:
    """One traces.jsonl line; a broken one is an error naming file:line."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path}:{line_no}: not a complete JSON trace ({err.msg} at character {err.pos}); the file is "
            "truncated or garbled: regenerate it (delete it and rerun generate)"
        ) from None
    if not isinstance(row, dict) or "id" not in row:
        raise ValueError(f"{path}:{line_no}: a trace must be a JSON object with an 'id'")
    return row


@dataclasses.dataclass
class TokenizePaths:
    target: str = arg("--target", "Target model folder.", kind="dir", required=True, exists=True)
    traces: str = arg("--traces", "traces.jsonl from generate.", required=True, exists=True)
    out: str = arg("--out", "tokens.safetensors to write.", required=True, sealed=True)


Settings, Paths = TokenizeSettings, TokenizePaths
EXITS = {ValueError: BAD_INPUT}


def run(paths: TokenizePaths, settings: TokenizeSettings) -> list[str]:
    """Render traces with the target's chat template into ids + assistant loss masks; plan the shards."""
    tokenize_traces(paths.target, paths.traces, paths.out, settings)
    return []
