"""bench.peer --diff: the differential check of draftsmith's loss and gradients against SpecForge's on
the same initial weights and samples (bench.peer's docstring)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import torch
from torch import Tensor

from bench.peer.convert import specforge_sample
from bench.peer.install import shim_command, side_env
from bench.peer.train import specforge_run_config
from draftsmith.core.data.loader import StreamingData, collate
from draftsmith.core.data.shards import Sample
from draftsmith.core.io.atomic import write_json


def teacher_in_vocab_mask(batch: Any, teacher_full: Tensor, t2d: Tensor, mask_offset: int) -> Tensor:
    """SpecForge trains a position only where the target's top-1 over the *whole* vocabulary is a draft
    token. As a loss mask for draftsmith's `ttt_step_targets`: loss_mask[s] is read for the prediction
    whose teacher is f_{s - mask_offset + 1}, so keep s where t2d[argmax lm_head(f_{s - mask_offset + 1})]."""
    B, T = batch.input_ids.shape
    top = (batch.final.float() @ teacher_full.T).argmax(-1)  # [B, T] the teacher's top-1 at each f_t
    in_vocab = t2d[top]  # [B, T] at f_t
    shift = 1 - mask_offset  # s = t + mask_offset - 1
    keep = torch.zeros(B, T, dtype=torch.bool)
    if shift >= 0:
        keep[:, : T - shift] = in_vocab[:, shift:]
    else:
        keep[:, -shift:] = in_vocab[:, : T + shift]
    return batch.loss_mask & keep


def per_depth_grads(
    drafter: Any, embed: Tensor, teacher: Tensor, batch: Any, objective: Any
) -> tuple[list[dict[str, Tensor]], list[float]]:
    """draftsmith's ttt_loss at depth 1..ttt_steps -> (the gradient of each depth's weighted loss, the
    per-step loss sums of the full depth)."""
    from draftsmith.core.training.objective import ttt_loss

    grads, sums = [], []
    for depth in range(1, objective.ttt_steps + 1):
        drafter.zero_grad(set_to_none=True)
        obj = replace(objective, ttt_steps=depth, step_weights=objective.step_weights[:depth])
        loss, stats = ttt_loss(drafter, embed, teacher, batch, obj)
        loss.backward()
        grads.append(
            {n: p.grad.detach().clone() for n, p in drafter.named_parameters() if p.grad is not None}
        )
        sums = stats.loss_sum
    return grads, sums


def step_grads(cumulative: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
    """Gradients of each TTT step's own weighted loss: depth d minus depth d-1."""
    return [
        {n: g - (cumulative[j - 1][n] if j else 0) for n, g in c.items()} for j, c in enumerate(cumulative)
    ]


def compare_grads(a: dict[str, Tensor], b: dict[str, Tensor]) -> dict[str, float]:
    """a against reference b: cosine, norm ratio, max relative element error (over all parameters)."""
    names = sorted(set(a) & set(b))
    va = torch.cat([a[n].double().flatten() for n in names])
    vb = torch.cat([b[n].double().flatten() for n in names])
    return {
        "cosine": float(torch.nn.functional.cosine_similarity(va, vb, dim=0)),
        "norm_ratio": float(va.norm() / vb.norm()),
        "max_abs_err_over_max": float((va - vb).abs().max() / vb.abs().max()),
    }


def init_stats(weights: dict[str, Tensor]) -> dict[str, dict[str, float]]:
    return {n: {"std": float(t.float().std()), "bound": float(t.float().abs().max())}
            for n, t in weights.items() if t.is_floating_point() and t.dim() == 2}  # fmt: skip


