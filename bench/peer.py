"""draftsmith's trainer against SpecForge 0.2.0's, at equal data (issue 23, item 4).

\b
    python bench/peer.py [--data results/data_config.json] [--vocab results/vocab_map.pt]
                         [--config config.yaml] [--settings '{"epochs": 3}'] [--work results/bench/peer]
                         [--venv ~/.cache/draftsmith/peer-venv] [--skip-vllm] [--json results/bench/peer.json]
    python bench/peer.py --diff [--diff-samples 2] [--diff-max-len 256]   # the differential check only

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
             and the few packages its offline EAGLE-3 path imports. bench/peer_shim.py applies the CPU
             workarounds at run time; nothing in the side environment is edited.
  convert    the shards to SpecForge's offline format: one `data_NNNNN.ckpt` per sample (input_ids,
             loss_mask, aux_hidden_state [1, T, 3H] = the aux states concatenated, hidden_state [1, T, H]
             after the final norm, bf16), vocab_mapping.pt (d2t, t2d), a target folder with the target's
             config and tokenizer plus its lm_head and embedding behind a `*.index.json`, and a draft config
             (LlamaForCausalLMEagle3, draft_vocab_size from the vocab map, aux ids in SpecForge's "output of
             layer k" convention: draftsmith's "input" ids minus one, the same tensors).
  draftsmith `draftsmith.stages.train.train` with the run's settings.
  specforge  `specforge train` (through peer_shim.py) on the converted data, then its checkpoint loaded
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

import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch
import yaml
from torch import Tensor

from draftsmith.core.atomic import atomic_path, write_json
from draftsmith.core.config import section_from_file
from draftsmith.core.layers import convert_layer_ids
from draftsmith.core.loader import StreamingData, collate
from draftsmith.core.manifest import load_manifest
from draftsmith.core.shards import Sample
from draftsmith.core.speculate import target_forwards
from draftsmith.core.stats import paired_difference, ratio_of_sums

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/harness.py, also when loaded by path
import harness  # noqa: E402

SPECFORGE = "specforge==0.2.0"
# What SpecForge 0.2.0's offline EAGLE-3 training imports. Its other requirements serve online capture
# (sglang), GPUs (its CUDA torch 2.11, triton, flash attention, yunchang) and tracking (wandb, tensorboard).
SPECFORGE_DEPS = (
    "transformers==5.8.1",  # SpecForge's pin
    "accelerate",
    "datasets",
    "pydantic",
    "pyyaml",
    "safetensors",
    "huggingface-hub",
    "tqdm",
    "psutil",
    "numpy",
)
SHIM = Path(__file__).with_name("peer_shim.py")
# Last measured (issue 23): SpecForge on older shards, and draftsmith's estimate across two datasets
LAST_MEASURED = {"specforge": [0.240, 0.195, 0.175], "draftsmith_estimate": [0.257, 0.200, 0.143]}
TARGET_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja")  # fmt: skip
HEAD_FILE = "head.safetensors"


def log(msg: str) -> None:
    click.echo(f"[peer {time.strftime('%H:%M:%S')}] {msg}", err=True)


# --------------------------------------------------------------------------------------------- install


def pip(venv: Path, *args: str, capture: bool = False) -> subprocess.CompletedProcess:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=capture, text=True)
    if proc.returncode != 0:
        raise click.ClickException(
            f"{' '.join(cmd)} failed ({proc.returncode})" + (f":\n{proc.stderr[-3000:]}" if capture else "")
        )
    return proc


def would_install(dry_run_output: str) -> list[str]:
    """pip --dry-run's "Would install a-1 b-2" -> ["a-1", "b-2"]."""
    for line in dry_run_output.splitlines():
        if line.startswith("Would install "):
            return line[len("Would install ") :].split()
    return []


def cuda_packages(names: list[str]) -> list[str]:
    """The names among pip's "name-version" list that would bring CUDA or Triton along."""
    bad = ("nvidia-", "cuda-", "triton")
    return [n for n in names if n.lower().startswith(bad)]


