"""Know before you spend: what a drafter could gain for this target at this serving point, before any
generation, extraction or training.

The free methods (n-gram lookup, suffix decoding) and plain decoding are measured in vLLM on the user's
own held-out prompts first (the same runs the final evaluation reuses). With the target's shape, the
drafter's planned shape and the serving point, the cost model then gives, per draft length k and
concurrency:

    ceiling     the drafter's projected speedup were every draft accepted (k + 1 tokens per forward)
    break-even  the per-position acceptance it must reach to match the best choice without training
                (the best free method, or plain decoding's 1.0x)   (both: draftsmith.core.evaluation.policy)

Where the ceiling stays below that choice at every concurrency, no training can help: the run stops
before generation (evaluate.preflight: block) or says so and goes on (warn).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draftsmith.core.config.settings import schema_default
from draftsmith.core.evaluation.cost import (
    ModelCost,
    ServingPoint,
    best_draft_length,
    draft_length_options,
    kv_elements_per_token,
)
from draftsmith.core.evaluation.policy import drafter_room
from draftsmith.core.model.kinds import kind
from draftsmith.core.planning.memory import drafter_shape


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
    # how its kind drafts k tokens (cost.ModelCost.drafting), before there is an export to read it from
    record = kind(drafter.get("kind") or schema_default("train.drafter.kind"))
    layers = int(drafter.get("num_layers") or 1) if record.layers else 1
    kv = kv_elements_per_token({
        "num_hidden_layers": layers, "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads, "head_dim": shape.head_dim,
        "hidden_size": shape.hidden_size,
    })  # fmt: skip
    params = float(shape.params()) * layers  # DFlash: the layer's weights once per layer (an estimate)
    return ModelCost(params, 0.0, 1.0, kv * bytes_per_parameter, layers, record.drafting)


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
    room = drafter_room(target, drafter, max_k, points, [b["speedup"] for b in best])
    pays = [c > b["speedup"] for c, b in zip(room["ceiling"], best, strict=True)]
    return {
        "concurrency": [p.concurrency for p in points],
        "free_best": best,
        "drafter": room,
        "room": pays,
        "any_room": any(pays),
    }


def outlook_line(name: str, outlook: dict[str, Any], device: str) -> str:
    """One line for a set at the first concurrency: what to serve now and what a drafter could reach."""
    best, room = outlook["free_best"][0], outlook["drafter"]
    serve = serve_label(best)
    top = room["ceiling"][0]
    k = max(room["by_k"], key=lambda o: o["ceiling"][0])["k"]
    a = room["break_even"][0]
    need = f"per-position acceptance >= {a:.2f}" if a is not None else "out of reach"
    pays = [i for i, p in enumerate(outlook["room"]) if p]
    where = "no drafter can beat it at any load"
    if pays:
        loads = ", ".join(str(outlook["concurrency"][i]) for i in pays)
        first = room["break_even"][pays[0]]
        where = f"a drafter could pay at concurrency {loads} (from per-position acceptance {first:.2f})"
    return (
        f"{name}: serve {serve} at {best['speedup']:.2f}x ({device}, concurrency {outlook['concurrency'][0]}); "
        f"a perfect drafter reaches {top:.2f}x (k = {k}), to beat it: {need}; {where}"
    )


def serve_label(best: dict[str, Any]) -> str:
    return "plain decoding" if best["method"] == "plain" else f"{best['method']} (k = {best['k']})"


def blocked_message(sets: dict[str, dict[str, Any]]) -> str:
    """The one line a blocked pre-flight stops with: per set what to serve and a perfect drafter's figure,
    at the first concurrency."""
    per_set = "; ".join(
        f"{name}: {serve_label(o['free_best'][0])} {o['free_best'][0]['speedup']:.2f}x, a perfect drafter "
        f"{o['drafter']['ceiling'][0]:.2f}x"
        for name, o in sets.items()
    )
    return (
        f"pre-flight: no drafter can beat the best choice without training at any concurrency up to "
        f"{max(next(iter(sets.values()))['concurrency'])} ({per_set}); serve that, or set "
        "evaluate.preflight: warn to train anyway"
    )
