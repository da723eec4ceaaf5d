"""What a method costs the user: projected wall-clock speedup at a serving point.

Speculation saves target forwards (tokens per target forward, measured) and costs the drafter's own
passes, a verify step over more tokens, and the free methods' lookup. At a serving point (a device,
tensor parallel degree, concurrency B, context length) one decode step of a method takes

    t_forward(model, n tokens per sequence) = overhead
        + bytes read / (bandwidth x bandwidth efficiency)        weights (MoE: the experts B x n tokens
                                                                 touch) + B x context x KV bytes per token
        + 2 x active parameters x B x n / (peak FLOP/s x FLOP efficiency)
        + 2 x layers x all-reduce latency                       with tensor parallel > 1
    plain          t_forward(target, 1)
    EAGLE-3 at k   t_forward(target, 1 + k) + k x t_forward(drafter, 1)      k sequential drafter passes
    n-gram, suffix t_forward(target, 1 + k x draft share) + B x lookup time   no model weights read
                   (lookup time: the method's own where measured, method_lookup_us, else lookup_us)
    hybrid at k    t_forward(target, 1 + k x draft share) + B x lookup time + the drafter's passes: k on
                   the steps it drafts (the tree had nothing), 1 on the others (it catches up every step)

    projected speedup = tokens per target forward (at k) x t_plain / t_step(method, k)

Bytes and FLOPs add (no overlap assumed), which fits decode, where neither saturates. The per-forward
overhead (launch, scheduling, sampling) is what makes a drafter pass cost more than its bytes on a fast
GPU: vLLM's measured step times for Llama-3.1-8B with an EAGLE-3 drafter on an H100 put it near 1 ms
(docs/evaluation.md, "The cost model", validated there and in bench/cost.py against measurements).
Tokens per target forward at k < K comes from the acceptance histograms measured at K (a chain that
drafts k tokens accepts min(accepted, k) of them); the chosen k is re-measured in vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from draftsmith.core.evaluation.methods import FREE_METHODS
from draftsmith.core.model.kinds import kind, kind_of_export

EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")

FORMULA = (
    "projected speedup = tokens per target forward at k x t_plain / t_step(method, k); t_forward = overhead + "
    "bytes / bandwidth + FLOPs / peak (+ tensor-parallel all-reduces); EAGLE-3: target over 1 + k tokens + k "
    "drafter passes; n-gram, suffix: target over 1 + k x draft share tokens + lookup"
)


@dataclass(frozen=True)
class Device:
    """One accelerator's decode-relevant figures. Peaks from the vendors' data sheets (dense bf16);
    efficiencies and overhead: what decode kernels reach (docs/evaluation.md)."""

    name: str
    bandwidth_gb_s: float  # HBM (or DRAM) bandwidth, GB/s
    tflops: float  # dense bf16 peak, TFLOP/s
    overhead_ms: float  # per model forward: launch, scheduling, sampling
    memory_gib: float | None = None
    bandwidth_efficiency: float = 0.8
    flops_efficiency: float = 0.6
    allreduce_us: float = 10.0  # per all-reduce of one decode step's activations (NVLink)
    # the per-forward overhead's split where one fixed figure is wrong (a CPU: measured, `fit_overheads`):
    # per layer of the model (a 1-layer drafter pays 1/30 of a 30-layer target's) and per token decoded
    layer_overhead_ms: float = 0.0
    token_overhead_us: float = 0.0


# Peaks: the vendors' data sheets (SXM parts, dense bf16). memory_gib: what torch reports as the card's
# total memory (the memory plan's budget, resources.gpu_model); None where not measured here.
DEVICES = {
    d.name: d
    for d in (
        Device("H100-80GB", 3350, 989, 1.0, 79.19),
        Device("H200-141GB", 4800, 989, 1.0, 139.8),
        Device("A100-80GB", 2039, 312, 1.0, 79.15),
        Device("A100-40GB", 1555, 312, 1.0, 39.39),
        Device("B200", 8000, 2250, 1.0),
        Device("L40S", 864, 362, 1.0),
    )
}


@dataclass(frozen=True)
class ModelCost:
    """What one forward of a model reads and computes, from its weights' shapes."""

    dense_parameters: float  # read whatever the batch: attention, dense MLPs, shared experts, lm_head
    routed_parameters: float  # all routed experts (0 for a dense model)
    expert_share: float  # routed experts one token reads (1.0 dense)
    kv_bytes_per_token: float  # KV cache of one context token over all layers, at bytes_per_parameter
    layers: int
    # a drafter's way to draft k tokens: "chain" (EAGLE-3, 3.1: k passes), "parallel" (P-EAGLE: one pass
    # over the k catch-up and mask slots), "block" (DFlash: one pass over the next token and k masks)
    drafting: str = "chain"

    def weights_read(self, tokens: float) -> float:
        """Parameters read by one forward over `tokens` tokens: a routed expert is read when any token
        picks it (uniform routing assumed)."""
        if not self.routed_parameters:
            return self.dense_parameters
        touched = 1.0 - (1.0 - self.expert_share) ** max(tokens, 1.0)
        return self.dense_parameters + self.routed_parameters * touched

    @property
    def active_parameters(self) -> float:
        """Parameters one token multiplies by (2 FLOPs each)."""
        return self.dense_parameters + self.routed_parameters * self.expert_share


