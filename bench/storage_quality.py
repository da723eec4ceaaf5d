"""Does float8 storage cost drafter quality? Two drafters trained the same way on bfloat16 and on
float8_e4m3fn shards of the same tokens, compared where it matters:

- validation accuracy per TTT step, sample by sample, on the bf16 states (what serving feeds the
  drafter) and on each drafter's own data (what its training logged), with the float8 - bf16 difference
  and its 95% paired bootstrap interval over validation samples;
- tokens per target forward in vLLM on every held-out set (generated tokens / (generated - accepted
  drafts): each target forward yields one token plus the drafts it accepts), with the paired difference
  and its interval over prompts; tau (1 + accepted / drafts) beside it under its own name.

    python -m bench.storage_quality --bf16 RUN/results --fp8 FP8/results --config config.yaml \
        --set split=RUN/results/prompts/heldout.jsonl --set handwritten=draftsmith/data/heldout_handwritten.jsonl

Each results folder holds data_config.json and drafter/; the vocabulary map is the bf16 run's (it is
counted from tokens, which both share). vLLM runs plain decoding once and each drafter once, over every
set in one batch (float32, greedy), and writes its per-set JSON under --out; a rerun reuses those files.
Prints the table and writes --out/storage_quality.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import torch
import yaml

from bench import harness
from draftsmith.core.data.loader import StreamingData
from draftsmith.core.data.manifest import load_manifest
from draftsmith.core.data.vocab import load_vocab_map
from draftsmith.core.evaluation.stats import bootstrap_ratio, bootstrap_tau, paired_difference
from draftsmith.core.export.formats import load_drafter
from draftsmith.core.model.target import load_target_head
from draftsmith.core.training.objective import Objective, StepStats, ttt_loss
from draftsmith.stages.train import TrainSettings

DTYPES = ("bf16", "fp8")


def validation_stats(
    drafter_dir: Path, data: StreamingData, target: Any, vocab: dict[str, Any], objective: Objective
) -> list[StepStats]:
    """One drafter's TTT stats in the validation view on every validation sample of `data`, sample by
    sample (sums over samples are what training's validation reports)."""
    drafter, _ = load_drafter(drafter_dir)
    draft_ids = torch.arange(vocab["d2t"].numel()) + vocab["d2t"]
    teacher = target.lm_head[draft_ids]
    out = []
    with torch.no_grad():
        for i in range(len(data.val)):
            out.append(ttt_loss(drafter, target.embed, teacher, data.batch([i], "val"), objective)[1])
    return out


def accuracy_rows(
    stats: dict[str, list[StepStats]], steps: int, level: float, resamples: int
) -> dict[str, list[dict[str, float]]]:
    """Per TTT step: each drafter's accuracy (correct / count over all samples) with its bootstrap interval
    over samples, and the fp8 - bf16 difference with its paired interval."""
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in (*stats, "fp8 - bf16")}
    for j in range(steps):
        counts = {k: ([s.correct[j] for s in v], [s.count[j] for s in v]) for k, v in stats.items()}
        for name, (correct, count) in counts.items():
            acc, lo, hi = bootstrap_ratio(correct, count, level, resamples)
            rows[name].append({"value": acc, "low": lo, "high": hi})
        diff, lo, hi = paired_difference(counts["fp8"], counts["bf16"], level, resamples)
        rows["fp8 - bf16"].append({"value": diff, "low": lo, "high": hi})
    return rows


def forward_rows(vllm: dict[str, Any], level: float, resamples: int) -> dict[str, Any]:
    """Tokens per target forward and tau per drafter on one held-out set, and the paired difference."""
    out: dict[str, Any] = {"num_prompts": vllm["num_prompts"]}
    counts = {}
    for name in DTYPES:
        method = vllm["methods"][name]
        rows = method["per_prompt"]
        accepted, tokens = [r["accepted"] for r in rows], [r["tokens"] for r in rows]
        forwards = [g - a for g, a in zip(tokens, accepted, strict=True)]  # each yields 1 + its accepted
        counts[name] = (tokens, forwards)
        tpf, lo, hi = bootstrap_ratio(tokens, forwards, level, resamples)
        tau, tlo, thi = bootstrap_tau(accepted, [r["drafts"] for r in rows], level, resamples)
        out[name] = {
            "tokens_per_forward": tpf, "low": lo, "high": hi, "tau": tau, "tau_low": tlo, "tau_high": thi,
            "tokens": sum(r["tokens"] for r in rows), "accepted": sum(accepted),
            "lossless": method["outputs_equal_plain"],
        }  # fmt: skip
    diff, lo, hi = paired_difference(counts["fp8"], counts["bf16"], level, resamples)
    out["fp8 - bf16"] = {"tokens_per_forward": diff, "low": lo, "high": hi}
    return out


def run_vllm(target: str, drafters: dict[str, Path], sets: dict[str, str], out: Path) -> dict[str, Any]:
    """Both drafters through vLLM on every set (reusing the per-set JSON files a previous run wrote)."""
    paths = {name: out / f"vllm-{name}.json" for name in sets}
    if not all(p.is_file() for p in paths.values()):
        from draftsmith.stages.evaluate import EvaluateSettings, evaluate_vllm

        (out / "vllm-logs").mkdir(parents=True, exist_ok=True)
        # as before the settings object: float32, eager on every device, no free methods, no re-measuring
        settings = EvaluateSettings(num_prompts=0, max_new_tokens=64, num_draft_tokens=3, ngram=False,
                                    suffix=False, remeasure_chosen_k=False, dtype="float32", vllm_eager=True)  # fmt: skip
        evaluate_vllm(target, drafters, sets, paths, settings, out / "vllm-logs")
    return {name: json.loads(p.read_text(encoding="utf-8")) for name, p in paths.items()}


