"""Aux layer ids, their conventions, and capturing them from a Hugging Face decoder.

draftsmith's convention is "input": id k is the input to decoder layer k, i.e. HF `hidden_states[k]`
(EAGLE reference, vLLM). SGLang, SpecForge and modelopt count "output": the output of layer k, so the
same tensors carry ids one lower.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

CONVENTIONS = ("input", "output")


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default in the "input" convention: [2, L//2, L-3]."""
    return [2, num_layers // 2, num_layers - 3]


def convert_layer_ids(ids: Sequence[int], src: str, dst: str) -> list[int]:
    """Re-express ids between conventions: input id k == output id k-1."""
    for c in (src, dst):
        if c not in CONVENTIONS:
            raise ValueError(f"unknown layer-id convention {c!r}; expected one of {CONVENTIONS}")
    shift = {("input", "output"): -1, ("output", "input"): 1}.get((src, dst), 0)
    return [int(i) + shift for i in ids]


def validate_aux_layers(ids: Sequence[int], num_layers: int) -> list[int]:
    """Input-convention ids must name a decoder layer's input: 1 <= k < L (0 is the raw embedding), in
    increasing order without repeats. Engines capture in layer order (vLLM `sorted(set(ids))`, SGLang in
    its layer loop), so any other order would feed `fc` its inputs permuted."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 1 <= i < num_layers]
    if bad:
        raise ValueError(
            f"aux layer ids {bad} out of range: the target has {num_layers} layers (1..{num_layers - 1})"
        )
    problem = aux_order_problem(ids)
    if problem:
        raise ValueError(problem)
    return ids


def resolve_aux_layers(aux_layers: list[int] | None, num_layers: int) -> list[int]:
    """The configured ids (EAGLE-3's default when None or empty), validated against the target's layers."""
    return validate_aux_layers(aux_layers or default_aux_layers(num_layers), num_layers)


def aux_order_problem(ids: Sequence[int]) -> str | None:
    """Why `ids` are not strictly increasing (the order engines capture in), or None."""
    ids = list(ids)
    if len(set(ids)) != len(ids):
        return f"aux layer ids {ids} repeat a layer"
    if ids != sorted(ids):
        return (
            f"aux layer ids {ids} are not in increasing order; engines capture in layer order "
            f"({sorted(ids)}), which would permute fc's inputs"
        )
    return None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a HF causal LM (model.model.layers) or of its base model (model.layers)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no .model.layers; not a supported decoder")
    return layers


@contextlib.contextmanager
def capture_aux(model: nn.Module, layer_ids: Sequence[int]) -> Iterator[dict[int, Tensor]]:
    """While active, every forward stores the input of each chosen layer in the yielded dict
    (id -> [B, T, H]), which is exactly HF `hidden_states[id]`."""
    captured: dict[int, Tensor] = {}
    layers = decoder_layers(model)
    handles = []
    for k in layer_ids:

        def hook(_module: nn.Module, args: tuple, kwargs: dict, k: int = k) -> None:
            captured[k] = args[0] if args else kwargs["hidden_states"]

        handles.append(layers[k].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def stack_aux(captured: dict[int, Tensor], layer_ids: Sequence[int]) -> Tensor:
    """{id: [B, T, H]} -> [B, T, A, H] in layer-id order."""
    return torch.stack([captured[k] for k in layer_ids], dim=2)
