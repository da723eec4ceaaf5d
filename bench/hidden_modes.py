"""files vs stream vs hybrid at equal data (train.hidden_states): the same tokens, target, vocabulary and
training settings, each mode run through the real commands, per seed:

    files:  draftsmith extract (every shard) -> draftsmith manifest -> draftsmith train
    stream: draftsmith manifest --tokens -> draftsmith train (the train job captures every epoch)
    hybrid: draftsmith manifest --tokens --cache -> draftsmith train (epoch 0 captures and caches)

Per mode and seed: validation accuracy per TTT step (the last epoch's), wall seconds of the whole mode
and per epoch (files: extraction apart), bytes of states written (shards, or hybrid's cache, kept for
the count with --keep-hidden-cache), and each command's peak resident memory (its own, from wait4). The
table shows the mean over seeds with the seeds' range; accuracies are "equal" when the modes' ranges
overlap (the seeds' spread is the yardstick, not a test).

    python -m bench.hidden_modes --tokens RUN/results/tokens.safetensors --vocab RUN/results/vocab_map.pt \
        --target resources/SmolLM2-135M-Instruct --config config.yaml --seeds 0,1

Writes --out (default results/bench/hidden_modes.json).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from bench import harness
from draftsmith.core.config.config import section_from_file
from draftsmith.stages.extract import RESULT_KEYS

MODES = ("files", "stream", "hybrid")
# the extract settings that decide the shards' content (the stage's own list)
EXTRACT_KEYS = RESULT_KEYS
# the extract keys a stream manifest records (rules/extract.smk, stream_manifest), hybrid adds its codec
STREAM_KEYS = ["min_teacher_agreement", "aux_layers", "batch_tokens", "storage_dtype", "backend", "compile",
               "vllm_eager"]  # fmt: skip


def measured(command: list[str], log: Path) -> dict[str, float]:
    """Run one command (its output into `log`) -> its wall seconds and peak resident memory (MB), its
    own (wait4), not the bench's; a failure raises with the log's tail."""
    t0 = time.perf_counter()
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise click.ClickException(f"{' '.join(command[:3])} failed:\n{log.read_text()[-3000:]}")
    return {"seconds": seconds, "peak_rss_mb": usage.ru_maxrss / 1024}  # Linux: KiB


def run_mode(
    mode: str, work: Path, tokens: str, vocab: str, target: str, extract: dict, train: dict, dtype: str
) -> dict[str, Any]:
    """One mode end to end in `work` -> its record."""
    cli = [sys.executable, "-m", "draftsmith.cli"]
    log = work / "commands.log"
    tokens = str(shutil.copy(tokens, work / "tokens.safetensors"))  # a manifest's files lie in its folder
    steps: dict[str, dict[str, float]] = {}
    written = 0
    if mode == "files":
        num_shards = len(json.loads(_tokens_meta(tokens))["shards"])
        shards = [str(work / "hidden" / f"shard-{k}.safetensors") for k in range(num_shards)]
        steps["extract"] = measured(
            [*cli, "extract", "--target", target, "--tokens", tokens, "--dtype", dtype,
             "--settings", json.dumps({k: extract[k] for k in EXTRACT_KEYS}), *shards], log,
        )  # fmt: skip
        manifest = work / "data_config.json"
        steps["manifest"] = measured(
            [*cli, "manifest", "--target", target, "--out", str(manifest), "--settings",
             json.dumps({"min_teacher_agreement": extract["min_teacher_agreement"]}), *shards], log,
        )  # fmt: skip
        written = sum(Path(s).stat().st_size for s in shards)
    else:
        keys = STREAM_KEYS + (["codec", "zstd_level"] if mode == "hybrid" else [])
        manifest = work / "stream_config.json"
        steps["manifest"] = measured(
            [*cli, "manifest", "--target", target, "--tokens", tokens, "--out", str(manifest), "--dtype", dtype,
             "--settings", json.dumps({k: extract[k] for k in keys}), *(["--cache"] if mode == "hybrid" else [])],
            log,
        )  # fmt: skip
    settings = {**train, "hidden_states": "files" if mode == "files" else mode, "keep_hidden_cache": True}
    steps["train"] = measured(
        [*cli, "train", "--manifest", str(manifest), "--vocab", vocab, "--out", str(work / "drafter"),
         "--checkpoints", str(work / "checkpoints"), "--metrics", str(work / "metrics.jsonl"),
         "--settings", json.dumps(settings)], log,
    )  # fmt: skip
    summary = json.loads((work / "drafter" / "train_summary.json").read_text())
    if mode == "hybrid":
        written = sum(
            p.stat().st_size for p in (work / "checkpoints").glob("run-*/hidden/shard-*.safetensors")
        )
    epochs = max(1, summary["epochs_completed"])
    return {
        "val_acc": summary["val_acc"],
        "seconds": sum(s["seconds"] for s in steps.values()),
        "train_seconds_per_epoch": steps["train"]["seconds"] / epochs,
        "extract_seconds": steps.get("extract", {}).get("seconds", 0.0),
        "bytes_written": written,
        "peak_rss_mb": max(s["peak_rss_mb"] for s in steps.values()),
        "steps": steps,
        "hidden_states": summary["hidden_states"],
    }


def _tokens_meta(tokens: str) -> str:
    from draftsmith.core.data.tokens import load_tokens

    return json.dumps(load_tokens(tokens)[1])


def spread(values: list[float]) -> str:
    """mean [min, max] over seeds."""
    return f"{sum(values) / len(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


@click.command()
@click.option("--tokens", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--vocab", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--target", required=True, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    help="Its train/extract sections.",
)
@click.option("--seeds", default="0,1", show_default=True, help="train.seed values, comma-separated.")
@click.option(
    "--modes", default=",".join(MODES), show_default=True, help="The modes to run, comma-separated."
)
@click.option("--epochs", type=int, help="Override train.epochs.")
@click.option("--val-fraction", type=float, help="Override train.val_fraction (a small data set needs some).")
@click.option("--dtype", default="auto", show_default=True, help="target.dtype (the compute dtype).")
@click.option("--out", default=str(harness.result_path("hidden_modes")), show_default=True)
def main(tokens, vocab, target, config_path, seeds, modes, epochs, val_fraction, dtype, out) -> None:
    load_before = harness.load_average()
    every = section_from_file("extract", Path(config_path) if config_path else None)
    # the keys the extract rule passes (rules/extract.smk) and the manifests'
    extract = {k: every[k] for k in (*EXTRACT_KEYS, "min_teacher_agreement")}
    overrides = {"epochs": epochs} if epochs else {}
    if val_fraction is not None:
        overrides["val_fraction"] = val_fraction
    chosen = [m for m in MODES if m in modes.split(",")]
    if not chosen or set(modes.split(",")) - set(MODES):
        raise click.BadParameter(f"{modes!r}: the modes are {', '.join(MODES)}", param_hint="--modes")
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in chosen}
    seed_list = [int(s) for s in seeds.split(",")]
    for seed in seed_list:
        train = {**harness.base_settings(config_path, {**overrides, "seed": seed}), "threads": None}
        for mode in harness.round_order(chosen, seed):  # the order flips per seed
            with tempfile.TemporaryDirectory(prefix=f"hidden-{mode}-") as tmp:
                record = run_mode(mode, Path(tmp), tokens, vocab, target, extract, train, dtype)
            results[mode].append({"seed": seed, **record})
            print(f"seed {seed} {mode}: {record['seconds']:.1f} s, val acc {record['val_acc']}", flush=True)
    steps = len(results[chosen[0]][0]["val_acc"] or [])
    if not steps:
        raise click.ClickException("no validation samples: raise --val-fraction")
    columns = [("mode", "<7"), *[(f"val acc {j}", "<24") for j in range(steps)], ("s / epoch (train)", "<24"),
               ("extract s", ">9.1f"), ("MB written", ">10.1f"), ("peak MB", ">8.0f")]  # fmt: skip
    rows = []
    for mode in chosen:
        runs = results[mode]
        accs = [spread([r["val_acc"][j] for r in runs]) for j in range(steps)]
        rows.append([
            mode, *accs, spread([r["train_seconds_per_epoch"] for r in runs]),
            sum(r["extract_seconds"] for r in runs) / len(runs), sum(r["bytes_written"] for r in runs) / len(runs) / 1e6,
            max(r["peak_rss_mb"] for r in runs),
        ])  # fmt: skip
    print(f"equal data: {tokens}, seeds {seed_list} (mean [min, max] over seeds)")
    print(harness.format_table(columns, rows))
    harness.write_result(
        {"tokens": tokens, "seeds": seed_list, "modes": results, "machine": harness.machine(load_before)}, out
    )


if __name__ == "__main__":
    main()
