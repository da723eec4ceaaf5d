import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = REPO / "resources" / "SmolLM2-135M-Instruct"
TINY_CONFIG = REPO / "tests" / "config.tiny.yaml"
# The shared tiny run's working folder: a space and shell metacharacters in every path of the run (its
# folder, the target folder and the prompt file below it). Every rule's command must hand them on as one
# argument each; a word the shell split or ran would leave an INJ* file in the working folder.
TINY_RUN_FOLDER = "tiny run $(touch INJ1);touch INJ2&'q'"


# cli_env, fp_tolerance and snakemake are plain helpers and belong in helpers.py; they move there once
# the modules being changed elsewhere that import them from here (test_extract_kill.py, test_workflow.py
# and others) settle, so that each helper has one import path.
def cli_env() -> dict[str, str]:
    """The environment for running this venv's `draftsmith` and `snakemake` commands in a subprocess."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="session")
def target_model() -> Path:
    """The real default target, materialised from its GGUF wheel if this checkout has not yet."""
    if not (DEFAULT_TARGET / "config.json").is_file():
        subprocess.run(
            [
                "draftsmith",
                "target",
                "--out",
                str(DEFAULT_TARGET),
                "--cache",
                str(REPO / "resources" / "wheels"),
            ],
            check=True,
            env=cli_env(),
        )
    return DEFAULT_TARGET


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


# Tests measure correctness, not speed: two threads, deterministic CPU kernels.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def tiny_llama():
    """A randomly initialised 4-layer Llama (seconds to build and run)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


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

    def copy(self, dest: Path) -> "TinyRun":
        """The run folder copied to `dest` (timestamps and Snakemake's records kept, so the copy is as
        finished as the run); its config still names the run's target and prompt file."""
        shutil.copytree(self.workdir, dest, symlinks=True)
        return TinyRun(dest, self.config)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, target_model) -> TinyRun:
    """ONE run of the whole workflow for the test session (~4-5 min on 2 cores): every test that only
    reads a finished tiny run's results reads this one (tests/e2e/test_workflow.py, test_faults.py,
    test_generate_servers.py). Paths with spaces and shell metacharacters: working folder, target folder
    and prompt file. Generation through the `vllm-server` backend, as config.yaml's (the server starts and
    stops inside the generate job; its lifecycle is asserted on this run's log)."""
    workdir = tmp_path_factory.mktemp(TINY_RUN_FOLDER)
    (workdir / "target model").symlink_to(target_model)
    shutil.copy(REPO / "draftsmith" / "data" / "prompts.jsonl", workdir / "my prompts.jsonl")
    # JSON strings are YAML double-quoted scalars: any character of a path survives Snakemake's parsing
    config = (
        f"target={{model: {json.dumps(str(workdir / 'target model'))}, gguf_wheel: null}}",
        f"prompts={{source: jsonl, path: {json.dumps(str(workdir / 'my prompts.jsonl'))}}}",
        "generate={backend: vllm-server}",
    )
    snakemake(workdir, "--config", *config)
    return TinyRun(workdir, config)
