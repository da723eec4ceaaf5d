"""The serving engines an export is written for, and what the gate checks about them without loading the
export stage: the layer-id convention each applies to the aux ids it reads, and the draft length the
drafter was trained for."""

from __future__ import annotations

from typing import Any

ENGINES = ("vllm", "sglang", "speculators")
# the layer-id convention each engine applies to the aux ids it reads
ENGINE_CONVENTIONS = {"vllm": "input", "sglang": "output", "speculators": "input"}


def trained_ttt_steps(config: dict[str, Any]) -> int | None:
    """The TTT steps the drafter of an export was trained with (None for a foreign export)."""
    settings = ((config.get("draftsmith") or {}).get("training") or {}).get("settings") or {}
    steps = settings.get("ttt_steps")
    return int(steps) if steps is not None else None


def draft_positions_warning(num_draft_tokens: int, ttt_steps: int | None) -> str | None:
    """Why drafting `num_draft_tokens` per step with a drafter trained for `ttt_steps` wastes positions."""
    if ttt_steps is None or num_draft_tokens <= ttt_steps:
        return None
    return (
        f"num_draft_tokens {num_draft_tokens} exceeds the {ttt_steps} TTT steps the drafter was trained "
        f"with: draft positions {ttt_steps + 1}..{num_draft_tokens} were never trained (raise "
        f"train.ttt_steps or lower evaluate.num_draft_tokens)"
    )
