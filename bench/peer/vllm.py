"""bench.peer's vllm stage: every export in real vLLM on the run's held-out sets, tokens per target
forward with paired intervals against SpecForge's drafter."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from draftsmith.core.config.config import section_from_file
from draftsmith.core.evaluation.speculate import target_forwards
from draftsmith.core.evaluation.stats import paired_difference, ratio_of_sums
from draftsmith.core.io.atomic import write_json


def heldout_sets(
    config_path: Path | None, manifest_path: Path, log: Callable[[str], None]
) -> dict[str, Path]:
    """The run's held-out prompt files as the workflow resolves them (core/workflow/rule_args.py:
    heldout_prompt_file), relative to the run's folder (the parent of results/); a set whose file is
    missing is left out, with a line to `log`."""
    import draftsmith

    cfg = (
        yaml.safe_load(config_path.read_text(encoding="utf-8"))
        if config_path and config_path.is_file()
        else {}
    )
    sets = ((cfg or {}).get("evaluate") or {}).get("heldout_sets") or {"heldout": "heldout"}
    run_dir = manifest_path.parent.parent
    out = {}
    for name, source in sets.items():
        if source == "heldout":
            path = manifest_path.parent / "prompts" / "heldout.jsonl"
        elif source == "handwritten":
            path = Path(draftsmith.__file__).parent / "data" / "heldout_handwritten.jsonl"
        elif source == "humaneval":
            path = run_dir / "resources" / "data" / "humaneval.jsonl"
        else:
            path = Path(source) if Path(source).is_absolute() else run_dir / source
        if path.is_file():
            out[name] = path
        else:
            log(f"held-out set {name}: {path} is missing, left out of the vLLM measurement")
    return out


def eval_settings(config_path: Path | None) -> dict[str, Any]:
    return section_from_file("evaluate", config_path)


def forward_counts(tokens: list[int], accepted: list[int]) -> tuple[list[int], list[int]]:
    """(tokens, target forwards) per prompt: the counts tokens per target forward is the ratio of."""
    return tokens, [target_forwards(t, a) for t, a in zip(tokens, accepted, strict=True)]


def tokens_per_forward(tokens: list[int], accepted: list[int]) -> float:
    """Output tokens per target forward over some prompts (draftsmith.core.evaluation.speculate's count)."""
    return ratio_of_sums(*(np.asarray(x, dtype=float) for x in forward_counts(tokens, accepted))).item()


def paired_interval(
    tokens_a: list[int],
    acc_a: list[int],
    tokens_b: list[int],
    acc_b: list[int],
    resamples: int = 2000,
    seed: int = 0,
) -> list[float]:
    """95% paired bootstrap interval of tokens_per_forward(a) - tokens_per_forward(b) over the same prompts
    (draftsmith.core.evaluation.stats, as the gate computes it)."""
    _, lo, hi = paired_difference(forward_counts(tokens_a, acc_a), forward_counts(tokens_b, acc_b),
                                  0.95, resamples, seed)  # fmt: skip
    return [lo, hi]


def export_digest(export: Path) -> str:
    return hashlib.sha256((export / "model.safetensors").read_bytes()).hexdigest()[:16]


def vllm_measure(
    target: str, exports: dict[str, Path], sets: dict[str, Path], ev: dict[str, Any], out: Path,
    reuse: list[Path], fresh: bool,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Each export in vLLM (`draftsmith evaluate-vllm`'s library call, every drafter not measured yet in one
    call: plain once, then one engine per drafter, every held-out set in one batch) -> label -> its
    per-set figures and per-prompt counts. A drafter already measured (same weights, same settings) in
    out/ or a `reuse` folder is read back: greedy decoding of the same prompts is deterministic."""
    from draftsmith.stages.evaluate import EvaluateSettings, evaluate_vllm

    keys = {"num_prompts": ev["num_prompts"], "set_num_prompts": ev.get("set_num_prompts"),
            "max_new_tokens": ev["max_new_tokens"], "num_draft_tokens": ev["num_draft_tokens"],
            "sets": {k: str(v) for k, v in sets.items()}}  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    for label, export in exports.items():
        for folder in [out, *reuse]:
            f = folder / f"{label}.json"
            if not fresh and f.is_file():
                r = json.loads(f.read_text(encoding="utf-8"))
                if r["digest"] == export_digest(export) and r["keys"] == keys:
                    results[label] = r
                    break
    missing = {label: exports[label] for label in exports if label not in results}
    if missing:
        outs = {name: out / "raw" / "-".join(missing) / f"{name}.json" for name in sets}
        (out / "logs").mkdir(parents=True, exist_ok=True)  # each engine run's output is kept there
        t0 = time.perf_counter()
        summaries = evaluate_vllm(
            target, {k: str(v) for k, v in missing.items()}, {k: str(v) for k, v in sets.items()},
            {k: str(v) for k, v in outs.items()},
            EvaluateSettings(num_prompts=ev["num_prompts"], max_new_tokens=ev["max_new_tokens"],
                             num_draft_tokens=ev["num_draft_tokens"], ngram=False, suffix=False,
                             remeasure_chosen_k=False, set_num_prompts=ev.get("set_num_prompts") or {},
                             dtype="float32", vllm_eager=True),
            out / "logs",
        )  # fmt: skip
        wall = time.perf_counter() - t0
        for label in missing:
            per_set = {}
            for name, summary in summaries.items():
                m = summary["methods"][label]
                per_set[name] = {
                    "num_prompts": summary["num_prompts"],
                    "tau": m["tau"],
                    "acceptance_per_position": m["acceptance_rate_per_position"],
                    "outputs_equal_plain": m["outputs_equal_plain"],
                    "tokens": [r["tokens"] for r in m["per_prompt"]],
                    "accepted": [r["accepted"] for r in m["per_prompt"]],
                }
            results[label] = {"digest": export_digest(missing[label]), "keys": keys, "sets": per_set,
                              "export": str(missing[label]), "batch_wall_s": round(wall, 1)}  # fmt: skip
            write_json(out / f"{label}.json", results[label])
    return results


def vllm_table_rows(results: dict[str, dict[str, Any]], reference: str = "specforge") -> dict[str, Any]:
    """Per set: tokens per target forward and tau of every drafter, and each one's paired difference
    from the reference's."""
    rows: dict[str, Any] = {}
    ref = results[reference]["sets"]
    for name in ref:
        row = {"num_prompts": ref[name]["num_prompts"], "tokens": sum(ref[name]["tokens"]), "drafters": {}}
        for label, r in results.items():
            x = r["sets"][name]
            entry = {
                "tokens_per_forward": tokens_per_forward(x["tokens"], x["accepted"]),
                "tau": x["tau"],
                "acceptance_per_position": x["acceptance_per_position"],
                "outputs_equal_plain": x["outputs_equal_plain"],
            }
            if label != reference:
                y = ref[name]
                entry["minus_" + reference] = entry["tokens_per_forward"] - tokens_per_forward(
                    y["tokens"], y["accepted"]
                )
                entry["interval95"] = paired_interval(x["tokens"], x["accepted"], y["tokens"], y["accepted"])
            row["drafters"][label] = entry
        rows[name] = row
    return rows
