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
