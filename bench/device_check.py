"""Checks a lent single-GPU machine can run in minutes (scripts/device-check.sh; issue 43): torch and
transformers only, no vLLM, no network, no model weights.

    python -m bench.device_check [--quick] [--device cuda]

Prints one table (format in docs/gpu.md, "Checks on a lent GPU"):

- train: peak CUDA memory of one training pass (forward, backward, AdamW step) of a Llama-3.1-8B-shaped
  and a Kimi-K2.5-shaped drafter at the shipped configs' tokens per pass, bf16 autocast, with and without
  checkpoint_ttt, against the memory plan's figure for that rank (draftsmith/core/planning/memory.py); and the
  training rate in tokens/s.
- mask: the extra memory of a 7-step TTT attention (forward and backward) at T = 8,191 through a mask
  whose row stride is steps x T (before the stride fix) and one padded to a multiple of 8 (after).
- ddp: one DistributedDataParallel step per drafter kind under NCCL with one rank (P-EAGLE also with
  ttt_steps 1: mask_hidden's gradient).

Shapes come from tests/data/target-configs/ and configs/*.yaml; every tensor is random. `--quick` shrinks
every size (a smoke run on a CPU with gloo: `--device cpu --quick`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

try:  # the image's torch and transformers; draftsmith's own small dependencies may be missing there
    from draftsmith.core.config.config import merged_config_files, text_config_json, with_defaults
    from draftsmith.core.data.loader import Batch
    from draftsmith.core.model import drafter as drafter_module
    from draftsmith.core.model.drafter import TTTKV, DrafterConfig
    from draftsmith.core.model.kinds import KINDS, drafter_loss, new_drafter
    from draftsmith.core.model.target import load_target_config
    from draftsmith.core.planning.memory import GB, drafter_shape, train_memory
    from draftsmith.core.training.objective import DraftingLoss, Objective
    from draftsmith.stages.train import TrainSettings
except ModuleNotFoundError as err:
    print(
        f"device-check: needs the Python package {err.name!r}, which {sys.executable} lacks: install or carry its wheel"
    )
    sys.exit(1)

TARGETS = ROOT / "tests" / "data" / "target-configs"
# (row name, shipped config, target config folder)
SHAPES = [
    ("llama-3.1-8b", "configs/llama-3.1-8b.yaml", "llama-3.1-8b"),
    ("kimi-k2.5", "configs/kimi-k2.5-8gpu.yaml", "kimi-k2.5"),
]
MASK_STEPS, MASK_T = 7, 8191  # an odd length: steps x T is not a multiple of 8


@dataclass
class Row:
    check: str
    case: str
    measured: str
    planned: str = ""
    note: str = ""


def objective(steps: int, checkpoint_ttt: bool, device: torch.device, precision: str = "bf16") -> Objective:
    """The training objective of the schema's defaults with these steps, precision and checkpointing."""
    settings = TrainSettings.from_dict(
        {"ttt_steps": steps, "precision": precision, "checkpoint_ttt": checkpoint_ttt, "noise_std": 0.0}
    )
    return Objective.from_settings(settings.objective, device)


def random_batch(cfg: DrafterConfig, rows: int, seq: int, device: torch.device) -> Batch:
    """`rows` samples of `seq` tokens, every position trained; aux and final states in bf16 (as stored)."""
    ids = torch.randint(0, cfg.target_vocab_size, (rows, seq), device=device)
    return Batch(
        input_ids=ids,
        loss_mask=torch.ones(rows, seq, dtype=torch.bool, device=device),
        lengths=torch.full((rows,), seq, device=device),
        aux=torch.randn(rows, seq, cfg.num_aux * cfg.target_hidden_size, device=device).bfloat16(),
        final=torch.randn(rows, seq, cfg.target_hidden_size, device=device).bfloat16(),
    )


