"""The gate's checks as pure functions: each passes and fails where it should, with its numbers."""

from __future__ import annotations

import math

import pytest

from draftsmith.gate import (
    Check,
    GateFailed,
    Thresholds,
    check_acc_gap,
    check_chat_template,
    check_export_convention,
    check_min_speedup,
    check_min_tau,
    check_tau_gap,
    check_teacher_agreement,
    diagnose,
    enforce,
    format_checks,
    order_checks,
    tau_tolerance,
    training_accuracy,
)

EXPORT = {
    "eagle_aux_hidden_state_layer_ids": [2, 15, 27],
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]},
    "norm_before_residual": False,
    "norm_before_fc": False,
    "fc_norm": False,
    "norm_output": False,
    "draftsmith": {"aux_layer_convention": "input", "aux_layer_ids_input": [2, 15, 27]},
}
MANIFEST = {
    "aux_layer_ids": [2, 15, 27],
    "layer_convention": "input",
    "teacher_agreement": 0.982,
    "min_teacher_agreement": 0.9,
    "chat_template_fingerprint": "872be49dbb638044",
}


def method(tau: float, accepted: list[int], speedup: float = 0.7, drafts: int | None = None) -> dict:
    k = 3
    per_pos = [sum(1 for a in accepted if a > i) for i in range(k)]
    n = drafts or len(accepted)
    return {
        "tau": tau,
        "drafts": n,
        "accepted_per_step": accepted,
        "acceptance_rate_per_position": [p / n for p in per_pos],
        "speedup": speedup,
    }


def test_thresholds():
    assert check_min_tau("offline", 1.3, 1.1).status == "pass"
    low = check_min_tau("offline", 1.02, 1.1)
    assert low.status == "fail" and "1.020" in low.value and "1.1" in low.threshold
    assert check_min_tau("vLLM", None, 1.1).status == "skip"
    assert check_min_speedup("vLLM", 0.5, 0.2).status == "pass"
    assert check_min_speedup("vLLM", 0.1, 0.2).failed


def test_teacher_agreement_and_template():
    assert check_teacher_agreement(MANIFEST).status == "pass"
    bad = check_teacher_agreement({**MANIFEST, "teacher_agreement": 0.41})
    assert bad.failed and "0.4100" in bad.value and "norm" in bad.where
    assert check_teacher_agreement({"min_teacher_agreement": 0.9}).status == "skip"
    assert check_chat_template(MANIFEST, "872be49dbb638044").status == "pass"
    moved = check_chat_template(MANIFEST, "0000aaaa0000aaaa")
    assert moved.failed and "872be49dbb638044" in moved.value and "0000aaaa0000aaaa" in moved.value


def test_export_convention():
    assert check_export_convention([], EXPORT, MANIFEST, "input").status == "pass"
    # an export written for SGLang ("output": ids one lower) served by vLLM
    sglang = {
        **EXPORT,
        "eagle_aux_hidden_state_layer_ids": [1, 14, 26],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]},
        "draftsmith": {"aux_layer_convention": "output"},
    }
    c = check_export_convention([], sglang, MANIFEST, "input")
    assert c.failed and "'output' convention" in c.value
    # ids that name other layers than the data's
    shifted = {**EXPORT, "eagle_aux_hidden_state_layer_ids": [3, 16, 28]}
    c = check_export_convention([], shifted, MANIFEST, "input")
    assert c.failed and "[2, 15, 27]" in c.value
    # check_export's own findings (norm flags, tensors) make it fail too
    c = check_export_convention(
        ["norm flag 'fc_norm' is True"], {**EXPORT, "fc_norm": True}, MANIFEST, "input"
    )
    assert c.failed and "fc_norm" in c.value


def test_tau_tolerance_band():
    # a constant acceptance count has no spread: only the floor remains
    assert tau_tolerance([1] * 50, 50) == pytest.approx(0.05)
    spread = [0, 3] * 100  # sd ~1.5
    tol = tau_tolerance(spread, 200)
    assert tol == pytest.approx(
        0.05 + 3 * math.sqrt(sum((a - 1.5) ** 2 for a in spread) / 199) * math.sqrt(2 / 200)
    )
    assert tau_tolerance(spread, 2000) < tol  # more vLLM drafts, a narrower band
    assert tau_tolerance([1], 10) == math.inf and tau_tolerance([1, 2], 0) == math.inf


def test_tau_gap():
    accepted = [0, 1, 0, 2, 0, 0, 1, 3] * 40
    off = method(1 + sum(accepted) / len(accepted), accepted)
    close = method(off["tau"] + 0.03, [], drafts=300)
    far = method(1.0, [], drafts=300)  # vLLM accepts nothing: e.g. aux ids off by one
    assert check_tau_gap("eagle3", off, close, None).status == "pass"
    gap = check_tau_gap("eagle3", off, far, None)
    assert gap.failed and "vLLM 1.000" in gap.value and "aux layer ids" in gap.where
    assert check_tau_gap("eagle3", off, close, 0.01).failed  # a configured tolerance wins
    assert check_tau_gap("ngram", off, far, None, blocking=False).status == "warn"
    assert check_tau_gap("eagle3", off, None, None).status == "skip"


