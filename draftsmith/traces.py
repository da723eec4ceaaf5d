"""Generation stage: every prompt answered by the target, appended line by line, resumable.

Work goes to `<out>.partial` (one JSON line per finished sample, flushed and fsynced per batch); a rerun
after a crash or kill keeps every complete line and skips those ids. When all prompts are done the
traces are written to `<out>` atomically in prompt order and the partial file is removed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from draftsmith.atomic import write_json, write_jsonl
from draftsmith.chat import render_prompt, template_fingerprint
from draftsmith.engines.hf import generate_batch
from draftsmith.prompts import read_prompt_file
from draftsmith.target import load_target


def read_partial(path: Path) -> dict[str, dict]:
    """Complete lines of a partial traces file by id; a torn last line (a kill mid-write) is dropped."""
    done: dict[str, dict] = {}
    if not path.exists():
        return done
    with open(path, "rb") as fh:
        data = fh.read()
    good_end = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        done[row["id"]] = row
        good_end += len(line)
    if good_end != len(data):  # cut the torn tail so appends start on a clean line
        with open(path, "rb+") as fh:
            fh.truncate(good_end)
    return done


def length_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar prompt length (less padding, same results)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def eos_token_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def generate_traces(
    target: str,
    prompts_path: str,
    out_path: str,
    summary_path: str,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    batch_size: int,
    dtype: str,
    seed: int,
) -> dict[str, Any]:
    prompts = read_prompt_file(prompts_path)
    out = Path(out_path)
    partial_path = out.with_name(out.name + ".partial")
    done = read_partial(partial_path)
    model, tokenizer = load_target(target, getattr(torch, dtype))
    fingerprint = template_fingerprint(tokenizer)
    stale = [i for i, row in done.items() if row.get("template") != fingerprint]
    if stale:  # traces from another template must not be mixed in
        raise RuntimeError(
            f"{partial_path}: {len(stale)} traces were rendered with another chat template; delete the file to restart"
        )
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    todo = [p for p in prompts if p["id"] not in done]
    rendered = [render_prompt(tokenizer, p["messages"]) for p in todo]
    print(f"generate: {len(prompts)} prompts, {len(done)} already done, {len(todo)} to go", flush=True)
    start, new_tokens = time.perf_counter(), 0
    bar = tqdm(total=len(todo), desc="generate", unit="sample", dynamic_ncols=True)
    with open(partial_path, "a", encoding="utf-8") as sink:
        for batch in length_batches([len(r) for r in rendered], batch_size):
            torch.manual_seed(seed + len(done))
            gens = generate_batch(
                model, [rendered[i] for i in batch], max_new_tokens, eos, pad, temperature, top_p
            )
            for i, gen in zip(batch, gens, strict=True):
                ids = [t for t in gen.response_ids if t not in eos]
                row = {
                    "id": todo[i]["id"],
                    "messages": todo[i]["messages"],
                    "response": tokenizer.decode(ids, skip_special_tokens=True),
                    "prompt_token_ids": rendered[i],
                    "response_token_ids": gen.response_ids,
                    "prompt_tokens": len(rendered[i]),
                    "completion_tokens": len(gen.response_ids),
                    "finish_reason": gen.finish_reason,
                    "engine": "transformers",
                    "template": fingerprint,
                }
                sink.write(json.dumps(row, ensure_ascii=False) + "\n")
                done[row["id"]] = row
                new_tokens += len(gen.response_ids)
            sink.flush()
            os.fsync(sink.fileno())
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.0f}")
    bar.close()
    elapsed = time.perf_counter() - start
    rows = [done[p["id"]] for p in prompts]
    write_jsonl(out, rows)
    partial_path.unlink(missing_ok=True)
    summary = {
        "samples": len(rows),
        "generated_now": len(todo),
        "truncated": sum(r["finish_reason"] == "length" for r in rows),
        "completion_tokens": sum(r["completion_tokens"] for r in rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "seconds": round(elapsed, 2),
        "tokens_per_second": round(new_tokens / elapsed, 1) if elapsed > 0 else None,
        "template": fingerprint,
    }
    write_json(summary_path, summary)
    print(
        f"generate: {summary['samples']} traces ({summary['truncated']} truncated at {max_new_tokens} tokens), "
        f"{summary['completion_tokens']} completion tokens, {summary['tokens_per_second']} tok/s",
        flush=True,
    )
    return summary
