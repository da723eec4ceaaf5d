"""speculators' own format (`Eagle3SpeculatorConfig`), which `vllm serve` also reads
(vllm/transformers_utils/configs/speculators/): the draft layer's config under
`transformer_layer_config`, the layer's tensors named `layers.0.*`, the target's input embedding carried
as `embed_tokens.weight` (its loader leaves a missing one at zeros)."""

from __future__ import annotations

from typing import Any

import torch

from draftsmith.core.export.formats.common import (
    SPECULATORS_ARCHITECTURE,
    SPECULATORS_VERSION,
    draftsmith_block,
    dtype_name,
    layer_fields,
    norm_flags,
    validate_for_export,
)
from draftsmith.core.model.drafter import DrafterConfig


def speculators_export_config(
    cfg: DrafterConfig,
    aux_layer_ids: list[int],
    target_path: str,
    num_draft_tokens: int,
    verifier_architectures: list[str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """config.json in speculators' format (`Eagle3SpeculatorConfig`); the verifier is the target.

    `transformer_layer_config` is what vLLM builds the draft layer from; it carries
    `num_aux_hidden_states` because vLLM otherwise assumes 3 for this format."""
    input_ids = [int(i) for i in aux_layer_ids]
    validate_for_export(cfg, input_ids, "speculators")
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    name = dtype_name(dtype)
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": {**layer_fields(cfg, name), "num_aux_hidden_states": cfg.num_aux},
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": input_ids,
        **norm_flags(cfg),
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": name,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(num_draft_tokens),  # speculators' own key
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {
                "name_or_path": str(target_path),
                "architectures": list(verifier_architectures or []),
            },
        },
        "draftsmith": draftsmith_block(cfg, "speculators", input_ids, target_path, extra),
    }


def speculators_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Native names -> speculators' (`midlayer.` -> `layers.0.`; the rest are the same)."""
    return {
        ("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v
        for k, v in tensors.items()
    }


def native_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """speculators' names -> native ones; drops what a speculators model keeps of its verifier."""
    skip = ("verifier_lm_head.", "verifier_norm.")
    return {
        ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
        for k, v in tensors.items()
        if not k.startswith(skip)
    }