@dataclass(frozen=True)
class ServingPoint:
    """One point of evaluate.serving (`serving_points` builds them; the schema holds the defaults)."""

    device: Device
    concurrency: int
    context_tokens: float
    tensor_parallel: int
    bytes_per_parameter: float
    lookup_us: float  # a free method's lookup, per request and step (CPU side)
    # a method's own lookup where it was measured (this CPU's profile fits it: vLLM's n-gram proposer
    # costs milliseconds a request there), replacing lookup_us for that method
    method_lookup_us: Mapping[str, float]


def lookup_seconds(point: ServingPoint, kind: str) -> float:
    """One step's lookup of a free method (or the hybrid's suffix tree) over the point's requests."""
    return point.concurrency * point.method_lookup_us.get(kind, point.lookup_us) * 1e-6


def forward_seconds(model: ModelCost, point: ServingPoint, tokens_per_sequence: float) -> float:
    """One forward of `model` over `tokens_per_sequence` tokens of each of the point's sequences."""
    d, tp, b = point.device, point.tensor_parallel, point.concurrency
    tokens = b * tokens_per_sequence
    weight_bytes = model.weights_read(tokens) * point.bytes_per_parameter
    kv_bytes = b * point.context_tokens * model.kv_bytes_per_token
    memory = (weight_bytes + kv_bytes) / tp / (d.bandwidth_gb_s * 1e9 * d.bandwidth_efficiency)
    compute = 2 * model.active_parameters * tokens / tp / (d.tflops * 1e12 * d.flops_efficiency)
    comm = 2 * model.layers * d.allreduce_us * 1e-6 if tp > 1 else 0.0
    overhead = (
        d.overhead_ms * 1e-3 + model.layers * d.layer_overhead_ms * 1e-3 + tokens * d.token_overhead_us * 1e-6
    )
    return overhead + memory + compute + comm


def step_seconds(
    kind: str,
    k: int,
    target: ModelCost,
    point: ServingPoint,
    drafter: ModelCost | None = None,
    draft_share: float = 1.0,
    drafter_share: float = 1.0,
) -> float:
    """One decode step of a method at draft length k (k = 0: plain decoding). kind: eagle3 (a trained
    drafter, drafting as its export does: `drafting_seconds`), a free method (ngram, suffix) that drafts
    on `draft_share` of steps, or hybrid (suffix decoding, the drafter on `drafter_share` of steps)."""
    if k == 0 or kind == "plain":
        return forward_seconds(target, point, 1)
    lookup = lookup_seconds(point, kind)
    if kind in FREE_METHODS:
        return forward_seconds(target, point, 1 + k * draft_share) + lookup
    if drafter is None:
        raise ValueError(f"method {kind!r} drafts with a model: its cost needs the drafter's shape")
    drafting = drafting_seconds(drafter, point, k)
    if kind == "hybrid":  # steps the suffix tree drafts still catch the drafter up: one pass of a token
        catch_up = (1.0 - drafter_share) * forward_seconds(drafter, point, 1)
        return (
            forward_seconds(target, point, 1 + k * draft_share) + lookup + drafter_share * drafting + catch_up
        )
    return forward_seconds(target, point, 1 + k) + drafting


