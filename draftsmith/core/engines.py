"""The serving engines an export is written for, and what the gate checks about them without loading the
export stage: the layer-id convention each applies to the aux ids it reads, and the draft length the
drafter was trained for; and vLLM's speculative_config for each method (what the vLLM measurement runs
and the model card's serve commands repeat)."""

from __future__ import annotations

import json
from pathlib import Path
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


# what vLLM must be told beside a drafter of each kind (train.drafter.kind) that plain eagle3 does not say
KIND_FIELDS: dict[str, dict[str, Any]] = {
    "dflash": {"method": "dflash"},
    "peagle": {"parallel_drafting": True},
}


def drafting_fields(drafter: str | Path) -> dict[str, Any]:
    """What vLLM must be told beside a trained drafter's folder, read from its config.json: a DFlash
    export is served by method dflash; a P-EAGLE one (a mask token id) with parallel drafting (vLLM would
    otherwise chain it as EAGLE-3). A folder not written yet (serve commands in a model card) says nothing."""
    path = Path(drafter) / "config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text(encoding="utf-8"))
    if any(str(a).startswith("DFlash") for a in config.get("architectures") or []):
        return KIND_FIELDS["dflash"]
    parallel = config.get("mask_token_id", config.get("pard_token")) is not None
    return KIND_FIELDS["peagle"] if parallel else {}


SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"  # vLLM's speculative_config field


def speculative_config(
    method: str | None,
    drafter: str | None,
    num_speculative_tokens: int,
    method_settings: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """vLLM's speculative_config for a method: eagle3 (a trained drafter's folder, served as its export
    says: `drafting_fields`), dflash, ngram (method_settings:
    the lookup's min and max n-gram length), suffix (method_settings: evaluate.suffix_decoding's keys,
    written as vLLM's suffix_decoding_* fields), or None (plain)."""
    settings = dict(method_settings or {})
    if method is None:
        return None
    # a serving policy's k per batch size (core/policy.vllm_schedule), for the methods vLLM schedules
    schedule = settings.pop(SCHEDULE_KEY, None)
    if schedule is not None and method not in ("eagle3", "ngram"):
        raise ValueError(f"{SCHEDULE_KEY}: vLLM schedules eagle3 and ngram, not {method!r}")
    scheduled = {SCHEDULE_KEY: [list(map(int, r)) for r in schedule]} if schedule is not None else {}
    if method == "eagle3":
        if not drafter:
            raise ValueError("method 'eagle3' needs a drafter folder")
        return {
            "method": "eagle3",
            "model": str(drafter),
            "num_speculative_tokens": num_speculative_tokens,
            **drafting_fields(drafter),
            **scheduled,
        }
    if method == "dflash":  # a DFlash export (core/export_formats/vllm_dflash.py)
        if not drafter:
            raise ValueError("method 'dflash' needs a drafter folder")
        return {"method": "dflash", "model": str(drafter), "num_speculative_tokens": num_speculative_tokens}
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_min": int(settings.get("min", 2)),
            "prompt_lookup_max": int(settings.get("max", 4)),
            **scheduled,
        }
    if method == "suffix":
        return {
            "method": "suffix",
            "num_speculative_tokens": num_speculative_tokens,  # a maximum: it drafts what its tree supports
            **{f"suffix_decoding_{key}": value for key, value in sorted(settings.items())},
        }
    raise ValueError(f"unknown speculative method {method!r}; expected eagle3, dflash, ngram, suffix or None")
