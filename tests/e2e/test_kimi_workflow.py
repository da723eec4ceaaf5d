"""The whole workflow through Snakemake on a Kimi-K2.5-layout twin: MLA + MoE (DeepSeek-V3's text model),
the multimodal wrapper's config (settings under `text_config`) and weights (under `language_model.`,
sharded, beside a vision tower), from traces to the three exports and the gate. Every stage reads the
target's config through the wrapper. The engines are transformers': vLLM's CPU build serves no MLA
target beside a Llama-style drafter (README, "What runs on a CPU here"), so evaluation is offline.

~2-3 minutes on 2 cores: 12 tiny prompts, one shard, 3 training steps.
"""

from __future__ import annotations

import csv
import json
import subprocess

import pytest
import twins
import yaml
from helpers.workflow import REPO, cli_env

pytestmark = pytest.mark.slow

CONFIG = {
    "target": {"gguf_wheel": None, "dtype": "float32"},  # float32: greedy traces the teacher check reproduces
    "prompts": {"source": "builtin", "max_prompts": 12, "num_heldout": 2},
    "generate": {"backend": "transformers", "max_new_tokens": 16, "batch_size": 10},
    "extract": {"num_shards": 1, "max_seq_len": 128, "aux_layers": [1, 2, 3]},
    "vocab": {"size": 1024},
    "train": {"epochs": 1, "max_steps": 3, "batch_tokens": 1024, "warmup_steps": 1, "ttt_steps": 2,
              "val_fraction": 0.1, "precision": "fp32"},
    "evaluate": {"vllm": False, "num_prompts": 2, "max_new_tokens": 8, "num_draft_tokens": 2,
                 "heldout_sets": {"heldout": "heldout"}, "gate": {"beats_free": "warn", "beats_untrained": "warn"}},
    "resources": {"default": {"mem_mb": 1000}, "train": {"threads": 2, "loader_threads": 0}},
}  # fmt: skip
STAGES = ("generate", "extract", "manifest", "vocab", "train", "untrained_drafter",
          "evaluate_offline/heldout", "eval_summary", "gate", "export")  # fmt: skip


@pytest.fixture(scope="module")
def kimi_run(tmp_path_factory, target_model):
    """(workdir, snakemake's exit code and output) of one run of the whole workflow, with --keep-going so
    that a failing export still leaves the gate's result to check."""
    workdir = tmp_path_factory.mktemp("kimi-run")
    target = workdir / "Kimi-K2.5-twin"
    twins.save_kimi(target, vocab_size=49152, tokenizer_from=target_model, initializer_range=0.1)
    config = {**CONFIG, "target": {**CONFIG["target"], "model": str(target)}}
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    cmd = ["snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir), "--configfile",
           str(workdir / "config.yaml"), "--cores", "2", "--keep-going"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=workdir, timeout=1800)
    return workdir, proc.returncode, proc.stdout[-4000:] + proc.stderr[-8000:]


def stage_seconds(workdir) -> dict[str, float]:
    """Wall seconds of each stage that ran (Snakemake's benchmark files)."""
    out = {}
    for stage in STAGES:
        path = workdir / "benchmarks" / f"{stage}.tsv"
        if path.is_file():
            out[stage] = float(next(csv.DictReader(path.open(), delimiter="\t"))["s"])
    return out


def test_traces_to_gate_on_the_kimi_layout(kimi_run):
    workdir, _, log = kimi_run
    results = workdir / "results"
    print("Kimi-K2.5-layout twin, stage wall seconds:", stage_seconds(workdir))
    for rel in ("traces.jsonl", "hidden/shard-0.safetensors", "data_config.json", "vocab_map.pt",
                "drafter/model.safetensors", "eval/untrained_drafter/config.json", "eval/heldout/offline.json",
                "eval/summary.json", "eval/gate.json"):  # fmt: skip
        assert (results / rel).is_file(), f"{rel} missing:\n{log}"
    manifest = json.loads((results / "data_config.json").read_text())
    assert manifest["aux_layer_ids"] == [1, 2, 3] and manifest["hidden_size"] == twins.HIDDEN
    assert manifest["teacher_agreement"] >= 0.9, manifest["teacher_agreement"]
    drafter = json.loads((results / "drafter" / "config.json").read_text())
    # an MLA target's drafter is Llama-style: 128-wide heads, as many kv heads as heads
    assert (drafter["head_dim"], drafter["num_key_value_heads"]) == (128, drafter["num_attention_heads"])
    assert drafter["vocab_size"] == 49152
    offline = json.loads((results / "eval" / "heldout" / "offline.json").read_text())
    assert offline["methods"]["eagle3"]["lossless"] is True


def test_the_commands_outside_the_workflow_read_the_wrapper_too(kimi_run):
    workdir, _, _ = kimi_run
    target = str(workdir / "Kimi-K2.5-twin")
    for cmd in (["draftsmith", "check-export", "results/drafter", "--target", target],
                ["draftsmith", "estimate", "--tokens", "results/tokens.safetensors", "--target", target, "--aux-layers", "1,2,3"]):  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=workdir)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_three_exports_are_written(kimi_run):
    workdir, code, log = kimi_run
    for engine in ("drafter", "drafter-sglang", "drafter-speculators"):
        assert (workdir / "results" / engine / "model.safetensors").is_file(), f"{engine}:\n{log}"
    assert code == 0, log