def prefill_seconds(model: ModelCost, point: ServingPoint, prompt_tokens: float) -> float:
    """What a model's prefill of `prompt_tokens` prompt tokens adds to the steps it rides in (vLLM
    schedules a prompt's chunk into a decode step, whose weights are read anyway): their FLOPs and their
    per-token overhead."""
    d = point.device
    flop_rate = d.tflops * 1e12 * d.flops_efficiency * point.tensor_parallel
    return prompt_tokens * (2 * model.active_parameters / flop_rate + d.token_overhead_us * 1e-6)


def run_seconds(
    kind: str,
    k: int,
    target: ModelCost,
    point: ServingPoint,
    steps: float,
    prompt_tokens: float,
    drafter: ModelCost | None = None,
    draft_share: float = 1.0,
) -> float:
    """Requests served start to end as an engine's wall clock counts them: `steps` decode steps of the
    method at the point and the prompts' prefill, the target's and, for a method that drafts with a
    model, the drafter's (it runs over the prompt to catch up). What bench/cost.py compares with vLLM."""
    prefill = prefill_seconds(target, point, prompt_tokens)
    if k and drafter is not None and kind not in (*FREE_METHODS, "plain"):
        prefill += prefill_seconds(drafter, point, prompt_tokens)
    return steps * step_seconds(kind, k, target, point, drafter, draft_share) + prefill


def drafting_seconds(drafter: ModelCost, point: ServingPoint, k: int) -> float:
    """The drafter's time to draft k tokens per verify step, as vLLM runs its kind: chain = k passes of
    one token (the first also re-reads the accepted tokens: nothing more when memory-bound); parallel =
    one pass over 2k tokens (up to k catch-up slots, the bonus and k-1 mask slots); block = one pass over
    1+k tokens (the next token and k mask slots; the context's projections ride in the same bytes)."""
    if drafter.drafting == "parallel":
        return forward_seconds(drafter, point, 2 * k)
    if drafter.drafting == "block":
        return forward_seconds(drafter, point, 1 + k)
    return k * forward_seconds(drafter, point, 1)


def projected_speedup(
    tokens_per_forward: float,
    kind: str,
    k: int,
    target: ModelCost,
    point: ServingPoint,
    drafter: ModelCost | None = None,
    draft_share: float = 1.0,
    drafter_share: float = 1.0,
) -> float:
    """Tokens per unit of time relative to plain decoding at the serving point."""
    return tokens_per_forward * speedup_factor(kind, k, target, point, drafter, draft_share, drafter_share)


# ------------------------------------------------------------------------------------ draft length


def accepted_at(accepted_per_pos: Sequence[int], k: int) -> int:
    """Drafts accepted had each step drafted only k tokens: a chain accepts min(accepted, k), i.e. the
    steps that accepted position i, summed over i < k (accepted_per_pos[i] = steps accepting > i)."""
    return int(sum(accepted_per_pos[:k]))


def forwards_at(tokens: int, forwards: int, accepted_per_pos: Sequence[int], k: int) -> float:
    """Target forwards one prompt would take at draft length k, from its counts at K >= k: the same
    tokens at the mean tokens per step that truncating every step's acceptance to k gives. Exact at K;
    tokens = forwards + accepted there, which `tokens` checks nothing against (it is the same output)."""
    if forwards <= 0:
        return float(forwards)
    full = accepted_at(accepted_per_pos, len(accepted_per_pos))
    return forwards * (forwards + full) / (forwards + accepted_at(accepted_per_pos, k))


