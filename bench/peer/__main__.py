"""draftsmith's trainer against SpecForge 0.2.0's, at equal data (issue 23, item 4).

\b
    python -m bench.peer [--data results/data_config.json] [--vocab results/vocab_map.pt]
                         [--config config.yaml] [--settings '{"epochs": 3}'] [--work results/bench/peer]
                         [--venv ~/.cache/draftsmith/peer-venv] [--skip-vllm] [--json results/bench/peer.json]
    python -m bench.peer --diff [--diff-samples 2] [--diff-max-len 256]   # the differential check only

Both trainers get the same training samples (draftsmith's split of this run's shards, truncated to
train.max_seq_len), the same epochs, learning rate, TTT steps, draft vocabulary (vocab_map.pt) and the
same positions to learn (train.loss_positions: "all" gives SpecForge a loss mask of ones); the optimizer
step counts match (SpecForge trains one sample per micro-batch and accumulates the gradients of as many
samples as draftsmith's token-packed batches hold on average). Everything else is each trainer's own
default: draftsmith's settings are the run's (schema < --config's `train` < --settings), SpecForge's its
schema's (bf16 weights with fp32 masters, AdamW (0.9, 0.999), cosine to 0 after 1.5% warm-up, clip 0.5).

Stages, each kept in --work and reused by a rerun with the same inputs (--fresh redoes them):

\b
  install    SpecForge's side environment (--venv): draftsmith's own CPU torch wheel from the local pip
             find-links (checked with `pip install --dry-run`: no CUDA package may come along), then
             `specforge==0.2.0` without its GPU/online requirements (sglang, triton, wandb, its CUDA torch)
             and the few packages its offline EAGLE-3 path imports. bench/peer/shim.py applies the CPU
             workarounds at run time; nothing in the side environment is edited.
  convert    the shards to SpecForge's offline format: one `data_NNNNN.ckpt` per sample (input_ids,
             loss_mask, aux_hidden_state [1, T, 3H] = the aux states concatenated, hidden_state [1, T, H]
             after the final norm, bf16), vocab_mapping.pt (d2t, t2d), a target folder with the target's
             config and tokenizer plus its lm_head and embedding behind a `*.index.json`, and a draft config
             (LlamaForCausalLMEagle3, draft_vocab_size from the vocab map, aux ids in SpecForge's "output of
             layer k" convention: draftsmith's "input" ids minus one, the same tensors).
  draftsmith `draftsmith.stages.train.train` with the run's settings.
  specforge  `specforge train` (through bench/peer/shim.py) on the converted data, then its checkpoint loaded
             into draftsmith's drafter (the weight names are the same: fc, midlayer.*, norm, lm_head, d2t,
             t2d) and exported exactly like draftsmith's own.
  evaluate   validation accuracy (the drafter's top-1 = the data's next token) and agreement (= the
             target's top-1 over the draft vocabulary) per TTT step of both exports, scored by draftsmith's
             evaluator (`ttt_loss`'s stats, as `train.evaluate` scores validation; float32) on the same
             validation samples and positions, with 95% paired bootstrap intervals of the differences.
  vllm       every export in real vLLM through `draftsmith evaluate-vllm`'s library call (plain decoding
             once, then one engine per drafter, the run's held-out sets in one batch, greedy, k as the run
             evaluates): tokens per target forward = generated / (generated - accepted) with a 95% paired
             bootstrap interval of each drafter's difference from SpecForge's, and vLLM's tau beside it.

--also NAME=EXPORT adds drafters (e.g. draftsmith trained with a proposed change) to the evaluate and vllm
stages; --specforge-from reuses a previous --work's SpecForge drafter and its vLLM measurement.

--diff: the differential check. The same initial weights (SpecForge's own initialisation, read from its
side) and the same samples through both trainers, in float32: SpecForge's `Eagle3TrainStrategy.forward_loss`
(its model, TTT loop and loss) in the side environment, draftsmith's `ttt_loss` here; per TTT step the
loss and the gradient of every parameter are compared, first with draftsmith set to SpecForge's
conventions (which must agree to float32 rounding: a disagreement there is an unnamed difference), then
each known difference alone, measured as the cosine and norm ratio of its per-step gradient to SpecForge's.

Machine load matters for the wall times: run it `nice`d and read them as the conditions they ran under
(the JSON records the load averages at start and end, and the machine: bench/harness.py).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import click

# This file runs the stages in order; each stage is its own module beside it: peer_install, peer_convert,
# peer_train (both trainers), peer_validate (evaluate), peer_vllm, peer_diff, and peer_report (the table).
from bench import harness
from bench.peer.convert import convert
from bench.peer.diff import diff_table, run_diff
from bench.peer.install import install, local_torch_spec
from bench.peer.report import table
from bench.peer.train import (
    draftsmith_steps,
    import_specforge,
    specforge_plan,
    train_draftsmith,
    train_specforge,
)
from bench.peer.validate import paired_acc_interval, validation
from bench.peer.vllm import eval_settings, heldout_sets, vllm_measure, vllm_table_rows


def log(msg: str) -> None:
    click.echo(f"[peer {time.strftime('%H:%M:%S')}] {msg}", err=True)


@click.command(help=__doc__)
@click.option(
    "--data",
    default="results/data_config.json",
    show_default=True,
    type=click.Path(exists=True, dir_okay=False),
)
@click.option(
    "--vocab", default="results/vocab_map.pt", show_default=True, type=click.Path(exists=True, dir_okay=False)
)
@click.option(
    "--config",
    "config_path",
    default="config.yaml",
    show_default=True,
    type=click.Path(),
    help="The run's config: its `train` settings for both trainers, its held-out sets and evaluate settings for vLLM.",
)
@click.option(
    "--settings", "settings_json", default="{}", help="JSON overrides of the train settings (both trainers)."
)
@click.option(
    "--work",
    default="results/bench/peer",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Where converted data, both trainers' outputs and the vLLM results are kept (and reused).",
)
@click.option(
    "--venv",
    default=str(Path.home() / ".cache" / "draftsmith" / "peer-venv"),
    show_default=True,
    type=click.Path(file_okay=False),
    help="SpecForge's side environment (created if missing).",
)
@click.option(
    "--torch",
    "torch_spec",
    default=None,
    help="torch requirement or wheel path for the side environment [default: draftsmith's own version, from the local find-links].",
)
@click.option(
    "--specforge-dtype",
    type=click.Choice(["bfloat16", "float32"]),
    default="bfloat16",
    show_default=True,
    help="SpecForge's model.torch_dtype (its default bf16 weights with fp32 masters).",
)
@click.option("--threads", type=int, default=None, help="torch threads of each training (default: torch's).")
@click.option("--skip-vllm", is_flag=True, help="Skip the vLLM measurement.")
@click.option(
    "--vllm-prompts",
    type=int,
    default=None,
    help="First N prompts of each held-out set in vLLM [default: the config's evaluate.num_prompts].",
)
@click.option(
    "--diff", "diff_only", is_flag=True, help="Run the differential check only (after install + convert)."
)
@click.option(
    "--diff-samples", default=2, show_default=True, help="Training samples the differential check runs."
)
@click.option("--diff-max-len", default=256, show_default=True, help="Tokens of each, at most.")
@click.option(
    "--also",
    multiple=True,
    metavar="NAME=EXPORT",
    help="Another drafter export (e.g. draftsmith trained with a proposed change) scored beside the two "
    "by the same evaluator and in the same vLLM batch. Repeatable.",
)
@click.option("--fresh", is_flag=True, help="Redo every stage instead of reusing --work.")
@click.option(
    "--specforge-from",
    type=click.Path(file_okay=False, exists=True),
    help="A previous --work whose trained SpecForge drafter to reuse (e.g. to compare a changed draftsmith).",
)
@click.option("--json", "json_path", default=str(harness.result_path("peer")), show_default=True)
def main(
    data: str, vocab: str, config_path: str, settings_json: str, work: str, venv: str, torch_spec: str | None,
    specforge_dtype: str, threads: int | None, skip_vllm: bool, diff_only: bool, diff_samples: int,
    diff_max_len: int, vllm_prompts: int | None, also: tuple[str, ...], fresh: bool, specforge_from: str | None,
    json_path: str,
) -> None:  # fmt: skip
    t_start, load_start = time.perf_counter(), harness.load_average()
    # absolute: SpecForge runs in its own working directory
    data_path, vocab_path = Path(data).resolve(), Path(vocab).resolve()
    work_dir, venv_dir = Path(work).resolve(), Path(venv).expanduser().resolve()
    config = Path(config_path) if config_path else None
    settings = harness.base_settings(
        config, {**json.loads(settings_json), "threads": threads, "checkpoint_every": 0}
    )
    result: dict[str, Any] = {"data": str(data_path), "vocab": str(vocab_path), "settings": settings,
                              "load_avg_start": load_start, "nproc": os.cpu_count()}  # fmt: skip
    result["install"] = install(venv_dir, torch_spec or local_torch_spec(), log)
    log("converting the shards to SpecForge's offline format")
    result["convert"] = convert(data_path, vocab_path, settings, work_dir / "specforge-data", fresh)
    if diff_only:
        d = run_diff(venv_dir, work_dir / "specforge-data", data_path, vocab_path, settings, diff_samples, diff_max_len,
                     threads, work_dir / "diff")  # fmt: skip
        click.echo(diff_table(d))
        harness.write_result(d, Path(json_path).with_name(Path(json_path).stem + "-diff.json"), click.echo)
        return
    steps, n_train = draftsmith_steps(data_path, settings)
    plan = specforge_plan(n_train, int(settings["epochs"]), steps)
    log(f"{n_train} training samples, {settings['epochs']} epochs: draftsmith {steps} optimizer steps, SpecForge "
        f"{plan['steps']} of {plan['accumulation_steps']} accumulated samples")  # fmt: skip
    result["trainers"] = {}
    t0 = time.perf_counter()
    log("training draftsmith")
    ds = train_draftsmith(data_path, vocab_path, settings, work_dir / "draftsmith", fresh)
    result["trainers"]["draftsmith"] = {"summary": {k: ds.get(k) for k in ("steps", "val_acc", "val_agreement",
                                        "train_acc", "tokens_per_s", "wall_s", "trained_tokens")},
                                        "wall_s": ds.get("wall_s", time.perf_counter() - t0),
                                        "export": str(work_dir / "draftsmith" / "drafter")}  # fmt: skip
    sf_work = Path(specforge_from) / "specforge" if specforge_from else work_dir / "specforge"
    if specforge_from:
        log(f"SpecForge's drafter from {sf_work} (not retrained)")
        sf = json.loads((sf_work / "summary.json").read_text(encoding="utf-8"))
        if sf["plan"] != plan:
            raise click.ClickException(f"{sf_work} trained another plan ({sf['plan']}, here {plan})")
    else:
        log("training SpecForge")
        sf = train_specforge(venv_dir, work_dir / "specforge-data", settings, plan, specforge_dtype, threads,
                             sf_work, fresh)  # fmt: skip
    sf_export = import_specforge(Path(sf["state"]), data_path, vocab_path, settings, sf_work / "drafter")
    result["trainers"]["specforge"] = {
        "plan": plan,
        "wall_s": sf["wall_s"],
        "export": str(sf_export),
        "log": sf["log"],
    }
    for item in also:
        name, _, path = item.partition("=")
        if not path or not (Path(path) / "model.safetensors").is_file():
            raise click.BadParameter(f"{item!r}: expected NAME=EXPORT_FOLDER", param_hint="--also")
        result["trainers"][name] = {"export": str(Path(path).resolve()), "wall_s": None}
    log("validation accuracy of every drafter, by draftsmith's evaluator")
    for r in result["trainers"].values():
        r["validation"] = validation(Path(r["export"]), data_path, vocab_path, settings)
    ref = result["trainers"]["specforge"]["validation"]
    result["validation_difference"] = {}
    for name, r in result["trainers"].items():
        if name == "specforge":
            continue
        v = r["validation"]
        result["validation_difference"][name] = {
            "acc": [a - b for a, b in zip(v["acc"], ref["acc"], strict=True)],
            "acc_interval95": paired_acc_interval(v["per_sample"], ref["per_sample"], "correct"),
            "agreement": [a - b for a, b in zip(v["agreement"], ref["agreement"], strict=True)],
            "agreement_interval95": paired_acc_interval(v["per_sample"], ref["per_sample"], "agree"),
        }
    result["beats_specforge_per_step"] = [
        a >= b for a, b in zip(result["trainers"]["draftsmith"]["validation"]["acc"], ref["acc"], strict=True)
    ]
    if not skip_vllm:
        log("every drafter in vLLM")
        ev = eval_settings(config)
        if vllm_prompts is not None:
            ev["num_prompts"], ev["set_num_prompts"] = vllm_prompts, None
        result["vllm_settings"] = {k: ev[k] for k in ("num_prompts", "max_new_tokens", "num_draft_tokens")}
        exports = {n: Path(r["export"]) for n, r in result["trainers"].items()}
        reuse = [Path(specforge_from).resolve() / "vllm"] if specforge_from else []
        measured = vllm_measure(str(result["convert"]["target"]), exports, heldout_sets(config, data_path, log), ev,
                                work_dir / "vllm", reuse, fresh)  # fmt: skip
        result["vllm"] = vllm_table_rows(measured)
    result["wall_s"], result["machine"] = round(time.perf_counter() - t_start, 1), harness.machine(load_start)
    result["load_avg_end"] = result["machine"]["load_average"]["after"]
    click.echo(table(result))
    harness.write_result(result, json_path, click.echo)


if __name__ == "__main__":
    main()
