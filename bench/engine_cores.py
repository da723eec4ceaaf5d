"""What a vLLM-CPU engine gets from the cores it is given: both cores, one core (how `draftsmith run` confines
a one-thread job), and both cores with another one-thread job beside it. Paired rounds.

    python -m bench.engine_cores [--prompts draftsmith/data/heldout_handwritten.jsonl ...] [--rounds 2]
                                 [--max-new-tokens 64] [--json results/bench/engine_cores.json]

Each variant decodes the same prompts greedily with plain decoding in a child engine (run_vllm_subprocess,
float32, as the evaluation runs it): "both" as it is, "one core" with the child confined to the first core
(its CPU affinity, which vLLM binds within), "beside a job" with both cores while a one-thread matmul loop
runs for the whole engine run (the loop's matmuls per second against alone are reported too). Decode
seconds exclude the engine's start. The variants alternate within each round; ratios are per round.

Measured on a 2-core Intel Xeon with AMX (2026-12-04, 90 prompts: a run's held-out split and the
hand-written set, 2 rounds): 17.8 s on both cores, 1.58x that on one core, 6.29x beside a one-thread job
(which kept 88% of its speed): docs/results.md.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click

from bench import harness
from draftsmith.core.io.cores import allowed_cores
from draftsmith.core.model.target import load_tokenizer
from draftsmith.stages.evaluate.stage import encode_prompts, read_eval_prompts
from draftsmith.stages.evaluate.vllm_runner import run_vllm_subprocess

# a one-thread matmul loop that runs until SIGTERM (or argv[1] seconds) and prints its matmuls per second
BURN = (
    "import signal, sys, time, torch\n"
    "torch.set_num_threads(1)\n"
    "stop = []\n"
    "signal.signal(signal.SIGTERM, lambda *_: stop.append(1))\n"
    "a = torch.randn(1024, 1024)\n"
    "t0, n = time.perf_counter(), 0\n"
    "while not stop and time.perf_counter() - t0 < float(sys.argv[1]):\n"
    "    a @ a\n"
    "    n += 1\n"
    "print(n / (time.perf_counter() - t0), flush=True)\n"
)


def burn_rate(seconds: float) -> float:
    """Matmuls per second of the one-thread loop run alone for `seconds`."""
    out = subprocess.run(
        [sys.executable, "-c", BURN, str(seconds)], capture_output=True, text=True, check=True
    )
    return float(out.stdout)


@contextlib.contextmanager
def confined(cores: set[int]) -> Iterator[None]:
    """This process (and the engine child it starts) on `cores` while the block runs."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def decode_seconds(target: str, prompts: list[list[int]], max_new_tokens: int, cache: Path) -> float:
    result = run_vllm_subprocess(
        target, None, None, prompts, max_new_tokens, 0, "float32", seed=0, temperature=0.0,
        gpu_memory_utilization=None, cache_dir=cache,
    )  # fmt: skip
    return float(result["seconds"])


@click.command()
@click.option("--target", default="resources/SmolLM2-135M-Instruct", show_default=True)
@click.option(
    "--prompts", "prompt_files", multiple=True, default=["draftsmith/data/heldout_handwritten.jsonl"],
    show_default=True, help="Prompt JSONL (repeat to join several).",
)  # fmt: skip
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--rounds", default=2, show_default=True)
@click.option("--json", "json_path", default=str(harness.result_path("engine_cores")), show_default=True)
def main(
    target: str, prompt_files: tuple[str, ...], max_new_tokens: int, rounds: int, json_path: str
) -> None:
    """Decode time of one vLLM-CPU engine on both cores, on one, and beside a one-thread job."""
    load = harness.load_average()
    cores = allowed_cores()
    if len(cores) < 2:
        raise click.ClickException("needs 2 cores or more: the variants differ in how many the engine gets")
    tokenizer = load_tokenizer(Path(target))
    prompts = [ids for path in prompt_files for ids in encode_prompts(tokenizer, read_eval_prompts(path, 0))]
    cache = Path(harness.RESULTS) / ".engine-cores-cache"
    burn_alone = burn_rate(10.0)
    burn_beside: list[float] = []

    def beside() -> float:
        loop = subprocess.Popen([sys.executable, "-c", BURN, "3600"], stdout=subprocess.PIPE, text=True)
        try:
            return decode_seconds(target, prompts, max_new_tokens, cache)
        finally:
            loop.terminate()
            out, _ = loop.communicate()
            burn_beside.append(float(out or 0.0))

    def one_core() -> float:
        with confined({cores[0]}):
            return decode_seconds(target, prompts, max_new_tokens, cache)

    variants = {
        "both cores": lambda: decode_seconds(target, prompts, max_new_tokens, cache),
        "one core": one_core,
        "both cores, a job beside": beside,
    }
    runs = harness.alternating_rounds(variants, rounds)
    base = runs["both cores"]
    rows, result = [], {"machine": harness.machine(load), "prompts": len(prompts), "variants": {}}
    for name, seconds in runs.items():
        ratio = harness.ratio_summary(harness.paired_ratios(seconds, base))
        result["variants"][name] = {"decode_seconds": seconds, "vs_both_cores": ratio}
        rows.append((name, harness.median(seconds), ratio["median"], ratio["low"], ratio["high"]))
    result["job_beside_speed"] = [rate / burn_alone for rate in burn_beside]
    print(f"{len(prompts)} prompts x {max_new_tokens} tokens, {rounds} round(s), on {harness.cpu_name()}")
    print(harness.format_table(
        [("variant", "<26"), ("decode s", ">9.1f"), ("x both", ">7.2f"), ("low", ">6.2f"), ("high", ">6.2f")], rows
    ))  # fmt: skip
    print(f"the job beside the engine: {harness.median(result['job_beside_speed']):.0%} of its speed alone")
    harness.write_result(result, json_path)


if __name__ == "__main__":
    main()
