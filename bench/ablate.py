"""Ablation of the TTT objective: which of the differences between draftsmith's trainer and SpecForge's
matter, measured on the same data, steps and seed.

    python -m bench.ablate [--data results/data_config.json] [--vocab results/vocab_map.pt]
                           [--variants baseline,random_head,...] [--epochs 3] [--jobs 2]
                           [--seeds 0,1] [--measure-prompts 16 --prompts heldout=PATH,handwritten=PATH]
                           [--json results/bench/ablate.json]

Every variant is `draftsmith train` with the run's settings (schema defaults < config.yaml's `train`
< --settings) and only the named keys changed. Validation accuracy per TTT step is scored on the same
held-out samples and the same positions (the predicted token is an assistant token) whatever the
variant trains on, so the rows compare. Variants run in child processes, --jobs at a time, each with
--threads torch threads (on a busy 2-core machine: --jobs 2 --threads 1).

The reference row is SpecForge 0.2.0 trained on the same shards and budget (3 epochs, lr 3e-3, 3 TTT
steps), evaluated with draftsmith's evaluator: validation accuracy 0.240 / 0.195 / 0.175.
"""

from __future__ import annotations

import json
import multiprocessing
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import click

from bench import harness

REFERENCE = {"name": "SpecForge 0.2.0 (same shards and budget)", "val_acc": [0.240, 0.195, 0.175]}

# name -> the settings it changes; "baseline" is the settings as given (the defaults: random head)
VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "target_head": {"head_init": "target"},
    "sample_norm": {"loss_norm": "sample"},
    "mask_offset0": {"mask_offset": 0},
    "sample_norm+mask_offset0": {"loss_norm": "sample", "mask_offset": 0},
    "beta2_0.999": {"adam_beta2": 0.999},
    "specforge_like": {"head_init": "random", "loss_norm": "sample", "mask_offset": 0, "adam_beta2": 0.999},
    # the same tokens in 4x as many optimizer steps: a few hundred samples make only ~20 steps an epoch
    "batch_1024": {"batch_tokens": 1024},
    "batch_512": {"batch_tokens": 512},
    "batch_512+lr_6e-3": {"batch_tokens": 512, "lr": 0.006},
    # later TTT steps weighed as much as the first (the reference and SpecForge: 0.8**j)
    "ttt_decay_1.0": {"ttt_decay": 1.0},
    # speculators' uniform noise on the aux states: a regulariser where data is scarce
    "noise_0.05": {"noise_std": 0.05},
    # SpecForge warms up for 1.5% of its steps (1 of 72) and uses AdamW's default betas
    "warmup_1": {"warmup_steps": 1},
    "warmup_1+beta2_0.999": {"warmup_steps": 1, "adam_beta2": 0.999},
    "fan_in_init": {"layer_init": "fan_in"},
    "normal_init": {"layer_init": "normal"},  # the reference's (the default before fan_in was measured)
    "warmup_1+fan_in_init": {"warmup_steps": 1, "layer_init": "fan_in"},
    # prompt positions as extra (free) training signal: their hidden states are extracted anyway
    "loss_all_positions": {"loss_positions": "all"},
    "fan_in_init+loss_all_positions": {"layer_init": "fan_in", "loss_positions": "all"},
    # SpecForge's TTT view: step j does not see the step-0 keys at t-j+1..t, and keeps position t
    "ttt_prefix_lagged": {"ttt_prefix": "lagged"},
    "ttt_positions_fixed": {"ttt_positions": "fixed"},
    "ttt_specforge_view": {"ttt_prefix": "lagged", "ttt_positions": "fixed"},
    # speculators' default optimizer (its PR #746): Muon for the weight matrices at 10x the rate, AdamW for
    # the rest; and Muon at AdamW's rate (its updates are scaled to AdamW's RMS: Moonshot's rule)
    "muon": {"optimizer": "muon"},
    "muon_lr_x1": {"optimizer": "muon", "muon_lr_scale": 1.0},
    # the LK losses (SpecForge lk_loss.py, arXiv 2602.23881): -log(alpha), and the cross-entropy blended
    # into 1 - alpha as alpha grows (SpecForge's defaults, and the paper's eta = 3)
    "lk_alpha": {"lk_loss": "alpha"},
    "lk_lambda": {"lk_loss": "lambda"},
    "lk_lambda_decay3": {"lk_loss": "lambda", "lk_kl_decay": 3.0},
    # per-step weights of the TTT loss (the default 0.8**j = 1 / 0.8 / 0.64; ttt_decay_1.0 above is 1 / 1 / 1)
    "step_weights_1_0.5_0.25": {"ttt_step_weights": [1.0, 0.5, 0.25]},
    "step_weights_1_1.25_1.5": {"ttt_step_weights": [1.0, 1.25, 1.5]},
    # the drafter kinds (issue 35), at the same data, steps and draft positions (ttt_steps)
    "kind_eagle3.1": {"drafter": {"kind": "eagle3.1"}},
    "kind_peagle": {"drafter": {"kind": "peagle"}},
    "kind_dflash": {"drafter": {"kind": "dflash"}},
}
# the serving points a measured variant is projected to: evaluate.serving's device at concurrency 1 and 32
PROJECTED_CONCURRENCY = (1, 32)


