"""Real target families in miniature through real engines (vLLM CPU): a Qwen3 twin served by the
`vllm-server` generation engine with vLLM's `qwen3` reasoning parser (single-token <think> markers, a
thinking chat template): the thinking is captured, and the training sequences hold every served token.

(The Llama-3.x twin with `llama3` RoPE runs through to vLLM acceptance in test_rope_vllm.py. An MLA
target beside a Llama-style drafter cannot be served by vLLM on CPU at all, see README "Your own
target"; its generation and extraction engines are exercised at unit level in test_target.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import twins
from conftest import DEFAULT_TARGET, REPO

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def env(tmp: Path) -> dict[str, str]:
    out = dict(os.environ)
    out["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{out.get('PATH', '')}"
    out.update(VLLM_CACHE_ROOT=str(tmp / "vllm-cache"), HF_HOME=str(tmp / "hf"), VLLM_CPU_KVCACHE_SPACE="1")
    return out


def test_qwen3_reasoning_through_vllm_server(tmp_path, target_model):
    target = tmp_path / "qwen3-twin"
    twins.save("qwen3", target, vocab_size=49152, initializer_range=0.1)
    twins.thinking_tokenizer(DEFAULT_TARGET, target)
    prompts = tmp_path / "p.jsonl"
    src = (REPO / "draftsmith" / "data" / "prompts.jsonl").read_text().splitlines(keepends=True)
    prompts.write_text("".join(src[:3]))
    settings = {"server_args": ["--enforce-eager", "--max-model-len", "1024", "--reasoning-parser", "qwen3"],
                "reasoning": "required", "max_new_tokens": 12, "concurrency": 3}  # fmt: skip
    cmd = ["draftsmith", "generate", "--target", str(target), "--prompts", str(prompts),
           "--out", str(tmp_path / "t.jsonl"), "--summary", str(tmp_path / "s.json"),
           "--server-log", str(tmp_path / "server.log"), "--engine", "vllm-server",
           "--dtype", "float32", "--settings", json.dumps(settings)]  # fmt: skip
    proc = subprocess.run(cmd, env=env(tmp_path), capture_output=True, text=True, timeout=900)
    log = (tmp_path / "server.log").read_text() if (tmp_path / "server.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    assert "reasoning_parser='qwen3'" in log or "qwen3" in log
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["done"] == 3 and summary["reasoning_capture_rate"] == 1.0, summary
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    # random weights never close the thinking: vLLM's parser labels the whole output reasoning
    assert all(r["reasoning"] and not r["response"] for r in rows), rows
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    for r in rows:
        assert tok.decode(r["response_token_ids"], skip_special_tokens=True).strip() == r["reasoning"].strip()

    out = tmp_path / "tokens.safetensors"
    cmd = ["draftsmith", "tokenize", "--target", str(target), "--traces", str(tmp_path / "t.jsonl"),
           "--out", str(out), "--num-shards", "1", "--max-seq-len", "512"]  # fmt: skip
    proc = subprocess.run(cmd, env=env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from safetensors.torch import load_file

    tokens = load_file(str(out))
    ids, mask = tokens["input_ids"], tokens["loss_mask"].bool()
    # the drafter trains on exactly the served tokens, thinking included (none lost to the parser split)
    served = [t for r in rows for t in r["response_token_ids"]]
    assert ids[mask].tolist() == served