def install(venv: Path, torch_spec: str) -> dict[str, Any]:
    """SpecForge 0.2.0 in its own venv on draftsmith's CPU torch; reused when it is there already."""
    marker = venv / "draftsmith-peer.json"
    if marker.is_file():
        info = json.loads(marker.read_text(encoding="utf-8"))
        if info.get("torch_spec") == torch_spec and info.get("specforge") == SPECFORGE:
            return info
    t0 = time.perf_counter()
    if not (venv / "bin" / "python").is_file():
        log(f"creating {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    deps = [torch_spec, *SPECFORGE_DEPS]
    plan = would_install(pip(venv, "install", "--dry-run", *deps, capture=True).stdout)
    if cuda_packages(plan):
        raise click.ClickException(
            f"installing {torch_spec} would bring {cuda_packages(plan)}: pass --torch with the path of a "
            "CPU torch wheel (draftsmith's venv was installed from one)"
        )
    log(f"installing into {venv}: {' '.join(plan) or 'nothing new'}")
    pip(venv, "install", "--quiet", *deps)
    pip(venv, "install", "--quiet", "--no-deps", SPECFORGE)
    check = subprocess.run([str(venv / "bin" / "python"), str(SHIM), "check"], capture_output=True, text=True)
    if check.returncode != 0:
        raise click.ClickException(f"SpecForge does not import in {venv}:\n{check.stderr[-3000:]}")
    info = {
        "venv": str(venv),
        "torch_spec": torch_spec,
        "specforge": SPECFORGE,
        "deps": list(SPECFORGE_DEPS),
        "installed": plan,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    write_json(marker, info)
    return info


def local_torch_spec() -> str:
    """draftsmith's own torch, as a requirement the local wheel satisfies (torch==2.13.0 for 2.13.0+cpu)."""
    return f"torch=={torch.__version__.split('+')[0]}"


# --------------------------------------------------------------------------------------------- convert


def specforge_sample(sample: Sample, loss_positions: str = "assistant") -> dict[str, Tensor]:
    """One sample in SpecForge's offline EAGLE-3 layout (`scripts/prepare_hidden_states.py`):
    input_ids [T] int64, loss_mask [T] int64 (ones on every token for loss_positions "all"),
    aux_hidden_state [1, T, A*H] (aux layers concatenated in id order), hidden_state [1, T, H] (the
    target's final state after its norm, what its lm_head reads), both in the stored dtype."""
    T, A, H = sample.aux.shape
    mask = torch.ones(T, dtype=torch.int64) if loss_positions == "all" else sample.loss_mask.to(torch.int64)
    return {
        "input_ids": sample.input_ids.to(torch.int64).clone(),
        "loss_mask": mask,
        "aux_hidden_state": sample.aux.reshape(1, T, A * H).clone(),
        "hidden_state": sample.final.reshape(1, T, H).clone(),
    }


def sample_from_specforge(raw: dict[str, Tensor], num_aux: int) -> Sample:
    """The inverse of `specforge_sample` (loss mask as bool): what the converter test round-trips."""
    _, T, AH = raw["aux_hidden_state"].shape
    return Sample(
        id="",
        input_ids=raw["input_ids"],
        loss_mask=raw["loss_mask"].bool(),
        aux=raw["aux_hidden_state"].reshape(T, num_aux, AH // num_aux),
        final=raw["hidden_state"].reshape(T, -1),
    )


def sample_file(folder: Path, i: int) -> Path:
    return folder / f"data_{i:05d}.ckpt"  # SpecForge lists feature files sorted by name


def write_samples(data: StreamingData, split: str, folder: Path, loss_positions: str) -> int:
    """Every sample of a split (draftsmith's split and truncation) as one .ckpt each, atomically."""
    refs = data.train if split == "train" else data.val
    for i in range(len(refs)):
        with atomic_path(sample_file(folder, i)) as tmp:
            torch.save(specforge_sample(data.sample(split, i), loss_positions), tmp)
    return len(refs)


def write_target_folder(target_dir: Path, out: Path) -> None:
    """What SpecForge reads of the target: its config and tokenizer, and lm_head + embedding behind a
    `model.safetensors.index.json` (it requires an index even for one file; a tied lm_head is written
    out as its own tensor)."""
    from safetensors.torch import save_file

    from draftsmith.core.target import load_target_head

    out.mkdir(parents=True, exist_ok=True)
    for name in TARGET_FILES:
        if (target_dir / name).is_file():
            shutil.copyfile(target_dir / name, out / name)
    head = load_target_head(target_dir)
    tensors = {"lm_head.weight": head.lm_head.clone(), "model.embed_tokens.weight": head.embed.clone()}
    with atomic_path(out / HEAD_FILE) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_json(
        out / "model.safetensors.index.json",
        {"metadata": {}, "weight_map": dict.fromkeys(tensors, HEAD_FILE)},
    )


def draft_config(
    target_config: dict[str, Any], draft_vocab_size: int, aux_ids_output: list[int]
) -> dict[str, Any]:
    """SpecForge's LlamaForCausalLMEagle3 config for this target, built as SpecForge builds one from a
    target (model_loading._generate_draft_config: the target's architecture fields, one layer, untied),
    with draftsmith's draft vocabulary size."""
    keep = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "max_position_embeddings", "rms_norm_eps", "hidden_act", "initializer_range", "attention_bias",
            "attention_dropout", "head_dim", "rope_theta", "rope_scaling", "rope_parameters",
            "bos_token_id", "eos_token_id", "pad_token_id")  # fmt: skip
    cfg = {k: target_config[k] for k in keep if target_config.get(k) is not None}
    cfg.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,
        use_cache=True,
        draft_vocab_size=int(draft_vocab_size),
        target_hidden_size=int(target_config["hidden_size"]),
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_ids_output), "use_aux_hidden_state": True},
    )
    cfg.setdefault("pad_token_id", 0)
    return cfg


