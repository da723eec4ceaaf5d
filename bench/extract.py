"""Extraction benchmark: the naive way of dumping hidden states vs draftsmith's extraction, on the same
samples in one process, against this machine's measured matmul ceilings.

    python -m bench.extract [--tokens results/tokens.safetensors] [--json results/bench/extract.json]

Variants (interleaved over --repeats rounds in bench/harness.py's alternating order, so background load
hits all alike; rates are medians, ratios are medians of each round's paired ratio):

    naive          fp32, full model with lm_head, `output_hidden_states=True`, one sequence per pass
    draftsmith     `extract_shard` (bf16 base model, hooks on the aux layers, no lm_head, length-bucketed
                   right-padded batches, teacher agreement on masked rows), compile off and on, without
                   writing and writing through the background writer (codecs none and zstd-planes)

Useful FLOPs count only real tokens: 2 x non-embedding parameters per token plus causal attention
(4 x heads x head_dim x layers per query-key pair, T(T+1)/2 pairs per sequence); lm_head, padding and
the teacher check are overhead. The rate is given as a fraction of the bf16 matmul ceiling measured
just before each run (the best of a few large matmuls shaped like the model's MLP); as an upper bound for this model,
its decoder's linear layers alone are timed on batch-sized inputs. Write overlap = tokens/s including
writing and closing the shard / tokens/s of the same variant without writing; besides the rounds'
paired ratios it is measured on its own, for the default codec, over alternating back-to-back pairs.

Two clocks: wall, and CPU time per thread (process CPU seconds / threads, the writer thread included).
On a machine shared with other work the wall clock also measures the neighbours; the CPU clock measures
what the process did with the time it got (run it with --threads 1 there: waiting OpenMP threads spin and
inflate CPU time). On the CPU clock, write overlap is the extra CPU that writing costs: what compute
would lose to it on a machine with no core to spare. The ceilings are wall-clock matmuls.

Pipelined extraction (--pipeline-pairs, alone with --only-pipeline): the extraction loop sequential
(forward, then the batch's CPU-side work: collect, bf16, teacher check, hand-off to the writer) and
pipelined (that work in a worker thread beside the next forward), in alternating back-to-back pairs,
writing zstd-planes shards. Hidden share = 1 - (pipelined loop - sequential forwards) / sequential
CPU-side work: 1 when the CPU-side work vanishes behind the forwards, 0 when nothing is gained. On a
CPU the forward and the worker share the cores, so this is the floor of what a GPU job gets; on a shared
machine use --threads 1 (a 2-thread OpenMP forward on oversubscribed cores spins and runs many times
slower, by amounts that swamp the overlap and differ between the loops). Without
the default target (resources/), --target tiny runs a random 8-layer twin of SmolLM2 on random tokens.

Writer throughput (--writer-threads, alone with --only-writer): the bench's shard is extracted once
(codec none); its samples, held in memory, are then written as zstd-planes shards by ShardWriter with
each thread count of --writer-threads, in alternating rounds. Writer rate = raw bf16 state bytes / wall
seconds from the first add() to the finished file, and per CPU-second of the writer's threads; against
the forward's rate here (the same states' bytes / seconds of the capture loop without writing) and a
GPU engine's (--forward-gbps, the issue-43 figure for an H100's prefill: ~1 GB/s of states per engine):
the threads a shard needs so that compression keeps up. Rates are medians with the rounds' range.

Without --tokens, the tiny workflow run's tokens (/tmp/wf/results/tokens.safetensors) are used if they
exist, else chat sequences made here from the built-in prompts; samples repeat until --min-tokens.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import torch

from bench import harness
from bench.harness import median
from draftsmith.backends.hf import HfExtractor
from draftsmith.core.config.config import section_defaults
from draftsmith.core.data.shards import ShardWriter, iter_samples
from draftsmith.core.data.tokens import load_tokens, write_tokens
from draftsmith.core.model.layers import resolve_aux_layers
from draftsmith.core.model.target import load_target
from draftsmith.stages.extract import ExtractSettings, extract_shard

TINY_RUN_TOKENS = "/tmp/wf/results/tokens.safetensors"
DEFAULT_TARGET = "resources/SmolLM2-135M-Instruct"


def matmul_ceiling(
    dtype: torch.dtype, rounds: int = 12, shape: tuple[int, int, int] = (2048, 576, 1536)
) -> float:
    """Best GFLOP/s of an [M, K] @ [K, N] matmul: a ceiling, the best this machine reached."""
    m, k, n = shape
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * m * k * n / best / 1e9


def non_embedding_params(model) -> int:
    return sum(
        p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n
    )


def useful_flops(lengths: list[int], params: int, cfg) -> float:
    """2 x params per token + causal attention (QK^T and AV, multiply-add) over T(T+1)/2 pairs."""
    attn_width = cfg.num_attention_heads * getattr(
        cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads
    )
    pairs = sum(t * (t + 1) // 2 for t in lengths)
    return 2.0 * params * sum(lengths) + 4.0 * attn_width * cfg.num_hidden_layers * pairs


def made_up_samples(target: str) -> tuple[list[list[int]], list[list[int]]]:
    """Chat sequences from the built-in prompts: each conversation answered with the text of the next
    few prompts (real-looking text, 70-470 tokens a sample). Throughput does not depend on the words."""
    from transformers import AutoTokenizer

    from draftsmith.core.data.chat import render_with_response
    from draftsmith.core.data.prompt_sources import read_prompt_file

    tokenizer = AutoTokenizer.from_pretrained(target)
    records = read_prompt_file(Path(__file__).resolve().parents[1] / "draftsmith" / "data" / "prompts.jsonl")
    texts = [r["messages"][-1]["content"] for r in records]
    ids, masks = [], []
    for i, record in enumerate(records):
        answer = " ".join(texts[(i + 1 + j) % len(texts)] for j in range(2 + i % 10))
        seq, mask = render_with_response(tokenizer, record["messages"], answer)
        ids.append(seq)
        masks.append(mask)
    return ids, masks


def bench_tokens(
    source: str | None,
    target: str,
    min_tokens: int,
    out: Path,
    made_up: bool = False,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """Write a one-shard tokens file with the chosen samples (the first ones up to max_tokens),
    repeated up to min_tokens."""
    if source is None and not made_up and Path(TINY_RUN_TOKENS).is_file():
        source = TINY_RUN_TOKENS
    if source:
        tensors, meta = load_tokens(source)
        offsets = tensors["offsets"].tolist()
        ids = [tensors["input_ids"][a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
        masks = [tensors["loss_mask"][a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
        template = meta["template"]
    else:
        ids, masks = made_up_samples(target)
        template = "bench"
    if max_tokens:
        keep = max(1, sum(1 for total in itertools.accumulate(len(s) for s in ids) if total <= max_tokens))
        ids, masks = ids[:keep], masks[:keep]
    base = len(ids)
    while sum(len(s) for s in ids) < min_tokens:
        k = len(ids) % base
        ids.append(ids[k])
        masks.append(masks[k])
    meta = {
        "sample_ids": [f"b{i}" for i in range(len(ids))],
        "template": template,
        "target": target,
        "shards": [[0, len(ids)]],
    }
    flat_ids, flat_mask = [t for s in ids for t in s], [m for s in masks for m in s]
    write_tokens(out, flat_ids, flat_mask, [0, *itertools.accumulate(len(s) for s in ids)], meta)
    return {"source": source or "built-in prompts (made up answers)", "lengths": [len(s) for s in ids]}


@torch.inference_mode()
def naive_pass(model, sequences: list[torch.Tensor], layer_ids: list[int]) -> tuple[float, float]:
    """The usual dump: full model, all hidden states, logits; one sequence per pass.
    Returns (wall seconds, CPU seconds of all threads)."""
    start, cpu = time.perf_counter(), time.process_time()
    for seq in sequences:
        out = model(seq[None], output_hidden_states=True)
        states = [out.hidden_states[k] for k in layer_ids] + [out.hidden_states[-1]]
        del out, states
    return time.perf_counter() - start, time.process_time() - cpu


@torch.inference_mode()
def linear_layers_rate(model, tokens: int, rounds: int = 3) -> float:
    """GFLOP/s of the decoder's linear layers alone, in order, on [tokens, in] bf16 activations: what
    the model's own matmul shapes reach here, an upper bound for any extraction of this model."""
    linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(tokens, m.in_features, dtype=torch.bfloat16) for m in linears}
    flops = sum(2.0 * tokens * m.in_features * m.out_features for m in linears)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for m in linears:
            m(inputs[m.in_features])
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def draftsmith_run(
    target: str,
    work: Path,
    out: str | None,
    codec: str | None,
    compile_mode: str,
    engine,
    batch_tokens: int,
    threads: int,
) -> tuple[float, float, dict]:
    """One extraction of the bench's shard: (wall s, CPU s, stats). With a codec it writes the shard
    and counts until the file is complete; without, only the capture loop."""
    stats = extract_shard(
        target,
        str(work / "tokens.safetensors"),
        0,
        out,
        ExtractSettings.from_dict(
            {
                "dtype": "bfloat16",
                "batch_tokens": batch_tokens,
                "codec": codec or "zstd-planes",
                "threads": threads,
                "compile": compile_mode,
            }
        ),
        extractor=engine,
    )
    if not out:
        return stats["seconds"], stats["cpu_seconds"], stats
    stats["bytes"] = os.path.getsize(out)
    os.unlink(out)
    return stats["wall_seconds_with_write"], stats["cpu_seconds_with_write"], stats


