"""A drafter with Llama-3.x's `llama3` RoPE scaling, trained on a tiny Llama twin that uses it, is
accepted by real vLLM (CPU) exactly as often as by draftsmith's own speculative decoding: vLLM builds
the same rotary embedding from the export's rope_parameters.

The twin scales RoPE beyond 16 positions (most frequencies divided by 8), and every prompt plus its
continuation is longer, so a drafter whose RoPE differed between training and serving would draft
differently; the control (the same weights exported with plain RoPE) shows that it does.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import twins
from click.testing import CliRunner
from conftest import DEFAULT_TARGET

from draftsmith.cli import main

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
NUM_PROMPTS, MAX_NEW_TOKENS, SPEC_TOKENS = 6, 48, 3


def cli(*args) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, f"draftsmith {' '.join(map(str, args))}:\n{result.output[-3000:]}"
    return result.output


def plain_rope_copy(drafter, out):
    """The same export with its RoPE replaced by plain RoPE of the same theta (the control)."""
    shutil.copytree(drafter, out)
    config = json.loads((out / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": config["rope_theta"], "rope_type": "default"}
    config["rope_scaling"] = None
    config["draftsmith"]["drafter_config"]["rope_scaling"] = None
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def train_and_measure(target, r, control_of=None) -> dict:
    """The stage commands on `target` (built-in prompts, fp32 greedy traces, a drafter trained until it
    has learnt them), then the offline and the vLLM measurement of the drafter on the training prompts.
    `control_of(drafter, out)` makes the export measured offline as "untrained" -> the results."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a busy 2-core machine: one thread avoids lock-step waits
    cli("prompts", "--source", "builtin", "--max-prompts", NUM_PROMPTS + 1, "--num-heldout", 1,
        "--out-train", r / "train.jsonl", "--out-heldout", r / "heldout.jsonl")  # fmt: skip
    cli("generate", "--target", target, "--prompts", r / "train.jsonl", "--out", r / "traces.jsonl",
        "--summary", r / "generate.json", "--max-new-tokens", MAX_NEW_TOKENS, "--batch-size", 8,
        "--dtype", "float32")  # fmt: skip
    cli("tokenize", "--target", target, "--traces", r / "traces.jsonl", "--out", r / "tokens.safetensors",
        "--num-shards", 1, "--max-seq-len", 256)  # fmt: skip
    cli("extract", "--target", target, "--tokens", r / "tokens.safetensors", "--shard", 0,
        "--out", r / "hidden" / "shard-0.safetensors", "--dtype", "float32", "--compile", "off",
        "--aux-layers", "1,2,3")  # fmt: skip
    cli("manifest", "--target", target, "--out", r / "data_config.json", r / "hidden" / "shard-0.safetensors")
    cli("vocab", "--tokens", r / "tokens.safetensors", "--target", target, "--size", 1024,
        "--out", r / "vocab_map.pt")  # fmt: skip
    settings = {"epochs": 20, "lr": 3e-3, "warmup_steps": 3, "batch_tokens": 4096, "ttt_steps": 3,
                "val_fraction": 0.0, "threads": 1, "checkpoint_every": 0, "precision": "fp32"}  # fmt: skip
    cli("train", "--data", r / "data_config.json", "--vocab", r / "vocab_map.pt", "--out", r / "drafter",
        "--checkpoints", r / "checkpoints", "--metrics", r / "metrics.jsonl",
        "--settings", json.dumps(settings))  # fmt: skip
    common = ["--target", target, "--num-prompts", NUM_PROMPTS, "--max-new-tokens", MAX_NEW_TOKENS,
              "--num-draft-tokens", SPEC_TOKENS, "--no-ngram", "--no-suffix"]  # fmt: skip
    control = ["--untrained", control_of(r / "drafter", r / "drafter-control")] if control_of else []
    cli("evaluate", *common, "--drafter", r / "drafter", *control,
        "--prompts", r / "train.jsonl", "--out", r / "offline.json")  # fmt: skip
    torch.set_num_threads(threads)
    # evaluate-vllm decodes named held-out sets (SET=PATH); one set here
    cli("evaluate-vllm", *common, "--drafter", r / "drafter", "--prompts", f"twin={r / 'train.jsonl'}",
        "--out", f"twin={r / 'vllm.json'}", "--log-dir", r / "logs",
        "--settings", json.dumps({"remeasure_chosen_k": False}))  # fmt: skip
    return {
        "root": r,
        "export": json.loads((r / "drafter" / "config.json").read_text()),
        "train": json.loads((r / "drafter" / "train_summary.json").read_text()),
        "offline": json.loads((r / "offline.json").read_text()),
        "vllm": json.loads((r / "vllm.json").read_text()),
    }


def assert_vllm_accepts_as_offline(run: dict, min_tau: float = 1.5) -> None:
    """Same target, fp32 greedy on both sides: the same plain continuations, and vLLM accepts exactly
    the drafts draftsmith's decoder accepts, position by position."""
    offline, vllm = run["offline"], run["vllm"]
    assert vllm["plain"]["outputs"] == offline["plain"]["outputs"]
    off, served = offline["methods"]["eagle3"], vllm["methods"]["eagle3"]
    print(f"offline tau {off['tau']:.4f} {off['accepted_per_pos']}/{off['drafts']}, "
          f"vLLM tau {served['tau']:.4f} {served['accepted_per_pos']}/{served['drafts']}")  # fmt: skip
    assert off["tau"] > min_tau, off  # the drafter learnt its traces: there is something to compare
    assert (served["drafts"], served["accepted_per_pos"]) == (off["drafts"], off["accepted_per_pos"])
    assert served["tau"] == pytest.approx(off["tau"], abs=1e-12)
    # the figure that compares methods, every forward counted: equal to the token, prompt by prompt
    assert [(r["tokens"], r["forwards"]) for r in served["per_prompt"]] == [
        (r["tokens"], r["forwards"]) for r in off["per_prompt"]
    ]
    assert served["tokens_per_forward"] == pytest.approx(off["tokens_per_forward"], abs=1e-12)


@pytest.fixture(scope="module")
def run(tmp_path_factory, target_model) -> dict:
    r = tmp_path_factory.mktemp("rope-vllm")
    target = r / "llama3-twin"
    # peaked logits (init 0.1): greedy continuations far from ties, identical in vLLM and transformers
    twins.save("llama3", target, vocab_size=49152, tokenizer_from=DEFAULT_TARGET, initializer_range=0.1)
    return train_and_measure(target, r, control_of=plain_rope_copy)


def test_export_carries_llama3_rope(run):
    rope = run["export"]["rope_parameters"]
    assert rope == twins.LLAMA3_ROPE
    assert run["export"]["rope_scaling"]["type"] == "llama3"


def test_offline_tau_equals_vllm_tau(run):
    assert_vllm_accepts_as_offline(run)
    control = run["offline"]["methods"]["untrained"]
    print(
        f"plain-RoPE control offline {control['tau']:.4f} {control['accepted_per_pos']}/{control['drafts']}"
    )


def test_plain_rope_drafts_differently(run):
    """The control: the same weights with plain RoPE accept a different number of drafts, so the
    equality above holds only because vLLM builds the llama3 rotary embedding."""
    offline = run["offline"]["methods"]
    trained, control = offline["eagle3"], offline["untrained"]
    assert (control["drafts"], control["accepted_per_pos"]) != (
        trained["drafts"],
        trained["accepted_per_pos"],
    )
