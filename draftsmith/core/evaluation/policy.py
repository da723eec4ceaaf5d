"""What to serve at every load, and what a drafter must reach to be worth training.

Speculation pays at low concurrency and stops paying past a crossover: the verify step over k+1 tokens
and the drafter's passes cost more as the batch grows, while plain decoding's step barely does. So the
answer is a policy over the serving point's concurrencies, in vLLM's own terms. Every figure here comes
from draftsmith.core.evaluation.cost (the step times, the options k = 1..K from the counts measured at K); nothing
is re-derived.

    concurrency_grid(serving)                      [1, 2, 4, ..., the largest configured concurrency]
    ceiling(target, drafter, k, point)             a drafter's projected speedup, every draft accepted
    break_even(target, drafter, k, point, to_beat) the per-position acceptance it must reach to match
    serving_policy(methods_by_k, target, drafters, grid)
                                                   per concurrency the best method and k; crossovers
    vllm_schedule(policy, method)                  num_speculative_tokens_per_batch_size
    suffix_cutoff(policy)                          where to stop serving suffix decoding (static k only)

A drafter's acceptance is modelled as one per-position acceptance a (position i is accepted given
position i-1 was): tokens per target forward at k = 1 + a + a^2 + ... + a^k, whatever its drafting shape
(chain, parallel, block verify the same way; only their drafting cost differs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from draftsmith.core.evaluation.cost import ModelCost, ServingPoint, draft_length_options, projected_speedup
from draftsmith.core.evaluation.methods import DRAFTED, FREE_METHODS, METHODS
from draftsmith.core.evaluation.methods import method as method_record
from draftsmith.core.model.kinds import KINDS

# the kinds' drafting shapes: EAGLE-3 (k passes), P-EAGLE, DFlash (one pass each)
DRAFTING_SHAPES = tuple(dict.fromkeys(k.drafting for k in KINDS.values()))
SCHEDULED = tuple(k for k, m in METHODS.items() if m.per_batch_k)  # suffix: vLLM serves a static k only
UNSERVED = tuple(k for k, m in METHODS.items() if not m.served)  # a control, an offline-only projection
TOLERANCE = 1e-4  # of the break-even acceptance


def concurrency_grid(serving: dict[str, Any]) -> list[int]:
    """Powers of two from 1 to the largest of evaluate.serving.concurrency, and the configured values."""
    configured = [int(b) for b in serving["concurrency"]]
    top, powers = max(configured), [1]
    while powers[-1] * 2 <= top:
        powers.append(powers[-1] * 2)
    return sorted(set(powers) | set(configured))


# ------------------------------------------------------------------------------ ceiling, break-even


def chain_tokens(a: float, k: int) -> float:
    """Tokens per target forward at draft length k when each position is accepted with probability a
    given the one before: 1 + a + ... + a^k (the bonus token, then the accepted prefix)."""
    return sum(a**i for i in range(k + 1))


def with_shape(drafter: ModelCost, shape: str) -> ModelCost:
    """The same drafter drafting as `shape` (cost.ModelCost.drafting): what the kind would cost."""
    if shape not in DRAFTING_SHAPES:
        raise ValueError(f"drafting shape {shape!r}: expected one of {', '.join(DRAFTING_SHAPES)}")
    return replace(drafter, drafting=shape)


def ceiling(target: ModelCost, drafter: ModelCost, k: int, point: ServingPoint) -> float:
    """The drafter's projected speedup when every draft is accepted (k+1 tokens per target forward),
    its drafting shape (drafter.drafting) paying its passes: no training can do better."""
    return projected_speedup(k + 1, DRAFTED, k, target, point, drafter)


def break_even(
    target: ModelCost, drafter: ModelCost, k: int, point: ServingPoint, to_beat: float
) -> float | None:
    """The per-position acceptance a at which the drafter's projected speedup equals `to_beat` (the best
    free method's there): None when even a = 1 falls short, 0.0 when a = 0 already reaches it. Bisection
    on [0, 1] (the speedup rises with a), to TOLERANCE; the upper end, so a reaches `to_beat`."""

    def speedup(a: float) -> float:
        return projected_speedup(chain_tokens(a, k), DRAFTED, k, target, point, drafter)

    if speedup(1.0) < to_beat:
        return None
    if speedup(0.0) >= to_beat:
        return 0.0
    lo, hi = 0.0, 1.0
    while hi - lo > TOLERANCE:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if speedup(mid) >= to_beat else (mid, hi)
    return hi


def position_acceptance(accepted_per_pos: Sequence[int], drafts: int) -> list[float]:
    """Measured acceptance per position given the one before (what break_even's a is): position 1 over
    the steps that drafted, position i over the steps that accepted position i-1."""
    out, before = [], drafts
    for accepted in accepted_per_pos:
        out.append(accepted / before if before else 0.0)
        before = accepted
    return out


def drafter_room(
    target: ModelCost,
    drafter: ModelCost,
    max_k: int,
    points: Sequence[ServingPoint],
    to_beat: Sequence[float],
) -> dict[str, Any]:
    """At each point (to_beat: the speedup to match there, one per point), per k = 1..max_k the drafter's
    ceiling and break-even; then the highest ceiling (over k: no training beats it at any k) and the
    lowest break-even (the easiest k to win at; None when no k can)."""
    by_k: list[dict[str, Any]] = [
        {
            "k": k,
            "ceiling": [ceiling(target, drafter, k, p) for p in points],
            "break_even": [
                break_even(target, drafter, k, p, b) for p, b in zip(points, to_beat, strict=True)
            ],
        }
        for k in range(1, max_k + 1)
    ]
    lowest = []
    for i in range(len(points)):
        reachable = [o["break_even"][i] for o in by_k if o["break_even"][i] is not None]
        lowest.append(min(reachable) if reachable else None)
    return {
        "shape": drafter.drafting,
        "to_beat": list(to_beat),
        "by_k": by_k,
        "ceiling": [max(o["ceiling"][i] for o in by_k) for i in range(len(points))],
        "break_even": lowest,
    }


# ------------------------------------------------------------------------------------ serving policy


def method_kind(key: str, method: dict[str, Any]) -> str:
    """A measured method's kind as the cost model reads it (results before kinds: its record's)."""
    return method.get("kind") or method_record(key).cost or DRAFTED


def methods_at_k(results: dict[str, Any], drafters: dict[str, ModelCost]) -> dict[str, dict[str, Any]]:
    """The methods one could serve, from one set's results (vllm.json or offline.json): the free methods
    and the drafters whose shape is known, each {"kind", "max_k", "per_prompt"} as measured at K =
    num_draft_tokens; those without per-prompt acceptance counts are left out."""
    out = {}
    for key, method in results["methods"].items():
        kind, rows = method_kind(key, method), method.get("per_prompt")
        if key in UNSERVED or (kind not in FREE_METHODS and key not in drafters):
            continue
        if rows and all("accepted_per_pos" in r for r in rows):
            out[key] = {"kind": kind, "max_k": int(results["num_draft_tokens"]), "per_prompt": rows}
    return out


def serving_policy(
    methods_by_k: dict[str, dict[str, Any]],
    target: ModelCost,
    drafters: dict[str, ModelCost],
    grid: Sequence[ServingPoint],
) -> dict[str, Any]:
    """Per concurrency of the grid (one serving point each) the best method and k, plain decoding (k = 0)
    where nothing projects above 1.0x; per method its own best k and speedup at each concurrency, the
    range of concurrencies where it is the best (first to last), and its crossover: the last concurrency where it still
    beats plain decoding when plain wins at every one past it (0: it never pays; None: it pays up to the
    grid's end). methods_by_k: `methods_at_k`. JSON-able."""
    concurrency = [p.concurrency for p in grid]
    per_method: dict[str, list[dict[str, Any]]] = {}
    for key, m in methods_by_k.items():
        options = draft_length_options(
            m["per_prompt"], m["max_k"], m["kind"], target, grid, drafters.get(key)
        )
        per_method[key] = []
        for i, c in enumerate(concurrency):  # the shortest k among equals, as cost.best_draft_length
            top = max(options, key=lambda o: (o["projected_speedup"][i], -o["k"]))
            per_method[key].append({"concurrency": c, "k": top["k"], "speedup": top["projected_speedup"][i]})
    best: list[dict[str, Any]] = []
    for i, c in enumerate(concurrency):
        entry: dict[str, Any] = {"concurrency": c, "method": "plain", "k": 0, "speedup": 1.0}
        for key, at in per_method.items():
            if at[i]["speedup"] > entry["speedup"]:
                entry = {"concurrency": c, "method": key, "k": at[i]["k"], "speedup": at[i]["speedup"]}
        best.append(entry)
    ranges: dict[str, list[int]] = {}
    for entry in best:
        lo_hi = ranges.setdefault(entry["method"], [entry["concurrency"], entry["concurrency"]])
        lo_hi[1] = entry["concurrency"]
    return {
        "grid": concurrency,
        "best": best,
        "ranges": ranges,
        "crossover": {key: crossover(at) for key, at in per_method.items()},
        "methods": per_method,
    }


def crossover(at: Sequence[dict[str, Any]]) -> int | None:
    """The last concurrency where a method beats plain decoding, past which plain wins at every grid
    concurrency; 0 when it never does, None when it still does at the grid's end."""
    if at[-1]["speedup"] > 1.0:
        return None
    paying = [e["concurrency"] for e in at if e["speedup"] > 1.0]
    return paying[-1] if paying else 0


def vllm_schedule(policy: dict[str, Any], method: str) -> list[list[int]] | None:
    """vLLM's speculative_config.num_speculative_tokens_per_batch_size for serving `method` (a drafter or
    n-gram lookup) at every load: inclusive batch-size ranges [start, end, k] covering 1..the grid's end,
    its best k where it beats plain decoding, 0 (off) where it does not; equal neighbours merged. A grid
    concurrency's k holds from just past the one before it up to it: the larger batch's choice, the safe
    side, since speculation pays less as the batch grows. None for suffix decoding (vLLM serves it with
    a static k only: `suffix_cutoff`) and for a method the policy did not measure."""
    if method not in SCHEDULED or method not in policy["methods"]:
        return None
    schedule: list[list[int]] = []
    start = 1
    for entry in policy["methods"][method]:
        k = entry["k"] if entry["speedup"] > 1.0 else 0
        if schedule and schedule[-1][2] == k:
            schedule[-1][1] = entry["concurrency"]
        else:
            schedule.append([start, entry["concurrency"], k])
        start = entry["concurrency"] + 1
    return schedule


def suffix_cutoff(policy: dict[str, Any]) -> int | None:
    """The concurrency past which to serve without suffix decoding (its crossover; 0: never serve it),
    None when it pays over the whole grid or was not measured."""
    return policy["crossover"].get("suffix")
