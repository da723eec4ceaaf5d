"""`make gpu-check` (scripts/gpu-check.sh, scripts/gpu_check.py) where no GPU is: one line, exit 1, nothing
installed. What it would run on a GPU is planned here (a dry run of its configuration) and its table is
built from a finished run's files."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess

import pytest
from conftest import REPO, cli_env

SCRIPT = REPO / "scripts" / "gpu-check.sh"
NO_GPU = "gpu-check: no NVIDIA GPU here (nvidia-smi -L lists none); run it on a GPU node\n"


def gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "nvidia_smi",
    [None, "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver'; exit 9",
     "echo 'No devices were found'; exit 6"],
    ids=["absent", "no driver", "no device"],
)  # fmt: skip
def test_without_a_gpu_it_says_so_in_one_line_and_installs_nothing(tmp_path, nvidia_smi):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in (
        "bash",
        "grep",
        "cat",
        "dirname",
        "python3",
    ):  # what runs before the check, and no nvidia-smi
        os.symlink(
            subprocess.check_output(["bash", "-c", f"command -v {tool}"], text=True).strip(), bin_dir / tool
        )
    if nvidia_smi:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/bash\n{nvidia_smi}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {
        "PATH": str(bin_dir),
        "GPU_CHECK_VENV": str(tmp_path / "venv"),
        "GPU_CHECK_DIR": str(tmp_path / "out"),
    }
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    assert (proc.returncode, proc.stderr, proc.stdout) == (1, NO_GPU, "")
    assert not (tmp_path / "venv").exists() and not (tmp_path / "out").exists()


def test_make_gpu_check_runs_the_script():
    rule = (REPO / "Makefile").read_text().split("\ngpu-check:")[1].split("\n\n")[0]
    assert "bash scripts/gpu-check.sh" in rule and "setup" not in rule.splitlines()[0]


def test_its_configuration_plans_every_gpu_stage_on_one_gpu_through_vllm(tmp_path):
    """The dry run of what gpu_check.py runs: vLLM server generation, vLLM extraction, training and vLLM
    evaluation each given one GPU, the target in its GPU dtype."""
    overlay = tmp_path / "gpu.yaml"
    overlay.write_text(json.dumps(gpu_check_module().OVERLAY))
    cmd = ["snakemake", "-n", "-p", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path),
           "--workflow-profile", "none", "--configfile", str(REPO / "tests" / "config.tiny.yaml"), str(overlay),
           "--cores", "2", "--resources", "gpu=1"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shells = [
        line for line in proc.stdout.splitlines() if line.startswith("Shell command: draftsmith run --gpus")
    ]
    by_command = {line.split(" -- draftsmith ")[1].split()[0]: line for line in shells}
    assert set(by_command) == {"generate", "extract", "train", "evaluate", "evaluate-vllm"}, by_command
    assert all("draftsmith run --gpus 1 --" in line for line in shells)
    assert (
        '"engine": "vllm-server"' in by_command["generate"]
        and "--enforce-eager" not in by_command["generate"]
    )
    assert '"engine": "vllm"' in by_command["extract"] and '"vllm_eager": false' in by_command["extract"]
    assert '"precision": "bf16"' in by_command["train"]
    assert (
        "--gpus 1 --dtype auto" in by_command["evaluate-vllm"]
        and "--vllm-eager" not in by_command["evaluate-vllm"]
    )


def test_the_table_reports_stages_devices_and_acceptance(tmp_path):
    run = tmp_path / "run"
    for stage, seconds in (("generate", 61.2), ("train", 20.0)):
        (run / "benchmarks").mkdir(parents=True, exist_ok=True)
        (run / "benchmarks" / f"{stage}.tsv").write_text(f"s\th:m:s\n{seconds}\t0:01:01\n")
        (run / "logs").mkdir(exist_ok=True)
        (run / "logs" / f"{stage}.log").write_text(
            "draftsmith run: CUDA_VISIBLE_DEVICES=0 (1 of 1 GPUs on n1)\n"
        )
    (run / "results" / "eval" / "split").mkdir(parents=True)
    (run / "results" / "eval" / "split" / "vllm.json").write_text(
        json.dumps(
            {"device": "cuda", "engine": "vLLM offline LLM (bfloat16, compiled, tensor parallel 1, ...)"}
        )
    )
    rows = [{"method": "trained drafter", "measured_by": "vLLM", "tokens_per_forward": 1.38,
             "tokens_per_forward_interval": [1.3, 1.45], "tau": 1.42, "speedup": 1.31},
            {"method": "plain decoding", "measured_by": "vLLM", "tokens_per_forward": 1.0, "tau": None,
             "speedup": 1.0}]  # fmt: skip
    summary = {"rows": rows, "verdict": {"action": "train longer", "deploy": "n-gram lookup"}}
    (run / "results" / "eval" / "summary.json").write_text(json.dumps(summary))
    text = gpu_check_module().table(run, "installed in 200 s", 412.0, 0)
    assert "workflow     finished in 412 s" in text
    assert "device cuda, vLLM offline LLM (bfloat16, compiled" in text
    assert "  generate                      61  CUDA_VISIBLE_DEVICES=0" in text
    assert (
        "  trained drafter           vLLM                   1.380  [1.300, 1.450]     1.420     1.31" in text
    )
    assert re.search(r"\n  plain decoding +vLLM +1\.000 +- +1\.00\n", text), text
    assert "verdict      train longer (deploy: n-gram lookup)" in text