def run_diff(
    venv: Path, conv_dir: Path, manifest_path: Path, vocab_path: Path, settings: dict[str, Any],
    samples: int, max_len: int, threads: int | None, out: Path,
) -> dict[str, Any]:  # fmt: skip
    """The differential check (module docstring)."""
    from draftsmith.core.model.drafter import build_drafter
    from draftsmith.core.training.objective import Objective, ttt_loss
    from draftsmith.stages.train import TrainSettings, load_inputs

    out.mkdir(parents=True, exist_ok=True)
    s = TrainSettings.from_dict(settings)
    manifest, vocab, target = load_inputs(manifest_path, vocab_path)
    data = StreamingData.from_manifest(manifest, s)
    picked = [data.sample("train", i) for i in range(min(samples, len(data.train)))]
    data.close()
    picked = [
        Sample(x.id, x.input_ids[:max_len], x.loss_mask[:max_len], x.aux[:max_len], x.final[:max_len])
        for x in picked
    ]
    # SpecForge also trains the teacher of the last position (x_T does not exist; draftsmith needs the
    # real next token to score): the one position per step it has more is left out on both sides here
    # and named in the result instead.
    raw = []
    for x in picked:
        r = specforge_sample(x, s.loss_positions)
        r["loss_mask"][-2:] = 0
        for k in ("aux_hidden_state", "hidden_state"):  # float32 models on both sides (bf16 values are exact)
            r[k] = r[k].float()
        raw.append(r)
    cfg = specforge_run_config(
        conv_dir, out / "unused", settings, {"accumulation_steps": 1, "steps": 1}, "float32"
    )
    write_json(out / "run.json", cfg)
    torch.save({"samples": raw, "weights": None}, out / "diff_in.pt")
    t0 = time.perf_counter()
    proc = subprocess.run(
        shim_command(venv, "diff", "--config", str(out / "run.json"),
                     "--inputs", str(out / "diff_in.pt"), "--out", str(out / "diff_out.pt")),
        capture_output=True, text=True, env=side_env(threads), cwd=out,
    )  # fmt: skip
    if proc.returncode != 0:
        raise click.ClickException(f"SpecForge's side of the diff failed:\n{proc.stderr[-4000:]}")
    specforge_side_s = time.perf_counter() - t0
    sf = torch.load(out / "diff_out.pt", map_location="cpu", weights_only=False)
    ttt = int(sf["ttt_steps"])
    drafter, embed, teacher = build_drafter(
        target, vocab["d2t"], vocab["t2d"], int(manifest["num_aux"]), s, "cpu"
    )
    # draftsmith's objective in float32 on the loss mask given (each sample's own, as SpecForge gets it)
    base = replace(
        Objective.from_settings(s, "cpu"),
        precision="fp32",
        loss_positions="assistant",
        noise_std=0.0,
        lk_loss="none",
    )
    own_init = init_stats({n: p.detach() for n, p in drafter.named_parameters()})
    drafter.load_state_dict({**drafter.state_dict(), **sf["initial"]})
    drafter.float()
    teacher_full = target.lm_head
    variants: dict[str, dict[str, Any]] = {
        # draftsmith set to SpecForge's conventions + SpecForge's teacher-in-vocabulary filter: must agree
        "specforge_conventions": {"mask_offset": 0, "loss_norm": "sample", "filter": True},
        # each known difference alone, from SpecForge's conventions
        "no_vocab_filter": {"mask_offset": 0, "loss_norm": "sample", "filter": False},
        "mask_offset_2": {"mask_offset": 2, "loss_norm": "sample", "filter": True},
        "position_norm": {"mask_offset": 0, "loss_norm": "position", "filter": True},
        # what draftsmith trains with (its settings)
        "draftsmith_settings": {
            "mask_offset": s.mask_offset,
            "loss_norm": s.loss_norm,
            "filter": False,
            "ttt_prefix": s.ttt_prefix,
            "ttt_positions": s.ttt_positions,
        },  # fmt: skip
    }
    rows: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for i, x in enumerate(picked):
        ref_depths = sf["samples"][i]
        ref_steps = step_grads([d["grads"] for d in ref_depths])
        ref_loss = ref_depths[-1]["plosses"]  # per step: masked CE sum / T
        T = x.num_tokens
        mask = raw[i]["loss_mask"].bool()
        for name, v in variants.items():
            batch = collate([Sample(x.id, x.input_ids, mask, x.aux, x.final)])
            if v["filter"]:
                batch = replace(
                    batch,
                    loss_mask=teacher_in_vocab_mask(batch, teacher_full, vocab["t2d"], v["mask_offset"]),
                )
            kw = {k: v[k] for k in ("mask_offset", "loss_norm", "ttt_prefix", "ttt_positions") if k in v}
            cum, sums = per_depth_grads(drafter, embed, teacher, batch, replace(base, **kw))
            steps = step_grads(cum)
            rows[name].append({
                "sample": i, "tokens": T,
                "loss_per_step": [sm / T for sm in sums], "specforge_loss_per_step": ref_loss,
                "grad_per_step": [compare_grads(steps[j], ref_steps[j]) for j in range(ttt)],
                "grad_total": compare_grads(cum[-1], ref_depths[-1]["grads"]),
            })  # fmt: skip
    # One optimizer step's gradient over all the samples: SpecForge accumulates one sample per micro-batch
    # (each loss divided by the accumulation count); draftsmith pads them into one batch.
    ref_batch = {n: sum(sf["samples"][i][-1]["grads"][n] for i in range(len(picked))) / len(picked)
                 for n in sf["samples"][0][-1]["grads"]}  # fmt: skip
    batch_rows = {}
    for name, v in variants.items():
        batch = collate(
            [
                Sample(x.id, x.input_ids, raw[i]["loss_mask"].bool(), x.aux, x.final)
                for i, x in enumerate(picked)
            ]
        )
        if v["filter"]:
            batch = replace(
                batch, loss_mask=teacher_in_vocab_mask(batch, teacher_full, vocab["t2d"], v["mask_offset"])
            )
        kw = {k: v[k] for k in ("mask_offset", "loss_norm", "ttt_prefix", "ttt_positions") if k in v}
        drafter.zero_grad(set_to_none=True)
        loss, _ = ttt_loss(drafter, embed, teacher, batch, replace(base, **kw))
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in drafter.named_parameters() if p.grad is not None}
        batch_rows[name] = compare_grads(grads, ref_batch)
    summary = {"samples": len(picked), "max_len": max_len, "ttt_steps": ttt, "variants": {},
               "batch_gradient": batch_rows, "specforge_side_s": round(specforge_side_s, 1)}  # fmt: skip
    for name, rs in rows.items():
        summary["variants"][name] = {
            "changes": variants[name],
            "loss_rel_err_per_step": [
                max(
                    abs(r["loss_per_step"][j] - r["specforge_loss_per_step"][j])
                    / max(abs(r["specforge_loss_per_step"][j]), 1e-12)
                    for r in rs
                )
                for j in range(ttt)
            ],  # fmt: skip
            "grad_cosine_per_step": [min(r["grad_per_step"][j]["cosine"] for r in rs) for j in range(ttt)],
            "grad_norm_ratio_per_step": [
                sum(r["grad_per_step"][j]["norm_ratio"] for r in rs) / len(rs) for j in range(ttt)
            ],
            "grad_max_err_per_step": [
                max(r["grad_per_step"][j]["max_abs_err_over_max"] for r in rs) for j in range(ttt)
            ],
            "rows": rs,
        }
    summary["init"] = {"specforge": init_stats(sf["initial"]), "draftsmith_" + s.layer_init: own_init}
    summary["named_elsewhere"] = {
        "last_position": "SpecForge also trains each step's last teacher position (f_{T-1}, whose next token "
        "is not in the data): one position per sample per step more than draftsmith; left out here",
        "teacher_bf16": "SpecForge's target head (teacher logits) runs in bf16; float32 on both sides here",
    }
    write_json(out / "diff.json", summary)
    return summary


def diff_table(d: dict[str, Any]) -> str:
    lines = [f"differential check: {d['samples']} samples of <= {d['max_len']} tokens, same initial weights "
             "(SpecForge's), float32; per TTT step, against SpecForge's own step:",
             f"{'variant':<24} {'loss rel. err':<26} {'grad cosine (min)':<26} {'grad norm ratio':<26}"]  # fmt: skip
    fmt = lambda xs, f: " / ".join(f.format(x) for x in xs)  # noqa: E731
    for name, v in d["variants"].items():
        lines.append(
            f"{name:<24} {fmt(v['loss_rel_err_per_step'], '{:.1e}'):<26} "
            f"{fmt(v['grad_cosine_per_step'], '{:.5f}'):<26} {fmt(v['grad_norm_ratio_per_step'], '{:.4f}'):<26}"
        )
    return "\n".join(lines)
