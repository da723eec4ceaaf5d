"""Learning curves: drafter quality against training tokens, to tell "more data" from "longer training".

    python -m bench.quality [--data results/data_config.json] [--vocab results/vocab_map.pt]
                            [--summary results/eval/summary.json] [--config config.yaml]
                            [--fractions 0.25,0.5,1] [--epochs 1,3] [--out results/bench/quality]

For each fraction f of the training samples (a fixed random subset, nested: the 0.5 subset holds the
0.25 one; every validation sample is always kept, so the validation figures compare) and each epoch
count, the drafter is trained with the run's settings (schema defaults < config `train` < --settings)
and measured: validation top-1 accuracy per TTT step and, with vLLM installed, tokens per target forward
of vLLM's own EAGLE-3 decoding (every step counted) with its 95% interval, and vLLM's tau beside it, on
every held-out set the run's eval summary measured (same prompts, tokens and draft length). Writes
quality.json and quality.png (tokens per target forward per held-out set against trained tokens beside
n-gram lookup's, with its interval as a band, and accuracy per TTT step; one line per epoch count). A curve still rising at f = 1 says more data helps; rising with
epochs at a fixed f only says the drafter is not yet fitted (watch the train/validation gap).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from bench import harness
from draftsmith.core.io.atomic import atomic_path


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def subset_rank(sample_id: str) -> float:
    """A sample's place in [0, 1): the subset of fraction f is every training sample ranked below f."""
    return int.from_bytes(hashlib.sha256(f"subset/{sample_id}".encode()).digest()[:8], "big") / 2**64


def subset_manifest(manifest_path: Path, fraction: float, val_fraction: float, folder: Path) -> Path:
    """A manifest of `fraction` of the training samples and every validation sample, in new shards.

    The subset shards' counts are their own; their teacher-agreement figures stay the full shards'."""
    from draftsmith.core.data.loader import is_validation
    from draftsmith.core.data.manifest import load_manifest
    from draftsmith.core.data.shards import ShardWriter, iter_samples, read_shard_meta
    from draftsmith.stages.manifest import ManifestSettings, build_manifest

    manifest = load_manifest(manifest_path)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, shard in enumerate(manifest["shards"]):
        meta = read_shard_meta(shard["path"])
        keep_meta = {key: meta[key] for key in ("aux_layer_ids", "layer_convention", "dtype") if key in meta}
        path = folder / f"shard-{k}.safetensors"
        writer = ShardWriter(path, keep_meta, codec="none", level=1, storage_dtype="bfloat16")
        samples = tokens = masked = 0
        for s in iter_samples(shard["path"]):
            if is_validation(s.id, val_fraction) or subset_rank(s.id) < fraction:
                writer.add(s)
                samples, tokens, masked = samples + 1, tokens + s.num_tokens, masked + int(s.loss_mask.sum())
        stats = {**meta["stats"], "num_samples": samples, "num_tokens": tokens, "num_masked_tokens": masked}
        writer.close({"template": meta.get("template"), "stats": stats})
        paths.append(str(path))
    out = folder / "data_config.json"
    build_manifest(paths, str(out), str(manifest["target"]), ManifestSettings(min_teacher_agreement=0.0))
    return out


