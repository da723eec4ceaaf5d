import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

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
