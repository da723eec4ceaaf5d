"""The GPU half of `make gpu-check` (scripts/gpu-check.sh installs the `gpu` extra, then runs this with it).

Runs the workflow on one GPU with tests/config.tiny.yaml and an overlay (OVERLAY): the GPU back-ends
(vLLM server generation, vLLM extraction, bf16 training, vLLM evaluation with CUDA graphs), a little more
data and training than the tiny config's, and a gate that judges what a tiny target can show (GATE).
Then prints what ran where and what it measured. Exit status: 0 when every stage ran and the gate
passed, else 1 (also without CUDA).
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU_STAGES = ("generate", "extract", "train", "evaluate")
# What the gate can judge on a 135M target's drafter trained for a minute: that it learned (it yields more
# tokens per target forward than the untrained drafter, which accepts nearly nothing), besides the
# contract checks that always block (offline decoding = vLLM's: tau_gap; the teacher's agreement; the
# export) and the lossless check of the offline decoder (a failed job). Not speed: a 135M target decodes
# so fast on a GPU that verifying drafts costs more than it saves, and such a drafter is not expected to
# beat the free methods at a serving point (beats_free, speed again: warn). Every check of evaluate.gate is
# named here; a check added to the schema must be added too (tests/unit/test_gpu_check.py fails until it is).
GATE = {"beats_untrained": "block", "beats_free": "warn", "speedup": "warn"}
# On top of tests/config.tiny.yaml: every GPU stage on one GPU through vLLM, as served. Its data and training
# were tried on a 2-core CPU with the CPU back-ends in their place (transformers generation and extraction,
# fp32, offline judging, 2026-12-02): 51 training conversations, 36 steps, and on the 8 held-out prompts
# 1.113 vs the untrained drafter's 1.000 tokens per target forward, difference [+0.076, +0.160]: beats_untrained
# passed with room. Not yet run on a GPU.
OVERLAY = {
    "target": {"dtype": "auto"},  # bfloat16 on a GPU
    # every built-in prompt (seconds to generate on a GPU); 8 held out, so that beats_untrained's interval
    # does not hang on whether one of 2 prompts happened to accept a draft
    "prompts": {"max_prompts": 61, "num_heldout": 8},
    "generate": {"backend": "vllm-server", "server_args": ["--max-model-len", "2048"]},  # CUDA graphs
    "extract": {"backend": "vllm", "vllm_eager": False, "num_shards": 1},  # one vLLM start
    # every epoch (the tiny config stops after 8 steps), smaller batches, a one-layer drafter's rate:
    # still seconds on a GPU
    "train": {
        "precision": "bf16",
        "max_steps": None,
        "epochs": 6,
        "batch_tokens": 1024,
        "lr": 0.003,
        "ttt_steps": 3,
    },  # every draft position evaluated (num_draft_tokens) is trained
    "evaluate": {"vllm": True, "vllm_eager": None, "num_prompts": 0, "max_new_tokens": 48, "gate": GATE},
    "resources": {stage: {"gpus": 1} for stage in GPU_STAGES},
}
TIMED = ("target", "prompts", "generate", "tokenize", "extract", "manifest", "vocab",
         "train", "untrained_drafter", "evaluate_offline/heldout", "evaluate_vllm", "eval_summary", "gate",
         "export")  # fmt: skip


def versions() -> str:
    import torch

    names = ("vllm", "torch", "transformers", "snakemake")
    have = []
    for name in names:
        try:
            have.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            have.append(f"{name} missing")
    return ", ".join(have) + f" (CUDA {torch.version.cuda})"


def gpu_line() -> str:
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    try:
        proc = subprocess.run(query, capture_output=True, text=True)
    except OSError:
        return "?"
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else "?"


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def stage_rows(run: Path) -> list[tuple[str, str, str]]:
    """(stage, wall seconds, the devices `draftsmith run` gave it) of each stage that ran."""
    rows = []
    for stage in TIMED:
        bench = run / "benchmarks" / f"{stage}.tsv"
        if not bench.is_file():
            continue
        seconds = next(csv.DictReader(bench.open(), delimiter="\t"))["s"]
        log = run / "logs" / f"{stage}.log"
        text = log.read_text(errors="replace") if log.is_file() else ""
        given = re.search(r"draftsmith run: (CUDA_VISIBLE_DEVICES=\S*)", text)
        rows.append((stage, f"{float(seconds):.0f}", given.group(1) if given else "-"))
    return rows


def table(run: Path, install: str, seconds: float, code: int) -> str:
    results = run / "results"
    vllm = read_json(results / "eval" / "heldout" / "vllm.json")
    train = (read_json(results / "drafter" / "config.json").get("draftsmith") or {}).get("training") or {}
    summary = read_json(results / "eval" / "summary.json")
    manifest = read_json(results / "data_config.json")
    lines = [
        "draftsmith GPU check",
        f"  GPU          {gpu_line()}",
        f"  stack        {versions()}",
        f"  install      {install}",
        f"  workflow     {'finished' if code == 0 else f'FAILED (snakemake exit {code})'} in {seconds:.0f} s",
        f"  vLLM eval    device {vllm.get('device', '?')}, {vllm.get('engine', '?')}",
        f"  training     {train.get('settings', {}).get('precision', '?')} on "
        f"{train.get('summary', {}).get('device', '?')}, {train.get('summary', {}).get('steps', '?')} steps, "
        f"{train.get('summary', {}).get('tokens_per_s') or 0:.0f} tokens/s",
        f"  teacher      agreement {manifest.get('teacher_agreement', '?')} (extraction through vLLM)",
        "",
        f"  {'stage':<24}{'wall s':>8}  devices",
        *(f"  {stage:<24}{secs:>8}  {devices}" for stage, secs, devices in stage_rows(run)),
        "",
        f"  {'method':<26}{'measured by':<13}{'tokens/forward':>15}  {'95% interval':<17}{'tau':>7}{'speedup':>9}",
    ]
    for row in summary.get("rows", []):
        interval = row.get("tokens_per_forward_interval")
        iv = f"[{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""
        per_forward = f"{row['tokens_per_forward']:.3f}" if row.get("tokens_per_forward") is not None else "-"
        tau = f"{row['tau']:.3f}" if row.get("tau") is not None else "-"
        by = row.get("measured_by") or row.get("engine") or "?"
        lines.append(
            f"  {row['method']:<26}{by:<13}{per_forward:>15}  {iv:<17}{tau:>7}{row.get('speedup') or 0:>9.2f}"
        )
    verdict = summary.get("verdict") or {}
    if verdict:
        lines += ["", f"  verdict      {verdict.get('action')} (deploy: {verdict.get('deploy')})"]
    return "\n".join(lines)


def write_overlay(out: Path) -> Path:
    """OVERLAY as the config file the run is given."""
    overlay = out / "gpu.yaml"
    overlay.write_text(json.dumps(OVERLAY, indent=1), encoding="utf-8")  # JSON is YAML
    return overlay


def workflow_command(run: Path, overlay: Path) -> list[str]:
    """The Snakemake command of the check, in folder `run`: the tiny config, then the overlay over it
    (config.yaml, the CPU demo's, is not read: a --configfile is given)."""
    return ["snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(run), "--workflow-profile",
            "none", "--configfile", str(REPO / "tests" / "config.tiny.yaml"), str(overlay), "--cores", "all",
            "--resources", "gpu=1", "--printshellcmds", "--rerun-incomplete"]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".gpu-check", help="folder for the run, its log and the table")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(
            f"gpu-check: torch {torch.__version__} sees no CUDA device (driver too old for its CUDA?)",
            file=sys.stderr,
        )
        return 1
    out = Path(args.out).resolve()
    run = out / "run"
    run.mkdir(parents=True, exist_ok=True)
    local_target = REPO / "resources" / "SmolLM2-135M-Instruct"
    if (local_target / "config.json").is_file() and not (run / "resources").exists():
        (run / "resources").mkdir()
        (run / "resources" / local_target.name).symlink_to(local_target)  # else the workflow materialises it
    cmd = workflow_command(run, write_overlay(out))
    log = out / "snakemake.log"
    print(f"gpu-check: running the workflow on one GPU (log: {log})", flush=True)
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as sink:
        code = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ)).returncode
    install = (out / "install.txt").read_text().strip() if (out / "install.txt").is_file() else "?"
    report = table(run, install, time.monotonic() - start, code)
    (out / "table.txt").write_text(report + "\n", encoding="utf-8")
    print(report)
    if code != 0:
        print(f"gpu-check: the workflow failed; the last lines of {log}:", file=sys.stderr)
        print("\n".join(log.read_text(errors="replace").splitlines()[-30:]), file=sys.stderr)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
