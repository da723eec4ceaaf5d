"""Training benchmarks, one command each (every one prints a table and writes JSON):

    python -m bench.train loader [--data results/data_config.json] [--vocab results/vocab_map.pt]
                                 [--json results/bench/train.json]
    python -m bench.train attention [--tokens 8192] [--heads 1,2] [--json results/bench/attention.json]

`loader`: can the loader feed training? Loader samples/s and tokens/s alone vs what training consumes,
on real shards, side by side in one process. Measured, each the median of --repeats rounds (the rounds of all variants interleave, so a busy
machine slows them alike):
  loader    decode + batch --epochs epoch plans, no model: the streaming loader with 0 (in the loop), 1
            and 2 background threads, and the in-memory loader (everything decoded up front, its one-off
            load time reported apart; batches collated by 2 background threads). For the shards as stored and, if they are not zstd-planes, a
            zstd-planes copy of the same states (the default codec, whose decode costs the most).
  train     forward + backward + optimizer step of the real drafter (target head and draft vocabulary
            from the data) on already-decoded batches: what training consumes.
  together  the same steps fed by the streaming loader: the fraction of time spent waiting for data.
headroom = loader tokens/s / training tokens/s (the faster training measurement; > 1: the loader is not
the bottleneck).

`attention`: peak memory of the TTT attention (forward and backward of every TTT step, as training
runs it) at --tokens tokens for a Kimi-K2.5-shaped drafter layer (head dim 128; 64 heads), the fused
form (drafter.TTTKV / ttt_attention) against the materialised one it replaced (ttt_attention_reference). Each
measurement runs in a fresh process and reports its peak resident memory above the inputs; on a CPU the
head count is reduced (--heads, --fused-heads) and the 64-head figure extrapolated from the line through
the two head counts (at least 8 for the fused form, whose peak at 1-2 heads is its mask alone).

On a CPU shared with other work, pass --threads 1: with more torch threads than free cores every small
op waits for the whole thread team, and the training-thread numbers become noise (measured on 2 busy
cores: training 152 tokens/s with 2 threads, 409 with 1).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import torch

from bench import harness
from bench.harness import median
from draftsmith.core.data.loader import Batch, InMemoryData, StreamingData, step_plan
from draftsmith.core.data.manifest import load_manifest
from draftsmith.core.data.shards import ShardWriter, iter_samples, read_shard_meta
from draftsmith.core.data.vocab import load_vocab_map
from draftsmith.core.io.atomic import write_json
from draftsmith.core.model.drafter import build_drafter
from draftsmith.core.model.target import load_target_head
from draftsmith.core.training.objective import Objective, ttt_loss
from draftsmith.core.training.optimizers import make_optimizer
from draftsmith.stages.train import TrainSettings


def zstd_copy(manifest: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The manifest's shards re-encoded with the zstd-planes codec into folder (same samples)."""
    shards = []
    for shard in manifest["shards"]:
        meta = read_shard_meta(shard["path"])
        keep = {k: meta[k] for k in ("aux_layer_ids", "layer_convention", "dtype") if k in meta}
        path = folder / Path(shard["path"]).name
        writer = ShardWriter(path, keep, codec="zstd-planes", level=1, storage_dtype="bfloat16")
        for sample in iter_samples(shard["path"]):
            writer.add(sample)
        writer.close()
        shards.append({**shard, "path": path})
    return {**manifest, "shards": shards, "codec": "zstd-planes"}


def drain(batches: Iterable[Batch | None]) -> tuple[int, int, float]:
    """Consume batches -> (samples, real tokens, seconds)."""
    samples = tokens = 0
    t0 = time.perf_counter()
    for b in batches:
        samples += int(b.lengths.numel())
        tokens += b.num_tokens
    return samples, tokens, time.perf_counter() - t0


def median_rate(runs: list[tuple[int, int, float]]) -> dict[str, float]:
    s = median(r[2] for r in runs)
    return {"samples_per_s": runs[0][0] / s, "tokens_per_s": runs[0][1] / s, "seconds": s}


def make_trainer(manifest: dict, vocab_path: str, settings: TrainSettings) -> Callable[[Batch], int]:
    """One optimizer step of the real drafter on a batch -> real tokens trained."""
    target = load_target_head(manifest["target"])
    vocab = load_vocab_map(vocab_path)
    num_aux = int(manifest["num_aux"])
    drafter, embed, teacher = build_drafter(target, vocab["d2t"], vocab["t2d"], num_aux, settings, "cpu")
    optimizer = make_optimizer(drafter, settings)
    objective = Objective.from_settings(settings).for_validation()  # no noise: the matmuls are the cost

    def step(batch: Batch) -> int:
        loss, stats = ttt_loss(drafter, embed, teacher, batch, objective)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), settings.grad_clip)
        optimizer.step()
        return stats.tokens

    return step