def heldout_reference(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per held-out set of a run's eval summary: its prompt file, how many prompts vLLM decoded, and
    n-gram lookup's vLLM tokens per target forward with its interval there (the free alternative a
    drafter must beat)."""
    sets = {}
    for name, info in summary["heldout_sets"].items():
        rows = [r for r in summary["rows"] if r["heldout"] == name and r["measured_by"] == "vLLM"]
        ngram = next((r for r in rows if r.get("key") == "ngram"), None)
        sets[name] = {
            "prompts": info["prompts"],
            "num_prompts": max((r["prompts"] for r in rows), default=info["num_prompts"]),
            "ngram": ngram["tokens_per_forward"] if ngram else None,
            "ngram_interval": ngram["tokens_per_forward_interval"] if ngram else None,
        }
    return sets


FIGURES = (
    "tokens_per_forward",
    "tokens_per_forward_interval",
    "tau",
    "tau_interval",
    "acceptance_per_position",
)


def run_row(train_summary: dict[str, Any], eval_summary: dict[str, Any]) -> dict[str, Any]:
    """The run's own drafter as the full-data point: its training summary and the trained drafter's vLLM
    rows of the run's eval summary (the same prompts this bench decodes), so it is not trained twice."""
    taus = {
        r["heldout"]: {k: r[k] for k in FIGURES}
        for r in eval_summary["rows"]
        if r.get("key") == "eagle3" and r["measured_by"] == "vLLM"
    }
    return {
        "fraction": 1.0,
        "epochs": train_summary["epochs"],
        **{k: train_summary[k] for k in ("train_samples", "val_samples", "trained_tokens", "steps")},
        "val_acc": train_summary["val_acc"],
        "val_agreement": train_summary.get("val_agreement"),  # absent from runs before it was measured
        "train_acc": train_summary["train_acc"],
        "vllm": taus or None,
        "wall_s": round(train_summary["wall_s"], 1),
        "source": "run",
    }


def figures_by_set(
    spans: dict[str, tuple[int, int]], counts: list[dict[str, Any]], num_draft_tokens: int, level: float
) -> dict[str, dict[str, Any]]:
    """Tokens per target forward and tau with their bootstrap intervals over prompts, and acceptance per
    position, per held-out set, from the per-prompt counts of one batch holding every set (`spans`: set ->
    [start, end) in the batch)."""
    from draftsmith.core.evaluation.stats import bootstrap_ratio, bootstrap_tau
    from draftsmith.stages.evaluate import counts_summary

    out = {}
    for name, (a, b) in spans.items():
        rows = counts[a:b]
        per_forward, lo, hi = bootstrap_ratio(
            [r["tokens"] for r in rows], [r["forwards"] for r in rows], level
        )
        tau, tau_lo, tau_hi = bootstrap_tau([r["accepted"] for r in rows], [r["drafts"] for r in rows], level)
        out[name] = {
            "tokens_per_forward": per_forward,
            "tokens_per_forward_interval": [lo, hi],
            "tau": tau,
            "tau_interval": [tau_lo, tau_hi],
            "acceptance_per_position": counts_summary(rows, num_draft_tokens)["acceptance_rate_per_position"],
        }
    return out


def vllm_figures(
    target: str, drafter: Path, sets: dict[str, dict[str, Any]], max_new_tokens: int, k: int, level: float
) -> dict[str, dict[str, Any]]:
    """The drafter in vLLM's EAGLE-3 decoding (greedy), every held-out set in one batch."""
    from transformers import AutoTokenizer

    from draftsmith.stages.evaluate import encode_prompts, read_eval_prompts, vllm_prompt_counts
    from draftsmith.stages.evaluate.vllm_runner import run_vllm_subprocess

    tokenizer = AutoTokenizer.from_pretrained(target)
    spans, ids, encoded = {}, [], []
    for name, info in sets.items():
        prompts = read_eval_prompts(info["prompts"], info["num_prompts"])
        spans[name] = (len(encoded), len(encoded) + len(prompts))
        ids += [p["id"] for p in prompts]
        encoded += encode_prompts(tokenizer, prompts)
    result = run_vllm_subprocess(
        target,
        str(drafter),
        "eagle3",
        encoded,
        max_new_tokens,
        k,
        "float32",
        seed=0,
        temperature=0.0,
        gpu_memory_utilization=None,
    )
    counts = vllm_prompt_counts(ids, result)
    if counts is None:
        raise RuntimeError("vLLM reported no per-request acceptance: cannot split the held-out sets")
    return figures_by_set(spans, counts, k, level)


