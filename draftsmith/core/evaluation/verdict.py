"""The acceptance gate's checks and verdict: is the trained drafter worth deploying, compared with what
costs nothing? Computed with the evaluation summary (draftsmith.stages.eval_summary); the gate stage
(draftsmith.stages.gate) enforces them.

A drafter is judged by what the user pays: its **projected wall-clock speedup at the serving point**
(evaluate.serving: device, tensor parallel, concurrency; draftsmith.core.evaluation.cost, draftsmith.core.evaluation.projection), at its
best draft length, against the best free method the engine serves (n-gram lookup, suffix decoding) on
the same held-out prompts, and against the untrained drafter on tokens per target forward (what training
bought; both cost the same per step). vLLM's tau counts only the steps that had a draft and is shown
beside, never compared. The motivating run deployed a drafter at 0.66x throughput; here such a drafter
fails `beats_free`, and the verdict names what to serve instead, per held-out set: chat and code differ.
Every check is printed; the gate stage fails (exit 3) when a blocking one fails (`evaluate.gate`).

    alternatives   beats_free (per held-out set): the trained drafter's projected speedup minus the best
                   free method's, each at its best k, paired bootstrap over prompts, passes when the
                   interval lies above 0; beats_untrained: the same on tokens per target forward.
    speed          speedup: speculative vs plain tokens/s measured here. On a CPU, verifying k+1 tokens
                   costs about k+1 single steps, so speed is reported, not judged (`auto`).
    contract       teacher_agreement, chat_template, export, tau_gap: the data, the template, the export
                   and vLLM's use of it agree with what training assumed.
    learning       generalisation (train vs validation accuracy) and still_learning (validation accuracy
                   rising at the end): warnings that choose the next action.

The verdict names, per held-out set, the method and draft length to serve with its projected speedup
at each concurrency and the runner-up, and the next action: "deploy drafter", "deploy suffix decoding",
"deploy n-gram", "no speculation", "more data", "train longer" or "contract broken".
"""

from __future__ import annotations

import math
from typing import Any

from draftsmith.core.config.stage_settings import GateSettings
from draftsmith.core.evaluation.checks import Check
from draftsmith.core.evaluation.engines import ENGINE_CONVENTIONS, draft_positions_warning, trained_ttt_steps
from draftsmith.core.evaluation.methods import FREE_METHODS, METHODS, PLAIN, method
from draftsmith.core.evaluation.projection import chosen, method_counts
from draftsmith.core.evaluation.stats import bootstrap_ratio, paired_difference

# what deploys each servable method (its record's `deploy`), plain decoding's "no speculation" last
DEPLOY_ACTION = {m.key: m.deploy for m in (*METHODS.values(), PLAIN) if m.deploy}
ACTIONS = (*DEPLOY_ACTION.values(), "more data", "train longer", "contract broken")
FIGURE = "tokens per target forward"
# per-prompt counts (numerator, denominator) of the judged figure and of vLLM's tau - 1
PER_FORWARD = ("tokens", "forwards")
PER_DRAFT = ("accepted", "drafts")


def _status(ok: bool, blocking: bool = True) -> str:
    return "pass" if ok else ("fail" if blocking else "warn")


def per_prompt_counts(
    results: dict[str, Any], prompt_ids: list[str], counts: tuple[str, str] = PER_FORWARD
) -> tuple[list[int], list[int]] | None:
    """(numerators, denominators) per prompt of one method's results, in the order of prompt_ids:
    (tokens, forwards) by default, (accepted, drafts) for tau; None without per-prompt counts."""
    rows = results.get("per_prompt")
    if not rows:
        return None
    by_id = {r["id"]: r for r in rows}
    missing = [p for p in prompt_ids if p not in by_id]
    if missing:
        raise ValueError(f"per-prompt counts lack prompt(s) {missing[:3]} of the held-out set")
    num, den = counts
    return [int(by_id[p][num]) for p in prompt_ids], [int(by_id[p][den]) for p in prompt_ids]


# --------------------------------------------------------------------------------------- alternatives

