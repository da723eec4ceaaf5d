"""The export stage (`draftsmith export`): from the trained vLLM export, the SGLang and speculators forms,
each checked against what its engine reads, and the model card in every export folder.

    stage.py   the SGLang and speculators forms from the trained vLLM export
    card.py    README.md (the model card) into every export folder

The formats themselves, their reader and their checks: draftsmith.core.export.formats.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from draftsmith.core.config.stage_args import BAD_INPUT, FAILED, arg
from draftsmith.core.export.formats import export_draft_positions_warning
from draftsmith.stages.export.stage import ExportError, export_engines, export_stage

__all__ = ["ExportError", "export_engines", "export_stage"]

log = logging.getLogger(__name__)


@dataclass
class ExportPaths:
    drafter: str = arg(
        "--drafter", "The trained vLLM export (results/drafter).", kind="dir", required=True, exists=True
    )
    out_sglang: str = arg("--out-sglang", "SGLang export to write.", kind="dir", required=True)
    out_speculators: str = arg(
        "--out-speculators",
        "speculators-format export to write (`vllm serve` reads it too).",
        kind="dir",
        required=True,
    )
    target: str = arg(
        "--target",
        "The target: its embedding goes into the speculators form, its architectures into speculators' "
        "verifier field; ranges are checked against it.",
        kind="dir",
        required=True,
        exists=True,
    )
    num_draft_tokens: int | None = arg(
        "--num-draft-tokens",
        "speculators' default draft length (the rule passes evaluate.num_draft_tokens) [default: the "
        "trained TTT steps].",
        kind="int",
        minimum=1,
    )
    summary: str | None = arg(
        "--summary",
        "The evaluation's summary.json: a model card (README.md) from it goes into every export, "
        "--drafter's included.",
        exists=True,
    )


Paths = ExportPaths
EXITS = {ExportError: BAD_INPUT, RuntimeError: FAILED}


def run(paths: ExportPaths) -> list[str]:
    """Write the SGLang and speculators exports of a trained drafter (same tensors, each engine's
    names and conventions), each checked against what its engine reads; with --summary, the model
    card of each export, --drafter's included."""
    if paths.num_draft_tokens is not None:
        warning = export_draft_positions_warning(paths.drafter, paths.num_draft_tokens)
        if warning:
            log.warning(warning)
    outs = export_stage(
        paths.drafter, paths.out_sglang, paths.out_speculators, paths.target, paths.num_draft_tokens,
        paths.summary,
    )  # fmt: skip
    return [f"{engine}: {path}" for engine, path in outs.items()]
