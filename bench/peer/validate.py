"""bench.peer's evaluate stage: validation accuracy and agreement per TTT step of each export by
draftsmith's evaluator, and paired intervals of their differences."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from draftsmith.core.data.loader import StreamingData, collate


def validation(
    export_dir: Path, manifest_path: Path, vocab_path: Path, settings: dict[str, Any]
) -> dict[str, Any]:
    """draftsmith's evaluator on the validation split, sample by sample: the drafter kind's loss stats
    (`ttt_loss`'s for the EAGLE kinds, `dflash_loss`'s for DFlash) in the view
    `train.validate` scores (`Objective.for_validation`: the inference view, the positions whose predicted
    token is an assistant token; float32) -> accuracy and agreement per TTT step, and each sample's counts
    for the paired interval."""
    from draftsmith.core.export.formats import load_drafter
    from draftsmith.core.model.kinds import drafter_loss
    from draftsmith.core.training.objective import Objective, StepStats
    from draftsmith.stages.train import TrainSettings, load_inputs

    manifest, vocab, target = load_inputs(manifest_path, vocab_path)
    s = TrainSettings.from_dict(settings)
    view = replace(Objective.from_settings(s, "cpu"), precision="fp32").for_validation()
    drafter, _ = load_drafter(export_dir)
    loss = drafter_loss(drafter.cfg)
    teacher = target.lm_head[torch.arange(vocab["d2t"].numel()) + vocab["d2t"]]
    data = StreamingData.from_manifest(manifest, s)
    total, per_sample = StepStats.zeros(s.ttt_steps), []
    with torch.no_grad():
        for i in range(len(data.val)):
            _, st = loss(drafter, target.embed, teacher, collate([data.sample("val", i)]), view)
            total.add(st)
            per_sample.append({"correct": st.correct, "agree": st.agree, "count": st.count})
    data.close()
    return {"acc": total.acc(), "agreement": total.agreement(), "step_loss": total.step_loss(),
            "positions": total.count, "samples": len(per_sample), "per_sample": per_sample}  # fmt: skip


def paired_acc_interval(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str = "correct",
                        resamples: int = 2000, seed: int = 0) -> list[list[float]]:  # fmt: skip
    """Per TTT step, the 95% percentile bootstrap interval of accuracy(a) - accuracy(b) over the same
    validation samples, resampled in pairs."""
    rng = random.Random(seed)
    n, steps = len(a), len(a[0]["count"])
    diffs: list[list[float]] = [[] for _ in range(steps)]
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        for j in range(steps):
            count = sum(a[i]["count"][j] for i in idx)
            if count:
                diffs[j].append((sum(a[i][key][j] for i in idx) - sum(b[i][key][j] for i in idx)) / count)
    out = []
    for d in diffs:
        d.sort()
        out.append([d[int(0.025 * len(d))], d[int(0.975 * len(d)) - 1]] if d else [math.nan, math.nan])
    return out
