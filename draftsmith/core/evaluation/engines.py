"""The serving engines an export is written for, and what the gate checks about them without loading the
export stage: the layer-id convention each applies to the aux ids it reads, and the draft length the
drafter was trained for; and vLLM's speculative_config for each method (what the vLLM measurement runs
and the model card's serve commands repeat)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith.core.evaluation.methods import METHODS
from draftsmith.core.model.kinds import kind, kind_of_export

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


def drafting_fields(drafter: str | Path) -> dict[str, Any]:
    """What vLLM must be told beside a trained drafter's folder: its kind's `vllm_fields`, the kind read
    from its config.json (`kind_of_export`): a DFlash export is served by method dflash, a P-EAGLE one with
    parallel drafting (vLLM would otherwise chain it as EAGLE-3). A folder not written yet (serve commands
    in a model card) says nothing."""
    path = Path(drafter) / "config.json"
    if not path.is_file():
        return {}
    return dict(kind(kind_of_export(json.loads(path.read_text(encoding="utf-8")))).vllm_fields)


SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"  # vLLM's speculative_config field


def speculative_config(
    method: str | None,
    drafter: str | None,
    num_speculative_tokens: int,
    method_settings: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """vLLM's speculative_config for a method of core/evaluation/methods.py at draft length k (its record's
    `vllm_config`; `method_settings`: a free method's own settings, the schema's defaults filled in), or
    None (plain)."""
    if method is None:
        return None
    if method not in METHODS or METHODS[method].vllm is None:
        served = [k for k, m in METHODS.items() if m.vllm]
        raise ValueError(f"unknown speculative method {method!r}; expected one of {served} or None")
    settings = dict(method_settings or {})
    # a serving policy's k per batch size (core/evaluation/policy.vllm_schedule), for the methods vLLM schedules
    schedule = settings.pop(SCHEDULE_KEY, None)
    if schedule is not None and not METHODS[method].per_batch_k:
        scheduled = [k for k, m in METHODS.items() if m.per_batch_k]
        raise ValueError(f"{SCHEDULE_KEY}: vLLM schedules {scheduled}, not {method!r}")
    config = METHODS[method].vllm_config(drafter, num_speculative_tokens, settings)
    if schedule is not None:
        config[SCHEDULE_KEY] = [list(map(int, r)) for r in schedule]
    return config


def drafter_config(drafter: str | None, k: int, settings: dict[str, Any]) -> dict[str, Any]:
    """A drafter's: its export folder, served as its kind says (`drafting_fields`: a DFlash export by
    method dflash, a P-EAGLE one with parallel drafting)."""
    if not drafter:
        raise ValueError("a drafter method needs a drafter folder")
    return {
        "method": "eagle3",
        "model": str(drafter),
        "num_speculative_tokens": k,
        **drafting_fields(drafter),
    }


def ngram_config(drafter: str | None, k: int, settings: dict[str, Any]) -> dict[str, Any]:
    """n-gram lookup's: the lookup's min and max n-gram length (evaluate.ngram_lookup)."""
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": int(settings["min"]),
        "prompt_lookup_max": int(settings["max"]),
    }


def suffix_config(drafter: str | None, k: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Suffix decoding's: evaluate.suffix_decoding's keys as vLLM's suffix_decoding_* fields; k is a
    maximum (it drafts what its tree supports)."""
    fields = {f"suffix_decoding_{key}": value for key, value in sorted(settings.items())}
    return {"method": "suffix", "num_speculative_tokens": k, **fields}