def data_key(manifest: dict[str, Any], vocab_path: Path, settings: dict[str, Any]) -> str:
    """What the converted data depends on: the shards' content, the vocab map, and the split/truncation/
    positions settings."""
    h = hashlib.sha256()
    for shard in manifest["shards"]:
        h.update(str(shard.get("content_sha256") or shard["path"]).encode())
    h.update(hashlib.sha256(vocab_path.read_bytes()).hexdigest().encode())
    for k in ("max_seq_len", "val_fraction", "loss_positions", "seed"):
        h.update(f"{k}={settings[k]}".encode())
    return h.hexdigest()[:16]


def convert(
    manifest_path: Path, vocab_path: Path, settings: dict[str, Any], out: Path, fresh: bool
) -> dict[str, Any]:
    """This run's shards and vocabulary in SpecForge's offline format under out/ -> a summary."""
    from draftsmith.core.vocab import load_vocab_map
    from draftsmith.stages.train import TrainSettings

    manifest = load_manifest(manifest_path)
    key = data_key(manifest, vocab_path, settings)
    summary_path = out / "convert.json"
    if not fresh and summary_path.is_file() and json.loads(summary_path.read_text())["key"] == key:
        return json.loads(summary_path.read_text())
    t0 = time.perf_counter()
    for split in ("train", "val"):
        shutil.rmtree(out / split, ignore_errors=True)
    data = StreamingData.from_manifest(manifest, TrainSettings.from_dict(settings))
    counts = {s: write_samples(data, s, out / s, settings["loss_positions"]) for s in ("train", "val")}
    data.close()
    vocab = load_vocab_map(vocab_path)
    with atomic_path(out / "vocab_mapping.pt") as tmp:
        torch.save({"d2t": vocab["d2t"], "t2d": vocab["t2d"]}, tmp)
    target_dir = Path(manifest["target"])
    if not target_dir.is_absolute() and not target_dir.is_dir():
        target_dir = (manifest_path.parent.parent / target_dir).resolve()
    target_dir = target_dir.resolve()
    write_target_folder(target_dir, out / "target")
    ids_input = [int(i) for i in manifest["aux_layer_ids"]]
    ids_input = convert_layer_ids(ids_input, manifest.get("layer_convention", "input"), "input")
    ids_output = convert_layer_ids(ids_input, "input", "output")
    tcfg = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
    write_json(
        out / "draft_config.json",
        draft_config(tcfg.get("text_config", tcfg), vocab["d2t"].numel(), ids_output),
    )
    summary = {
        "key": key,
        "samples": counts,
        "tokens": {
            "train": sum(r.num_tokens for r in data.train),
            "val": sum(r.num_tokens for r in data.val),
        },
        "aux_layer_ids_input": ids_input,
        "aux_layer_ids_output": ids_output,
        "draft_vocab_size": int(vocab["d2t"].numel()),
        "loss_positions": settings["loss_positions"],
        "target": str(target_dir),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    write_json(summary_path, summary)
    return summary


# ------------------------------------------------------------------------------------------- settings


def draftsmith_steps(manifest_path: Path, settings: dict[str, Any]) -> tuple[int, int]:
    """(optimizer steps of draftsmith's whole run, training samples)."""
    from draftsmith.stages.train import TrainSettings

    data = StreamingData.from_manifest(load_manifest(manifest_path), TrainSettings.from_dict(settings))
    steps = sum(len(data.epoch_batches(e)) for e in range(settings["epochs"]))
    n = len(data.train)
    data.close()
    if settings.get("max_steps") is not None:
        steps = min(steps, settings["max_steps"])
    return steps, n


def specforge_plan(num_samples: int, epochs: int, steps: int) -> dict[str, int]:
    """Micro-batches of one sample, accumulated so that SpecForge makes as many optimizer steps as
    draftsmith: accumulation = round(samples * epochs / steps); the run stops at the last complete step."""
    accumulation = max(1, round(num_samples * epochs / max(1, steps)))
    return {"accumulation_steps": accumulation, "steps": (num_samples * epochs) // accumulation}


def specforge_run_config(
    conv_dir: Path, out_dir: Path, settings: dict[str, Any], plan: dict[str, int], dtype: str
) -> dict[str, Any]:
    """`specforge train`'s config: SpecForge's defaults except the equal-data knobs and the CPU ones."""
    return {
        "model": {
            "target_model_path": str(conv_dir / "target"),
            "draft_model_config": str(conv_dir / "draft_config.json"),
            "vocab_mapping_path": str(conv_dir / "vocab_mapping.pt"),
            "torch_dtype": dtype,
        },
        "data": {
            "hidden_states_path": str(conv_dir / "train"),
            "max_length": int(settings["max_seq_len"]),
            "dataloader_num_workers": 0,  # CPU
        },
        "training": {
            "num_epochs": int(settings["epochs"]),
            "batch_size": 1,
            "accumulation_steps": plan["accumulation_steps"],
            "max_steps": plan["steps"],
            "total_steps": plan["steps"],
            "learning_rate": float(settings["lr"]),
            "ttt_length": int(settings["ttt_steps"]),
            "attention_backend": "sdpa",  # CPU: flex attention has no CPU backward
            "fsdp_sharding": "NO_SHARD",  # CPU, one process
            "seed": int(settings["seed"]),
            "log_interval": 1,
        },
        "output_dir": str(out_dir),
        "run_id": "peer",
    }


# ---------------------------------------------------------------------------------------------- train


def side_env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the side environment must not see draftsmith's packages
    env["TORCH_COMPILE_DISABLE"] = "1"
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def draftsmith_code() -> str:
    """A digest of the draftsmith modules that decide training (the package on the import path)."""
    import draftsmith

    root = Path(draftsmith.__file__).parent
    h = hashlib.sha256()
    for name in (
        "stages/train.py",
        "core/objective.py",
        "core/optimizers.py",
        "core/drafter.py",
        "core/loader.py",
        "core/shards.py",
        "stages/vocab.py",
        "core/vocab.py",
    ):
        h.update((root / name).read_bytes())
    return h.hexdigest()[:16]


def train_draftsmith(
    manifest: Path, vocab: Path, settings: dict[str, Any], out: Path, fresh: bool
) -> dict[str, Any]:
    from draftsmith.stages.train import TrainSettings, train

    summary_path = out / "drafter" / "train_summary.json"
    key_path = out / "settings.json"
    settings = {**settings, "draftsmith_code": draftsmith_code()}  # a changed trainer retrains
    if (
        not fresh
        and summary_path.is_file()
        and key_path.is_file()
        and json.loads(key_path.read_text()) == settings
    ):
        return json.loads(summary_path.read_text())
    shutil.rmtree(out, ignore_errors=True)
    values = {k: v for k, v in settings.items() if k != "draftsmith_code"}
    summary = train(
        manifest, vocab, out / "drafter", out / "checkpoints", out / "metrics.jsonl",
        TrainSettings.from_dict(values), device="cpu", progress=False,
    )  # fmt: skip
    write_json(key_path, settings)
    return summary


def newest_specforge_state(out_dir: Path, run_id: str = "peer") -> Path:
    """The training_state.pt of SpecForge's newest checkpoint (`<output_dir>/<run_id>-latest`)."""
    path = out_dir / f"{run_id}-latest" / "training_state.pt"
    if not path.is_file():
        raise click.ClickException(f"SpecForge wrote no {path}")
    return path


def specforge_weights(state: dict[str, Any]) -> dict[str, Tensor]:
    """The draft weights of a SpecForge training_state.pt (`draft_state_dict`: the model's own dtype, what
    it deploys), under draftsmith's (= vLLM's) names, without the target's frozen embedding."""
    weights = state.get("draft_state_dict", state)
    return {
        name.removeprefix("module.").removeprefix("draft_model."): t
        for name, t in weights.items()
        if isinstance(t, Tensor) and "embed_tokens" not in name
    }


def finished_specforge_run(out: Path, cfg: dict[str, Any], plan: dict[str, int]) -> dict[str, Any] | None:
    """The summary of a SpecForge run under out/ with this config that reached its last step, else None
    (wall time: from its run.json to its final state)."""
    run_json, state = out / "run.json", out / "run" / "peer-latest" / "training_state.pt"
    if not (run_json.is_file() and state.is_file()) or json.loads(run_json.read_text()) != cfg:
        return None
    if int(torch.load(state, map_location="cpu", weights_only=False).get("global_step", -1)) != plan["steps"]:
        return None
    wall = state.stat().st_mtime - run_json.stat().st_mtime
    return {
        "config": cfg,
        "plan": plan,
        "state": str(state),
        "wall_s": round(wall, 1),
        "log": str(out / "train.log"),
    }


def train_specforge(
    venv: Path, conv_dir: Path, settings: dict[str, Any], plan: dict[str, int], dtype: str, threads: int | None,
    out: Path, fresh: bool,
) -> dict[str, Any]:  # fmt: skip
    cfg = specforge_run_config(conv_dir, out / "run", settings, plan, dtype)
    summary_path = out / "summary.json"
    if not fresh and summary_path.is_file() and json.loads(summary_path.read_text())["config"] == cfg:
        return json.loads(summary_path.read_text())
    done = finished_specforge_run(out, cfg, plan)
    if not fresh and done is not None:  # trained, but its summary was never written (the bench was stopped)
        write_json(summary_path, done)
        return done
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    write_json(out / "run.json", cfg)
    t0 = time.perf_counter()
    log_path = out / "train.log"
    with open(log_path, "w", encoding="utf-8") as fh:
        proc = subprocess.run(
            [str(venv / "bin" / "python"), str(SHIM), "train", "--config", str(out / "run.json")],
            stdout=fh, stderr=subprocess.STDOUT, env=side_env(threads), cwd=out,
        )  # fmt: skip
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise click.ClickException(f"SpecForge's training failed ({proc.returncode}); {log_path}:\n{tail}")
    state_path = newest_specforge_state(out / "run")
    summary = {
        "config": cfg,
        "plan": plan,
        "state": str(state_path),
        "wall_s": round(wall, 1),
        "log": str(log_path),
    }
    write_json(summary_path, summary)
    return summary


def import_specforge(
    state_path: Path, manifest_path: Path, vocab_path: Path, settings: dict[str, Any], out_dir: Path
) -> Path:
    """SpecForge's trained weights in draftsmith's drafter, exported as draftsmith exports its own."""
    from draftsmith.core.kinds import build_drafter
    from draftsmith.stages.train import TrainSettings, load_inputs, write_drafter

    manifest, vocab, target = load_inputs(manifest_path, vocab_path)
    s = TrainSettings.from_dict(settings)
    drafter, _, _ = build_drafter(target, vocab["d2t"], vocab["t2d"], int(manifest["num_aux"]), s, "cpu")
    weights = specforge_weights(torch.load(state_path, map_location="cpu", weights_only=False))
    drafter.load_state_dict(
        {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in weights.items()}
    )
    if not torch.equal(drafter.d2t, vocab["d2t"]) or not torch.equal(drafter.t2d, vocab["t2d"]):
        raise click.ClickException(f"{state_path}: its d2t/t2d are not {vocab_path}'s")
    summary = {"trainer": "SpecForge 0.2.0", "state": str(state_path)}
    write_drafter(drafter, out_dir, manifest, target.config, s, summary)
    return out_dir


# -------------------------------------------------------------------------------------------- evaluate


def validation(
    export_dir: Path, manifest_path: Path, vocab_path: Path, settings: dict[str, Any]
) -> dict[str, Any]:
    """draftsmith's evaluator on the validation split, sample by sample: `ttt_loss`'s stats in the view
    `train.validate` scores (`Objective.for_validation`: the inference view, the positions whose predicted
    token is an assistant token; float32) -> accuracy and agreement per TTT step, and each sample's counts
    for the paired interval."""
    from draftsmith.core.export_formats import load_drafter
    from draftsmith.core.objective import Objective, StepStats, ttt_loss
    from draftsmith.stages.train import TrainSettings, load_inputs

    manifest, vocab, target = load_inputs(manifest_path, vocab_path)
    s = TrainSettings.from_dict(settings)
    view = replace(Objective.from_settings(s, "cpu"), precision="fp32").for_validation()
    drafter, _ = load_drafter(export_dir)
    teacher = target.lm_head[torch.arange(vocab["d2t"].numel()) + vocab["d2t"]]
    data = StreamingData.from_manifest(manifest, s)
    total, per_sample = StepStats.zeros(s.ttt_steps), []
    with torch.no_grad():
        for i in range(len(data.val)):
            _, st = ttt_loss(drafter, target.embed, teacher, collate([data.sample("val", i)]), view)
            total.add(st)
            per_sample.append({"correct": st.correct, "agree": st.agree, "count": st.count})
    data.close()
    return {"acc": total.acc(), "agreement": total.agreement(), "step_loss": total.step_loss(),
            "positions": total.count, "samples": len(per_sample), "per_sample": per_sample}  # fmt: skip


def paired_acc_interval(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str = "correct",
                        resamples: int = 2000, seed: int = 0) -> list[list[float]]:  # fmt: skip
    """Per TTT step, the 95% percentile bootstrap interval of accuracy(a) - accuracy(b) over the same
    validation samples, resampled in pairs."""
    rng = random.Random(seed)
    n, steps = len(a), len(a[0]["count"])
    diffs: list[list[float]] = [[] for _ in range(steps)]
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        for j in range(steps):
            count = sum(a[i]["count"][j] for i in idx)
            if count:
                diffs[j].append((sum(a[i][key][j] for i in idx) - sum(b[i][key][j] for i in idx)) / count)
    out = []
    for d in diffs:
        d.sort()
        out.append([d[int(0.025 * len(d))], d[int(0.975 * len(d)) - 1]] if d else [math.nan, math.nan])
    return out


# ----------------------------------------------------------------------------------------------- vLLM


def heldout_sets(config_path: Path | None, manifest_path: Path) -> dict[str, Path]:
    """The run's held-out prompt files as the workflow resolves them (rules/common.smk), relative to the
    run's folder (the parent of results/); a set whose file is missing is left out, with a line."""
    import draftsmith

    cfg = (
        yaml.safe_load(config_path.read_text(encoding="utf-8"))
        if config_path and config_path.is_file()
        else {}
    )
    sets = ((cfg or {}).get("evaluate") or {}).get("heldout_sets") or {"split": "split"}
    run_dir = manifest_path.parent.parent
    out = {}
    for name, source in sets.items():
        if source == "split":
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
    """Output tokens per target forward over some prompts (draftsmith.core.speculate's count)."""
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
    (draftsmith.core.stats, as the gate computes it)."""
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


# ----------------------------------------------------------------------------------------------- diff


def teacher_in_vocab_mask(batch: Any, teacher_full: Tensor, t2d: Tensor, mask_offset: int) -> Tensor:
    """SpecForge trains a position only where the target's top-1 over the *whole* vocabulary is a draft
    token. As a loss mask for draftsmith's `ttt_step_targets`: loss_mask[s] is read for the prediction
    whose teacher is f_{s - mask_offset + 1}, so keep s where t2d[argmax lm_head(f_{s - mask_offset + 1})]."""
    B, T = batch.input_ids.shape
    top = (batch.final.float() @ teacher_full.T).argmax(-1)  # [B, T] the teacher's top-1 at each f_t
    in_vocab = t2d[top]  # [B, T] at f_t
    shift = 1 - mask_offset  # s = t + mask_offset - 1
    keep = torch.zeros(B, T, dtype=torch.bool)
    if shift >= 0:
        keep[:, : T - shift] = in_vocab[:, shift:]
    else:
        keep[:, -shift:] = in_vocab[:, : T + shift]
    return batch.loss_mask & keep


def per_depth_grads(
    drafter: Any, embed: Tensor, teacher: Tensor, batch: Any, objective: Any
) -> tuple[list[dict[str, Tensor]], list[float]]:
    """draftsmith's ttt_loss at depth 1..ttt_steps -> (the gradient of each depth's weighted loss, the
    per-step loss sums of the full depth)."""
    from draftsmith.core.objective import ttt_loss

    grads, sums = [], []
    for depth in range(1, objective.ttt_steps + 1):
        drafter.zero_grad(set_to_none=True)
        obj = replace(objective, ttt_steps=depth, step_weights=objective.step_weights[:depth])
        loss, stats = ttt_loss(drafter, embed, teacher, batch, obj)
        loss.backward()
        grads.append(
            {n: p.grad.detach().clone() for n, p in drafter.named_parameters() if p.grad is not None}
        )
        sums = stats.loss_sum
    return grads, sums


def step_grads(cumulative: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
    """Gradients of each TTT step's own weighted loss: depth d minus depth d-1."""
    return [
        {n: g - (cumulative[j - 1][n] if j else 0) for n, g in c.items()} for j, c in enumerate(cumulative)
    ]


def compare_grads(a: dict[str, Tensor], b: dict[str, Tensor]) -> dict[str, float]:
    """a against reference b: cosine, norm ratio, max relative element error (over all parameters)."""
    names = sorted(set(a) & set(b))
    va = torch.cat([a[n].double().flatten() for n in names])
    vb = torch.cat([b[n].double().flatten() for n in names])
    return {
        "cosine": float(torch.nn.functional.cosine_similarity(va, vb, dim=0)),
        "norm_ratio": float(va.norm() / vb.norm()),
        "max_abs_err_over_max": float((va - vb).abs().max() / vb.abs().max()),
    }


def init_stats(weights: dict[str, Tensor]) -> dict[str, dict[str, float]]:
    return {n: {"std": float(t.float().std()), "bound": float(t.float().abs().max())}
            for n, t in weights.items() if t.is_floating_point() and t.dim() == 2}  # fmt: skip


def run_diff(
    venv: Path, conv_dir: Path, manifest_path: Path, vocab_path: Path, settings: dict[str, Any],
    samples: int, max_len: int, threads: int | None, out: Path,
) -> dict[str, Any]:  # fmt: skip
    """The differential check (module docstring)."""
    from draftsmith.core.kinds import build_drafter
    from draftsmith.core.objective import Objective, ttt_loss
    from draftsmith.stages.train import TrainSettings, load_inputs

    out.mkdir(parents=True, exist_ok=True)
    s = TrainSettings.from_dict(settings)
    manifest, vocab, target = load_inputs(manifest_path, vocab_path)
    data = StreamingData.from_manifest(manifest, s)
    picked = [data.sample("train", i) for i in range(min(samples, len(data.train)))]
    data.close()
    picked = [
        Sample(x.id, x.input_ids[:max_len], x.loss_mask[:max_len], x.aux[:max_len], x.final[:max_len])
        for x in picked
    ]
    # SpecForge also trains the teacher of the last position (x_T does not exist; draftsmith needs the
    # real next token to score): the one position per step it has more is left out on both sides here
    # and named in the result instead.
    raw = []
    for x in picked:
        r = specforge_sample(x, s.loss_positions)
        r["loss_mask"][-2:] = 0
        for k in ("aux_hidden_state", "hidden_state"):  # float32 models on both sides (bf16 values are exact)
            r[k] = r[k].float()
        raw.append(r)
    cfg = specforge_run_config(
        conv_dir, out / "unused", settings, {"accumulation_steps": 1, "steps": 1}, "float32"
    )
    write_json(out / "run.json", cfg)
    torch.save({"samples": raw, "weights": None}, out / "diff_in.pt")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(venv / "bin" / "python"), str(SHIM), "diff", "--config", str(out / "run.json"),
         "--inputs", str(out / "diff_in.pt"), "--out", str(out / "diff_out.pt")],
        capture_output=True, text=True, env=side_env(threads), cwd=out,
    )  # fmt: skip
    if proc.returncode != 0:
        raise click.ClickException(f"SpecForge's side of the diff failed:\n{proc.stderr[-4000:]}")
    specforge_side_s = time.perf_counter() - t0
    sf = torch.load(out / "diff_out.pt", map_location="cpu", weights_only=False)
    ttt = int(sf["ttt_steps"])
    drafter, embed, teacher = build_drafter(
        target, vocab["d2t"], vocab["t2d"], int(manifest["num_aux"]), s, "cpu"
    )
    # draftsmith's objective in float32 on the loss mask given (each sample's own, as SpecForge gets it)
    base = replace(
        Objective.from_settings(s, "cpu"),
        precision="fp32",
        loss_positions="assistant",
        noise_std=0.0,
        lk_loss="none",
    )
    own_init = init_stats({n: p.detach() for n, p in drafter.named_parameters()})
    drafter.load_state_dict({**drafter.state_dict(), **sf["initial"]})
    drafter.float()
    teacher_full = target.lm_head
    variants: dict[str, dict[str, Any]] = {
        # draftsmith set to SpecForge's conventions + SpecForge's teacher-in-vocabulary filter: must agree
        "specforge_conventions": {"mask_offset": 0, "loss_norm": "sample", "filter": True},
        # each known difference alone, from SpecForge's conventions
        "no_vocab_filter": {"mask_offset": 0, "loss_norm": "sample", "filter": False},
        "mask_offset_2": {"mask_offset": 2, "loss_norm": "sample", "filter": True},
        "position_norm": {"mask_offset": 0, "loss_norm": "position", "filter": True},
        # what draftsmith trains with (its settings)
        "draftsmith_settings": {
            "mask_offset": s.mask_offset,
            "loss_norm": s.loss_norm,
            "filter": False,
            "ttt_prefix": s.ttt_prefix,
            "ttt_positions": s.ttt_positions,
        },  # fmt: skip
    }
    rows: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for i, x in enumerate(picked):
        ref_depths = sf["samples"][i]
        ref_steps = step_grads([d["grads"] for d in ref_depths])
        ref_loss = ref_depths[-1]["plosses"]  # per step: masked CE sum / T
        T = x.num_tokens
        mask = raw[i]["loss_mask"].bool()
        for name, v in variants.items():
            batch = collate([Sample(x.id, x.input_ids, mask, x.aux, x.final)])
            if v["filter"]:
                batch = replace(
                    batch,
                    loss_mask=teacher_in_vocab_mask(batch, teacher_full, vocab["t2d"], v["mask_offset"]),
                )
            kw = {k: v[k] for k in ("mask_offset", "loss_norm", "ttt_prefix", "ttt_positions") if k in v}
            cum, sums = per_depth_grads(drafter, embed, teacher, batch, replace(base, **kw))
            steps = step_grads(cum)
            rows[name].append({
                "sample": i, "tokens": T,
                "loss_per_step": [sm / T for sm in sums], "specforge_loss_per_step": ref_loss,
                "grad_per_step": [compare_grads(steps[j], ref_steps[j]) for j in range(ttt)],
                "grad_total": compare_grads(cum[-1], ref_depths[-1]["grads"]),
            })  # fmt: skip
    # One optimizer step's gradient over all the samples: SpecForge accumulates one sample per micro-batch
    # (each loss divided by the accumulation count); draftsmith pads them into one batch.
    ref_batch = {n: sum(sf["samples"][i][-1]["grads"][n] for i in range(len(picked))) / len(picked)
                 for n in sf["samples"][0][-1]["grads"]}  # fmt: skip
    batch_rows = {}
    for name, v in variants.items():
        batch = collate(
            [
                Sample(x.id, x.input_ids, raw[i]["loss_mask"].bool(), x.aux, x.final)
                for i, x in enumerate(picked)
            ]
        )
        if v["filter"]:
            batch = replace(
                batch, loss_mask=teacher_in_vocab_mask(batch, teacher_full, vocab["t2d"], v["mask_offset"])
            )
        kw = {k: v[k] for k in ("mask_offset", "loss_norm", "ttt_prefix", "ttt_positions") if k in v}
        drafter.zero_grad(set_to_none=True)
        loss, _ = ttt_loss(drafter, embed, teacher, batch, replace(base, **kw))
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in drafter.named_parameters() if p.grad is not None}
        batch_rows[name] = compare_grads(grads, ref_batch)
    summary = {"samples": len(picked), "max_len": max_len, "ttt_steps": ttt, "variants": {},
               "batch_gradient": batch_rows, "specforge_side_s": round(specforge_side_s, 1)}  # fmt: skip
    for name, rs in rows.items():
        summary["variants"][name] = {
            "changes": variants[name],
            "loss_rel_err_per_step": [
                max(
                    abs(r["loss_per_step"][j] - r["specforge_loss_per_step"][j])
                    / max(abs(r["specforge_loss_per_step"][j]), 1e-12)
                    for r in rs
                )
                for j in range(ttt)
            ],  # fmt: skip
            "grad_cosine_per_step": [min(r["grad_per_step"][j]["cosine"] for r in rs) for j in range(ttt)],
            "grad_norm_ratio_per_step": [
                sum(r["grad_per_step"][j]["norm_ratio"] for r in rs) / len(rs) for j in range(ttt)
            ],
            "grad_max_err_per_step": [
                max(r["grad_per_step"][j]["max_abs_err_over_max"] for r in rs) for j in range(ttt)
            ],
            "rows": rs,
        }
    summary["init"] = {"specforge": init_stats(sf["initial"]), "draftsmith_" + s.layer_init: own_init}
    summary["named_elsewhere"] = {
        "last_position": "SpecForge also trains each step's last teacher position (f_{T-1}, whose next token "
        "is not in the data): one position per sample per step more than draftsmith; left out here",
        "teacher_bf16": "SpecForge's target head (teacher logits) runs in bf16; float32 on both sides here",
    }
    write_json(out / "diff.json", summary)
    return summary