# ------------------------------------------------------------------------------------ model shapes


def tensor_sizes(folder: str | Path) -> dict[str, int]:
    """name -> element count of every tensor in the folder's safetensors files (headers only)."""
    sizes: dict[str, int] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sizes[name] = math.prod(f.get_slice(name).get_shape())
    if not sizes:
        raise ValueError(f"{folder}: no safetensors weights to count")
    return sizes


def active_expert_share(config: dict) -> float:
    """The share of routed experts one token reads (1.0 for a dense model)."""
    per_token = config.get("num_experts_per_tok")
    total = next((config[k] for k in EXPERT_COUNT_KEYS if config.get(k)), None)
    return per_token / total if per_token and total else 1.0


def kv_elements_per_token(config: dict) -> float:
    """KV-cache elements one context token holds over all layers: MLA caches its compressed latent
    (kv_lora_rank + qk_rope_head_dim); other attention 2 x kv heads x head dim."""
    layers = int(config.get("num_hidden_layers") or 0)
    if config.get("kv_lora_rank"):
        return layers * (config["kv_lora_rank"] + (config.get("qk_rope_head_dim") or 0))
    heads = config.get("num_attention_heads") or 1
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return layers * 2 * kv_heads * head_dim


def target_cost(target_path: str | Path, bytes_per_parameter: float) -> ModelCost:
    """The target's forward: its weights by name (the embedding is not read, only a few rows; the
    lm_head is, or the tied embedding in its place), routed experts apart."""
    from draftsmith.core.model.target import text_config_dict

    config = text_config_dict(target_path)
    sizes = tensor_sizes(target_path)
    tied = not any("lm_head" in name for name in sizes)
    dense = routed = 0.0
    for name, n in sizes.items():
        if "embed_tokens" in name and not tied:
            continue
        if ".experts." in name and "shared_experts" not in name:
            routed += n
        else:
            dense += n
    return ModelCost(
        dense_parameters=dense,
        routed_parameters=routed,
        expert_share=active_expert_share(config) if routed else 1.0,
        kv_bytes_per_token=kv_elements_per_token(config) * bytes_per_parameter,
        layers=int(config.get("num_hidden_layers") or 1),
    )


def drafter_cost(export_dir: str | Path, bytes_per_parameter: float) -> ModelCost:
    """One drafter pass of an export: everything but the vocabulary maps and the target's embedding
    that speculators' format carries; its one layer's KV cache."""
    import json

    skip = ("d2t", "t2d", "embed_tokens.weight")
    params = float(sum(n for name, n in tensor_sizes(export_dir).items() if name not in skip))
    config = json.loads((Path(export_dir) / "config.json").read_text(encoding="utf-8"))
    layers = int(config.get("num_hidden_layers") or 1)
    kv = kv_elements_per_token({**config, "num_hidden_layers": layers}) if config.get("hidden_size") else 0.0
    return ModelCost(
        params, 0.0, 1.0, kv * bytes_per_parameter, layers, kind(kind_of_export(config)).drafting
    )


# ------------------------------------------------------------------------------------ calibration

OVERHEAD_TERMS = ("overhead_ms", "layer_overhead_ms", "token_overhead_us")
OVERHEAD_UNITS = (1e-3, 1e-3, 1e-6)  # seconds per unit of each term
# evaluate.serving.device: the profile bench/cost.py measured here (evaluate.serving.profile)
THIS_CPU = "this-cpu"


