"""Generation throughput: the transformers engine (batched) vs a vLLM server (concurrent requests).

    python bench/generate.py [--num-prompts 32] [--max-new-tokens 64] [--json results/bench/generate.json]

Every variant runs the real generate stage (`generate_traces`) on the same prompts (the first N built-in
ones), greedy, in this one process, one after the other: transformers at each batch size, then one vLLM
server (started once, `--enforce-eager`, stopped at the end) at each concurrency. Tokens/s counts the
generated tokens over the generation time (model load and server start-up are reported apart). Timings
on a shared machine are noisy: compare the ratios within one run, not numbers across runs.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import click

from draftsmith.atomic import write_json
from draftsmith.generate import GenerateSettings, generate_traces
from draftsmith.prompts import BUILTIN_PROMPTS


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
@click.option("--num-prompts", default=32, show_default=True)
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--batch-sizes", default="8,32", show_default=True, help="transformers engine.")
@click.option("--concurrency", "concurrencies", default="1,4,16", show_default=True, help="server engine.")
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--server-args", default='["--enforce-eager", "--max-model-len", "1024"]', show_default=True)
@click.option("--json", "json_path", default="results/bench/generate.json", show_default=True)
def main(
    target: str,
    num_prompts: int,
    max_new_tokens: int,
    batch_sizes: str,
    concurrencies: str,
    dtype: str,
    server_args: str,
    json_path: str,
) -> None:
    from draftsmith.engines.server import VllmServer

    tmp = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp / "vllm-cache"))
    prompts = tmp / "prompts.jsonl"
    lines = BUILTIN_PROMPTS.read_text(encoding="utf-8").splitlines(keepends=True)[:num_prompts]
    prompts.write_text("".join(lines), encoding="utf-8")
    common = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "dtype": dtype}
    rows = []
    for bs in _ints(batch_sizes):
        settings = GenerateSettings(engine="transformers", batch_size=bs, **common)
        rows.append(
            {"engine": "transformers", "setting": f"batch {bs}"}
            | run_variant(target, prompts, tmp / f"hf{bs}", settings)
        )
    with VllmServer(
        target, extra_args=json.loads(server_args), log_path=tmp / "server.log", dtype=dtype, seed=0
    ) as srv:
        startup = srv.startup_seconds
        for c in _ints(concurrencies):
            settings = GenerateSettings(engine="openai", base_url=srv.base_url, concurrency=c, **common)
            rows.append(
                {"engine": "vllm server", "setting": f"concurrency {c}"}
                | run_variant(target, prompts, tmp / f"srv{c}", settings)
            )
    base = next((r for r in rows if r["setting"] == f"batch {max(_ints(batch_sizes))}"), rows[0])
    for r in rows:
        r["ratio"] = round(r["tokens_per_second"] / base["tokens_per_second"], 2)
    print(
        f"\n{num_prompts} prompts x <= {max_new_tokens} new tokens, greedy, {dtype}; server start-up {startup:.0f}s"
    )
    print(f"{'engine':<14}{'setting':<16}{'tokens':>8}{'seconds':>9}{'tok/s':>8}{'ratio':>7}")
    for r in rows:
        print(
            f"{r['engine']:<14}{r['setting']:<16}{r['tokens']:>8}{r['seconds']:>9.1f}{r['tokens_per_second']:>8.1f}{r['ratio']:>7.2f}"
        )
    print(f"ratio = tok/s / transformers {base['setting']}")
    result = {
        "num_prompts": num_prompts,
        "max_new_tokens": max_new_tokens,
        "dtype": dtype,
        "server_args": json.loads(server_args),
        "server_startup_seconds": round(startup, 1),
        "cpu_count": os.cpu_count(),
        "baseline": f"transformers {base['setting']}",
        "rows": rows,
    }
    write_json(json_path, result)
    print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