def validation_projection(drafter: Path, agreement: list[float | None]) -> dict[str, Any]:
    """Without decoding: tokens per target forward a drafter would reach if its validation agreement at
    draft position j were its acceptance there given the earlier ones accepted (the TTT view: each
    position scored on the real prefix), 1 + a0 + a0*a1 + ..., and that projected by the cost model at
    concurrency PROJECTED_CONCURRENCY (evaluate.serving's device, the drafter's own cost)."""
    from draftsmith.core.config.settings import schema_default
    from draftsmith.core.evaluation.cost import drafter_cost, serving_points, speedup_factor, target_cost

    target = json.loads((drafter / "config.json").read_text())["draftsmith"]["target"]
    rates = [a or 0.0 for a in agreement]
    per_forward, chain = 1.0, 1.0
    for a in rates:
        chain *= a
        per_forward += chain
    serving = {**schema_default("evaluate.serving"), "concurrency": list(PROJECTED_CONCURRENCY)}
    points = serving_points(serving, 700.0)
    bytes_per = serving["bytes_per_parameter"]
    factors = [
        speedup_factor(
            "eagle3", len(rates), target_cost(target, bytes_per), p, drafter_cost(drafter, bytes_per)
        )
        for p in points
    ]
    return {"tokens_per_forward": per_forward, "projected_speedup": [per_forward * f for f in factors]}


def measure(
    drafter: Path, sets: dict[str, str], num_prompts: int, work: Path, evaluate: dict[str, Any]
) -> dict[str, Any]:
    """Offline speculative decoding of a trained drafter beside the free methods on `num_prompts` prompts
    of each held-out set (name -> prompt file), projected by the cost model (evaluate.serving's device,
    concurrency PROJECTED_CONCURRENCY) -> {set: {method: tokens per target forward, per-position
    acceptance, chosen draft length, projected speedups}}."""
    return {
        name: measure_set(drafter, path, num_prompts, work / name, evaluate) for name, path in sets.items()
    }


def measure_set(
    drafter: Path, prompts: str, num_prompts: int, work: Path, evaluate: dict[str, Any]
) -> dict[str, Any]:
    from draftsmith.core.config.settings import schema_default
    from draftsmith.core.evaluation.cost import drafter_cost, serving_points, target_cost
    from draftsmith.core.evaluation.projection import chosen, set_projection
    from draftsmith.stages.evaluate import EvaluateSettings, evaluate_offline

    target = json.loads((drafter / "config.json").read_text())["draftsmith"]["target"]
    settings = EvaluateSettings.from_dict({**evaluate, "num_prompts": num_prompts, "hybrid": False})
    work.mkdir(parents=True, exist_ok=True)
    results = evaluate_offline(target, {"eagle3": drafter}, prompts, work / "offline.json", settings)
    serving = {**schema_default("evaluate.serving"), "concurrency": list(PROJECTED_CONCURRENCY)}
    context = sum(len(o) for o in results["plain"]["outputs"]) / max(1, len(results["plain"]["outputs"]))
    points = serving_points(serving, context)
    bytes_per = serving["bytes_per_parameter"]
    projected = set_projection(
        results,
        target_cost(target, bytes_per),
        {"eagle3": drafter_cost(drafter, bytes_per)},
        points,
        (0.95, 1000, 0),
    )
    out = {}
    for key, method in results["methods"].items():
        option = chosen(projected["methods"][key]) if key in projected["methods"] else {}
        out[key] = {
            "tokens_per_forward": method["tokens_per_forward"],
            "acceptance_rates": method.get("acceptance_rates"),
            "chosen_k": projected["methods"].get(key, {}).get("chosen_k"),
            "projected_speedup": option.get("projected_speedup"),
        }
    return out