BASELINE_WHERE = {
    "free": "a free method (suffix decoding, n-gram lookup) is as fast or faster at the serving point once "
    "the drafter's own passes are paid for: more and more varied training data first (the learning checks "
    "say which), a shorter draft, or serve the free method the verdict names for this kind of traffic",
    "untrained": "a drafter that is no better than its random start learned nothing usable: a broken "
    "contract (see the contract checks), a learning rate or step count far off, or a target whose "
    "held-out text the training data does not resemble",
}
Measured = tuple[str, tuple[list[int], list[int]]]  # (measured by, per-prompt (tokens, forwards))


def check_beats(
    baseline: str,
    heldout: str,
    trained: Measured | None,
    other: Measured | None,
    mode: str,
    settings: GateSettings,
) -> Check:
    """beats_<baseline> on one held-out set, on tokens per target forward."""
    name = f"beats_{baseline} ({heldout})"
    blocking = mode == "block"
    threshold = (
        f"{settings.level:.0%} interval of the difference in {FIGURE} above 0 (evaluate.gate.beats_{baseline}: "
        f"{mode})"
    )
    where = BASELINE_WHERE[baseline]
    if trained is None or other is None:
        return Check(name, "skip", f"{method(baseline).label} not measured", threshold, where, blocking,
                     "alternatives", heldout)  # fmt: skip
    (by, a), (other_by, b) = trained, other
    ours = bootstrap_ratio(a[0], a[1], *settings.bootstrap)[0]
    theirs = bootstrap_ratio(b[0], b[1], *settings.bootstrap)[0]
    diff, lo, hi = paired_difference(a, b, *settings.bootstrap)
    measured = by if by == other_by else f"{by} vs {other_by}"
    value = (
        f"trained {ours:.3f} vs {method(baseline).short} {theirs:.3f} {FIGURE} ({measured}, {len(a[0])} "
        f"prompts): difference {diff:+.3f} [{lo:+.3f}, {hi:+.3f}]"
    )
    return Check(name, _status(lo > 0, blocking), value, threshold, where, blocking, "alternatives", heldout)


def check_beats_free(
    heldout: str, projection: dict[str, Any] | None, mode: str, settings: GateSettings
) -> Check:
    """beats_free on one held-out set: the trained drafter's projected speedup at the serving point's first
    concurrency, at its best k, minus the best free method's at its best k, paired over prompts."""
    name = f"beats_free ({heldout})"
    blocking = mode == "block"
    point = (projection or {}).get("points", ["the serving point"])[0]
    threshold = (
        f"{settings.level:.0%} interval of the difference in projected speedup ({point}) above 0 "
        f"(evaluate.gate.beats_free: {mode})"
    )
    methods = (projection or {}).get("methods", {})
    free = {k: p for k, p in methods.items() if p["kind"] in FREE_METHODS}
    if "eagle3" not in methods or not free:
        missing = "the trained drafter" if "eagle3" not in methods else "no free method"
        return Check(name, "skip", f"{missing} measured with per-prompt counts", threshold,
                     BASELINE_WHERE["free"], blocking, "alternatives", heldout)  # fmt: skip
    best = max(free, key=lambda k: chosen(free[k])["projected_speedup"][0])
    ours, theirs = methods["eagle3"], free[best]
    diff, lo, hi = paired_difference(method_counts(ours), method_counts(theirs), *settings.bootstrap)
    value = (
        f"trained k={ours['chosen_k']} {chosen(ours)['projected_speedup'][0]:.2f}x vs {method(best).short} "
        f"k={theirs['chosen_k']} {chosen(theirs)['projected_speedup'][0]:.2f}x projected ({point}, "
        f"{len(method_counts(ours)[0])} prompts): difference {diff:+.3f} [{lo:+.3f}, {hi:+.3f}]"
    )
    return Check(name, _status(lo > 0, blocking), value, threshold, BASELINE_WHERE["free"], blocking,
                 "alternatives", heldout)  # fmt: skip


# ---------------------------------------------------------------------------------------------- speed


def speed_blocks(mode: str, device: str | None) -> bool:
    """Whether the speedup check blocks: `auto` blocks on a GPU (or any accelerator), not on a CPU,
    where verifying k+1 tokens costs about k+1 single steps of a small target."""
    if mode == "auto":
        return device not in (None, "cpu")
    return mode == "block"