def term_counts(
    price: Callable[[ServingPoint], float], point: ServingPoint, lookups: Sequence[str] = ()
) -> tuple[float, tuple[float, ...]]:
    """What `price` (seconds at a point: a step, a run) charges split as the fit sees it: (the seconds its
    bytes, FLOPs and the lookups not fitted cost with no overhead, the count each fitted term multiplies:
    OVERHEAD_TERMS in their units, then the lookup of each method of `lookups` in us). Read off `price`
    at points with one unit term each, so the split is the model's own (linear in the terms)."""
    zero_device = replace(point.device, overhead_ms=0.0, layer_overhead_ms=0.0, token_overhead_us=0.0)
    zero_lookups = {**point.method_lookup_us, **dict.fromkeys(lookups, 0.0)}
    zero = replace(point, device=zero_device, method_lookup_us=zero_lookups)
    bare = price(zero)
    units = [
        replace(zero, device=replace(zero_device, **{term: 1.0}))  # type: ignore[arg-type]
        for term in OVERHEAD_TERMS
    ] + [replace(zero, method_lookup_us={**zero_lookups, method: 1.0}) for method in lookups]
    scale = (*OVERHEAD_UNITS, *(1e-6 for _ in lookups))
    return bare, tuple((price(one) - bare) / unit for one, unit in zip(units, scale, strict=True))


def overhead_counts(
    kind: str,
    k: int,
    target: ModelCost,
    point: ServingPoint,
    drafter: ModelCost | None = None,
    draft_share: float = 1.0,
) -> tuple[float, tuple[float, ...]]:
    """One decode step of a method split as the cost model charges it (term_counts of step_seconds):
    (bare seconds, (forwards, layer-forwards, tokens)), the three counts each overhead term multiplies."""
    return term_counts(lambda p: step_seconds(kind, k, target, p, drafter, draft_share), point)


def fit_overheads(
    observations: Sequence[tuple[Sequence[float], float]],
    lookups: Sequence[str] = (),
    weights: Sequence[float] | None = None,
) -> dict[str, float]:
    """The overhead terms (OVERHEAD_TERMS, in their units) and each method's lookup of `lookups` (us a
    request and step) that best explain measured times: each observation is (its counts from
    term_counts, its measured seconds minus the bare seconds). Least squares (each residual times its
    weight: 1 / the measured seconds fits relative errors, what a speedup's error is) with every term
    >= 0 (a negative cost is no cost), exact over every subset of the terms; a term the data cannot tell
    apart from the others stays 0."""
    if not observations:
        raise ValueError("fit_overheads: no observations")
    names = (*OVERHEAD_TERMS, *lookups)
    scale = np.array([*OVERHEAD_UNITS, *(1e-6 for _ in lookups)])
    w = np.ones(len(observations)) if weights is None else np.asarray(weights, dtype=np.float64)
    a = np.array([counts for counts, _ in observations], dtype=np.float64) * scale * w[:, None]
    y = np.array([seconds for _, seconds in observations]) * w
    best: tuple[float, np.ndarray] = (float(y @ y), np.zeros(len(names)))  # all terms 0
    for mask in range(1, 2 ** len(names)):
        cols = [i for i in range(len(names)) if mask >> i & 1]
        sub = a[:, cols]
        if np.linalg.matrix_rank(sub) < len(cols):
            continue  # collinear over these observations: not identifiable
        x, *_ = np.linalg.lstsq(sub, y, rcond=None)
        if (x < 0).any():
            continue
        residual = y - sub @ x
        if float(residual @ residual) < best[0] - 1e-18:
            full = np.zeros(len(names))
            full[cols] = x
            best = (float(residual @ residual), full)
    return {name: float(v) for name, v in zip(names, best[1], strict=True)}


PROFILE_KEYS = ("bandwidth_gb_s", "tflops", *OVERHEAD_TERMS)