def run_variant(
    name: str, values: dict[str, Any], data: str, vocab: str, workdir: str, measured: dict[str, Any] | None
) -> dict[str, Any]:
    """One training run in this (child) process -> its row; `measured` {prompts, num_prompts}: then also
    the drafter's offline measurement beside the free methods (`measure`)."""
    from draftsmith.stages.train import TrainSettings, train

    settings = TrainSettings.from_dict(values)
    root = Path(workdir) / f"{name}-seed{settings.seed}"
    t0 = time.perf_counter()
    summary = train(
        data, vocab, root / "drafter", root / "checkpoints", root / "metrics.jsonl", settings, progress=False
    )
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines() if line.strip()]
    methods = None
    if (
        summary["val_agreement"] is None and settings.val_fraction > 0
    ):  # stopped by max_steps before an epoch end
        from bench.peer import validate as peer_validate

        scored = peer_validate.validation(root / "drafter", Path(data), Path(vocab), values)
        summary = {**summary, "val_acc": scored["acc"], "val_agreement": scored["agreement"]}
    projected = validation_projection(root / "drafter", summary["val_agreement"] or [])
    if measured:
        evaluate = {**measured["evaluate"], "threads": settings.threads}
        methods = measure(root / "drafter", measured["sets"], measured["num_prompts"], root, evaluate)
    return {
        "variant": name,
        "seed": settings.seed,
        "methods": methods,
        "from_validation": projected,
        "changes": VARIANTS.get(name, {}),
        "val_acc": summary["val_acc"],
        "val_agreement": summary["val_agreement"],
        "val_loss": summary["val_loss"],
        "train_acc": summary["train_acc"],
        "val_acc_per_epoch": [r["acc"] for r in rows if r["kind"] == "val"],
        "steps": summary["steps"],
        "trained_tokens": summary["trained_tokens"],
        "train_samples": summary["train_samples"],
        "val_samples": summary["val_samples"],
        "wall_s": wall,
    }


def fmt(accs: list[float | None] | None) -> str:
    return " / ".join("  -  " if a is None else f"{a:.3f}" for a in (accs or []))


def table(rows: list[dict[str, Any]]) -> str:
    width = max(len(f"{r['variant']} s{r['seed']}") for r in rows + [{"variant": "reference", "seed": 0}])
    c = " / ".join(f"c{b}" for b in PROJECTED_CONCURRENCY)
    lines = [
        f"{'variant':<{width}}  val acc per TTT step   val agreement          train acc              steps"
        f"  wall s  tok/fwd (val)  projected {c} (val)"
    ]
    for r in rows:
        v = r.get("from_validation") or {}
        speed = " / ".join(f"{x:.2f}x" for x in v.get("projected_speedup") or [])
        lines.append(
            f"{r['variant'] + ' s' + str(r['seed']):<{width}}  {fmt(r['val_acc']):<21}  "
            f"{fmt(r['val_agreement']):<21}  {fmt(r['train_acc']):<21}  {r['steps']:>5}  {r['wall_s']:>6.0f}  "
            f"{v.get('tokens_per_forward', 0.0):>13.3f}  {speed}"
        )
    lines.append(f"{'reference':<{width}}  {fmt(REFERENCE['val_acc'])}   ({REFERENCE['name']})")
    measured = [r for r in rows if r.get("methods")]
    if measured:
        c = " / ".join(f"c{b}" for b in PROJECTED_CONCURRENCY)
        head = f"{'variant':<{width}}  set          method   tokens/forward  acceptance per position   k  projected {c}"
        lines += ["", head]
        for r in measured:
            for set_name, methods in r["methods"].items():
                for key, m in methods.items():
                    speed = " / ".join(f"{x:.2f}x" for x in m["projected_speedup"] or [])
                    lines.append(
                        f"{r['variant'] + ' s' + str(r['seed']):<{width}}  {set_name:<11}  {key:<7}  "
                        f"{m['tokens_per_forward']:>14.3f}  {fmt(m['acceptance_rates']):<24}  "
                        f"{m['chosen_k'] or '-'}  {speed}"
                    )
    return "\n".join(lines)