@click.group()
def main() -> None:
    """Training benchmarks (see the module docstring)."""


@main.command()
@click.option("--data", "manifest_path", default="results/data_config.json", show_default=True)
@click.option("--vocab", "vocab_path", default=None, help="[default: vocab_map.pt beside --data]")
@click.option("--json", "json_path", default=str(harness.result_path("train")), show_default=True)
@click.option("--repeats", default=3, show_default=True, help="Rounds per measurement (median).")
@click.option("--epochs", default=8, show_default=True, help="Epoch plans each loader round goes through.")
@click.option("--train-steps", default=4, show_default=True, help="Optimizer steps per training round.")
@click.option("--threads", default=None, type=int, help="torch threads for training [default: torch's].")
@click.option("--batch-tokens", default=None, type=int, help="[default: the train section's default]")
def loader(
    manifest_path: str,
    vocab_path: str | None,
    json_path: str,
    repeats: int,
    epochs: int,
    train_steps: int,
    threads: int | None,
    batch_tokens: int | None,
) -> None:
    if threads:
        torch.set_num_threads(threads)
    load_before = harness.load_average()
    vocab_path = vocab_path or str(Path(manifest_path).with_name("vocab_map.pt"))
    manifest = load_manifest(manifest_path)
    settings = TrainSettings.from_dict(
        {"val_fraction": 0.0, **({"batch_tokens": batch_tokens} if batch_tokens else {})}
    )
    print(
        f"{manifest_path}: {manifest['num_samples']} samples, {manifest['num_tokens']:,} tokens, "
        f"hidden {manifest['hidden_size']} x {manifest['num_aux']} aux + final, codec {manifest['codec']}; "
        f"batch_tokens {settings.batch_tokens}, torch threads {torch.get_num_threads()}"
    )
    tmp = tempfile.TemporaryDirectory(prefix="draftsmith-bench-")
    manifests = {manifest.get("codec", "none"): manifest}
    if "zstd-planes" not in manifests:
        manifests["zstd-planes"] = zstd_copy(manifest, Path(tmp.name))

    # ---- loader alone
    loaders: dict[str, Any] = {}
    for codec, m in manifests.items():
        for n in (0, 1, 2):
            loaders[f"{codec}, streaming, {n} threads"] = StreamingData.from_manifest(
                m, replace(settings, loader_threads=n)
            )
        t0 = time.perf_counter()
        loaders[f"{codec}, in memory"] = InMemoryData.from_manifest(m, replace(settings, loader_threads=2))
        loaders[f"{codec}, in memory"].load_s = time.perf_counter() - t0
    first = next(iter(loaders.values()))
    plan = [b for e in range(epochs) for b in first.epoch_batches(e)]  # the same for every loader
    runs: dict[str, list] = {name: [] for name in loaders}
    for _ in range(repeats):
        for name, data in loaders.items():
            runs[name].append(drain(data.batches(plan, "train")))
    loader_rows = {name: median_rate(r) for name, r in runs.items()}
    for name, data in loaders.items():
        if isinstance(data, InMemoryData):
            loader_rows[name]["load_s"] = data.load_s

    # ---- training alone, then fed by the streaming loader (default codec and threads)
    step = make_trainer(manifest, vocab_path, settings)
    ready = [b for b in loaders[f"{manifest.get('codec', 'none')}, in memory"].batches(plan, "train")]
    ready = (ready * (train_steps // len(ready) + 1))[:train_steps]
    step_fp32 = make_trainer(manifest, vocab_path, replace(settings, precision="fp32"))
    step(ready[0]), step_fp32(ready[0])  # warm-up (allocations, first-call overheads)
    streaming = loaders[f"zstd-planes, streaming, {settings.loader_threads} threads"]
    train_runs, fp32_runs, fed_runs = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = sum(step(b) for b in ready)
        train_runs.append((len(ready), tokens, time.perf_counter() - t0))
        t0 = time.perf_counter()
        tokens = sum(step_fp32(b) for b in ready)
        fp32_runs.append((len(ready), tokens, time.perf_counter() - t0))
        wait, tokens, n = 0.0, 0, 0
        t0 = time.perf_counter()
        batches = streaming.batches(
            (plan * (train_steps // len(plan) + 1))[:train_steps], "train"
        )  # a fresh iterator: nothing decoded before the clock starts
        while True:
            tw = time.perf_counter()
            b = next(batches, None)
            wait += time.perf_counter() - tw
            if b is None:
                break
            tokens += step(b)
            n += 1
        fed_runs.append((n, tokens, time.perf_counter() - t0, wait))

    def step_rate(runs: list[tuple[int, int, float]]) -> dict[str, float]:
        r = median_rate(runs)  # counts optimizer steps, not samples
        return {"steps_per_s": r.pop("samples_per_s"), **r}

    train_row = step_rate(train_runs)
    fp32_row = step_rate(fp32_runs)
    fed = sorted(fed_runs, key=lambda r: r[2])[len(fed_runs) // 2]
    fed_row = {**step_rate([r[:3] for r in fed_runs]), "data_wait_fraction": fed[3] / fed[2]}

    # ---- report: headroom against the faster of the two training measurements (the conservative ratio)
    consumed = max(train_row["tokens_per_s"], fed_row["tokens_per_s"])
    print(f"\n{'loader (no model)':40s} {'samples/s':>10s} {'tokens/s':>10s} {'headroom':>9s}")
    for name, r in loader_rows.items():
        r["headroom"] = r["tokens_per_s"] / consumed
        extra = f"  (+ {r['load_s']:.2f} s up-front decode)" if "load_s" in r else ""
        print(f"{name:40s} {r['samples_per_s']:10.0f} {r['tokens_per_s']:10.0f} {r['headroom']:8.0f}x{extra}")
    print(
        f"\n{'training, ' + settings.precision + ' (forward+backward+step)':40s} "
        f"{train_row['tokens_per_s']:10.0f} tokens/s"
    )
    print(
        f"{'training, fp32 (no autocast)':40s} {fp32_row['tokens_per_s']:10.0f} tokens/s  "
        f"({train_row['tokens_per_s'] / fp32_row['tokens_per_s']:.2f}x for {settings.precision})"
    )
    print(
        f"{'training fed by the streaming loader':40s} {fed_row['tokens_per_s']:10.0f} tokens/s, "
        f"waiting for data {fed_row['data_wait_fraction']:.1%} of the time"
    )
    default = f"zstd-planes, streaming, {settings.loader_threads} threads"
    print(f"\nheadroom of the default loader ({default}): {loader_rows[default]['headroom']:.0f}x")
    result = {
        "data": manifest_path,
        "samples": manifest["num_samples"],
        "tokens": manifest["num_tokens"],
        "hidden_size": manifest["hidden_size"],
        "batch_tokens": settings.batch_tokens,
        "torch_threads": torch.get_num_threads(),
        "loader_batches_per_round": len(plan),
        "loader": loader_rows,
        "precision": settings.precision,
        "train": train_row,
        "train_fp32": fp32_row,
        "precision_speedup": train_row["tokens_per_s"] / fp32_row["tokens_per_s"],
        "train_fed_by_loader": fed_row,
        "train_tokens_per_s_for_headroom": consumed,
        "default_loader": default,
        "headroom": loader_rows[default]["headroom"],
        "machine": harness.machine(load_before),
    }
    for data in loaders.values():
        data.close()
    tmp.cleanup()
    harness.write_result(result, json_path)


# ------------------------------------------------------------------------------------------- attention

KIMI_HEADS, KIMI_HEAD_DIM = 64, 128  # Kimi-K2.5's drafter layer (drafter.derived_shape for MLA targets)


def attention_peak(fused: bool, heads: int, tokens: int, steps: int, threads: int) -> dict[str, float]:
    """In a fresh process: forward + backward of `steps` TTT steps of attention over [1, heads, tokens,
    128] fp32 inputs -> peak resident memory above the inputs (MiB) and seconds."""
    import resource

    from draftsmith.core.model.drafter import TTTKV, ttt_attention_reference

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)

    def draw() -> torch.Tensor:
        return torch.randn(1, heads, tokens, KIMI_HEAD_DIM, generator=gen).requires_grad_()

    qs, keys, values = (
        [draw() for _ in range(steps)],
        [draw() for _ in range(steps)],
        [draw() for _ in range(steps)],
    )
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    t0 = time.perf_counter()
    kv = TTTKV(steps=steps)  # as ttt_loss attends: one shared mask
    if fused:
        loss = sum(kv.attend(qs[j], keys[j], values[j]).square().mean() for j in range(steps))
    else:
        loss = sum(
            ttt_attention_reference(qs[j], keys[: j + 1], values[: j + 1]).square().mean()
            for j in range(steps)
        )
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mib": (peak - base) / 1024, "seconds": seconds}


@main.command()
@click.option("--tokens", default=8192, show_default=True, help="Sequence length (one sample).")
@click.option("--heads", default="1,2", show_default=True, help="Head counts of the materialised form.")
@click.option(
    "--fused-heads",
    default="1,8",
    show_default=True,
    help="Head counts of the fused form (more: its per-head share is small beside the mask).",
)
@click.option("--steps", default=3, show_default=True, help="TTT steps.")
@click.option("--threads", default=1, show_default=True, help="torch threads per measurement.")
@click.option("--json", "json_path", default=str(harness.result_path("attention")), show_default=True)
def attention(tokens: int, heads: str, fused_heads: str, steps: int, threads: int, json_path: str) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    load_before = harness.load_average()
    counts = {False: [int(h) for h in heads.split(",")], True: [int(h) for h in fused_heads.split(",")]}
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for fused in (False, True):
        for h in counts[fused]:
            with ProcessPoolExecutor(1, mp_context=ctx) as pool:  # one at a time: peaks do not mix
                r = pool.submit(attention_peak, fused, h, tokens, steps, threads).result()
            rows.append({"implementation": "fused" if fused else "materialised", "heads": h, **r})
            print(
                f"{rows[-1]['implementation']:13s} {h:3d} heads: peak +{r['peak_mib']:8.0f} MiB, {r['seconds']:6.1f} s"
            )
    projected = {}
    for name in ("materialised", "fused"):
        pts = [(r["heads"], r["peak_mib"]) for r in rows if r["implementation"] == name]
        (h0, m0), (h1, m1) = pts[0], pts[-1]
        per_head = (m1 - m0) / (h1 - h0) if h1 != h0 else m0 / h0
        projected[name] = {"mib_per_head": per_head, "fixed_mib": m0 - per_head * h0}
        projected[name]["kimi_fp32_gib"] = (projected[name]["fixed_mib"] + per_head * KIMI_HEADS) / 1024
    scores_gib = KIMI_HEADS * tokens * tokens * 4 / 2**30
    print(
        f"\n{tokens} tokens, {steps} TTT steps, fp32, batch 1, head dim {KIMI_HEAD_DIM}; projected to "
        f"{KIMI_HEADS} heads (linear in heads):"
    )
    for name, p in projected.items():
        print(
            f"  {name:13s} {p['mib_per_head']:8.0f} MiB per head + {p['fixed_mib']:6.0f} MiB -> "
            f"{p['kimi_fp32_gib']:6.1f} GiB"
        )
    print(f"  (one [64, {tokens}, {tokens}] fp32 score tensor alone: {scores_gib:.1f} GiB)")
    shape = {"tokens": tokens, "ttt_steps": steps, "dtype": "float32", "head_dim": KIMI_HEAD_DIM}
    result = {**shape, "rows": rows, "projected_64_heads": projected, "score_tensor_gib": scores_gib}
    harness.write_result({**result, "machine": harness.machine(load_before)}, json_path)


# ------------------------------------------------------------------------------------------------- ddp


def ddp_worker(rank: int, world: int, port: int, args: dict[str, Any], out: str) -> None:
    """One rank of a data-parallel group on the CPU (gloo): `steps` optimizer steps of the real drafter on
    its share of the first batches, through train_step as training runs it -> out/rank-<r>.json with
    its step times and the bytes DistributedDataParallel handed to all-reduce."""
    import os

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from draftsmith.core.training.distributed import init_distributed
    from draftsmith.core.training.objective import DraftingLoss
    from draftsmith.core.training.optimizers import make_scheduler
    from draftsmith.stages.train import load_inputs, train_step

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    os.environ.update({**env, "WORLD_SIZE": str(world)})
    torch.set_num_threads(args["threads"])
    dist = init_distributed("cpu")
    settings = TrainSettings(val_fraction=0.0, batch_tokens=args["batch_tokens"], precision=args["precision"])
    manifest, vocab, target = load_inputs(args["data"], args["vocab"])
    data = StreamingData.from_manifest(manifest, settings)
    num_aux = int(manifest["num_aux"])
    drafter, embed, teacher = build_drafter(
        target, vocab["d2t"], vocab["t2d"], num_aux, settings, dist.device
    )
    trained = dist.wrap(DraftingLoss(drafter, embed, teacher))
    sent = {"bytes": 0}
    if world > 1:

        def counting(state, bucket):  # no annotations: DDP checks them against types, not strings
            state["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
            return allreduce_hook(None, bucket)  # DDP's own: all-reduce, then divide by the world size

        trained.register_comm_hook(sent, counting)
    optimizer = make_optimizer(drafter, settings)
    scheduler = make_scheduler(optimizer, settings, args["steps"] + 1)
    objective = Objective.from_settings(settings)
    plan = data.epoch_batches(0)[: args["steps"] + 1]  # the first is a warm-up
    times, tokens, counted = [], 0, 0
    lengths = data.train_lengths()
    shares = [step_plan(b, lengths, rank, world, 0)[0] for b in plan]  # as train() shares them
    for step, batch in enumerate(data.batches(shares, "train")):
        t0 = time.perf_counter()
        stats, _, _ = train_step(trained, batch, objective, optimizer, scheduler, settings, dist, step)
        if step == 0:
            counted = sent["bytes"]
            continue
        times.append(time.perf_counter() - t0)
        tokens += stats.tokens
    data.close()
    steps = len(times)
    result = {
        "rank": rank,
        "world": world,
        "steps": steps,
        "step_s": median(times),
        "tokens_per_s": tokens / sum(times),
        "allreduce_bytes_per_step": (sent["bytes"] - counted) / steps,
        "parameters": sum(p.numel() for p in drafter.parameters()),
    }
    write_json(Path(out) / f"rank-{rank}.json", result)
    dist.finish()


@main.command()
@click.option("--data", "manifest_path", default="results/data_config.json", show_default=True)
@click.option("--vocab", "vocab_path", default=None, help="[default: vocab_map.pt beside --data]")
@click.option("--steps", default=20, show_default=True, help="Optimizer steps measured (after 1 warm-up).")
@click.option("--batch-tokens", default=None, type=int, help="[default: the train section's default]")
@click.option("--threads", default=1, show_default=True, help="torch threads per process.")
@click.option("--json", "json_path", default=str(harness.result_path("ddp")), show_default=True)
def ddp(
    manifest_path: str,
    vocab_path: str | None,
    steps: int,
    batch_tokens: int | None,
    threads: int,
    json_path: str,
) -> None:
    """Data-parallel training, 1 vs 2 processes on this machine: step time, tokens/s, and the bytes each
    rank hands to all-reduce per step (DDP's gradient buckets; a ring all-reduce sends 2 (N-1)/N of them)."""
    import multiprocessing
    import socket

    load_before = harness.load_average()
    vocab_path = vocab_path or str(Path(manifest_path).with_name("vocab_map.pt"))
    precision = "fp32"  # the same arithmetic in every configuration
    args = {
        "data": manifest_path,
        "vocab": vocab_path,
        "steps": steps,
        "threads": threads,
        "precision": precision,
    }
    args["batch_tokens"] = batch_tokens or TrainSettings().batch_tokens
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for world in (1, 2):
        with socket.socket() as s, tempfile.TemporaryDirectory(prefix="draftsmith-ddp-") as out:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            procs = [ctx.Process(target=ddp_worker, args=(r, world, port, args, out)) for r in range(world)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            if any(p.exitcode for p in procs):
                raise click.ClickException(f"a rank of the {world}-process run failed")
            ranks = [json.loads((Path(out) / f"rank-{r}.json").read_text()) for r in range(world)]
        row = {
            "processes": world,
            "step_s": max(r["step_s"] for r in ranks),
            "tokens_per_s": min(
                r["tokens_per_s"] for r in ranks
            ),  # the whole batch's tokens (stats are summed)
            "allreduce_bytes_per_rank_per_step": ranks[0]["allreduce_bytes_per_step"],
            "ring_bytes_sent_per_rank_per_step": ranks[0]["allreduce_bytes_per_step"]
            * 2
            * (world - 1)
            / world,
            "parameters": ranks[0]["parameters"],
            "ranks": ranks,
        }
        rows.append(row)
    print(
        f"\n{manifest_path}: {rows[0]['parameters'] / 1e6:.1f} M parameters, batch_tokens {args['batch_tokens']},"
    )
    print(
        f"{steps} steps after a warm-up, {precision}, {threads} torch thread(s) per process, gloo on the CPU\n"
    )
    columns = [("processes", ">9d"), ("step s", ">8.3f"), ("tokens/s", ">9.0f"), ("all-reduce MB/step", ">19.2f"),
               ("sent MB/step (ring)", ">20.2f")]  # fmt: skip
    table = [[r["processes"], r["step_s"], r["tokens_per_s"], r["allreduce_bytes_per_rank_per_step"] / 1e6,
              r["ring_bytes_sent_per_rank_per_step"] / 1e6] for r in rows]  # fmt: skip
    print(harness.format_table(columns, table))
    result = {"data": manifest_path, "steps": steps, "threads": threads, "rows": rows}
    harness.write_result({**result, "machine": harness.machine(load_before)}, json_path)


if __name__ == "__main__":
    main()