def fair_speed(data: dict[str, Any]) -> bool:
    """Whether a measurement's tokens/s may be shown or judged: only one that says so (`fair: true`:
    engines alone, paired rounds, the same prompts, as a bench would run them). The evaluation's engines
    run beside other jobs, so its own ratios are noise plus whoever else ran."""
    return data.get("fair") is True


UNFAIR_SPEED = (
    "not judged: the engines ran beside other jobs (no fair measurement: engines alone, paired rounds)"
)


def check_speedup(
    engine: str,
    speedup: float | None,
    ngram_speedup: float | None,
    device: str | None,
    mode: str,
    fair: bool,
) -> Check:
    """speedup: the measured tokens/s ratio, judged only where `fair` (else skipped with a note: an
    unfair ratio would pass or block on whoever else ran)."""
    blocking = speed_blocks(mode, device)
    threshold = f"> 1.0x plain decoding (evaluate.gate.speedup: {mode}, measured on {device or 'unknown'})"
    where = (
        "tokens/s with vs without speculation in the serving engine: fewer draft tokens, a larger batch "
        "budget, or (on a CPU) no speculation at all for a small target"
    )
    if speedup is None:
        return Check("speedup", "skip", "not measured", threshold, where, blocking, "speed")
    if not fair:
        return Check("speedup", "skip", UNFAIR_SPEED, threshold, where, blocking, "speed")
    value = f"{speedup:.2f}x plain ({engine})" + (
        f"; n-gram lookup {ngram_speedup:.2f}x" if ngram_speedup is not None else ""
    )
    if mode == "auto" and not blocking:
        value += (
            "; informational: on a CPU a verify step of k+1 tokens costs about k+1 decode steps, so "
            "speculation pays only when nearly every draft is accepted"
        )
        return Check("speedup", "info", value, threshold, where, False, "speed")
    return Check("speedup", _status(speedup > 1.0, blocking), value, threshold, where, blocking, "speed")


def check_teacher_agreement(manifest: dict[str, Any]) -> Check:
    agreement = manifest.get("teacher_agreement")
    minimum = float(manifest.get("min_teacher_agreement") or 0.0)
    return Check(
        "teacher_agreement",
        "skip" if agreement is None else _status(agreement >= minimum),
        "n/a (not recorded)" if agreement is None else f"{agreement:.4f}",
        f">= {minimum} (data_config.json min_teacher_agreement)",
        "results/data_config.json per-shard teacher_agreement: wrong aux/final layers, the final norm not "
        "applied to the stored state, traces sampled or rendered with another template",
    )


def check_chat_template(manifest: dict[str, Any], current_fingerprint: str | None) -> Check:
    stored = manifest.get("chat_template_fingerprint")
    ok = stored is not None and stored == current_fingerprint
    return Check(
        "chat_template",
        "skip" if stored is None or current_fingerprint is None else _status(ok),
        f"data {stored} vs target {current_fingerprint}",
        "equal fingerprints",
        "the target folder's chat template (tokenizer_config.json / chat_template.jinja) changed after "
        "the traces were generated, or serving uses another template: regenerate the traces",
    )


def check_export_convention(
    export_problems: list[str],
    export_config: dict[str, Any],
    manifest: dict[str, Any],
    engine_convention: str,
) -> Check:
    """check_export's problems, plus: the export's ids are in the engine's convention and name the same
    layers the data was extracted from."""
    from draftsmith.core.model.layers import convert_layer_ids

    problems = list(export_problems)
    block = export_config.get("draftsmith") or {}
    convention = block.get("aux_layer_convention", "input")
    ids = export_config.get("eagle_aux_hidden_state_layer_ids") or (
        export_config.get("eagle_config") or {}
    ).get("eagle_aux_hidden_state_layer_ids")
    dflash = export_config.get("dflash_config") or {}
    if not ids and dflash.get("target_layer_ids") is not None:  # a DFlash export counts layer outputs
        ids = convert_layer_ids(dflash["target_layer_ids"], "output", convention)
    if convention != engine_convention:
        problems.append(
            f"ids written in the {convention!r} convention, the engine counts {engine_convention!r}"
        )
    data_ids = manifest.get("aux_layer_ids")
    if ids and data_ids:
        as_data = convert_layer_ids(ids, convention, manifest.get("layer_convention", "input"))
        if list(as_data) != list(data_ids):
            problems.append(
                f"export aux ids {ids} ({convention}) are layers {as_data} in the data's convention, but the "
                f"data was extracted at {data_ids}"
            )
    flags = {
        k: export_config.get(k) for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
    }
    return Check(
        "export",
        _status(not problems),
        f"aux ids {ids} ({convention}), norm flags {sorted(k for k, v in flags.items() if v) or 'all off'}"
        + (f"; {len(problems)} problem(s): " + "; ".join(problems) if problems else ""),
        f"check_export clean, {engine_convention} convention, ids = data's",
        "results/drafter/config.json vs data_config.json; `draftsmith check-export results/drafter --target "
        "TARGET`; re-export with the engine's convention",
    )


