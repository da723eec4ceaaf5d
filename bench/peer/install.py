"""bench.peer's install stage: SpecForge 0.2.0's side environment (its own venv on draftsmith's CPU
torch, without its GPU/online requirements) and the environment its processes run in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch

from draftsmith.core.io.atomic import write_json

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
SHIM = Path(__file__).with_name("shim.py")


def shim_command(venv: Path, *args: str) -> list[str]:
    """The shim run by the side environment's Python. -P: its folder (bench/peer/, whose stage modules are
    named train, vllm, ...) must not come first on sys.path, where it would shadow SpecForge's imports."""
    return [str(venv / "bin" / "python"), "-P", str(SHIM), *args]


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


def install(venv: Path, torch_spec: str, log: Callable[[str], None]) -> dict[str, Any]:
    """SpecForge 0.2.0 in its own venv on draftsmith's CPU torch; reused when it is there already.
    `log` gets a line per step."""
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
    check = subprocess.run(shim_command(venv, "check"), capture_output=True, text=True)
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


def side_env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the side environment must not see draftsmith's packages
    env["TORCH_COMPILE_DISABLE"] = "1"
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env
