"""Aux layer ids: conventions, the order engines capture in, and what capture_aux hands back."""

from __future__ import annotations

import pytest
import torch

from draftsmith.core.model.layers import (
    aux_order_problem,
    capture_aux,
    convert_layer_ids,
    stack_aux,
    validate_aux_layers,
)


def test_convert_round_trip() -> None:
    assert convert_layer_ids([2, 15, 27], "input", "output") == [1, 14, 26]
    assert convert_layer_ids([1, 14, 26], "output", "input") == [2, 15, 27]
    assert convert_layer_ids([2, 15], "input", "input") == [2, 15]
    with pytest.raises(ValueError, match="unknown layer-id convention 'outputs'"):
        convert_layer_ids([2], "input", "outputs")


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([20, 2, 10], r"not in increasing order; engines capture in layer order \(\[2, 10, 20\]\)"),
        ([2, 10, 10], "repeat a layer"),
        ([0, 10, 20], r"out of range: the target has 32 layers \(1..31\)"),
        ([2, 10, 32], "out of range"),
    ],
)
def test_validate_refuses(ids: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_aux_layers(ids, 32)


def test_validate_accepts_increasing() -> None:
    assert validate_aux_layers([2, 16, 29], 32) == [2, 16, 29]
    assert aux_order_problem([2, 16, 29]) is None


def engine_capture_order(model: torch.nn.Module, ids: list[int]) -> list[int]:
    """Which layers' inputs an engine hands to fc, in order: vLLM keeps `sorted(set(ids))` and appends
    while it walks the decoder layers, so the order is always increasing whatever the config says."""
    return [k for k in range(len(model.model.layers)) if k in set(ids)]


def test_capture_matches_hf_hidden_states_in_engine_order(tiny_llama) -> None:
    ids = validate_aux_layers([1, 3, 4], tiny_llama.config.num_hidden_layers)
    x = torch.randint(0, 256, (2, 7))
    with torch.no_grad(), capture_aux(tiny_llama, ids) as captured:
        out = tiny_llama(x, output_hidden_states=True)
    aux = stack_aux(captured, ids)  # [B, T, A, H]
    assert aux.shape == (2, 7, 3, 64)
    for j, k in enumerate(engine_capture_order(tiny_llama, ids)):
        torch.testing.assert_close(aux[:, :, j], out.hidden_states[k], rtol=0, atol=0)