def load_profile(path: str | Path) -> tuple[Device, dict[str, Any]]:
    """A serving profile bench/cost.py wrote (this CPU's measured figures and fitted overheads) -> the
    device and the profile's serving settings (bytes_per_parameter, lookup_us and the methods' own
    method_lookup_us: as it was measured; a profile written before the lookups were fitted has none).
    Bad input: a ValueError naming the file and the key."""
    import json

    where = Path(path)
    if not where.is_file():
        raise ValueError(
            f"evaluate.serving.profile: {where} does not exist; measure this CPU first: python -m bench.cost "
            f"--profile {where}"
        )
    try:
        profile = json.loads(where.read_text(encoding="utf-8"))
        figures = profile["device"]
        values = {key: float(figures[key]) for key in PROFILE_KEYS}
        settings: dict[str, Any] = {key: float(profile[key]) for key in ("bytes_per_parameter", "lookup_us")}
        settings["method_lookup_us"] = {
            str(m): float(v) for m, v in (profile.get("method_lookup_us") or {}).items()
        }
    except (ValueError, KeyError, TypeError) as err:
        why = f"no key {err}" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
        raise ValueError(
            f"{where}: not a serving profile ({why}); rewrite it with python -m bench.cost"
        ) from None
    bad = [
        key
        for key, v in values.items()
        if not math.isfinite(v) or v < 0 or (v == 0 and key in PROFILE_KEYS[:2])
    ]
    if bad:
        raise ValueError(f"{where}: device.{bad[0]} = {values[bad[0]]} is not a measured figure")
    check_method_lookups(settings["method_lookup_us"], f"{where}: method_lookup_us")
    device = Device(str(figures.get("name") or THIS_CPU), memory_gib=None, bandwidth_efficiency=1.0,
                    flops_efficiency=1.0, **values)  # fmt: skip
    return device, settings


def serving_profile_errors(serving: dict[str, Any]) -> list[str]:
    """evaluate.serving.device this-cpu: the measured profile it costs methods with, read at start (the
    pre-flight, the first job, reads it)."""
    if serving["device"] != THIS_CPU:
        return []
    try:
        load_profile(serving.get("profile") or "")
    except ValueError as err:
        return [str(err)]
    return []


def check_method_lookups(lookups: Mapping[str, float], where: str) -> None:
    """Each of a method's own lookup times names a method priced with a lookup and is a time (>= 0).
    Bad input: a ValueError naming `where` and the method."""
    for method, us in lookups.items():
        if method not in (*FREE_METHODS, "hybrid"):
            known = ", ".join((*FREE_METHODS, "hybrid"))
            raise ValueError(f"{where}.{method}: not a method priced with a lookup ({known})")
        if not math.isfinite(us) or us < 0:
            raise ValueError(f"{where}.{method} = {us} is not a time in microseconds")


def serving_bytes(serving: dict[str, Any]) -> float:
    """Bytes a parameter (and a KV-cache element) weighs at the serving point of evaluate.serving: the
    measured profile's for this-cpu (vLLM-CPU decodes in float32 there), else bytes_per_parameter."""
    if serving["device"] == THIS_CPU:
        return load_profile(serving.get("profile") or "")[1]["bytes_per_parameter"]
    if serving.get("bytes_per_parameter") is None:
        from draftsmith.core.config.settings import schema_default

        return float(schema_default("evaluate.serving.bytes_per_parameter"))
    return float(serving["bytes_per_parameter"])


def serving_points(serving: dict[str, Any], context_tokens: float) -> list[ServingPoint]:
    """evaluate.serving (the schema's defaults under the keys it gives) -> one point per concurrency (the
    first is the one the verdict decides at). A preset device's figures are replaced by those the settings
    give; `this-cpu` takes them from the measured profile (evaluate.serving.profile), its bytes per
    parameter and lookup time included."""
    from draftsmith.core.config.settings import schema_default

    serving = {**schema_default("evaluate.serving"), **serving}
    name = serving["device"]
    if name == THIS_CPU:
        device, measured = load_profile(serving.get("profile") or "")
        return [
            replace(p, device=device, **measured)
            for p in serving_points({**serving, "device": next(iter(DEVICES))}, context_tokens)
        ]
    if name not in DEVICES:
        raise ValueError(
            f"evaluate.serving.device: unknown device {name!r}; known: {', '.join(DEVICES)}, {THIS_CPU}"
        )
    overrides = {
        field: serving[key]
        for key, field in (
            ("bandwidth_gb_s", "bandwidth_gb_s"),
            ("tflops", "tflops"),
            ("overhead_ms", "overhead_ms"),
            ("bandwidth_efficiency", "bandwidth_efficiency"),
            ("flops_efficiency", "flops_efficiency"),
        )
        if serving.get(key) is not None
    }
    device = replace(DEVICES[name], **overrides)
    context = serving.get("context_tokens") or context_tokens
    lookups = {str(m): float(v) for m, v in serving["method_lookup_us"].items()}
    check_method_lookups(lookups, "evaluate.serving.method_lookup_us")
    return [
        ServingPoint(
            device=device,
            concurrency=int(b),
            context_tokens=float(context),
            tensor_parallel=int(serving["tensor_parallel"]),
            bytes_per_parameter=float(serving["bytes_per_parameter"]),
            lookup_us=float(serving["lookup_us"]),
            method_lookup_us=lookups,
        )
        for b in serving["concurrency"]
    ]