def diff_table(d: dict[str, Any]) -> str:
    lines = [f"differential check: {d['samples']} samples of <= {d['max_len']} tokens, same initial weights "
             "(SpecForge's), float32; per TTT step, against SpecForge's own step:",
             f"{'variant':<24} {'loss rel. err':<26} {'grad cosine (min)':<26} {'grad norm ratio':<26}"]  # fmt: skip
    fmt = lambda xs, f: " / ".join(f.format(x) for x in xs)  # noqa: E731
    for name, v in d["variants"].items():
        lines.append(
            f"{name:<24} {fmt(v['loss_rel_err_per_step'], '{:.1e}'):<26} "
            f"{fmt(v['grad_cosine_per_step'], '{:.5f}'):<26} {fmt(v['grad_norm_ratio_per_step'], '{:.4f}'):<26}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- main


def fmt_acc(xs: list[float | None] | None) -> str:
    return " / ".join("  -  " if x is None else f"{x:.3f}" for x in (xs or []))


def table(result: dict[str, Any]) -> str:
    """The peer table: validation accuracy per TTT step (and each drafter's paired difference from
    SpecForge's), then tokens per target forward in vLLM per held-out set."""
    lines = ["drafter                val acc per TTT step     agreement per TTT step   train wall s",
             "---------------------  -----------------------  -----------------------  ------------"]  # fmt: skip
    for name, r in result["trainers"].items():
        v = r.get("validation") or {}
        wall = f"{r['wall_s']:>12.0f}" if r.get("wall_s") is not None else f"{'-':>12}"
        lines.append(f"{name:<21}  {fmt_acc(v.get('acc')):<23}  {fmt_acc(v.get('agreement')):<23}  {wall}")
    for name, d in (result.get("validation_difference") or {}).items():
        iv = " / ".join(
            f"{x:+.3f} [{lo:+.3f}, {hi:+.3f}]"
            for x, (lo, hi) in zip(d["acc"], d["acc_interval95"], strict=True)
        )
        lines.append(f"{name} - specforge, val acc per TTT step [95% paired interval]: {iv}")
    lines.append(f"(last measured: SpecForge {fmt_acc(LAST_MEASURED['specforge'])}, "
                 f"draftsmith estimate {fmt_acc(LAST_MEASURED['draftsmith_estimate'])})")  # fmt: skip
    for set_name, row in (result.get("vllm") or {}).items():
        lines.append(f"vLLM, {set_name} ({row['num_prompts']} prompts, {row['tokens']} tokens), k = "
                     f"{result['vllm_settings']['num_draft_tokens']}: tokens per target forward (tau)")  # fmt: skip
        for label, e in row["drafters"].items():
            diff = ""
            if "interval95" in e:
                lo, hi = e["interval95"]
                diff = f"   {e['minus_specforge']:+.3f} [{lo:+.3f}, {hi:+.3f}] vs specforge"
            lines.append(f"  {label:<21} {e['tokens_per_forward']:.3f} ({e['tau']:.3f}){diff}")
    return "\n".join(lines)


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
    result["install"] = install(venv_dir, torch_spec or local_torch_spec())
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
        measured = vllm_measure(str(result["convert"]["target"]), exports, heldout_sets(config, data_path), ev,
                                work_dir / "vllm", reuse, fresh)  # fmt: skip
        result["vllm"] = vllm_table_rows(measured)
    result["wall_s"], result["machine"] = round(time.perf_counter() - t_start, 1), harness.machine(load_start)
    result["load_avg_end"] = result["machine"]["load_average"]["after"]
    click.echo(table(result))
    harness.write_result(result, json_path, click.echo)


if __name__ == "__main__":
    main()
