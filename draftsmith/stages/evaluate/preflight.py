"""`draftsmith preflight`: before any generation, what a drafter could gain here (draftsmith.core.planning.preflight).

Plain decoding, n-gram lookup and suffix decoding measured in vLLM on every held-out set (the runs kept
by what they measured, so the final evaluation reuses them), then per set and concurrency the best free
choice, a perfect drafter's ceiling and the acceptance it must reach to beat that choice.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.core.config.stage_args import arg
from draftsmith.core.config.stage_settings import PreflightSettings
from draftsmith.core.evaluation.cost import (
    THIS_CPU,
    describe_point,
    serving_bytes,
    serving_points,
    target_cost,
)
from draftsmith.core.evaluation.policy import concurrency_grid
from draftsmith.core.io.atomic import write_json
from draftsmith.core.model.target import text_config_dict
from draftsmith.core.planning.preflight import (
    blocked_message,
    outlook_line,
    planned_drafter_cost,
    set_outlook,
)
from draftsmith.stages.evaluate.stage import evaluate_vllm

log = logging.getLogger(__name__)


class PreflightBlocked(RuntimeError):
    """No drafter can beat the best choice without training on any set (exit 3 with block)."""


@dataclass
class PreflightPaths:
    target: str = arg("--target", "Target model folder.", kind="dir", required=True, exists=True)
    prompts: dict[str, str] = arg(
        "--prompts", "Held-out prompt JSONL of a set (repeat per set).", kind="named", required=True
    )
    plan: dict[str, Any] = arg(
        "--drafter-plan",
        'The drafter training will build: {"drafter": train.drafter, "vocab_size": vocab.size, '
        '"aux_layers": extract.aux_layers} (JSON, inline or @file).',
        kind="json",
        required=True,
    )
    out: str = arg("--out", "Folder for preflight.json and each set's vllm.json.", kind="dir", required=True)
    log_dir: str | None = arg("--log-dir", "Keep each vLLM run's output here.", kind="dir")
    runs_dir: str | None = arg(
        "--runs-dir", "Keep each finished vLLM run's result here; a rerun (and the evaluation) reuses it.",
        kind="dir",
    )  # fmt: skip


def preflight(paths: PreflightPaths, settings: PreflightSettings) -> dict[str, Any]:
    """Measure the free methods in vLLM and write out/preflight.json; returns it."""
    out = Path(paths.out)
    set_paths = {name: str(out / name / "vllm.json") for name in paths.prompts}
    if paths.log_dir:
        Path(paths.log_dir).mkdir(parents=True, exist_ok=True)
    summaries = evaluate_vllm(
        paths.target, {}, paths.prompts, set_paths, settings.vllm, paths.log_dir, paths.runs_dir
    )
    serving = settings.serving
    drafter = planned_drafter_cost(paths.plan, text_config_dict(paths.target), serving_bytes(serving))
    here = this_cpu_view(serving)
    sets = {}
    for name, summary in summaries.items():
        sets[name] = set_entry(name, summary, serving, settings, paths)
        if here:  # beside the projection that decides: this CPU's, measured where the run is
            sets[name]["this_cpu"] = set_entry(name, summary, here, settings, paths)
    result = {
        "target": str(paths.target),
        "drafter_plan": paths.plan,
        "drafter_parameters": drafter.dense_parameters,
        "drafting": drafter.drafting,
        "concurrency": concurrency_grid(serving),
        "num_draft_tokens": settings.num_draft_tokens,
        "sets": sets,
        "drafter_can_pay": any(s["any_room"] for s in sets.values()),
        "mode": settings.preflight,
    }
    write_json(out / "preflight.json", result)
    return result


def this_cpu_view(serving: dict[str, Any]) -> dict[str, Any] | None:
    """evaluate.serving as this CPU (its measured profile, bench/cost.py) where the serving point is
    another device and the profile exists; None otherwise (nothing to add)."""
    if serving["device"] == THIS_CPU or not Path(serving.get("profile") or "").is_file():
        return None
    return {**serving, "device": THIS_CPU}


def set_entry(
    name: str,
    summary: dict[str, Any],
    serving: dict[str, Any],
    settings: PreflightSettings,
    paths: PreflightPaths,
) -> dict[str, Any]:
    """One set's outlook over the serving grid of `serving`, the models costed at the points' bytes per
    parameter (a CPU profile's float32, a GPU's bf16)."""
    points = serving_points({**serving, "concurrency": concurrency_grid(serving)}, summary["context_tokens"])
    bytes_per = points[0].bytes_per_parameter
    target = target_cost(paths.target, bytes_per)
    drafter = planned_drafter_cost(paths.plan, text_config_dict(paths.target), bytes_per)
    outlook = set_outlook(summary["methods"], settings.num_draft_tokens, target, drafter, points)
    return {
        **outlook,
        "serving_point": describe_point(points[0]),
        "line": outlook_line(name, outlook, points[0].device.name),
    }


def run_preflight(paths: PreflightPaths, settings: PreflightSettings) -> Iterator[str]:
    """The pre-flight: plain decoding, n-gram lookup and suffix decoding measured in vLLM on every
    held-out set (needs the vllm extra), and per set and concurrency of evaluate.serving the best choice
    without training, a perfect drafter's projected speedup (its ceiling: every draft accepted) and the
    per-position acceptance it must reach to beat that choice (its break-even). Where the ceiling is below
    the best free choice at every concurrency on every set, no training can help: with evaluate.preflight
    block the command exits 3 naming what to serve; with warn it says so."""
    result = preflight(paths, settings)
    for entry in result["sets"].values():
        yield entry["line"]
    for entry in result["sets"].values():
        if entry.get("this_cpu"):
            yield entry["this_cpu"]["line"]
    if not result["drafter_can_pay"]:
        message = blocked_message(result["sets"])
        if settings.preflight == "block":
            raise PreflightBlocked(message)
        log.warning(message)