def describe_point(point: ServingPoint) -> str:
    d = point.device
    tp = f", TP {point.tensor_parallel}" if point.tensor_parallel > 1 else ""
    return f"{d.name}{tp}, concurrency {point.concurrency}, context {point.context_tokens:.0f} tokens"


def speedup_factor(
    kind: str,
    k: int,
    target: ModelCost,
    point: ServingPoint,
    drafter: ModelCost | None = None,
    draft_share: float = 1.0,
    drafter_share: float = 1.0,
) -> float:
    """t_plain / t_step: what one unit of tokens per target forward is worth at the point (so that
    projected speedup = tokens per target forward x this factor, and an interval on the one scales)."""
    plain = step_seconds("plain", 0, target, point)
    return plain / step_seconds(kind, k, target, point, drafter, draft_share, drafter_share)


def counts_at(rows: Sequence[dict[str, Any]], k: int) -> tuple[list[int], list[float]]:
    """Per prompt (tokens, target forwards at draft length k) from per-prompt counts measured at K >= k
    (each row: tokens, forwards, accepted_per_pos)."""
    tokens = [int(r["tokens"]) for r in rows]
    forwards = [forwards_at(r["tokens"], r["forwards"], r["accepted_per_pos"], k) for r in rows]
    return tokens, forwards


def draft_length_options(
    rows: Sequence[dict[str, Any]],
    max_k: int,
    kind: str,
    target: ModelCost,
    points: Sequence[ServingPoint],
    drafter: ModelCost | None = None,
) -> list[dict[str, Any]]:
    """Every draft length 1..max_k of one method on some prompts: tokens per target forward (estimated
    from the acceptance at max_k) and the projected speedup at each point. The share of steps that
    drafted is taken as measured at max_k."""
    drafts = sum(int(r["drafts"]) for r in rows)
    measured_forwards = sum(int(r["forwards"]) for r in rows)
    share = drafts / measured_forwards if measured_forwards else 0.0
    # the hybrid's drafter drafts on the steps the suffix tree left empty (per-prompt drafter_steps)
    drafter_share = (
        sum(int(r.get("drafter_steps", 0)) for r in rows) / measured_forwards if measured_forwards else 0.0
    )
    options = []
    for k in range(1, max_k + 1):
        tokens, forwards = counts_at(rows, k)
        per_forward = sum(tokens) / sum(forwards) if sum(forwards) else 1.0
        factors = [speedup_factor(kind, k, target, p, drafter, share, drafter_share) for p in points]
        options.append({
            "k": k,
            "tokens_per_forward": per_forward,
            "draft_share": share,
            "speedup_factor": factors,
            "projected_speedup": [per_forward * f for f in factors],
        })  # fmt: skip
    return options


def best_draft_length(options: Sequence[dict[str, Any]], point_index: int = 0) -> int:
    """The k with the highest projected speedup at one point (the shortest among equals)."""
    return max(options, key=lambda o: (o["projected_speedup"][point_index], -o["k"]))["k"]