def check_draft_positions(num_draft_tokens: int | None, ttt_steps: int | None) -> Check:
    """Drafting more tokens per step than the TTT steps trained drafts positions the drafter never
    learnt: they are mostly rejected and cost a drafter forward each. Warning only."""
    if num_draft_tokens is None or ttt_steps is None:
        return Check(
            "draft_positions", "skip", "n/a", "num_draft_tokens <= train.ttt_steps", "", blocking=False
        )
    warning = draft_positions_warning(num_draft_tokens, ttt_steps)
    return Check(
        "draft_positions",
        _status(warning is None, blocking=False),
        f"{num_draft_tokens} draft tokens, {ttt_steps} TTT steps trained",
        "num_draft_tokens <= train.ttt_steps",
        warning or "",
        blocking=False,
    )


# ----------------------------------------------------------------------------------------- tau gap


def tau_tolerance(
    accepted_per_step: list[int], vllm_drafts: int, floor: float = 0.05, z: float = 3.0
) -> float:
    """How far vLLM's tau may sit from the offline tau before it counts as an integration failure.

    Both count the same thing (accepted drafts per draft) on the same prompt ids. In float32 they agree
    exactly: 8 prompts x 64 tokens gave identical counters in both engines for an EAGLE-3 drafter (484
    drafts, 20 accepted) and for n-gram lookup (57 drafts, accepted per position [38, 28, 20]). They
    part ways only where a near-tie flips a token (bf16, other kernels or batch shapes) and the two
    continuations diverge; from there they average over different text. So the band is z standard
    errors of the difference of two means, with the spread of the offline per-step counts standing in
    for both: z * sd * sqrt(1/n_offline + 1/n_vllm), plus a floor for a few flipped steps.
    """
    n = len(accepted_per_step)
    if n < 2 or vllm_drafts < 1:
        return math.inf
    mean = sum(accepted_per_step) / n
    var = sum((a - mean) ** 2 for a in accepted_per_step) / (n - 1)
    return floor + z * math.sqrt(var) * math.sqrt(1 / n + 1 / vllm_drafts)


def check_tau_gap(
    label: str,
    offline: dict[str, Any] | None,
    vllm: dict[str, Any] | None,
    max_gap: float | None,
    blocking: bool = True,
) -> Check:
    """offline/vllm: one method's entries of offline.json / vllm.json."""
    where = (
        "vLLM loads the drafter but drafts differently than training assumed: aux layer ids/convention "
        "(logs 'Using auxiliary layers'), norm flags, d2t (vLLM loads a missing d2t silently); compare "
        "results/eval/offline.json and vllm.json per position"
    )
    if not offline or not vllm:
        missing = "vLLM" if offline else "the offline decoder (evaluate.offline)"
        return Check(f"tau_gap ({label})", "skip", f"{missing} not measured", "-", where, blocking)
    gap = abs(vllm["tau"] - offline["tau"])
    tol = max_gap if max_gap is not None else tau_tolerance(offline["accepted_per_step"], vllm["drafts"])
    return Check(
        f"tau_gap ({label})",
        _status(gap <= tol, blocking),
        f"offline {offline['tau']:.3f} vs vLLM {vllm['tau']:.3f} (gap {gap:.3f})",
        ("any (too few drafts to tell)" if math.isinf(tol) else f"<= {tol:.3f}")
        + (" (evaluate.max_tau_gap)" if max_gap is not None else " (3 sigma + 0.05)"),
        where,
        blocking,
    )


# ------------------------------------------------------------------------------------------- learning


