"""Each measured method projected to the serving point, at every draft length, with intervals.

For one held-out set and one method: its per-prompt counts at the measured draft length K give tokens per
target forward at every k <= K (draftsmith.core.evaluation.cost.forwards_at); the cost model turns each into a projected
speedup at each serving concurrency; the best k at the first concurrency is the method's choice, taken
from a vLLM re-measurement at that k when there is one. Intervals are the bootstrap over prompts of tokens
per target forward, scaled by the cost factor (a constant per method, k and point), so a paired
comparison of two methods scales each side's numerators.

    set_projection(results, ...)   -> {"points", "methods": {key: projection}, "ranking"}
    method_counts(projection)      -> per-prompt (tokens x factor, forwards) at the chosen k, point 0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draftsmith.core.evaluation.cost import (
    ModelCost,
    ServingPoint,
    best_draft_length,
    counts_at,
    describe_point,
    draft_length_options,
    speedup_factor,
)
from draftsmith.core.evaluation.methods import FREE_METHODS
from draftsmith.core.evaluation.policy import (
    ceiling,
    drafter_room,
    method_kind,
    methods_at_k,
    position_acceptance,
    serving_policy,
)
from draftsmith.core.evaluation.stats import bootstrap_ratio

Bootstrap = tuple[float, int, int]  # (level, resamples, seed)


def method_projection(
    key: str,
    method: dict[str, Any],
    max_k: int,
    target: ModelCost,
    points: Sequence[ServingPoint],
    drafter: ModelCost | None,
    bootstrap: Bootstrap,
) -> dict[str, Any] | None:
    """One method's options k = 1..max_k and its choice; None without per-prompt counts."""
    rows = method.get("per_prompt")
    if not rows or any("accepted_per_pos" not in r for r in rows):
        return None
    kind = method_kind(key, method)
    options = draft_length_options(rows, max_k, kind, target, points, drafter)
    for option in options:
        tokens, forwards = counts_at(rows, option["k"])
        option["counts"] = [tokens, forwards]
        option["measured"] = option["k"] == max_k
    chosen = best_draft_length(options)
    remeasured = (method.get("at_k") or {}).get(str(chosen))
    if remeasured and remeasured.get("per_prompt"):
        at = remeasured["per_prompt"]
        tokens, forwards = [r["tokens"] for r in at], [r["forwards"] for r in at]
        drafts = sum(r["drafts"] for r in at)
        share = drafts / sum(forwards) if sum(forwards) else 0.0
        factors = [speedup_factor(kind, chosen, target, p, drafter, share) for p in points]
        per_forward = sum(tokens) / sum(forwards) if sum(forwards) else 1.0
        options[chosen - 1] = {
            "k": chosen, "tokens_per_forward": per_forward, "draft_share": share, "speedup_factor": factors,
            "projected_speedup": [per_forward * f for f in factors], "counts": [tokens, forwards],
            "measured": True, "outputs_equal_plain": remeasured.get("outputs_equal_plain"),
        }  # fmt: skip
    for option in options:
        _, lo, hi = bootstrap_ratio(option["counts"][0], option["counts"][1], *bootstrap)
        option["tokens_per_forward_interval"] = [lo, hi]
        option["projected_intervals"] = [[lo * f, hi * f] for f in option["speedup_factor"]]
    return {"kind": kind, "chosen_k": chosen, "measured_k": max_k, "options": options}


def chosen(projection: dict[str, Any]) -> dict[str, Any]:
    """The option at the chosen draft length."""
    return projection["options"][projection["chosen_k"] - 1]


def method_counts(projection: dict[str, Any], point: int = 0) -> tuple[list[float], list[float]]:
    """Per prompt (tokens x cost factor at `point`, forwards) at the chosen k: their ratio of sums is
    the projected speedup, for paired bootstrap comparisons."""
    option = chosen(projection)
    tokens, forwards = option["counts"]
    factor = option["speedup_factor"][point]
    return [t * factor for t in tokens], list(forwards)