def tiny_twin(work: Path) -> str:
    """A random 8-layer Llama shaped like SmolLM2-135M (hidden 576, vocabulary 49,152; it has 30 layers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    path = work / "tiny-twin"
    LlamaForCausalLM(cfg).to(torch.bfloat16).eval().save_pretrained(path)
    return str(path)


def random_tokens(out: Path, min_tokens: int) -> dict[str, Any]:
    """A one-shard tokens file of random chat-sized sequences (70-470 tokens), answers loss-masked."""
    g = torch.Generator().manual_seed(0)
    lengths: list[int] = []
    while sum(lengths) < min_tokens:
        lengths.append(int(torch.randint(70, 471, (1,), generator=g)))
    masks = [torch.arange(n) >= n // 3 for n in lengths]  # the first third is the prompt
    meta = {
        "sample_ids": [f"b{i}" for i in range(len(lengths))],
        "template": "bench",
        "shards": [[0, len(lengths)]],
    }
    ids = torch.randint(0, 49152, (sum(lengths),), generator=g)
    write_tokens(out, ids, torch.cat(masks), [0, *itertools.accumulate(lengths)], meta)
    return {"source": "random tokens (tiny twin)", "lengths": lengths}


def pipeline_overlap(
    target: str, work: Path, engine, batch_tokens: int, threads: int, pairs: int
) -> dict[str, Any]:
    """Sequential vs pipelined extraction loop (zstd-planes shard written), alternating back-to-back
    pairs: loop seconds (the probe's batches excluded), the sequential loop's forwards and CPU-side work,
    and the share of that work the pipelined loop hides behind the forwards (per pair; medians)."""
    out = str(work / "pipeline" / "shard-0.safetensors")

    def run(pipeline: bool) -> dict[str, float]:
        with contextlib.redirect_stderr(io.StringIO()):
            stats = extract_shard(
                target, str(work / "tokens.safetensors"), 0, out,
                ExtractSettings.from_dict(
                    {"dtype": "bfloat16", "batch_tokens": batch_tokens, "threads": threads, "compile": "off"}
                ),
                extractor=engine, pipeline=pipeline,
            )  # fmt: skip
        os.unlink(out)
        return {
            "loop_seconds": stats["seconds"] - stats["probe_seconds"],
            "with_write_seconds": stats["wall_seconds_with_write"],
            "forward_seconds": stats["forward_seconds"],
            "post_seconds": stats["post_seconds"],
            "cpu_seconds": stats["cpu_seconds"],
        }

    runs = harness.alternating_rounds({False: lambda: run(False), True: lambda: run(True)}, pairs)
    hidden = [
        1 - (p["loop_seconds"] - s["forward_seconds"]) / s["post_seconds"]
        for s, p in zip(runs[False], runs[True], strict=True)
    ]
    speedup = harness.paired_ratios(runs[False], runs[True], lambda r: r["loop_seconds"])

    def medians(pipeline: bool) -> dict[str, float]:
        return {k: round(median(r[k] for r in runs[pipeline]), 3) for k in runs[pipeline][0]}

    return {
        "pairs": pairs,
        "sequential": medians(False),
        "pipelined": medians(True),
        "hidden_share": round(median(hidden), 3),
        "hidden_share_pairs": [round(h, 3) for h in hidden],
        "loop_speedup": round(median(speedup), 3),
        "runs": runs,
    }


def print_pipeline(p: dict[str, Any]) -> None:
    print(f"\npipelined extraction loop (zstd-planes written), medians over {p['pairs']} alternating pairs:")
    print(
        f"{'loop':12s} {'loop s':>8s} {'+write s':>9s} {'forward s':>10s} {'CPU-side s':>11s} {'CPU s':>7s}"
    )
    for name, key in (("sequential", "sequential"), ("pipelined", "pipelined")):
        r = p[key]
        print(
            f"{name:12s} {r['loop_seconds']:8.2f} {r['with_write_seconds']:9.2f} {r['forward_seconds']:10.2f} "
            f"{r['post_seconds']:11.2f} {r['cpu_seconds']:7.2f}"
        )
    pairs = ", ".join(f"{h:.0%}" for h in p["hidden_share_pairs"])
    print(
        f"CPU-side work hidden behind the forwards: {p['hidden_share']:.1%} (pairs: {pairs}); "
        f"loop speed-up x{p['loop_speedup']:.2f}"
    )


def writer_throughput(
    target: str,
    work: Path,
    engine,
    batch_tokens: int,
    threads: int,
    counts: list[int],
    rounds: int,
    forward_gbps: float,
) -> dict[str, Any]:
    """ShardWriter's zstd-planes rate per thread count over the bench's samples (extracted once, held in
    memory), in alternating rounds, against the forward's rate here and a GPU engine's (forward_gbps)."""
    tokens = str(work / "tokens.safetensors")
    plain = str(work / "writer" / "plain.safetensors")
    settings = {"dtype": "bfloat16", "batch_tokens": batch_tokens, "threads": threads, "compile": "off"}
    with contextlib.redirect_stderr(io.StringIO()):
        forward = extract_shard(
            target, tokens, 0, None, ExtractSettings.from_dict(settings), extractor=engine
        )
        extract_shard(target, tokens, 0, plain, ExtractSettings.from_dict({**settings, "codec": "none"}),
                      extractor=engine)  # fmt: skip
    samples = list(iter_samples(plain))
    # raw bf16, what a forward yields
    state_bytes = sum(2 * (s.aux.numel() + s.final.numel()) for s in samples)
    level = section_defaults("extract")["zstd_level"]
    out = work / "writer" / "shard-0.safetensors"

    def write(count: int) -> dict[str, float]:
        start = time.perf_counter()
        writer = ShardWriter(out, {}, "zstd-planes", level, "bfloat16", sample_ids=[s.id for s in samples],
                             threads=count)  # fmt: skip
        for sample in samples:
            writer.add(sample)
        writer.close()
        seconds = time.perf_counter() - start
        size = out.stat().st_size
        out.unlink()
        return {"seconds": seconds, "cpu_seconds": writer.cpu_seconds, "file_bytes": size}

    runs = harness.alternating_rounds({str(c): (lambda c=c: write(c)) for c in counts}, rounds)
    here_gbps = state_bytes / forward["seconds"] / 1e9
    rows = {}
    for c in counts:
        r = runs[str(c)]
        gbps = harness.ratio_summary([state_bytes / x["seconds"] / 1e9 for x in r])
        per_cpu = harness.ratio_summary([state_bytes / x["cpu_seconds"] / 1e9 for x in r])
        speedup = harness.ratio_summary(
            harness.paired_ratios(runs[str(counts[0])], r, lambda x: x["seconds"])
        )
        rows[c] = {"gbps": gbps, "gb_per_cpu_second": per_cpu, "speedup": speedup,
                   "ratio": r[0]["file_bytes"] / state_bytes}  # fmt: skip
    per_thread = median(rows[c]["gb_per_cpu_second"]["median"] for c in counts)
    return {
        "samples": len(samples),
        "state_bytes": state_bytes,
        "zstd_level": level,
        "rounds": rounds,
        "speedup_against_threads": counts[0],  # each row's speedup: paired wall-time ratios against it
        "forward_here_gbps": here_gbps,
        "forward_gpu_gbps": forward_gbps,
        "threads_to_keep_up": {
            "here": math.ceil(here_gbps / per_thread),
            "gpu": math.ceil(forward_gbps / per_thread),
        },
        "by_threads": rows,
        "runs": runs,
    }


def print_writer(w: dict[str, Any]) -> None:
    def cell(x: dict[str, float], spec: str = ".2f") -> str:
        return f"{x['median']:{spec}} [{x['low']:{spec}}-{x['high']:{spec}}]"

    first = w["speedup_against_threads"]
    print(
        f"\nwriter throughput, zstd-planes level {w['zstd_level']} ({w['samples']} samples, "
        f"{w['state_bytes'] / 1e6:.1f} MB of bf16 states), medians [range] over {w['rounds']} alternating rounds:"
    )
    print(harness.format_table(
        [("threads", ">7d"), ("GB/s (wall)", "<20s"), ("GB per CPU-s", "<20s"), (f"x {first} thread", "<20s"),
         ("ratio", ">6.3f")],
        [(c, cell(r["gbps"]), cell(r["gb_per_cpu_second"]), cell(r["speedup"]), r["ratio"])
         for c, r in w["by_threads"].items()],
    ))  # fmt: skip
    need = w["threads_to_keep_up"]
    print(
        f"the forward yields {w['forward_here_gbps']:.3g} GB/s of states here ({need['here']} writer thread(s) keep up) "
        f"and ~{w['forward_gpu_gbps']:.1f} GB/s per GPU engine (--forward-gbps): {need['gpu']} thread(s) per engine"
    )


def summarise(
    times: dict[str, list[tuple[float, float]]],
    clock: str,
    threads: int,
    n_tok: int,
    flops: float,
    ceilings: dict[str, dict[str, list[float]]],
) -> dict[str, dict[str, Any]]:
    """Median rates per variant on one clock ("wall", or "cpu": CPU seconds / threads). The % of a
    ceiling is the median over rounds of the run's rate / the ceiling measured just before it: this
    machine swings between fast and slow spells, and a ceiling from another moment would mislead."""

    def seconds(t: tuple[float, float]) -> float:
        return t[0] if clock == "wall" else t[1] / threads

    rows = {}
    for name, runs in times.items():
        typical = median(seconds(t) for t in runs)
        rate = flops / typical / 1e9
        rows[name] = {
            "tokens_per_second": round(n_tok / typical, 1),
            "useful_gflops": round(rate, 1),
            **{
                f"pct_of_{key}_ceiling": round(
                    100
                    * median(flops / seconds(t) / 1e9 / c for t, c in zip(runs, beside[name], strict=True)),
                    1,
                )
                for key, beside in ceilings.items()
            },
            "seconds": [round(seconds(t), 3) for t in runs],
        }
    for name, row in rows.items():
        row["vs_naive"] = round(median(harness.paired_ratios(times["naive"], times[name], seconds)), 3)
        if " write=" in name and not name.endswith("write=no"):
            ratios = harness.paired_ratios(
                times[name.rsplit(" write=", 1)[0] + " write=no"], times[name], seconds
            )
            row["write_overlap"] = round(median(ratios), 3)
            row["write_overlap_rounds"] = [round(r, 3) for r in ratios]
    return rows


def print_table(rows: dict[str, dict[str, Any]], title: str) -> None:
    print(f"\n{title}")
    print(
        f"{'variant':40s} {'tok/s':>8s} {'x naive':>8s} {'GFLOP/s':>8s} {'% bf16':>7s} {'% fp32':>7s} {'overlap':>8s}"
    )
    for name, r in rows.items():
        overlap = f"{r['write_overlap']:.1%}" if "write_overlap" in r else ""
        print(
            f"{name:40s} {r['tokens_per_second']:8,.0f} {r['vs_naive']:8.2f} {r['useful_gflops']:8.0f} "
            f"{r['pct_of_bf16_ceiling']:6.1f}% {r['pct_of_fp32_ceiling']:6.1f}% {overlap:>8s}"
        )


@click.command()
@click.option(
    "--tokens",
    type=click.Path(exists=True, dir_okay=False),
    help="A tokens.safetensors to take samples from.",
)
@click.option(
    "--target",
    default=DEFAULT_TARGET,
    show_default=True,
    help="A target folder, or tiny: a random twin of SmolLM2.",
)
@click.option(
    "--made-up", is_flag=True, help="Use the built-in prompts' made-up conversations (70-470 tokens)."
)
@click.option("--min-tokens", default=8192, show_default=True, help="Repeat samples up to this many tokens.")
@click.option("--max-tokens", type=int, help="Take only the first samples, up to this many tokens.")
@click.option("--threads", default=2, show_default=True)
@click.option(
    "--repeats", default=5, show_default=True, help="Interleaved rounds; medians and paired ratios reported."
)
@click.option("--batch-tokens", default=4096, show_default=True)
@click.option(
    "--compile/--no-compile", "with_compile", default=True, show_default=True, help="Also time compiled."
)
@click.option(
    "--overlap-pairs",
    default=12,
    show_default=True,
    help="Alternating no-write/zstd-planes pairs per compile mode for the write overlap (0: skip).",
)
@click.option(
    "--pipeline-pairs",
    default=6,
    show_default=True,
    help="Alternating sequential/pipelined pairs of the extraction loop, compile off (0: skip).",
)
@click.option(
    "--only-pipeline", is_flag=True, help="Only the pipelined-loop comparison (no naive, no compile)."
)
@click.option(
    "--writer-threads",
    default="1,2,4",
    show_default=True,
    help="Thread counts of the writer-throughput rows, comma-separated (empty: skip).",
)
@click.option("--writer-rounds", default=5, show_default=True, help="Alternating rounds of the writer rows.")
@click.option(
    "--forward-gbps",
    default=1.0,
    show_default=True,
    help="A GPU engine's states per second (GB/s) to size writer threads against.",
)
@click.option("--only-writer", is_flag=True, help="Only the writer-throughput rows (no naive, no compile).")
@click.option(
    "--json",
    "json_path",
    help="[results/bench/extract.json; with --only-pipeline extract-pipeline.json, --only-writer extract-writer.json]",
)
def main(
    tokens: str | None,
    target: str,
    made_up: bool,
    min_tokens: int,
    max_tokens: int | None,
    threads: int,
    repeats: int,
    batch_tokens: int,
    with_compile: bool,
    overlap_pairs: int,
    pipeline_pairs: int,
    only_pipeline: bool,
    writer_threads: str,
    writer_rounds: int,
    forward_gbps: float,
    only_writer: bool,
    json_path: str | None,
) -> None:
    torch.set_num_threads(threads)
    load_before = harness.load_average()
    work = Path(tempfile.mkdtemp(prefix="bench-extract-"))
    counts = [int(c) for c in writer_threads.split(",") if c.strip()]
    if only_writer and not counts:
        raise click.UsageError("--only-writer needs --writer-threads")
    name = "extract-pipeline" if only_pipeline else "extract-writer" if only_writer else "extract"
    json_path = json_path or str(harness.result_path(name))
    if target == "tiny" or not Path(target, "config.json").is_file():
        if not (only_pipeline or only_writer):
            raise click.UsageError(
                f"{target}: no target there (the tiny twin is for --only-pipeline, --only-writer)"
            )
        print(f"{target}: no target there; a random tiny twin of SmolLM2 on random tokens instead")
        target = tiny_twin(work)
        data = random_tokens(work / "tokens.safetensors", min_tokens)
    else:
        data = bench_tokens(tokens, target, min_tokens, work / "tokens.safetensors", made_up, max_tokens)
    if only_writer:
        n_tok = sum(data["lengths"])
        print(f"{len(data['lengths'])} samples, {n_tok:,} tokens from {data['source']}; {threads} threads, "
              f"{harness.cpu_name()}, load average {load_before}")  # fmt: skip
        from transformers import AutoModelForCausalLM  # the twin has no tokenizer for load_target

        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
        engine = HfExtractor(model, resolve_aux_layers(None, model.config.num_hidden_layers))
        writer = writer_throughput(
            target, work, engine, batch_tokens, threads, counts, writer_rounds, forward_gbps
        )
        print_writer(writer)
        machine = harness.machine(load_before)
        print(f"load average during the run: {load_before} -> {machine['load_average']['after']}")
        harness.write_result(
            {"target": target, "tokens": n_tok, "source": data["source"], "writer": writer, **machine},
            json_path,
        )
        return
    if only_pipeline:
        n_tok = sum(data["lengths"])
        print(
            f"{len(data['lengths'])} samples, {n_tok:,} tokens from {data['source']}; {threads} threads, {harness.cpu_name()}"
        )
        from transformers import AutoModelForCausalLM  # the twin has no tokenizer for load_target

        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
        engine = HfExtractor(model, resolve_aux_layers(None, model.config.num_hidden_layers))
        pipeline = pipeline_overlap(target, work, engine, batch_tokens, threads, pipeline_pairs)
        print_pipeline(pipeline)
        machine = harness.machine(load_before)
        print(f"load average during the run: {load_before} -> {machine['load_average']['after']}")
        harness.write_result(
            {
                "target": target,
                "samples": len(data["lengths"]),
                "tokens": n_tok,
                "source": data["source"],
                "batch_tokens": batch_tokens,
                "pipeline": pipeline,
                **machine,  # cpu, threads, nproc, torch, load_average
            },
            json_path,
        )
        return
    lengths = data["lengths"]
    tensors, _ = load_tokens(work / "tokens.safetensors")
    offsets = tensors["offsets"].tolist()
    sequences = [tensors["input_ids"][a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    n_tok = sum(lengths)
    print(
        f"{len(lengths)} samples, {n_tok:,} tokens (lengths {min(lengths)}-{max(lengths)}, "
        f"mean {n_tok / len(lengths):.0f}) from {data['source']}; {threads} threads, {harness.cpu_name()}"
    )

    model, _ = load_target(target, torch.float32)
    cfg = model.config
    layer_ids = resolve_aux_layers(None, cfg.num_hidden_layers)
    params = non_embedding_params(model)
    flops = useful_flops(lengths, params, cfg)
    print(
        f"useful work: {params / 1e6:.1f} M non-embedding parameters, {flops / n_tok / 1e6:.0f} MFLOP/token "
        f"({2 * params / 1e6:.0f} linear + {(flops / n_tok - 2 * params) / 1e6:.0f} attention)"
    )
    naive_pass(model, sequences[:1], layer_ids)  # warm-up
    # One engine per compile mode, reused by every round and codec (as one job would use it).
    engines = {"off": HfExtractor.from_target(target, layer_ids, "bfloat16")}
    compile_seconds = None
    if with_compile:
        engines["on"] = HfExtractor.from_target(target, layer_ids, "bfloat16")
        print("compiling (torch.compile of the decoder layers, one-off)...", flush=True)
        compile_seconds = engines["on"].compile()
        print(f"compiled in {compile_seconds:.0f}s", flush=True)

    variants: dict[str, dict[str, Any]] = {"naive": {}}
    modes = ["off", "on"] if with_compile else ["off"]
    for mode in modes:
        for codec in (None, "none", "zstd-planes"):
            variants[f"draftsmith compile={mode} write={codec or 'no'}"] = {"compile": mode, "codec": codec}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    extra: dict[str, list[dict]] = {name: [] for name in variants}
    # ceilings measured just before each run: {"bf16": {variant: [GFLOP/s per round]}, "fp32": ...}
    ceilings: dict[str, dict[str, list[float]]] = {
        "bf16": {n: [] for n in variants},
        "fp32": {n: [] for n in variants},
    }
    linear_rates: list[float] = []
    for rnd in range(repeats):
        linear_rates.append(linear_layers_rate(engines["off"].model, batch_tokens))
        for name in harness.round_order(list(variants), rnd):
            v = variants[name]
            for dtype, key in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
                ceilings[key][name].append(matmul_ceiling(dtype, rounds=6))
            if name == "naive":
                times[name].append(naive_pass(model, sequences, layer_ids))
            else:
                out = str(work / f"hidden-{rnd}" / "shard-0.safetensors") if v["codec"] else None
                wall, cpu, stats = draftsmith_run(
                    target, work, out, v["codec"], v["compile"], engines[v["compile"]], batch_tokens, threads
                )
                times[name].append((wall, cpu))
                extra[name].append(
                    {
                        "teacher_agreement": stats["teacher_agreement"],
                        "bytes": stats.get("bytes"),
                        # writing's share of the cores: the writer thread's CPU time, plus closing
                        # the shard (after compute, so every core waits for it)
                        "writing_core_share": (stats["writer_cpu_seconds"] + threads * stats["close_seconds"])
                        / (threads * stats["wall_seconds_with_write"])
                        if out
                        else None,
                        "writer_cpu_seconds": stats.get("writer_cpu_seconds"),
                        "close_seconds": stats.get("close_seconds"),
                    }
                )
            wall, cpu = times[name][-1]
            print(
                f"round {rnd + 1}/{repeats}: {name}: {n_tok / wall:,.0f} tok/s wall, "
                f"{n_tok / (cpu / threads):,.0f} tok/s per CPU-time",
                flush=True,
            )

    overlap: dict[str, dict[str, Any]] = {}
    for mode in modes if overlap_pairs else []:

        def run(codec: str | None, mode: str = mode) -> float:
            out = str(work / "overlap" / "shard-0.safetensors") if codec else None
            return draftsmith_run(target, work, out, codec, mode, engines[mode], batch_tokens, threads)[0]

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            pairs = harness.alternating_rounds({"plain": lambda: run(None), "writing": lambda: run("zstd-planes")},
                                               overlap_pairs)  # fmt: skip
        ratios = harness.paired_ratios(pairs["plain"], pairs["writing"])
        quartiles = statistics.quantiles(ratios, n=4)
        overlap[mode] = {"ratios": ratios, "median": median(ratios), "quartiles": quartiles}

    pipeline = None
    if pipeline_pairs:
        pipeline = pipeline_overlap(target, work, engines["off"], batch_tokens, threads, pipeline_pairs)
    writer = None
    if counts:
        writer = writer_throughput(
            target, work, engines["off"], batch_tokens, threads, counts, writer_rounds, forward_gbps
        )

    measured = {key: [c for runs in beside.values() for c in runs] for key, beside in ceilings.items()}
    ceiling = {key: median(values) for key, values in measured.items()}
    tables = {clock: summarise(times, clock, threads, n_tok, flops, ceilings) for clock in ("wall", "cpu")}
    for clock, rows in tables.items():
        for name, row in rows.items():
            row["runs"] = extra[name]
        print_table(
            rows,
            f"{clock} clock"
            + (" (CPU seconds / threads: robust to other load)" if clock == "cpu" else "")
            + f"; % of the ceiling measured beside each run (2048x576 @ 576x1536; bf16 "
            f"{min(measured['bf16']):.0f}-{max(measured['bf16']):.0f}, fp32 "
            f"{min(measured['fp32']):.0f}-{max(measured['fp32']):.0f} GFLOP/s)",
        )
    print("\nwriting's cost, measured without the machine's noise (CPU time, not throughput):")
    for name, runs in extra.items():
        if runs and runs[0]["writing_core_share"] is not None:
            share = median(r["writing_core_share"] for r in runs)
            ratios = sorted(tables["wall"][name]["write_overlap_rounds"])
            print(
                f"  {name}: writer thread + close = {share:.1%} of the cores' time (what writing takes "
                f"from compute, before OpenMP threads wait on each other); paired throughput ratios per round "
                f"{ratios[0]:.2f}-{ratios[-1]:.2f}"
            )
    for mode, o in overlap.items():
        print(
            f"write overlap, zstd-planes, compile={mode}: {o['median']:.1%} median over {len(o['ratios'])} "
            f"alternating back-to-back pairs (quartiles {o['quartiles'][0]:.1%}-{o['quartiles'][2]:.1%})"
        )
    if pipeline:
        print_pipeline(pipeline)
    if writer:
        print_writer(writer)
    linear_best = max(linear_rates)
    print(
        f"upper bound: this model's linear layers alone, {batch_tokens} tokens at a time, reach "
        f"{linear_best:.0f} GFLOP/s = {100 * linear_best / max(measured['bf16']):.1f}% of the best bf16 ceiling"
    )
    if compile_seconds:
        print(f"compile: {compile_seconds:.0f}s once per job (not in the rates)")
    machine = harness.machine(load_before)
    print(f"load average during the run: {load_before} -> {machine['load_average']['after']}")
    harness.write_result(
        {
            "samples": len(lengths),
            "tokens": n_tok,
            "lengths": {"min": min(lengths), "max": max(lengths), "mean": n_tok / len(lengths)},
            "source": data["source"],
            "batch_tokens": batch_tokens,
            "non_embedding_params": params,
            "useful_mflop_per_token": flops / n_tok / 1e6,
            "ceiling_gflops_median": ceiling,
            "ceiling_gflops_beside_each_run": ceilings,
            "linear_layers_gflops": {"best": linear_best, "rounds": linear_rates},
            "write_overlap_alternating_pairs": overlap,
            "pipeline": pipeline,
            "writer": writer,
            "compile_seconds": compile_seconds,
            "variants": tables,
            **machine,  # cpu, threads, nproc, torch, load_average
        },
        json_path,
    )


if __name__ == "__main__":
    main()