def test_training_accuracy_and_acc_gap():
    rows = [
        {"kind": "train", "step": s, "acc": [0.2 + 0.01 * s, 0.1], "positions": [100, 90]} for s in range(30)
    ]
    rows += [{"kind": "resume", "step": 12}, {"kind": "val", "step": 30, "acc": [0.45, 0.3]}]
    rows.append({"kind": "train", "step": 31, "acc": [0.9, None], "positions": [0, 0]})  # weight 0
    acc = training_accuracy(rows, last=10)
    assert acc["train_acc0"] == pytest.approx(sum(0.2 + 0.01 * s for s in range(21, 30)) / 9)
    assert acc["val_acc0"] == 0.45
    ok = check_acc_gap(acc, 0.40, 0.3)
    assert ok.status == "pass" and not ok.blocking
    warn = check_acc_gap({"train_acc0": 0.7, "val_acc0": 0.6}, 0.3, 0.3)
    assert warn.status == "warn" and not warn.failed and "gap 0.400" in warn.value
    assert check_acc_gap(training_accuracy([]), 0.3, 0.3).status == "skip"


def test_order_format_and_enforce():
    checks = [
        Check("a", "pass", "1", ">= 0", "x"),
        Check("b", "warn", "2", "<= 1", "look at b", blocking=False),
        Check("c", "fail", "3", ">= 4", "look at c"),
    ]
    assert [c.name for c in order_checks(checks)] == ["c", "b", "a"]
    text = format_checks(checks)
    lines = text.splitlines()
    assert lines[1].startswith("c") and "FAIL" in lines[1] and "look at c" in lines[2]
    assert "look at b" in text and "-> look at: x" not in text  # where-lines only for fail/warn
    with pytest.raises(GateFailed, match=r"1 check\(s\): c: 3 \[>= 4\].*c -> look at c"):
        enforce(checks)
    enforce(checks[:2])  # a warning alone does not fail the gate


def test_diagnose_orders_and_names_every_check():
    accepted = [0, 1, 2, 0, 1] * 40
    tau = 1 + sum(accepted) / len(accepted)
    offline = {"methods": {"eagle3": method(tau, accepted), "ngram": method(1.2, [0, 1] * 20)}}
    vllm = {
        "methods": {
            "eagle3": method(tau - 0.02, [], speedup=0.45, drafts=190),
            "ngram": method(1.21, [], drafts=40),
        }
    }
    rows = [{"kind": "train", "step": 1, "acc": [0.5, 0.3], "positions": [10, 9]}]
    th = Thresholds(min_tau=1.1, min_speedup=0.2, max_tau_gap=None, max_acc_gap=0.3)
    checks = diagnose(offline, vllm, MANIFEST, EXPORT, [], "872be49dbb638044", rows, th)
    names = [c.name for c in checks]
    assert names == [
        "min_tau (offline)",
        "min_tau (vLLM)",
        "min_speedup (vLLM)",
        "teacher_agreement",
        "chat_template",
        "export",
        "tau_gap (eagle3)",
        "tau_gap (ngram)",
        "acc_gap",
    ]
    assert all(c.status == "pass" for c in checks), format_checks(checks)
    # without vLLM: the speedup is the offline one and the gaps are skipped
    checks = diagnose(offline, None, MANIFEST, EXPORT, [], "872be49dbb638044", rows, th)
    assert "min_speedup (offline)" in [c.name for c in checks]
    assert next(c for c in checks if c.name == "tau_gap (eagle3)").status == "skip"
    # a drifted template and a slow engine fail, and the gate names them
    slow = {"methods": {**vllm["methods"], "eagle3": method(tau, [], speedup=0.1, drafts=190)}}
    checks = diagnose(offline, slow, MANIFEST, EXPORT, [], "ffff", rows, th)
    failed = [c.name for c in order_checks(checks) if c.failed]
    assert failed == ["min_speedup (vLLM)", "chat_template"]
    with pytest.raises(GateFailed, match="min_speedup"):
        enforce(checks)


def test_draft_positions_beyond_the_trained_ttt_steps_warn():
    from draftsmith.gate import check_draft_positions

    assert check_draft_positions(3, 3).status == "pass"
    warn = check_draft_positions(5, 3)
    assert warn.status == "warn" and not warn.blocking and "positions 4..5 were never trained" in warn.where
    assert check_draft_positions(3, None).status == "skip"
    # diagnose lists it after the export check when the export records its training settings
    accepted = [0, 1, 2, 0, 1] * 40
    offline = {
        "methods": {"eagle3": method(1 + sum(accepted) / len(accepted), accepted)},
        "num_draft_tokens": 5,
    }
    export = {
        **EXPORT,
        "draftsmith": {**EXPORT.get("draftsmith", {}), "training": {"settings": {"ttt_steps": 3}}},
    }
    rows = [{"kind": "train", "step": 1, "acc": [0.5, 0.3], "positions": [10, 9]}]
    th = Thresholds(min_tau=1.1, min_speedup=0.2, max_tau_gap=None, max_acc_gap=0.3)
    checks = diagnose(offline, None, MANIFEST, export, [], "872be49dbb638044", rows, th)
    names = [c.name for c in checks]
    assert names[names.index("export") + 1] == "draft_positions"
    assert next(c for c in checks if c.name == "draft_positions").status == "warn"
    enforce([c for c in checks if c.name == "draft_positions"])  # a warning never blocks
