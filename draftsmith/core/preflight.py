"""Know before you spend: what a drafter could gain for this target at this serving point, before any
generation, extraction or training.

The free methods (n-gram lookup, suffix decoding) and plain decoding are measured in vLLM on the user's
own held-out prompts first (the same runs the final evaluation reuses). With the target's shape, the
drafter's planned shape and the serving point, the cost model then gives, per draft length k and
concurrency:

    ceiling     the drafter's projected speedup were every draft accepted (k + 1 tokens per forward)
    break-even  the per-position acceptance a chain drafter must reach to match the best choice without
                training (the best free method, or plain decoding's 1.0x)

Where the ceiling stays below that choice at every concurrency, no training can help: the run stops
before generation (evaluate.preflight: block) or says so and goes on (warn).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draftsmith.core.cost import (
    ModelCost,
    ServingPoint,
    best_draft_length,
    draft_length_options,
    kv_elements_per_token,
)
from draftsmith.core.memory import drafter_shape
from draftsmith.core.policy import break_even, ceiling

# how each drafter kind drafts k tokens (cost.ModelCost.drafting), before there is an export to read it from
KIND_DRAFTING = {"eagle3": "chain", "eagle3.1": "chain", "peagle": "parallel", "dflash": "block"}


def planned_drafter_cost(
    plan: dict[str, Any], target_config: dict[str, Any], bytes_per_parameter: float
) -> ModelCost:
    """One pass of the drafter training will build, from its planned shape (memory.drafter_shape: the
    target's config.json and train.drafter) before it exists. plan: {"drafter": train.drafter,
    "vocab_size": vocab.size, "aux_layers": extract.aux_layers}."""
    drafter = dict(plan.get("drafter") or {})
    aux = plan.get("aux_layers")
    config = {"train": {"drafter": drafter}, "vocab": {"size": plan["vocab_size"]}}
    shape = drafter_shape(config, target_config, len(aux) if aux else 3)
    kind = drafter.get("kind") or "eagle3"
    layers = int(drafter.get("num_layers") or 1) if kind == "dflash" else 1
    kv = kv_elements_per_token({
        "num_hidden_layers": layers, "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads, "head_dim": shape.head_dim,
        "hidden_size": shape.hidden_size,
    })  # fmt: skip
    params = float(shape.params()) * layers  # DFlash: the layer's weights once per layer (an estimate)
    return ModelCost(params, 0.0, 1.0, kv * bytes_per_parameter, layers, KIND_DRAFTING[kind])


def free_best(
    methods: dict[str, dict[str, Any]], max_k: int, target: ModelCost, points: Sequence[ServingPoint]
) -> list[dict[str, Any]]:
    """Per point: the best choice without training, {"method", "k", "speedup"}, plain decoding (k = 0,
    1.0x) included, from each free method's per-prompt counts at max_k."""
    best = [{"method": "plain", "k": 0, "speedup": 1.0} for _ in points]
    for name, method in methods.items():
        rows = method.get("per_prompt")
        if not rows:
            continue
        options = draft_length_options(rows, max_k, name, target, points)
        for i in range(len(points)):
            k = best_draft_length(options, i)
            speedup = options[k - 1]["projected_speedup"][i]
            if speedup > best[i]["speedup"]:
                best[i] = {"method": name, "k": k, "speedup": speedup}
    return best


def drafter_outlook(
    target: ModelCost, drafter: ModelCost, max_k: int, points: Sequence[ServingPoint], to_beat: list[float]
) -> list[dict[str, Any]]:
    """Per point: the drafter's ceiling at each k = 1..max_k, its best, and the break-even acceptance
    per k against to_beat[i] (None where even the ceiling cannot reach it)."""
    out = []
    for i, point in enumerate(points):
        ceilings = [ceiling(target, drafter, k, point) for k in range(1, max_k + 1)]
        out.append({
            "concurrency": point.concurrency,
            "ceiling": ceilings,
            "best_ceiling": max(ceilings),
            "break_even": [break_even(target, drafter, k, point, to_beat[i]) for k in range(1, max_k + 1)],
        })  # fmt: skip
    return out


def set_outlook(
    methods: dict[str, dict[str, Any]],
    max_k: int,
    target: ModelCost,
    drafter: ModelCost,
    points: Sequence[ServingPoint],
) -> dict[str, Any]:
    """One held-out set's pre-flight: the best free choice and the drafter's outlook at every point, and
    whether the drafter could beat it anywhere (`room`)."""
    best = free_best(methods, max_k, target, points)
    outlook = drafter_outlook(target, drafter, max_k, points, [b["speedup"] for b in best])
    room = [o["best_ceiling"] > b["speedup"] for o, b in zip(outlook, best, strict=True)]
    return {"free_best": best, "drafter": outlook, "room": room, "any_room": any(room)}


def outlook_line(name: str, outlook: dict[str, Any], device: str) -> str:
    """One line for a set at the first concurrency: what to serve now and what a drafter could reach."""
    best, drafter = outlook["free_best"][0], outlook["drafter"][0]
    serve = "plain decoding" if best["method"] == "plain" else f"{best['method']} (k = {best['k']})"
    k = drafter["ceiling"].index(drafter["best_ceiling"]) + 1
    a = drafter["break_even"][k - 1]
    need = f"each draft accepted with probability >= {a:.2f} at k = {k}" if a is not None else "unreachable"
    verdict = "room for a drafter" if outlook["any_room"] else "no drafter can beat it at any concurrency"
    return (
        f"{name}: serve {serve} at {best['speedup']:.2f}x ({device}, concurrency {drafter['concurrency']}); "
        f"a perfect drafter reaches {drafter['best_ceiling']:.2f}x (k = {k}); to beat it: {need}; {verdict}"
    )