def learning_curve(rows: list[dict[str, Any]], last: int = 20) -> dict[str, Any]:
    """What metrics.jsonl says about training: accuracy per TTT step of the last `last` train rows
    (position-weighted) and of the last validation, and the first-draft validation gain since the
    previous validation."""
    train = [r for r in rows if r.get("kind") == "train" and r.get("acc")]
    val = [r for r in rows if r.get("kind") == "val" and r.get("acc") and r["acc"][0] is not None]
    out: dict[str, Any] = {"train_acc": None, "val_acc": None, "val_gain": None, "val_points": len(val)}
    tail = train[-last:]
    if tail:
        ttt = max(len(r["acc"]) for r in tail)
        acc = []
        for j in range(ttt):
            pts = [(r["acc"][j], ((r.get("positions") or [])[j:j + 1] or [1])[0] or 0)
                   for r in tail if len(r["acc"]) > j and r["acc"][j] is not None]  # fmt: skip
            total = sum(w for _, w in pts)
            if pts:
                acc.append(sum(a * w for a, w in pts) / total if total else sum(a for a, _ in pts) / len(pts))
        out["train_acc"] = acc or None
    if val:
        out["val_acc"] = list(val[-1]["acc"])
        if len(val) >= 2:
            out["val_gain"] = val[-1]["acc"][0] - val[-2]["acc"][0]
    return out


def training_accuracy(rows: list[dict[str, Any]], last: int = 20) -> dict[str, Any]:
    """First-draft accuracy of training (last `last` train rows, position-weighted) and of the last
    validation."""
    curve = learning_curve(rows, last)
    return {
        "train_acc0": curve["train_acc"][0] if curve["train_acc"] else None,
        "val_acc0": curve["val_acc"][0] if curve["val_acc"] else None,
    }


def check_generalisation(curve: dict[str, Any], max_gap: float) -> Check:
    train, val = curve.get("train_acc"), curve.get("val_acc")
    where = (
        "results/train/metrics.jsonl: the drafter fits its training tokens far better than unseen ones; it "
        "is data-bound: more (and more varied) prompts, or existing answers as extra data; not more epochs"
    )
    threshold = f"train - validation first-draft accuracy <= {max_gap} (evaluate.max_acc_gap)"
    if not train or not val:
        return Check(
            "generalisation", "skip", "no train or validation rows", threshold, where, False, "learning"
        )
    gap = train[0] - val[0]
    value = f"train {_fmt_list(train)} / validation {_fmt_list(val)} per TTT step (gap {gap:.3f})"
    return Check("generalisation", _status(gap <= max_gap, False), value, threshold, where, False, "learning")


def check_still_learning(curve: dict[str, Any], min_gain: float) -> Check:
    gain = curve.get("val_gain")
    where = "results/train/metrics.jsonl: validation accuracy still rose at the last evaluation: more epochs"
    threshold = f"last validation gain <= {min_gain} (evaluate.min_val_gain)"
    if gain is None:
        return Check("still_learning", "skip", f"{curve.get('val_points', 0)} validation point(s)", threshold,
                     where, False, "learning")  # fmt: skip
    return Check("still_learning", _status(gain <= min_gain, False), f"first-draft validation gain {gain:+.3f}",
                 threshold, where, False, "learning")  # fmt: skip


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _fmt_list(xs: list[float | None]) -> str:
    return " / ".join(_fmt(x) for x in xs)


# -------------------------------------------------------------------------------------------- verdict


def passed(checks: list[Check]) -> bool:
    return not any(c.failed for c in checks)


def _one(checks: list[Check], prefix: str, heldout: str | None = None) -> Check | None:
    return next((c for c in checks if c.name.startswith(prefix) and c.heldout == heldout), None)


