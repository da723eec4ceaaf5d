"""The acceptance gate and its diagnosis: a list of checks, each pass/fail with its numbers and where to
look, printed always; the workflow fails (exit 3) when a blocking one fails.

The seed story's drafter reached ~15% acceptance and 0.66x throughput, and nobody knew why. The checks
follow the places that went wrong in practice (research/eagle3-anchors.md section 5):

    teacher_agreement   data: argmax(lm_head(final)) vs the next trace token. Low = wrong layers, missing
                        final norm, or traces rendered with another template.
    chat_template       the template fingerprint of the training data vs the target's tokenizer now (what
                        serving renders): thinking/assistant suffixes alone halve acceptance.
    export              the export's aux ids, their convention and norm flags vs what vLLM reads
                        (draftsmith.export.check_export; vLLM counts aux ids as "input to layer k").
    tau_gap             vLLM's tau vs draftsmith's offline tau on the same prompts: the drafter trains
                        fine but the engine uses it differently (aux ids off by one, norms ignored).
    acc_gap             training accuracy vs validation vs held-out position-0 acceptance: a drafter that
                        fits its traces but not new prompts (prompt diversity, overfitting). Warning only.
    min_tau, min_speedup  the thresholds: is the drafter worth deploying at all.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


class GateFailed(RuntimeError):
    """A blocking check failed: the drafter would not pay for itself, or something upstream is broken."""


@dataclass
class Check:
    name: str
    status: str  # "pass", "fail" or "warn" (failed, but not blocking); "skip" when it cannot be computed
    value: str  # the measured number(s), formatted
    threshold: str  # what it is compared against
    where: str  # where to look when it fails
    blocking: bool = True

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _status(ok: bool, blocking: bool = True) -> str:
    return "pass" if ok else ("fail" if blocking else "warn")


# ------------------------------------------------------------------------------------------- thresholds


def check_min_tau(label: str, tau: float | None, min_tau: float) -> Check:
    return Check(
        f"min_tau ({label})",
        "skip" if tau is None else _status(tau >= min_tau),
        "n/a" if tau is None else f"tau {tau:.3f}",
        f">= {min_tau} (evaluate.min_tau)",
        "the checks below: a tau near 1.0 with everything else passing means the drafter learned little "
        "(more and more diverse prompts, more epochs; compare the untrained baseline)",
    )


def check_min_speedup(label: str, speedup: float | None, min_speedup: float) -> Check:
    return Check(
        f"min_speedup ({label})",
        "skip" if speedup is None else _status(speedup >= min_speedup),
        "n/a" if speedup is None else f"{speedup:.2f}x",
        f">= {min_speedup} (evaluate.min_speedup)",
        "tokens/s with vs without speculation on this machine; a small target on a CPU verifies k+1 "
        "tokens at nearly k+1 times the cost of one, so only a high tau pays (try fewer draft tokens)",
    )


# ----------------------------------------------------------------------------------------------- data


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
    from draftsmith.layers import convert_layer_ids

    problems = list(export_problems)
    block = export_config.get("draftsmith") or {}
    convention = block.get("aux_layer_convention", "input")
    ids = export_config.get("eagle_aux_hidden_state_layer_ids") or (
        export_config.get("eagle_config") or {}
    ).get("eagle_aux_hidden_state_layer_ids")
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
    from draftsmith.export import untrained_positions_warning

    if num_draft_tokens is None or ttt_steps is None:
        return Check(
            "draft_positions", "skip", "n/a", "num_draft_tokens <= train.ttt_steps", "", blocking=False
        )
    warning = untrained_positions_warning(num_draft_tokens, ttt_steps)
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
        return Check(f"tau_gap ({label})", "skip", "vLLM not measured", "-", where, blocking)
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


# ------------------------------------------------------------------------------------------ acc gap


def training_accuracy(rows: list[dict[str, Any]], last: int = 20) -> dict[str, Any]:
    """Step-0 (first draft) accuracy of training: position-weighted over the last `last` train rows of
    metrics.jsonl, and the last validation row's."""
    train = [r for r in rows if r.get("kind") == "train" and r.get("acc") and r["acc"][0] is not None]
    val = [r for r in rows if r.get("kind") == "val" and r.get("acc") and r["acc"][0] is not None]
    out: dict[str, Any] = {"train_acc0": None, "val_acc0": None, "train_rows": 0}
    tail = train[-last:]
    if tail:
        weights = [(r.get("positions") or [1])[0] or 0 for r in tail]
        total = sum(weights)
        if total:
            out["train_acc0"] = sum(r["acc"][0] * w for r, w in zip(tail, weights, strict=True)) / total
        else:
            out["train_acc0"] = sum(r["acc"][0] for r in tail) / len(tail)
        out["train_rows"] = len(tail)
    if val:
        out["val_acc0"] = val[-1]["acc"][0]
    return out