def drafter_config(folder: str, draft_vocab: int, shape: dict[str, Any], quick: bool) -> DrafterConfig:
    """The drafter draftsmith derives for the target (its kind and `shape` over it); `quick`: the same
    kind at toy sizes."""
    cfg = DrafterConfig.from_target(load_target_config(TARGETS / folder), draft_vocab, 3, shape)
    if not quick:
        return cfg
    return replace(
        cfg,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        target_hidden_size=64,
        target_vocab_size=1024,
        draft_vocab_size=256,
        mask_token_id=None if cfg.mask_token_id is None else 1023,
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def train_case(
    name: str, config_file: str, folder: str, checkpoint_ttt: bool, device: torch.device, quick: bool
) -> Row:
    """One training pass as the shipped config plans it per rank: measured peak and rate, the plan's total."""
    config = with_defaults(merged_config_files([ROOT / config_file]))
    target = text_config_json(TARGETS / folder)
    tr, res = config["train"], config["resources"]["train"]
    shape = drafter_shape(config, target, 3)
    plan = train_memory(
        shape,
        int(target["vocab_size"]),
        batch_tokens=int(tr["batch_tokens"]),
        max_seq_len=int(tr["max_seq_len"]),
        world=max(1, int(res["gpus"])),
        ttt_steps=int(tr["ttt_steps"]),
        micro_batch_tokens=int(res["micro_batch_tokens"]),
        checkpoint_ttt=checkpoint_ttt,
        lk_loss=str(tr["lk_loss"]),
    )
    seq = plan.seq_len if not quick else 64
    rows = max(1, plan.tokens_per_pass // plan.seq_len) if not quick else 1
    cfg = drafter_config(folder, int(config["vocab"]["size"]), {}, quick)
    reset_peak(device)
    torch.manual_seed(0)
    drafter = new_drafter(cfg).to(device).train()
    embed = torch.randn(cfg.target_vocab_size, cfg.target_hidden_size, device=device)
    teacher = torch.randn(cfg.draft_vocab_size, cfg.target_hidden_size, device=device)
    model = DraftingLoss(drafter, embed, teacher, loss=drafter_loss(cfg))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    batch = random_batch(cfg, rows, seq, device)
    obj = objective(int(tr["ttt_steps"]), checkpoint_ttt, device)
    times = []
    for step in range(4):  # the first builds AdamW's state; the last three are timed
        sync(device)
        t0 = time.perf_counter()
        loss, _ = model(batch, obj)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        if step:
            times.append(time.perf_counter() - t0)
    peak = peak_bytes(device)
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0
    tokens = rows * seq
    rate = tokens / (sum(times) / len(times))
    del model, drafter, optimizer, batch, embed, teacher
    reset_peak(device)
    ckpt = "checkpoint_ttt" if checkpoint_ttt else "no checkpoint"
    return Row(
        "train",
        f"{name} {tokens:,} tok/pass, {ckpt}",
        f"{peak / GB:.1f} GB" if device.type == "cuda" else "n/a (cpu)",
        f"{plan.total / GB:.1f} GB",
        f"{rate:,.0f} tok/s" + (f", reserved {reserved / GB:.1f} GB" if reserved else ""),
    )


@contextlib.contextmanager
def mask_align(align: int) -> Iterator[None]:
    before = drafter_module.MASK_ALIGN
    drafter_module.MASK_ALIGN = align
    try:
        yield
    finally:
        drafter_module.MASK_ALIGN = before


def mask_case(align: int, device: torch.device, quick: bool) -> Row:
    """Extra memory of a 7-step TTT attention's forward and backward (the mask and what SDPA makes of it)."""
    T = 61 if quick else MASK_T
    heads, dim = 8, 64
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with mask_align(align):
        reset_peak(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        kv = TTTKV(steps=MASK_STEPS)
        qs = [torch.randn(1, heads, T, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
        total = torch.zeros((), device=device)
        for _ in range(MASK_STEPS):
            total = total + kv.attend(*qs).float().sum()
        total.backward()
        sync(device)
        stride = kv.bias.stride(-2)
        peak = peak_bytes(device) - base
        del kv, qs, total
    label = "before the fix (row stride steps x T)" if align == 1 else "after (row stride padded to 8)"
    return Row(
        "mask",
        f"{MASK_STEPS} steps x T {T:,}: {label}",
        f"{peak / GB:.2f} GB" if device.type == "cuda" else "n/a (cpu)",
        "",
        f"row stride {stride}",
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_case(kind: str, steps: int, device: torch.device, quick: bool) -> Row:
    """Two DistributedDataParallel steps of this kind (one rank, as draftsmith.core.training.distributed wraps it)."""
    from torch.nn.parallel import DistributedDataParallel

    # Llama-3.1-8B's width, a narrower MLP: the step's collectives are what is checked, not its size
    cfg = drafter_config("llama-3.1-8b", 32000, {"kind": kind, "intermediate_size": 2048}, quick)
    torch.manual_seed(0)
    drafter = new_drafter(cfg).to(device).train()
    embed = torch.randn(cfg.target_vocab_size, cfg.target_hidden_size, device=device)
    teacher = torch.randn(cfg.draft_vocab_size, cfg.target_hidden_size, device=device)
    model = DraftingLoss(drafter, embed, teacher, loss=drafter_loss(cfg))
    wrapped = DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True
    )
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    batch = random_batch(cfg, 2, 64 if quick else 512, device)
    obj = objective(steps, False, device, "bf16" if device.type == "cuda" else "fp32")
    t0 = time.perf_counter()
    losses = []
    for _ in range(2):  # the second step is where a parameter without a gradient fails DDP
        loss, _ = wrapped(batch, obj)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    sync(device)
    seconds = time.perf_counter() - t0
    del wrapped, model, drafter, optimizer
    finite = all(torch.isfinite(torch.tensor(losses)).tolist())
    return Row(
        "ddp",
        f"{kind}, ttt_steps {steps}",
        "ok" if finite else "NON-FINITE LOSS",
        "",
        f"2 steps in {seconds:.1f} s",
    )


def progress(row: Row) -> None:
    print(
        f"device-check: {row.check} {row.case}: {row.measured} {row.planned} {row.note}".rstrip(), flush=True
    )


def guarded(check: str, case: str, run: Callable[[], Row]) -> Row:
    """A check's row, or a row saying how it failed (one failing check does not hide the others)."""
    try:
        return run()
    except Exception as err:  # noqa: BLE001 - reported in the table
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return Row(check, case, "FAILED", "", f"{type(err).__name__}: {' '.join(str(err).split())[:160]}")


def table(rows: list[Row], header: str) -> str:
    cols = ["check", "case", "measured", "planned", "note"]
    cells = [[getattr(r, c) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    line = lambda xs: "| " + " | ".join(x.ljust(w) for x, w in zip(xs, widths, strict=True)) + " |"  # noqa: E731
    out = [header, line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    return "\n".join(out + [line(x) for x in cells])


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.device_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run, e.g. on a CPU)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"device-check: CUDA is not available (torch {torch.__version__}): run it on a GPU machine")
        return 1
    started = time.perf_counter()
    rows: list[Row] = []
    for name, config_file, folder in SHAPES:
        for ckpt in (False, True):
            case = f"{name}, checkpoint_ttt {ckpt}"
            run = lambda n=name, c=config_file, f=folder, k=ckpt: train_case(n, c, f, k, device, args.quick)  # noqa: E731
            rows.append(guarded("train", case, run))
            progress(rows[-1])
    for align in (1, 8):
        rows.append(guarded("mask", f"align {align}", lambda a=align: mask_case(a, device, args.quick)))
        progress(rows[-1])
    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.distributed.init_process_group(backend, rank=0, world_size=1)
    try:
        for kind, steps in [*((k, 3) for k in KINDS), ("peagle", 1)]:
            run = lambda k=kind, n=steps: ddp_case(k, n, device, args.quick)  # noqa: E731
            rows.append(guarded("ddp", f"{kind}, ttt_steps {steps}", run))
            progress(rows[-1])
    finally:
        torch.distributed.destroy_process_group()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    header = (
        f"device-check on {name}: torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"{time.perf_counter() - started:.0f} s{' (--quick)' if args.quick else ''}"
    )
    print(table(rows, header))
    return 1 if any(r.measured in ("FAILED", "NON-FINITE LOSS") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
