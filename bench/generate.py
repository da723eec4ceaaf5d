"""Generation throughput: the transformers back-end (batched) vs a vLLM server (concurrent requests), paired.

    python -m bench.generate [--prompts results/prompts/train.jsonl] [--num-prompts 32]
                             [--max-new-tokens 64] [--repeats 2] [--json results/bench/generate.json]

Every variant runs the real generate stage (`generate_traces`) on the same prompts (the first N of
--prompts, default the built-in ones), greedy, in this one process. The variants alternate within each of
--repeats rounds: transformers at each batch size, then a vLLM server (started for the round,
`--enforce-eager`, stopped before the next round so it takes no CPU from transformers) at each
concurrency; a busy machine then slows both alike, and the per-round ratio vLLM / transformers is the
paired comparison. Tokens/s counts the generated tokens over the generation time (model load and server
start-up are reported apart). Run it on a quiet machine: the two back-ends use the cores differently.

Measured on a 2-core AVX2 EPYC (float32, 32 built-in prompts x 160 tokens, 2 rounds): transformers batch
32 at 63.6 tok/s, the vLLM server (concurrency 32) at 107.0 tok/s, 1.68x, after a 44 s start-up; the
default run's ShareGPT prompts pad worse in batches (transformers 36 tok/s there), so config.yaml
generates through `vllm-server`.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import click

from bench import harness
from bench.harness import median
from draftsmith.core.data.prompt_sources import BUILTIN_PROMPTS
from draftsmith.stages.generate import GenerateSettings, generate_traces

SERVER_KEY_ENV = "DRAFTSMITH_BENCH_SERVER_KEY"  # generate.api_key_env for the bench's own server


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run_variant(target: str, prompts: Path, work: Path, settings: GenerateSettings) -> dict:
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    summary = generate_traces(target, str(prompts), str(work / "t.jsonl"), str(work / "s.json"), settings)
    return {
        "tokens": summary["tokens"],
        "seconds": summary["seconds"],
        "tokens_per_second": summary["tokens_per_second"],
        "wall_seconds": round(time.perf_counter() - t0, 2),  # incl. model load for transformers
        "truncated": summary["truncated"],
        "errors": summary["errors"],
    }


@click.command()
@click.option("--target", default="resources/SmolLM2-135M-Instruct", show_default=True)
@click.option("--prompts", "prompts_path", default=str(BUILTIN_PROMPTS), show_default=True)
@click.option("--num-prompts", default=32, show_default=True)
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--batch-sizes", default="32", show_default=True, help="transformers back-end.")
@click.option("--concurrency", "concurrencies", default="32", show_default=True, help="server back-end.")
@click.option("--repeats", default=2, show_default=True, help="Rounds; the variants alternate within each.")
@click.option(
    "--dtype",
    default="auto",
    show_default=True,
    help="auto = bfloat16 where the CPU or GPU multiplies it natively, else float32 (as target.dtype).",
)
@click.option("--server-args", default='["--enforce-eager", "--max-model-len", "2048"]', show_default=True)
@click.option("--json", "json_path", default=str(harness.result_path("generate")), show_default=True)
def main(
    target: str,
    prompts_path: str,
    num_prompts: int,
    max_new_tokens: int,
    batch_sizes: str,
    concurrencies: str,
    repeats: int,
    dtype: str,
    server_args: str,
    json_path: str,
) -> None:
    from draftsmith.backends.server import VllmServer
    from draftsmith.core.model.precision import compute_dtype

    dtype = compute_dtype(dtype)
    load_before = harness.load_average()

    tmp = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp / "vllm-cache"))
    prompts = tmp / "prompts.jsonl"
    lines = [x for x in Path(prompts_path).read_text(encoding="utf-8").splitlines(keepends=True) if x.strip()]
    prompts.write_text("".join(lines[:num_prompts]), encoding="utf-8")
    common = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "dtype": dtype}
    runs: list[dict] = []
    startups = []
    for r in range(repeats):
        for bs in _ints(batch_sizes):
            settings = GenerateSettings(backend="transformers", batch_size=bs, **common)
            runs.append(
                {"round": r, "backend": "transformers", "setting": f"batch {bs}"}
                | run_variant(target, prompts, tmp / f"r{r}-hf{bs}", settings)
            )
        with VllmServer(
            target, extra_args=json.loads(server_args), log_path=tmp / f"server-{r}.log", dtype=dtype, seed=0
        ) as srv:
            startups.append(srv.startup_seconds)
            # the server refuses a request without its key (drawn at each start), as a user's would
            os.environ[SERVER_KEY_ENV] = srv.api_key or ""
            for c in _ints(concurrencies):
                settings = GenerateSettings(
                    backend="openai",
                    base_url=srv.base_url,
                    api_key_env=SERVER_KEY_ENV,
                    concurrency=c,
                    **common,
                )
                runs.append(
                    {"round": r, "backend": "vllm server", "setting": f"concurrency {c}"}
                    | run_variant(target, prompts, tmp / f"r{r}-srv{c}", settings)
                )
    variants = list(dict.fromkeys((x["backend"], x["setting"]) for x in runs))
    rows = []
    for backend, setting in variants:
        mine = [x for x in runs if (x["backend"], x["setting"]) == (backend, setting)]
        rows.append(
            {
                "backend": backend,
                "setting": setting,
                "tokens": mine[0]["tokens"],
                "tokens_per_second": median(x["tokens_per_second"] for x in mine),
                "per_round": [x["tokens_per_second"] for x in mine],
            }
        )
    base_setting = f"batch {max(_ints(batch_sizes))}"
    base = {x["round"]: x for x in runs if x["setting"] == base_setting}
    for row in rows:  # paired: each round's ratio to that round's transformers run, then the median
        mine = [x for x in runs if (x["backend"], x["setting"]) == (row["backend"], row["setting"])]
        ratios = harness.paired_ratios(
            mine, [base[x["round"]] for x in mine], lambda x: x["tokens_per_second"]
        )
        row["ratio_per_round"] = [round(q, 3) for q in ratios]
        row["ratio"] = round(median(ratios), 3)
    print(
        f"\n{len(lines[:num_prompts])} prompts x <= {max_new_tokens} new tokens, greedy, {dtype}, {repeats} rounds; "
        f"server start-up {median(startups):.0f}s"
    )
    columns = [("backend", "<12"), ("setting", "<14"), ("tokens", ">6"), ("tok/s", ">6.1f"), ("ratio", ">5.2f"),
               ("per round", "<")]  # fmt: skip
    table = [[r["backend"], r["setting"], r["tokens"], r["tokens_per_second"], r["ratio"], str(r["per_round"])]
             for r in rows]  # fmt: skip
    print(harness.format_table(columns, table))
    print(f"ratio = median over rounds of tok/s / that round's transformers {base_setting}")
    result = {
        "prompts": prompts_path,
        "num_prompts": len(lines[:num_prompts]),
        "max_new_tokens": max_new_tokens,
        "dtype": dtype,
        "repeats": repeats,
        "server_args": json.loads(server_args),
        "server_startup_seconds": [round(x, 1) for x in startups],
        "cpu_count": os.cpu_count(),
        "baseline": f"transformers {base_setting}",
        "rows": rows,
        "runs": runs,
        "machine": harness.machine(load_before),
    }
    harness.write_result(result, json_path)


if __name__ == "__main__":
    main()