def plot(rows: list[dict[str, Any]], sets: dict[str, dict[str, Any]], path: Path) -> None:
    """One panel per held-out set (vLLM tokens per target forward with its interval, n-gram lookup's as a
    band), then one per TTT step (validation accuracy), all against trained tokens, one line per epoch
    count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    names = [n for n in sets if any((r["vllm"] or {}).get(n) for r in rows)]
    steps = max(len(r["val_acc"] or []) for r in rows)
    fig, axes = plt.subplots(1, len(names) + steps, figsize=(4.2 * (len(names) + steps), 3.6), squeeze=False)
    axes = axes[0]
    for epochs in sorted({r["epochs"] for r in rows}):
        line = sorted((r for r in rows if r["epochs"] == epochs), key=lambda r: r["trained_tokens"])
        x = [r["trained_tokens"] for r in line]
        for ax, name in zip(axes, names, strict=False):
            measured = [r for r in line if (r["vllm"] or {}).get(name)]
            taus = [r["vllm"][name] for r in measured]
            y = [t["tokens_per_forward"] for t in taus]
            err = [
                [t["tokens_per_forward"] - t["tokens_per_forward_interval"][0] for t in taus],
                [t["tokens_per_forward_interval"][1] - t["tokens_per_forward"] for t in taus],
            ]
            xs = [r["trained_tokens"] for r in measured]
            ax.errorbar(xs, y, yerr=err, fmt="o-", capsize=3, label=f"{epochs} epochs")
        for j in range(steps):
            acc = [(r["val_acc"] or [None] * steps)[j] for r in line]  # None: no validation sample
            axes[len(names) + j].plot(
                x, [float("nan") if a is None else a for a in acc], "o-", label=f"{epochs} epochs"
            )
    for ax, name in zip(axes, names, strict=False):
        ref = sets[name]
        if ref.get("ngram") is not None:
            ax.axhline(ref["ngram"], color="grey", linestyle="--", label="n-gram lookup")
            if ref.get("ngram_interval"):
                ax.axhspan(*ref["ngram_interval"], color="grey", alpha=0.15)
        ax.set_title(f"vLLM tokens per target forward, {name} ({ref['num_prompts']} prompts)", fontsize=9)
    for j in range(steps):
        axes[len(names) + j].set_title(f"validation accuracy, TTT step {j}")
    for ax in axes:
        ax.set_xscale("log")  # quality grows about linearly in log tokens
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("trained tokens (all epochs)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


@click.command(help=__doc__)
@click.option("--data", default="results/data_config.json", show_default=True, type=click.Path(exists=True))
@click.option("--vocab", default="results/vocab_map.pt", show_default=True, type=click.Path(exists=True))
@click.option(
    "--summary", "summary_path", default="results/eval/summary.json", show_default=True,
    help="The run's eval summary: the held-out sets, prompt counts and decoding settings to measure with, "
    "and n-gram lookup's tokens per target forward there to compare against.",
)  # fmt: skip
@click.option("--config", "config_path", default="config.yaml", show_default=True, type=click.Path())
@click.option("--settings", "settings_json", default="{}", help="JSON overrides of train settings.")
@click.option("--fractions", default="0.25,0.5,1", show_default=True)
@click.option("--epochs", "epoch_list", default="1,3", show_default=True)
@click.option("--vllm/--no-vllm", default=True, show_default=True, help="Measure acceptance in vLLM.")
@click.option(
    "--run-drafter", type=click.Path(exists=True, file_okay=False), default=None,
    help="The run's trained drafter (results/drafter): stands for fraction 1 at the run's epoch count "
    "(its train_summary.json and the eval summary's vLLM rows) instead of training it again; pass it "
    "with the run's config so the other points share its settings.",
)  # fmt: skip
@click.option("--out", default="results/bench/quality", show_default=True, type=click.Path(file_okay=False))
def main(**kw: Any) -> None:
    from draftsmith.stages.train import TrainSettings, train

    load_before = harness.load_average()
    values = harness.base_settings(kw["config_path"], json.loads(kw["settings_json"]))
    values["checkpoint_every"] = 0
    out = Path(kw["out"])
    target = json.loads(Path(kw["data"]).read_text(encoding="utf-8"))["target"]
    sets: dict[str, dict[str, Any]] = {}
    if kw["vllm"]:
        if not Path(kw["summary_path"]).is_file():
            raise click.UsageError(f"--summary {kw['summary_path']}: no such file (or pass --no-vllm)")
        eval_summary = json.loads(Path(kw["summary_path"]).read_text(encoding="utf-8"))
        sets = heldout_reference(eval_summary)
    rows: list[dict[str, Any]] = []
    if kw["run_drafter"]:
        train_summary = json.loads(
            (Path(kw["run_drafter"]) / "train_summary.json").read_text(encoding="utf-8")
        )
        rows.append(run_row(train_summary, eval_summary if kw["vllm"] else {"rows": []}))
    with tempfile.TemporaryDirectory(prefix="draftsmith-quality-") as work:
        for fraction in _floats(kw["fractions"]):
            todo = [
                e
                for e in (int(e) for e in _floats(kw["epoch_list"]))
                if not any(r["fraction"] == fraction and r["epochs"] == e for r in rows)  # the run's own
            ]
            if not todo:
                continue
            data = subset_manifest(
                Path(kw["data"]), fraction, values["val_fraction"], Path(work) / f"f{fraction}"
            )
            for epochs in todo:
                settings = TrainSettings.from_dict({**values, "epochs": epochs})
                run = Path(work) / f"f{fraction}-e{epochs}"
                t0 = time.perf_counter()
                summary = train(
                    data,
                    kw["vocab"],
                    run / "drafter",
                    run / "ckpt",
                    run / "metrics.jsonl",
                    settings,
                    progress=False,
                )
                taus = None
                if kw["vllm"]:
                    taus = vllm_figures(
                        target, run / "drafter", sets, eval_summary["max_new_tokens"],
                        eval_summary["num_draft_tokens"], eval_summary["level"],
                    )  # fmt: skip
                rows.append(
                    {
                        "fraction": fraction,
                        "epochs": epochs,
                        "train_samples": summary["train_samples"],
                        "val_samples": summary["val_samples"],
                        "trained_tokens": summary["trained_tokens"],
                        "steps": summary["steps"],
                        "val_acc": summary["val_acc"],
                        "val_agreement": summary["val_agreement"],
                        "train_acc": summary["train_acc"],
                        "vllm": taus,
                        "wall_s": round(time.perf_counter() - t0, 1),
                    }
                )
                r = rows[-1]
                acc = " / ".join(f"{a:.3f}" for a in r["val_acc"] or [] if a is not None)
                per_forward = ", ".join(
                    f"{name} {t['tokens_per_forward']:.3f} [{t['tokens_per_forward_interval'][0]:.3f}, "
                    f"{t['tokens_per_forward_interval'][1]:.3f}] (tau {t['tau']:.3f})"
                    for name, t in (taus or {}).items()
                )
                click.echo(
                    f"fraction {fraction} x {epochs} epochs: {r['trained_tokens']:,} tokens, val acc {acc}, "
                    f"vLLM tokens per target forward {per_forward or '-'} ({r['wall_s']:.0f} s)"
                )
    out.mkdir(parents=True, exist_ok=True)
    result = {"data": kw["data"], "settings": values, "heldout": sets, "rows": rows,
              "machine": harness.machine(load_before)}  # fmt: skip
    harness.write_result(result, out / "quality.json", click.echo)
    plot(rows, sets, out / "quality.png")
    click.echo(f"wrote {out / 'quality.png'}")


if __name__ == "__main__":
    main()
