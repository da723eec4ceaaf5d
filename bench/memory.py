"""Bytes the TTT loss keeps for the backward pass, measured, and the per-token coefficients of
draftsmith/core/planning/memory.py fitted to them.

    python -m bench.memory            # measure scaled-down drafters, fit, print the coefficients

What is counted: every tensor autograd saves during `ttt_loss` (torch.autograd.graph.saved_tensors_hooks)
plus, with activation checkpointing, the tensors the checkpoints hold alive (found through the garbage
collector after the forward), each storage once; the drafter's own fp32 parameters, the batch and the
frozen target tensors are not activations and are left out (memory.py counts them apart). The bf16
copies of the weights that autocast makes are counted: memory.py's `weight_copies` term.

Everything here runs on the CPU in seconds: bf16 autocast, every position valid.
"""

from __future__ import annotations

import copy
import gc
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.core.data.loader import Batch
from draftsmith.core.model.drafter import DrafterConfig, Eagle3Drafter
from draftsmith.core.planning.memory import CHECKPOINTED, CURRENT, DrafterShape, activation_bytes
from draftsmith.core.training import objective as objective_module
from draftsmith.core.training.objective import Objective, ttt_loss


@dataclass(frozen=True)
class Case:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    draft_vocab: int
    tokens: int  # one sample of this length
    steps: int = 7

    def shape(self) -> DrafterShape:
        return DrafterShape(
            hidden_size=self.hidden,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate,
            draft_vocab_size=self.draft_vocab,
            target_hidden_size=self.hidden,
            num_aux=3,
        )


def objective(steps: int, checkpoint_ttt: bool) -> Objective:
    return Objective(
        ttt_steps=steps,
        step_weights=tuple(0.8**j for j in range(steps)),
        precision="bf16",
        mask_offset=2,
        loss_norm="position",
        loss_positions="all",
        ttt_prefix="accepted",
        ttt_positions="advance",
        noise_std=0.0,
        lk_loss="none",
        lk_kl_scale=1.0,
        lk_kl_decay=0.0,
        checkpoint_ttt=checkpoint_ttt,
    )


def measure(case: Case, checkpoint_ttt: bool = False, seed: int = 0) -> int:
    """Bytes held for the backward pass after one `ttt_loss` forward on `case`, with autocast's weight
    cache on as on a GPU (draftsmith.core.training.objective.CPU_AUTOCAST_CACHE)."""
    objective_module.CPU_AUTOCAST_CACHE = True
    try:
        return _measure(case, checkpoint_ttt, seed)
    finally:
        objective_module.CPU_AUTOCAST_CACHE = False