def beats_reference(val_acc: list[float | None] | None) -> bool:
    """False also when there is no validation figure (a run stopped by max_steps before any)."""
    return val_acc is not None and all(
        a is not None and a >= r for a, r in zip(val_acc, REFERENCE["val_acc"], strict=False)
    )


@click.command(help=__doc__)
@click.option("--data", default="results/data_config.json", show_default=True, type=click.Path(exists=True))
@click.option("--vocab", default="results/vocab_map.pt", show_default=True, type=click.Path(exists=True))
@click.option("--config", "config_path", default="config.yaml", show_default=True, type=click.Path())
@click.option(
    "--settings", "settings_json", default="{}", help="JSON overrides of train settings (all variants)."
)
@click.option("--variants", default=",".join(VARIANTS), show_default=True, help="Comma-separated names.")
@click.option("--epochs", type=int, default=None, help="Override train.epochs (screening: fewer).")
@click.option(
    "--seeds",
    default="0",
    show_default=True,
    help="Comma-separated train.seed values: each variant per seed.",
)
@click.option(
    "--measure-prompts",
    type=int,
    default=0,
    show_default=True,
    help="Also decode this many held-out prompts (--prompts) with each drafter beside the free methods and "
    "project the speedups (0 = validation figures only).",
)
@click.option(
    "--prompts",
    default="heldout=results/prompts/heldout.jsonl,handwritten=draftsmith/data/heldout_handwritten.jsonl",
    show_default=True,
    help="Held-out sets to measure on, NAME=PATH comma-separated.",
)
@click.option(
    "--evaluate-settings",
    default='{"max_new_tokens": 64, "num_draft_tokens": 3}',
    show_default=True,
    help="JSON evaluate settings of the measurement (config.yaml's draft length and answer length).",
)
@click.option("--jobs", default=1, show_default=True, help="Variants trained at the same time.")
@click.option("--threads", default=1, show_default=True, help="torch threads per variant.")
@click.option("--json", "json_path", default=str(harness.result_path("ablate")), show_default=True)
def main(
    data: str,
    vocab: str,
    config_path: str,
    settings_json: str,
    variants: str,
    epochs: int | None,
    seeds: str,
    measure_prompts: int,
    prompts: str,
    evaluate_settings: str,
    jobs: int,
    threads: int,
    json_path: str,
) -> None:
    names = [v.strip() for v in variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise click.BadParameter(
            f"unknown variants {unknown}; known: {list(VARIANTS)}", param_hint="--variants"
        )
    overrides = {**json.loads(settings_json), "threads": threads, "checkpoint_every": 0}
    if epochs is not None:
        overrides["epochs"] = epochs
    load_before = harness.load_average()
    base = harness.base_settings(config_path, overrides)
    click.echo(f"base settings: {json.dumps(base)}")
    rows: list[dict[str, Any]] = []
    ctx = multiprocessing.get_context("spawn")  # fresh torch per run: no thread-pool state shared
    with (
        tempfile.TemporaryDirectory(prefix="draftsmith-ablate-") as work,
        ProcessPoolExecutor(jobs, mp_context=ctx) as pool,
    ):
        sets = dict(item.split("=", 1) for item in prompts.split(",") if item.strip())
        evaluate = json.loads(evaluate_settings)
        measured = (
            {"sets": sets, "num_prompts": measure_prompts, "evaluate": evaluate} if measure_prompts else None
        )
        futures = {
            (n, seed): pool.submit(
                run_variant, n, {**base, **VARIANTS[n], "seed": seed}, data, vocab, work, measured
            )
            for seed in [int(x) for x in seeds.split(",")]
            for n in names
        }
        for (n, seed), future in futures.items():
            rows.append(future.result())
            click.echo(f"{n} seed {seed}: val acc {fmt(rows[-1]['val_acc'])} ({rows[-1]['wall_s']:.0f} s)")
    click.echo(table(rows))
    for r in rows:
        r["beats_reference"] = beats_reference(r["val_acc"])
    out = {"data": data, "vocab": vocab, "base_settings": base, "reference": REFERENCE, "rows": rows,
           "machine": harness.machine(load_before)}  # fmt: skip
    harness.write_result(out, json_path, click.echo)


if __name__ == "__main__":
    main()