def set_projection(
    results: dict[str, Any],
    target: ModelCost,
    drafters: dict[str, ModelCost],
    points: Sequence[ServingPoint],
    bootstrap: Bootstrap,
    grid: Sequence[ServingPoint] | None = None,
) -> dict[str, Any]:
    """Every method of one set's results (vllm.json, else offline.json) projected; the ranking at the
    first point puts the judged candidates (the trained drafter, the free methods, plain decoding) in
    order, best first. With the trained drafter measured: its room (`drafter_room`: ceiling and
    break-even against the best free method at each point, its measured acceptance per position). With
    `grid` (one point per concurrency of draftsmith.core.evaluation.policy.concurrency_grid): the serving policy,
    and the trained drafter's ceiling over that grid (`drafter_ceiling`, at its best k)."""
    max_k = int(results["num_draft_tokens"])
    methods = {}
    for key, method in results["methods"].items():
        kind = method_kind(key, method)
        if kind not in FREE_METHODS and key not in drafters:
            continue
        projection = method_projection(key, method, max_k, target, points, drafters.get(key), bootstrap)
        if projection is not None:
            methods[key] = projection
    candidates = {k: chosen(p)["projected_speedup"][0] for k, p in methods.items() if k != "untrained"}
    candidates["plain"] = 1.0
    ranking = sorted(candidates, key=lambda k: -candidates[k])
    out: dict[str, Any] = {
        "points": [describe_point(p) for p in points],
        "concurrency": [p.concurrency for p in points],
        "device": points[0].device.name,
        "methods": methods,
        "ranking": ranking,
    }
    if "eagle3" in methods and drafters.get("eagle3") is not None:
        out["drafter_room"] = room(results, methods, target, drafters["eagle3"], points)
    if grid:
        out["policy"] = serving_policy(methods_at_k(results, drafters), target, drafters, grid)
        if drafters.get("eagle3") is not None:
            # the line no training can cross, drawn over the grid beside the methods' (report.plot_per_forward)
            out["policy"]["drafter_ceiling"] = [
                max(ceiling(target, drafters["eagle3"], k, p) for k in range(1, max_k + 1)) for p in grid
            ]
    return out


def room(
    results: dict[str, Any],
    methods: dict[str, Any],
    target: ModelCost,
    drafter: ModelCost,
    points: Sequence[ServingPoint],
) -> dict[str, Any]:
    """The trained drafter's ceiling and break-even at each point against the best of the free methods
    (each at its best k there) and plain decoding, and its measured acceptance per position."""
    free = [k for k, p in methods.items() if p["kind"] in FREE_METHODS]
    best = []
    for i in range(len(points)):
        at = {k: max(o["projected_speedup"][i] for o in methods[k]["options"]) for k in free}
        best.append(max([("plain", 1.0), *at.items()], key=lambda m: m[1]))
    rows = results["methods"]["eagle3"]["per_prompt"]
    accepted = [sum(col) for col in zip(*(r["accepted_per_pos"] for r in rows), strict=True)]
    return {
        **drafter_room(target, drafter, int(results["num_draft_tokens"]), points, [s for _, s in best]),
        "to_beat_method": [m for m, _ in best],
        "position_acceptance": position_acceptance(accepted, sum(int(r["drafts"]) for r in rows)),
    }


def summary_of(projection: dict[str, Any] | None) -> dict[str, Any] | None:
    """A method's projection without per-prompt counts (for tables and the JSON summary's headline)."""
    if projection is None:
        return None
    best = chosen(projection)
    return {
        "kind": projection["kind"],
        "k": projection["chosen_k"],
        "measured_at_k": best["measured"],
        "tokens_per_forward": best["tokens_per_forward"],
        "tokens_per_forward_interval": best["tokens_per_forward_interval"],
        "projected_speedup": best["projected_speedup"],
        "projected_intervals": best["projected_intervals"],
        "by_k": [
            {
                "k": o["k"],
                "tokens_per_forward": o["tokens_per_forward"],
                "projected_speedup": o["projected_speedup"],
                "measured": o["measured"],
            }
            for o in projection["options"]
        ],  # fmt: skip
    }
