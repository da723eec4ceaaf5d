"""The drafter export formats, one per engine: their writers, their reader, and the checks that catch a
broken export before it is served. Training writes the vLLM form, the export stage
(draftsmith.stages.export) the other two; evaluation, the summary and push read and check them.

    common.py       file names, the shared layer fields and draftsmith block (the engines and their
                    conventions: draftsmith/core/evaluation/engines.py)
    vllm.py         the native form (results/drafter/, written by training)
    sglang.py       the native form with SGLang's aux-id convention
    speculators.py  speculators' format
    load.py         reading an export back (any of the three, or a foreign one)
    check.py        what each engine reads, checked

Three forms of the same trained weights:

    results/drafter/              vLLM's native EAGLE-3 form (`vllm/model_executor/models/llama_eagle3.py`)
    results/drafter-sglang/       the same files with SGLang's aux-id convention
    results/drafter-speculators/  speculators' own format (`Eagle3SpeculatorConfig`), which `vllm serve`
                                  also reads (vllm/transformers_utils/configs/speculators/)

The native form (vLLM, SGLang):

    config.json         LlamaConfig-style fields for the single draft layer, plus the EAGLE-3 fields
    model.safetensors   the drafter state dict as is: fc.weight, midlayer.*, norm.weight, lm_head.weight,
                        d2t [Vd] int64, t2d [V] bool; no embed_tokens (the engine shares the target's)

What the engines read from config.json (checked against their loaders):
- vLLM sizes fc from `num_aux_hidden_states` (else len(eagle_config ids), else 3) and captures the layers
  named by top-level `eagle_aux_hidden_state_layer_ids` ("input to layer k"), as `sorted(set(ids))`.
- SGLang reads only `eagle_config.eagle_aux_hidden_state_layer_ids` and captures id + 1 of each
  (`set_eagle3_layers_to_capture`: it counts "output of layer k"); its fc is always 3 aux states wide;
  it silently skips weight names it does not know (so `midlayer.*`, never `layers.0.*`).
- Both allocate a draft-to-target map only when `draft_vocab_size` != the target's vocabulary; vLLM
  then fails on a `d2t` it has no parameter for, so a full-size draft vocabulary is written without
  d2t/t2d. A missing d2t or fc.weight otherwise loads *silently*, hence `check_export`.
- `norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output` change the layer; draftsmith trains
  with all four off and writes them explicitly (vLLM defaults `norm_before_residual` to True for
  speculators-format configs).

The `draftsmith` block records what the engine fields do not: the layer-id convention of the ids written,
the input-convention ids, the target path and the full `DrafterConfig`, so `load_drafter` rebuilds the
exact module.
"""

from draftsmith.core.evaluation.engines import (
    ENGINE_CONVENTIONS,
    ENGINES,
    draft_positions_warning,
    trained_ttt_steps,
)
from draftsmith.core.export.formats.check import (
    check_against_target,
    check_export,
    expected_shapes,
    unreadable,
)
from draftsmith.core.export.formats.common import (
    CONFIG_NAME,
    NORM_FLAGS,
    WEIGHTS_NAME,
    export_draft_positions_warning,
    needs_vocab_map,
)
from draftsmith.core.export.formats.load import (
    drafter_config_from_export,
    engine_of,
    engine_view,
    load_drafter,
)
from draftsmith.core.export.formats.sglang import sglang_config
from draftsmith.core.export.formats.speculators import (
    native_names,
    speculators_export_config,
    speculators_names,
)
from draftsmith.core.export.formats.vllm import export_config, save_drafter

__all__ = [
    "CONFIG_NAME",
    "ENGINES",
    "ENGINE_CONVENTIONS",
    "NORM_FLAGS",
    "WEIGHTS_NAME",
    "check_against_target",
    "check_export",
    "draft_positions_warning",
    "drafter_config_from_export",
    "engine_of",
    "engine_view",
    "expected_shapes",
    "export_draft_positions_warning",
    "export_config",
    "load_drafter",
    "native_names",
    "needs_vocab_map",
    "save_drafter",
    "sglang_config",
    "speculators_export_config",
    "speculators_names",
    "trained_ttt_steps",
    "unreadable",
]