def _measure(case: Case, checkpoint_ttt: bool, seed: int) -> int:
    torch.manual_seed(seed)
    H, V = case.hidden, 4 * case.draft_vocab
    cfg = DrafterConfig(
        hidden_size=H,
        num_attention_heads=case.heads,
        num_key_value_heads=case.kv_heads,
        head_dim=case.head_dim,
        intermediate_size=case.intermediate,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4 * case.tokens,
        target_hidden_size=H,
        target_vocab_size=V,
        draft_vocab_size=case.draft_vocab,
        kind="eagle3",
    )
    drafter = Eagle3Drafter(cfg).train()
    embed, teacher = torch.randn(V, H), torch.randn(case.draft_vocab, H)
    T = case.tokens
    batch = Batch(
        input_ids=torch.randint(0, V, (1, T)),
        loss_mask=torch.ones(1, T, dtype=torch.bool),
        lengths=torch.tensor([T]),
        aux=torch.randn(1, T, 3 * H).bfloat16(),
        final=torch.randn(1, T, H).bfloat16(),
    )
    own = {
        t.untyped_storage().data_ptr() for t in [*drafter.parameters(), *drafter.buffers(), embed, teacher]
    }
    own |= {t.untyped_storage().data_ptr() for t in vars(batch).values()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    gc.collect()
    before = {id(o) for o in live_tensors()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = ttt_loss(drafter, embed, teacher, batch, objective(case.steps, checkpoint_ttt))
    if checkpoint_ttt:  # what the checkpoints keep alive is held in Python, not through the hooks
        for o in live_tensors():
            if id(o) not in before and o.layout == torch.strided:
                storage = o.untyped_storage()
                if storage.data_ptr() not in own and storage.nbytes():
                    saved[storage.data_ptr()] = storage.nbytes()
    loss.backward()  # the forward's graph is complete and usable
    return sum(saved.values())


def live_tensors() -> list[torch.Tensor]:
    with warnings.catch_warnings():  # isinstance on some torch objects warns of deprecations
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


CASES = [  # 1/64-scale drafters (Llama-3.1-8B: H 4096 -> 64, I 14336 -> 224, Vd 32000 -> 500)
    Case(64, 4, 2, 16, 224, 500, 96),
    Case(64, 4, 2, 16, 224, 500, 192),
    Case(64, 4, 2, 16, 224, 500, 384),
    Case(128, 4, 2, 16, 224, 500, 192),
    Case(64, 8, 2, 16, 224, 500, 192),
    Case(64, 4, 4, 16, 224, 500, 192),
    Case(64, 4, 2, 16, 448, 500, 192),
    Case(64, 4, 2, 16, 224, 1000, 192),
    Case(64, 4, 2, 16, 224, 500, 192, steps=3),
    Case(112, 8, 8, 16, 192, 500, 128),  # Kimi-K2.5-like proportions
]


def main() -> None:
    torch.set_num_threads(1)
    for checkpoint_ttt in (False, True):
        print(
            f"checkpoint_ttt={checkpoint_ttt}"
            + (" (what the checkpoints keep; one step recomputed comes on top)" if checkpoint_ttt else "")
        )
        for case in CASES:
            got = measure(case, checkpoint_ttt)
            coefficients = CHECKPOINTED if checkpoint_ttt else CURRENT
            model = activation_bytes(
                case.shape(),
                case.tokens,
                case.tokens,
                case.steps,
                checkpoint_ttt,
                p_bytes=4,
                coefficients=coefficients,
            )
            print(
                f"  H {case.hidden} heads {case.heads}x{case.head_dim} kv {case.kv_heads} I {case.intermediate} "
                f"Vd {case.draft_vocab} T {case.tokens} steps {case.steps}: measured {got / case.tokens:8.0f} "
                f"B/token, model {model / case.tokens:8.0f} ({model / got - 1:+.1%})"
            )


SHIPPED = {  # config -> the folder of its target's config.json under tests/data/target-configs
    "llama-3.1-8b": "llama-3.1-8b",
    "qwen3-235b-a22b": "qwen3-235b-a22b",
    "kimi-k2.5-8gpu": "kimi-k2.5",
    "quality": None,  # the embedded SmolLM2 target on a CPU: no GPU stage
}


# GPUs per generate / extract job in each config before issue 32 (each job one engine over all of them)
BEFORE_JOB_GPUS = {"llama-3.1-8b": 1, "qwen3-235b-a22b": 8, "kimi-k2.5-8gpu": 8}


def tables() -> str:
    """docs/gpu.md's tables: each shipped config's memory per GPU and stage on an H100 and an H200, before
    issue 32 (the loss as it was, no micro-batches, shares by sample count at their nominal batch_tokens /
    world) and now (with the vLLM stages' engines x GPUs each where the job runs several engines)."""
    from draftsmith.core.config.config import merged_config_files, with_defaults
    from draftsmith.core.planning.memory import BEFORE, GB, GIB, GPU_PRESETS, plan_config

    root = Path(__file__).resolve().parents[1]
    out = []
    for name, target in SHIPPED.items():
        config = with_defaults(merged_config_files([root / "configs" / f"{name}.yaml"]))
        out.append(f"**configs/{name}.yaml**")
        if target is None:
            out.append("\nNo stage asks for GPUs (`resources.<stage>.gpus` are 0): nothing to plan.\n")
            continue
        config["target"]["model"] = str(root / "tests" / "data" / "target-configs" / target)
        before = copy.deepcopy(config)
        before["resources"]["train"]["micro_batch_tokens"] = 0
        before["resources"]["train"]["checkpoint_ttt"] = False
        for stage in ("generate", "extract"):  # one engine per job, tensor parallel over the job's GPUs then
            before["resources"][stage]["tensor_parallel"] = BEFORE_JOB_GPUS[name]
        world = before["resources"]["train"]["gpus"]
        share = before["train"]["batch_tokens"] // world
        rows: dict[str, dict[str, str]] = {}
        gpus = ["H100-80GB", "H200-141GB"]
        for gpu in gpus:
            memory = GPU_PRESETS[gpu] * GIB
            for when, cfg, kw in (
                ("before", before, {"coefficients": BEFORE, "share_tokens": share}),
                ("now", config, {}),
            ):
                for need in plan_config(cfg, memory, **kw):
                    mark = "" if need.fits else " ✗"
                    layout = (
                        f" ({need.engines}×{need.gpus} GPUs)" if when == "now" and need.engines > 1 else ""
                    )
                    cell = f"{need.total / GB:.1f} / {need.budget / GB:.1f}{mark}{layout}"
                    rows.setdefault(need.stage, {})[f"{gpu} {when}"] = cell
        cols = [f"{g} {w}" for g in gpus for w in ("before", "now")]
        out.append("")
        out.append("| stage (GB per GPU / budget) | " + " | ".join(cols) + " |")
        out.append("|---|" + "---|" * len(cols))
        for stage, cells in rows.items():
            out.append(f"| {stage} | " + " | ".join(cells.get(c, "") for c in cols) + " |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    if "--tables" in sys.argv:
        print(tables())
    else:
        main()
