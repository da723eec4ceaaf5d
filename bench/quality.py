"""Learning curves: drafter quality against training tokens, to tell "more data" from "longer training".

    python bench/quality.py [--data results/data_config.json] [--vocab results/vocab_map.pt]
                            [--prompts results/prompts/heldout.jsonl] [--fractions 0.25,0.5,1]
                            [--epochs 1,3] [--out results/bench/quality]

For each fraction f of the training samples (a fixed random subset, nested: the 0.5 subset holds the
0.25 one; every validation sample is always kept, so the validation figures compare) and each epoch
count, the drafter is trained with the run's settings (schema defaults < config `train` < --settings)
and measured: validation top-1 accuracy per TTT step and, with vLLM installed, the mean acceptance
length tau of vLLM's own EAGLE-3 decoding on the held-out prompts (greedy, k = --num-draft-tokens).
Writes quality.json and quality.png (tau and accuracy per step against trained tokens, one line per
epoch count). A curve still rising at f = 1 says more data helps; rising with epochs at a fixed f only
says the drafter is not yet fitted (watch the train/validation gap for overfitting).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import yaml

from draftsmith.atomic import atomic_path, write_json
from draftsmith.config import settings_defaults


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def subset_rank(sample_id: str) -> float:
    """A sample's place in [0, 1): the subset of fraction f is every training sample ranked below f."""
    return int.from_bytes(hashlib.sha256(f"subset/{sample_id}".encode()).digest()[:8], "big") / 2**64


def subset_manifest(manifest_path: Path, fraction: float, val_fraction: float, folder: Path) -> Path:
    """A manifest of `fraction` of the training samples and every validation sample, in new shards.

    The subset shards' counts are their own; their teacher-agreement figures stay the full shards'."""
    from draftsmith.loader import is_validation
    from draftsmith.manifest import build_manifest, load_manifest
    from draftsmith.shards import ShardWriter, iter_samples, read_shard_meta

    manifest = load_manifest(manifest_path)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, shard in enumerate(manifest["shards"]):
        meta = read_shard_meta(shard["path"])
        keep_meta = {key: meta[key] for key in ("aux_layer_ids", "layer_convention", "dtype") if key in meta}
        path = folder / f"shard-{k}.safetensors"
        writer = ShardWriter(path, keep_meta, codec="none")
        samples = tokens = masked = 0
        for s in iter_samples(shard["path"]):
            if is_validation(s.id, val_fraction) or subset_rank(s.id) < fraction:
                writer.add(s)
                samples, tokens, masked = samples + 1, tokens + s.num_tokens, masked + int(s.loss_mask.sum())
        stats = {**meta["stats"], "num_samples": samples, "num_tokens": tokens, "num_masked_tokens": masked}
        writer.close({"template": meta.get("template"), "stats": stats})
        paths.append(str(path))
    out = folder / "data_config.json"
    build_manifest(paths, str(out), str(manifest["target"]), min_teacher_agreement=0.0)
    return out


def vllm_tau(
    target: str, drafter: Path, prompts: str, num_prompts: int, max_new_tokens: int, k: int
) -> float:
    from transformers import AutoTokenizer

    from draftsmith.engines.vllm_spec import run_vllm_subprocess
    from draftsmith.evaluate import encode_prompts, read_eval_prompts, vllm_method_summary

    tokenizer = AutoTokenizer.from_pretrained(target)
    encoded = encode_prompts(tokenizer, read_eval_prompts(prompts, num_prompts))
    result = run_vllm_subprocess(target, str(drafter), "eagle3", encoded, max_new_tokens, k)
    return vllm_method_summary(result, 0.0, k)["tau"]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = max(len(r["val_acc"] or []) for r in rows)
    fig, axes = plt.subplots(1, 1 + steps, figsize=(4.2 * (1 + steps), 3.6), squeeze=False)
    axes = axes[0]
    for epochs in sorted({r["epochs"] for r in rows}):
        line = sorted((r for r in rows if r["epochs"] == epochs), key=lambda r: r["trained_tokens"])
        x = [r["trained_tokens"] for r in line]
        if any(r["vllm_tau"] is not None for r in line):
            axes[0].plot(x, [r["vllm_tau"] for r in line], "o-", label=f"{epochs} epochs")
        for j in range(steps):
            acc = [(r["val_acc"] or [None] * steps)[j] for r in line]  # None: no validation sample
            axes[1 + j].plot(
                x, [float("nan") if a is None else a for a in acc], "o-", label=f"{epochs} epochs"
            )
    axes[0].set_title("vLLM tau (held-out prompts)")
    for j in range(steps):
        axes[1 + j].set_title(f"validation accuracy, TTT step {j}")
    for ax in axes:
        ax.set_xlabel("trained tokens (all epochs)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


@click.command(help=__doc__)
@click.option("--data", default="results/data_config.json", show_default=True, type=click.Path(exists=True))
@click.option("--vocab", default="results/vocab_map.pt", show_default=True, type=click.Path(exists=True))
@click.option("--prompts", default="results/prompts/heldout.jsonl", show_default=True)
@click.option("--config", "config_path", default="config.yaml", show_default=True, type=click.Path())
@click.option("--settings", "settings_json", default="{}", help="JSON overrides of train settings.")
@click.option("--fractions", default="0.25,0.5,1", show_default=True)
@click.option("--epochs", "epoch_list", default="1,3", show_default=True)
@click.option("--vllm/--no-vllm", default=True, show_default=True, help="Measure tau in vLLM.")
@click.option("--num-prompts", default=16, show_default=True)
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--num-draft-tokens", default=3, show_default=True)
@click.option("--out", default="results/bench/quality", show_default=True, type=click.Path(file_okay=False))
def main(**kw: Any) -> None:
    from draftsmith.train import TrainSettings, train

    values = settings_defaults("train")
    config_path = Path(kw["config_path"])
    if config_path.is_file():
        values.update((yaml.safe_load(config_path.read_text(encoding="utf-8")) or {}).get("train") or {})
    values.update(json.loads(kw["settings_json"]))
    values.pop("gpus", None)
    values["checkpoint_every"] = None
    out = Path(kw["out"])
    target = json.loads(Path(kw["data"]).read_text(encoding="utf-8"))["target"]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="draftsmith-quality-") as work:
        for fraction in _floats(kw["fractions"]):
            data = subset_manifest(
                Path(kw["data"]), fraction, values["val_fraction"], Path(work) / f"f{fraction}"
            )
            for epochs in [int(e) for e in _floats(kw["epoch_list"])]:
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
                tau = None
                if kw["vllm"]:
                    tau = vllm_tau(
                        target, run / "drafter", kw["prompts"], kw["num_prompts"], kw["max_new_tokens"],
                        kw["num_draft_tokens"],
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
                        "train_acc": summary["train_acc"],
                        "vllm_tau": tau,
                        "wall_s": round(time.perf_counter() - t0, 1),
                    }
                )
                r = rows[-1]
                acc = " / ".join(f"{a:.3f}" for a in r["val_acc"] or [] if a is not None)
                click.echo(
                    f"fraction {fraction} x {epochs} epochs: {r['trained_tokens']:,} tokens, val acc {acc}, "
                    f"tau {'-' if tau is None else f'{tau:.3f}'} ({r['wall_s']:.0f} s)"
                )
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "quality.json", {"data": kw["data"], "settings": values, "rows": rows})
    plot(rows, out / "quality.png")
    click.echo(f"wrote {out / 'quality.json'} and {out / 'quality.png'}")


if __name__ == "__main__":
    main()
