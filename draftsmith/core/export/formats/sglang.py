"""SGLang's form: the native files (`draftsmith.core.export.formats.vllm`) with SGLang's aux-id convention.

SGLang reads only `eagle_config.eagle_aux_hidden_state_layer_ids` and captures id + 1 of each
(`set_eagle3_layers_to_capture`: it counts "output of layer k"), so the ids are written one lower; its fc
always fuses 3 aux states; it silently skips weight names it does not know (so `midlayer.*`, never
`layers.0.*`). Serving results/drafter/ with SGLang would capture every layer one too late: it loads, and
acceptance falls.
"""

from __future__ import annotations

from typing import Any

import torch

from draftsmith.core.export.formats.vllm import export_config
from draftsmith.core.model.drafter import DrafterConfig


def sglang_config(
    cfg: DrafterConfig,
    aux_layer_ids: list[int],
    target_path: str,
    dtype: torch.dtype = torch.bfloat16,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """config.json for SGLang; `aux_layer_ids` are in the "input" convention."""
    return export_config(cfg, aux_layer_ids, target_path, "sglang", dtype, extra)