def fmt(row: dict[str, float], key: str = "value", digits: int = 3) -> str:
    return f"{row[key]:.{digits}f} [{row['low']:.{digits}f}, {row['high']:.{digits}f}]"


def print_accuracy(accuracy: dict[str, Any]) -> None:
    for where, rows in (("bf16 states", accuracy["on_bf16_states"]), ("own data", accuracy["on_own_data"])):
        print(f"validation accuracy per TTT step on {where} ({accuracy['validation_samples']} samples, "
              f"{accuracy['positions_per_step']} positions):")  # fmt: skip
        for name, per_step in rows.items():
            print(f"  {name:11s} " + " / ".join(fmt(r) for r in per_step), flush=True)


@click.command()
@click.option("--bf16", "bf16_dir", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--fp8", "fp8_dir", required=True, type=click.Path(file_okay=False, exists=True))
@click.option(
    "--config", "config_path", default="config.yaml", show_default=True, type=click.Path(exists=True)
)
@click.option("--set", "sets", multiple=True, metavar="NAME=PATH", help="A held-out prompt set (repeat).")
@click.option("--out", default="results/bench/storage_quality", show_default=True, type=click.Path())
@click.option("--resamples", default=2000, show_default=True)
@click.option("--vocab", "vocab_path", type=click.Path(exists=True), help="[default: --bf16's vocab_map.pt]")
def main(
    bf16_dir: str,
    fp8_dir: str,
    config_path: str,
    sets: tuple[str, ...],
    out: str,
    resamples: int,
    vocab_path: str | None,
) -> None:
    level = 0.95
    load_before = harness.load_average()
    dirs = {"bf16": Path(bf16_dir), "fp8": Path(fp8_dir)}
    out_dir = Path(out)
    config = yaml.safe_load(Path(config_path).read_text(encoding="utf-8"))
    settings = TrainSettings.from_dict(config.get("train") or {})
    objective = Objective.from_settings(settings, torch.device("cpu")).for_validation()
    manifests = {k: load_manifest(d / "data_config.json") for k, d in dirs.items()}
    vocab = load_vocab_map(vocab_path or dirs["bf16"] / "vocab_map.pt")
    target = load_target_head(manifests["bf16"]["target"])
    data = {k: StreamingData.from_manifest(m, settings) for k, m in manifests.items()}
    if [r.id for r in data["bf16"].val] != [r.id for r in data["fp8"].val]:
        raise click.UsageError("the two data sets hold other validation samples: not the same tokens")
    storage = {
        k: {"dtype": m["dtype"], "bytes": m["bytes"], "tokens": m["num_tokens"], "bytes_per_token": m["bytes"] / m["num_tokens"]}
        for k, m in manifests.items()
    }  # fmt: skip

    # validation: each drafter on the bf16 states, and on its own data
    on_bf16 = {
        k: validation_stats(dirs[k] / "drafter", data["bf16"], target, vocab, objective) for k in DTYPES
    }
    on_own = {"bf16": on_bf16["bf16"]}
    on_own["fp8"] = validation_stats(dirs["fp8"] / "drafter", data["fp8"], target, vocab, objective)
    print_accuracy(
        accuracy := {
            "on_bf16_states": accuracy_rows(on_bf16, settings.ttt_steps, level, resamples),
            "on_own_data": accuracy_rows(on_own, settings.ttt_steps, level, resamples),
            "validation_samples": len(data["bf16"].val),
            "positions_per_step": [
                sum(s.count[j] for s in on_bf16["bf16"]) for j in range(settings.ttt_steps)
            ],
        }
    )
    for d in data.values():
        d.close()

    prompt_sets = dict(s.split("=", 1) for s in sets)
    vllm = (
        run_vllm(manifests["bf16"]["target"], {k: dirs[k] / "drafter" for k in DTYPES}, prompt_sets, out_dir)
        if prompt_sets
        else {}  # no --set: validation accuracy only
    )
    forwards = {name: forward_rows(v, level, resamples) for name, v in vllm.items()}

    print(
        "storage: "
        + "; ".join(
            f"{k} {s['dtype']} {s['bytes_per_token']:.0f} B/token ({s['bytes'] / 1e6:.1f} MB)"
            for k, s in storage.items()
        )
    )
    print("vLLM, greedy, k = 3: tokens per target forward [95%] (tau beside it)")
    for name, row in forwards.items():
        cells = [
            f"{k} {fmt(row[k], 'tokens_per_forward')} (tau {row[k]['tau']:.3f}{'' if row[k]['lossless'] else ', NOT lossless'})"
            for k in DTYPES
        ]
        print(
            f"  {name} ({row['num_prompts']} prompts): "
            + "; ".join(cells)
            + f"; fp8 - bf16 {fmt(row['fp8 - bf16'], 'tokens_per_forward')}"
        )
    result = {"storage": storage, "accuracy": accuracy, "vllm": forwards, "settings": settings.to_dict()}
    harness.write_result(
        {**result, "machine": harness.machine(load_before)}, out_dir / "storage_quality.json"
    )


if __name__ == "__main__":
    main()
