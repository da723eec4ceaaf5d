"""chat.py: the one end-of-sequence helper every stage uses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftsmith.core.data.chat import eos_token_ids


def test_eos_token_ids_unites_every_source() -> None:
    tokenizer = SimpleNamespace(eos_token_id=2)
    generation_config = SimpleNamespace(eos_token_id=[7, 2])  # Llama-3 style: a list
    assert eos_token_ids(tokenizer, generation_config) == [2, 7]
    assert eos_token_ids(tokenizer, SimpleNamespace(eos_token_id=None)) == [2]
    assert eos_token_ids(5) == [5] and eos_token_ids([3, 1, 3]) == [1, 3] and eos_token_ids((4,)) == [4]
    assert eos_token_ids(None, required=False) == []
    with pytest.raises(ValueError, match="eos token"):
        eos_token_ids(SimpleNamespace(eos_token_id=None), None)


def test_transformers_generation_config() -> None:
    from transformers import GenerationConfig

    assert eos_token_ids(SimpleNamespace(eos_token_id=0), GenerationConfig(eos_token_id=[9, 3])) == [0, 3, 9]
