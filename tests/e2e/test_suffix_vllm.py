"""Suffix decoding, offline and in vLLM, on the real default target: draftsmith's offline twin
(speculate.SuffixProposer, the same Arctic Inference calls vLLM's proposer makes) drafts and accepts
exactly as vLLM's `suffix` method, prompt by prompt, position by position (~1 min: one vLLM engine)."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# answers that repeat their prompt or themselves, so the suffix trees have something to draft from
PROMPTS = [
    "Repeat this list three times, one item per line: apple, banana, cherry, date, elderberry.",
    "Write the numbers from 1 to 30 separated by commas.",
    "Write a Python function add(a, b) and then the same function again with a docstring.",
]
SUFFIX = {"max_tree_depth": 24, "max_spec_factor": 1.0, "min_token_prob": 0.1, "max_cached_requests": 0}


def test_suffix_decoding_offline_equals_vllm(tmp_path, target_model):

    from draftsmith.core.model.target import load_tokenizer
    from draftsmith.stages.evaluate import (
        EvaluateSettings,
        encode_prompts,
        evaluate_offline,
        vllm_prompt_counts,
    )
    from draftsmith.stages.evaluate.vllm_runner import run_vllm_subprocess

    prompts = tmp_path / "prompts.jsonl"
    records = [{"id": f"p{i}", "messages": [{"role": "user", "content": p}]} for i, p in enumerate(PROMPTS)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    offline = evaluate_offline(
        target_model, {}, prompts, tmp_path / "offline.json", EvaluateSettings(num_prompts=0,
        max_new_tokens=64, num_draft_tokens=3, ngram=False, suffix=True, suffix_decoding=SUFFIX, hybrid=False,
        threads=2),
    )  # fmt: skip
    off = offline["methods"]["suffix"]
    assert off["lossless"] is True and off["kind"] == "suffix" and off["settings"] == SUFFIX

    encoded = encode_prompts(load_tokenizer(target_model), records)
    served = run_vllm_subprocess(
        str(target_model), None, "suffix", encoded, 64, 3, "float32", cache_dir=tmp_path / "cache",
        log_path=tmp_path / "vllm.log", method_settings=SUFFIX, seed=0, temperature=0.0, gpu_memory_utilization=None,
    )  # fmt: skip
    assert served["outputs"] == offline["plain"]["outputs"]  # lossless in vLLM: plain greedy's tokens
    rows = vllm_prompt_counts([r["id"] for r in records], served)
    print("suffix per prompt (offline, vLLM):", [(r["accepted_per_pos"], r["drafts"]) for r in off["per_prompt"]],
          [(r["accepted_per_pos"], r["drafts"]) for r in rows])  # fmt: skip
    assert sum(r["drafts"] for r in rows) > 0  # it drafted: the comparison below means something
    assert [(r["tokens"], r["forwards"], r["drafts"], r["accepted_per_pos"]) for r in rows] == [
        (r["tokens"], r["forwards"], r["drafts"], r["accepted_per_pos"]) for r in off["per_prompt"]
    ]