def check_acc_gap(acc: dict[str, Any], heldout_pos0: float | None, max_gap: float) -> Check:
    train, val = acc.get("train_acc0"), acc.get("val_acc0")
    value = f"train {_fmt(train)} / val {_fmt(val)} / held-out position-0 acceptance {_fmt(heldout_pos0)}"
    if train is None or heldout_pos0 is None:
        return Check("acc_gap", "skip", value, f"train - held-out <= {max_gap}", "", blocking=False)
    gap = train - heldout_pos0
    return Check(
        "acc_gap",
        _status(gap <= max_gap, blocking=False),
        value + f" (gap {gap:.3f})",
        f"train - held-out <= {max_gap} (evaluate.max_acc_gap)",
        "results/train/metrics.jsonl: train far above val = overfitting (fewer epochs, more data); val far "
        "above held-out = training prompts unlike the held-out ones (more diverse prompts)",
        blocking=False,
    )


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


# -------------------------------------------------------------------------------------------- verdict


def passed(checks: list[Check]) -> bool:
    return not any(c.failed for c in checks)


def order_checks(checks: list[Check]) -> list[Check]:
    """Failed checks first, then warnings, then the rest (stable within each group)."""
    rank = {"fail": 0, "warn": 1}
    return sorted(checks, key=lambda c: rank.get(c.status, 2))


def format_checks(checks: list[Check]) -> str:
    """The diagnosis as a text table, failed checks first; 'where' lines only under failed/warned ones."""
    rows = order_checks(checks)
    name_w = max(len(c.name) for c in rows)
    lines = [f"{'check'.ljust(name_w)}  status  value  [threshold]"]
    for c in rows:
        lines.append(f"{c.name.ljust(name_w)}  {c.status.upper():6}  {c.value}  [{c.threshold}]")
        if c.status in ("fail", "warn") and c.where:
            lines.append(f"{'':{name_w}}  -> look at: {c.where}")
    return "\n".join(lines)


def gate_message(checks: list[Check]) -> str:
    failed = [c for c in order_checks(checks) if c.failed]
    head = "; ".join(f"{c.name}: {c.value} [{c.threshold}]" for c in failed)
    looks = " | ".join(f"{c.name} -> {c.where}" for c in failed)
    return f"the acceptance gate failed on {len(failed)} check(s): {head}. Where to look: {looks}"


def enforce(checks: list[Check]) -> None:
    """Raise GateFailed (naming the failed checks first) when a blocking check failed."""
    if not passed(checks):
        raise GateFailed(gate_message(checks))


# ------------------------------------------------------------------------------------------ diagnosis


@dataclass
class Thresholds:
    min_tau: float
    min_speedup: float
    max_tau_gap: float | None  # None: tau_tolerance's statistical band
    max_acc_gap: float


def diagnose(
    offline: dict[str, Any],
    vllm: dict[str, Any] | None,
    manifest: dict[str, Any],
    export_config: dict[str, Any],
    export_problems: list[str],
    current_fingerprint: str | None,
    metrics_rows: list[dict[str, Any]],
    thresholds: Thresholds,
    method: str = "eagle3",
    engine: str = "vllm",
) -> list[Check]:
    """Every check for the trained drafter (`method` in offline.json/vllm.json), in a fixed order.

    The thresholds apply to the serving engine's numbers when vLLM was measured (what a deployment will
    see) and to the offline numbers otherwise; tau is gated on both."""
    off = offline["methods"].get(method)
    if off is None:
        raise KeyError(f"offline results have no method {method!r}: {sorted(offline['methods'])}")
    served = (vllm or {}).get("methods", {}).get(method)
    checks = [check_min_tau("offline", off["tau"], thresholds.min_tau)]
    if vllm is not None:
        checks.append(check_min_tau("vLLM", served["tau"] if served else None, thresholds.min_tau))
    speed_label, speedup = ("vLLM", served["speedup"]) if served else ("offline", off["speedup"])
    checks.append(check_min_speedup(speed_label, speedup, thresholds.min_speedup))
    checks.append(check_teacher_agreement(manifest))
    checks.append(check_chat_template(manifest, current_fingerprint))
    from draftsmith.export import ENGINE_CONVENTIONS

    convention = ENGINE_CONVENTIONS[engine]
    checks.append(check_export_convention(export_problems, export_config, manifest, convention))
    from draftsmith.export import trained_ttt_steps

    positions = check_draft_positions(offline.get("num_draft_tokens"), trained_ttt_steps(export_config))
    if positions.status != "skip":  # shown only where both numbers are known
        checks.append(positions)
    checks.append(check_tau_gap(method, off, served, thresholds.max_tau_gap))
    # the baselines' gaps check the measurement itself (no training involved): warnings only
    for name in sorted(set(offline["methods"]) - {method}):
        base = (vllm or {}).get("methods", {}).get(name)
        if base is not None:
            checks.append(
                check_tau_gap(name, offline["methods"][name], base, thresholds.max_tau_gap, blocking=False)
            )
    rates = off.get("acceptance_rate_per_position") or [None]
    checks.append(check_acc_gap(training_accuracy(metrics_rows), rates[0], thresholds.max_acc_gap))
    return checks
