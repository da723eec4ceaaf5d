"""`make gpu-check` (scripts/gpu-check.sh, scripts/gpu_check.py) where no GPU is: one line, exit 1, nothing
installed. What it would run on a GPU is planned here (a dry run of its configuration) and its table is
built from a finished run's files."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from helpers.workflow import REPO, cli_env

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


@pytest.fixture(scope="module")
def gpu_check_plan(tmp_path_factory) -> str:
    """The dry run of what gpu_check.py runs (its overlay written and its command built as main() does,
    with -n -p), in an empty folder: the printed plan."""
    module = gpu_check_module()
    run = tmp_path_factory.mktemp("gpu-check")
    cmd = module.workflow_command(run / "run", module.write_overlay(run))
    (run / "run").mkdir()
    cmd = [cmd[0], "-n", "-p", *cmd[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=run, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_its_configuration_plans_every_gpu_stage_on_one_gpu_through_vllm(gpu_check_plan):
    """vLLM server generation, vLLM extraction, training and vLLM evaluation each given one GPU, the
    target in its GPU dtype."""
    shells = [
        line
        for line in gpu_check_plan.splitlines()
        if line.startswith("Shell command: draftsmith run --gpus")
    ]
    by_command = {line.split(" -- draftsmith ")[1].split()[0]: line for line in shells}
    expected = {"generate", "extract", "train", "evaluate", "evaluate-vllm", "preflight"}
    assert set(by_command) == expected, by_command
    assert all("draftsmith run --gpus 1 --" in line for line in shells)
    assert (
        '"backend": "vllm-server"' in by_command["generate"]
        and "--enforce-eager" not in by_command["generate"]
    )
    assert '"backend": "vllm"' in by_command["extract"] and '"vllm_eager": false' in by_command["extract"]
    assert '"precision": "bf16"' in by_command["train"] and '"max_steps": null' in by_command["train"]
    for vllm in ("evaluate-vllm", "preflight"):  # the pre-flight's engines are the evaluation's
        assert "--dtype auto --gpus 1" in by_command[vllm] and '"vllm_eager": true' not in by_command[vllm]


def test_its_gate_judges_what_a_tiny_target_can_show_not_speed(gpu_check_plan):
    """The modes the gate runs with (the tiny config, then the overlay): the drafter must beat the
    untrained one; every other check of evaluate.gate only warns. A check added to the schema without a
    mode here would take its default (block, for most): this fails until GATE names it."""
    from draftsmith.core.config.config import section_schema

    (summary,) = [line for line in gpu_check_plan.splitlines() if " draftsmith eval-summary " in line
                  or line.startswith("Shell command: draftsmith eval-summary ")]  # fmt: skip
    settings = shlex.split(summary)[shlex.split(summary).index("--settings") + 1]
    modes = json.loads(settings)["gate"]
    checks = set(section_schema("evaluate.gate"))
    assert modes == {name: "block" if name == "beats_untrained" else "warn" for name in checks}, modes
    assert set(gpu_check_module().GATE) == checks


def test_the_table_reports_stages_devices_and_acceptance(tmp_path):
    run = tmp_path / "run"
    for stage, seconds in (("generate", 61.2), ("train", 20.0)):
        (run / "benchmarks").mkdir(parents=True, exist_ok=True)
        (run / "benchmarks" / f"{stage}.tsv").write_text(f"s\th:m:s\n{seconds}\t0:01:01\n")
        (run / "logs").mkdir(exist_ok=True)
        (run / "logs" / f"{stage}.log").write_text(
            "draftsmith run: CUDA_VISIBLE_DEVICES=0 (1 of 1 GPUs on n1)\n"
        )
    (run / "results" / "eval" / "heldout").mkdir(parents=True)
    (run / "results" / "eval" / "heldout" / "vllm.json").write_text(
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


PREREQS = REPO / "scripts" / "gpu-prereqs.sh"


def run_check(tmp_path, check: str, stand_ins: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """One check of scripts/gpu-prereqs.sh with PATH holding only bash's own tools and the stand-ins."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("bash", "timeout"):
        target = subprocess.check_output(["bash", "-c", f"command -v {tool}"], text=True).strip()
        if not (bin_dir / tool).exists():
            os.symlink(target, bin_dir / tool)
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    script = f"source {shlex.quote(str(PREREQS))}; {check} {' '.join(map(shlex.quote, args))}"
    env = {"PATH": str(bin_dir), "GPU_CHECK_PYPI_TIMEOUT": "5"}
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=30)


def test_gpu_check_names_a_missing_compiler_in_one_line(tmp_path):
    """Issue 43 item 5: arctic-inference builds from source; no cc/gcc is said before any install."""
    proc = run_check(tmp_path, "check_compiler", {})
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1 and "no C compiler" in proc.stderr
    proc = run_check(tmp_path, "check_compiler", {"gcc": "exit 0"})
    assert proc.returncode == 0 and proc.stdout == "gpu-check: compiler gcc found\n"


def test_gpu_check_finds_the_python_headers_through_sysconfig(tmp_path):
    include = tmp_path / "include"
    include.mkdir()
    python = {"py": f"echo {include}"}  # what `python -c 'print(sysconfig.get_path(\"include\"))'` prints
    proc = run_check(tmp_path, "check_python_headers", python, "py")
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1 and "no Python.h" in proc.stderr
    (include / "Python.h").write_text("")
    proc = run_check(tmp_path, "check_python_headers", python, "py")
    assert proc.returncode == 0 and "Python headers found" in proc.stdout


def test_gpu_check_says_when_pypi_is_out_of_reach(tmp_path):
    proc = run_check(tmp_path, "check_pypi", {"py": "exit 1"}, "py")  # pip index versions fails
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1 and "not reachable" in proc.stderr
    proc = run_check(tmp_path, "check_pypi", {"py": 'test "$*" = "-m pip index versions pip --index-url '
                                              'https://pypi.org/simple"'}, "py")  # fmt: skip
    assert proc.returncode == 0 and "reachable" in proc.stdout


def test_gpu_check_runs_the_prerequisites_before_installing():
    text = SCRIPT.read_text()
    assert text.index("check_prereqs") < text.index("pip install") and text.index("nvidia-smi") < text.index(
        "check_prereqs"
    )


def test_the_device_check_refuses_without_cuda_in_one_line():
    """scripts/device-check.sh (the checks a lent GPU runs: bench/device_check.py) on this CPU machine:
    one line on stderr, exit 1, nothing run."""
    script = REPO / "scripts" / "device-check.sh"
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "device-check: CUDA is not available here (torch sees no GPU, or no torch for "
        f"{sys.executable}); run it on a GPU machine"
    ]