def serving_choice(projection: dict[str, Any] | None, level: float = 0.95) -> dict[str, Any]:
    """The fastest method at the serving point's first concurrency and the runner-up, from one set's
    projection: its draft length and projected speedup at every concurrency with intervals. Plain
    decoding wins when nothing beats 1.0x beyond the interval."""
    if not projection or not projection.get("methods"):
        return {"method": "plain", "k": 0, "projected_speedup": None, "runner_up": None}

    def entry(key: str) -> dict[str, Any]:
        if key == "plain":
            n = len(projection["concurrency"])
            return {"method": "plain", "k": 0, "projected_speedup": [1.0] * n,
                    "projected_intervals": [[1.0, 1.0]] * n}  # fmt: skip
        p = projection["methods"][key]
        best = chosen(p)
        return {"method": key, "k": p["chosen_k"], "projected_speedup": best["projected_speedup"],
                "projected_intervals": best["projected_intervals"], "measured_at_k": best["measured"]}  # fmt: skip

    ranking = projection["ranking"]
    first = entry(ranking[0])
    if first["method"] != "plain" and first["projected_intervals"][0][0] <= 1.0:
        # not faster than plain decoding beyond the noise of these prompts
        return {**entry("plain"), "runner_up": first, "points": projection["points"]}
    runner = next((entry(k) for k in ranking[1:]), None)
    return {**first, "runner_up": runner, "points": projection["points"]}


