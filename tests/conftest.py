import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = REPO / "resources" / "SmolLM2-135M-Instruct"


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