def set_verdict(
    checks: list[Check], heldout: str, projection: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What to deploy for the traffic one held-out set stands for, and what to do next, from that set's
    projection at the serving point, its comparisons and the shared contract and learning checks:

        contract broken   a blocking contract check failed: nothing measured downstream can be trusted,
                          serve the fastest free method (or nothing)
        deploy drafter    the drafter is the fastest at the serving point, beyond the noise of the free
                          methods (beats_free) and of its untrained start (beats_untrained)
        more data         it is not, its ceiling leaves room (`drafter_room`: every draft accepted, it
                          would beat the best free method at the first concurrency), and validation
                          accuracy is far below training (data-bound)
        train longer      the same, and validation accuracy was still rising at the end
        deploy suffix decoding / deploy n-gram / no speculation
                          it is not, and the curves show neither, or its ceiling leaves no room (no
                          training can win: the reason gives both figures): the fastest other choice
    """
    contract = [c for c in checks if c.group == "contract" and c.failed]
    free, untrained = _one(checks, "beats_free", heldout), _one(checks, "beats_untrained", heldout)
    loses = [c for c in (free, untrained) if c is not None and c.missed]
    overfit, rising = _one(checks, "generalisation"), _one(checks, "still_learning")
    fastest = serving_choice(projection)
    if fastest["method"] == "eagle3" and (loses or contract):  # not trusted: the next fastest other choice
        alternative = _without_drafter(projection)
        fastest = {**alternative, "runner_up": fastest}
    reasons = [f"{c.name}: {c.value}" for c in contract + loses]
    room = drafter_room_of(projection)
    no_room = room is not None and room["ceiling"] <= room["to_beat"]
    if contract:
        action = "contract broken"
    elif fastest["method"] == "eagle3":
        action = "deploy drafter"
        reasons = [f"{c.name}: {c.value}" for c in (free, untrained) if c is not None]
    elif free is not None and free.status == "pass" and untrained is not None and untrained.missed:
        action = "contract broken"  # faster than the free methods, not than its own random start: off
    elif free is not None and free.status == "skip" and untrained is not None and not untrained.missed:
        action = DEPLOY_ACTION[fastest["method"]]  # nothing free measured: the drafter was not ranked
    elif overfit is not None and overfit.missed and not no_room:
        action = "more data"
        reasons.append(f"generalisation: {overfit.value}")
    elif rising is not None and rising.missed and not no_room:
        action = "train longer"
        reasons.append(f"still_learning: {rising.value}")
    else:
        action = DEPLOY_ACTION[fastest["method"]]
    if room is not None:
        reasons.append(room_reason(room, no_room and action != "deploy drafter"))
    return {
        "heldout": heldout,
        "deploy": method(fastest["method"]).label if fastest["method"] != "plain" else "plain decoding",
        "method": fastest["method"],
        "k": fastest.get("k", 0),
        "projected_speedup": fastest.get("projected_speedup"),
        "projected_intervals": fastest.get("projected_intervals"),
        "points": (projection or {}).get("points"),
        "concurrency": (projection or {}).get("concurrency"),
        "runner_up": _brief(fastest.get("runner_up")),
        "action": action,
        "reasons": reasons,
        "room": room,
        "by_load": ((projection or {}).get("policy") or {}).get("best"),
    }


def drafter_room_of(projection: dict[str, Any] | None) -> dict[str, Any] | None:
    """The trained drafter's room at the deciding (first) concurrency, from the projection's
    `drafter_room`: its ceiling (every draft accepted, best k), the speedup to beat (the best free
    method's, or plain decoding's 1.0x) and by what, its break-even and measured acceptance per
    position; None where the projection has none."""
    room = (projection or {}).get("drafter_room")
    if not room or projection is None:
        return None
    return {
        "ceiling": room["ceiling"][0],
        "to_beat": room["to_beat"][0],
        "to_beat_method": room["to_beat_method"][0],
        "break_even": room["break_even"][0],
        "position_acceptance": room["position_acceptance"],
        "point": projection["points"][0],
    }


def room_reason(room: dict[str, Any], decides: bool) -> str:
    """One line with both figures: the drafter's ceiling against what it must beat, and its measured
    acceptance per position against its break-even. `decides`: the ceiling is why it is not trained on."""
    other = "plain decoding" if room["to_beat_method"] == "plain" else method(room["to_beat_method"]).label
    acceptance = " / ".join(f"{a:.2f}" for a in room["position_acceptance"])
    needs = "none reaches it" if room["break_even"] is None else f"break-even {room['break_even']:.2f}"
    figures = (
        f"ceiling {room['ceiling']:.2f}x (every draft accepted, {room['point']}) vs {other} "
        f"{room['to_beat']:.2f}x; acceptance per position {acceptance} vs {needs}"
    )
    if decides:
        return f"no room: {figures}: no training can beat {other}, so serve it"
    return f"room: {figures}"


def _without_drafter(projection: dict[str, Any] | None) -> dict[str, Any]:
    """serving_choice with the trained drafter left out."""
    if not projection:
        return serving_choice(None)
    rest = {k: v for k, v in projection["methods"].items() if k != "eagle3"}
    ranking = [k for k in projection["ranking"] if k != "eagle3"]
    return serving_choice({**projection, "methods": rest, "ranking": ranking})


def _brief(entry: dict[str, Any] | None) -> dict[str, Any] | None:
    if not entry:
        return None
    return {k: entry.get(k) for k in ("method", "k", "projected_speedup", "projected_intervals")}


def verdict(checks: list[Check], projections: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The verdict on every held-out set (`per_set`: what to deploy for that kind of traffic) and overall:
    `deploy` is the one method every set agrees on, or "per held-out set"; `action` is the first set's
    that does not deploy the drafter (what to do next), else "deploy drafter"."""
    sets = list(dict.fromkeys(c.heldout for c in checks if c.heldout))
    per_set = [set_verdict(checks, s, (projections or {}).get(s)) for s in sets]
    if not per_set:
        return {"heldout": None, "deploy": "plain decoding", "action": "contract broken",
                "reasons": ["nothing measured"], "per_set": []}  # fmt: skip
    losing = [v for v in per_set if v["action"] != "deploy drafter"]
    first = losing[0] if losing else per_set[0]
    methods = {(v["deploy"], v["k"]) for v in per_set}
    return {
        "heldout": first["heldout"],
        "deploy": per_set[0]["deploy"] if len(methods) == 1 else "per held-out set",
        "action": first["action"],
        "reasons": first["reasons"],
        "per_set": per_set,
    }


# ------------------------------------------------------------------------------------------ diagnosis


def judged_counts(
    results: dict[str, Any],
    key: str,
    prompt_ids: list[str] | None = None,
    counts: tuple[str, str] = PER_FORWARD,
) -> Measured | None:
    """(measured by, per-prompt counts) of a method on one held-out set (on prompt_ids, default: all that
    engine decoded): vLLM's when measured (what serving sees), else the offline measurement's."""
    for by, data in (("vLLM", results.get("vllm")), ("offline", results.get("offline"))):
        if data and key in data["methods"]:
            found = per_prompt_counts(data["methods"][key], prompt_ids or data["prompt_ids"], counts)
            if found is not None:
                return by, found
    return None


def diagnose(
    sets: dict[str, dict[str, Any]],
    manifest: dict[str, Any],
    export_config: dict[str, Any],
    export_problems: list[str],
    current_fingerprint: str | None,
    metrics_rows: list[dict[str, Any]],
    settings: GateSettings,
    key: str = "eagle3",
    engine: str = "vllm",
    projections: dict[str, dict[str, Any]] | None = None,
) -> list[Check]:
    """Every check, in a fixed order. sets: held-out set name -> {"offline": offline.json,
    "vllm": vllm.json or None}; the first set's speed is the one judged. `engine` is the serving engine
    whose aux-id convention the export must use. projections: set name -> draftsmith.core.evaluation.projection's
    set_projection (the serving point's figures that beats_free compares)."""
    checks: list[Check] = []
    for heldout, results in sets.items():
        if key not in results["offline"]["methods"]:
            raise KeyError(f"{heldout}: offline results have no method {key!r}")
        projection = (projections or {}).get(heldout)
        checks.append(check_beats_free(heldout, projection, settings.mode("beats_free"), settings))
        trained = judged_counts(results, key)
        for baseline in ("untrained",):
            other, ours = judged_counts(results, baseline), trained
            if ours and other and ours[0] != other[0]:  # two engines: pair on the prompts both decoded
                ids = results["offline"]["prompt_ids"]
                ours, other = judged_counts(results, key, ids), judged_counts(results, baseline, ids)
            mode = settings.mode(f"beats_{baseline}")
            checks.append(check_beats(baseline, heldout, ours, other, mode, settings))
    first = next(iter(sets.values()))
    served = (first.get("vllm") or {}).get("methods", {})
    data, by = (first["vllm"], "vLLM") if key in served else (first["offline"], "offline")
    ngram = data["methods"].get("ngram")
    checks.append(check_speedup(by, data["methods"][key]["speedup"], ngram["speedup"] if ngram else None,
                                data.get("device"), settings.mode("speedup"), fair_speed(data)))  # fmt: skip
    contract = [
        check_teacher_agreement(manifest),
        check_chat_template(manifest, current_fingerprint),
        check_export_convention(export_problems, export_config, manifest, ENGINE_CONVENTIONS[engine]),
    ]
    for heldout, results in sets.items():
        if not results.get("offline_measured", True):  # evaluate.offline: false: nothing to compare with
            contract.append(_on_set(check_tau_gap(key, None, None, settings.max_tau_gap), heldout))
            continue
        off, vllm = results["offline"]["methods"], (results.get("vllm") or {}).get("methods", {})
        ids = results["offline"]["prompt_ids"]
        gap = check_tau_gap(key, off[key], on_prompts(vllm.get(key), ids), settings.max_tau_gap)
        contract.append(_on_set(gap, heldout))
        # the baselines' gaps check the measurement itself (no training involved): warnings only
        for name in sorted(set(off) & set(vllm) - {key}):
            gap = check_tau_gap(
                name, off[name], on_prompts(vllm[name], ids), settings.max_tau_gap, blocking=False
            )
            contract.append(_on_set(gap, heldout))
    for c in contract:
        c.group = "contract"
    checks += contract
    num_draft_tokens = first["offline"].get("num_draft_tokens")
    positions = check_draft_positions(num_draft_tokens, trained_ttt_steps(export_config))
    if positions.status != "skip":  # shown only where both numbers are known
        checks.append(positions)
    curve = learning_curve(metrics_rows)
    checks += [
        check_generalisation(curve, settings.max_acc_gap),
        check_still_learning(curve, settings.min_val_gain),
    ]
    return checks


def on_prompts(method: dict[str, Any] | None, prompt_ids: list[str]) -> dict[str, Any] | None:
    """A method's tau and drafts on just these prompts (the offline contract check decodes the first few
    of what vLLM decoded), from its per-prompt counts; unchanged without them."""
    if method is None or not method.get("per_prompt"):
        return method
    by_id = {r["id"]: r for r in method["per_prompt"]}
    if any(p not in by_id for p in prompt_ids) or len(prompt_ids) == len(by_id):
        return method
    accepted = sum(by_id[p]["accepted"] for p in prompt_ids)
    drafts = sum(by_id[p]["drafts"] for p in prompt_ids)
    return {**method, "tau": 1.0 + accepted / drafts if drafts else 1.0, "drafts": drafts}


def _on_set(check: Check, heldout: str) -> Check:
    check.name = f"{check.name[:-1]}, {heldout})"
    check.heldout = heldout
    return check
