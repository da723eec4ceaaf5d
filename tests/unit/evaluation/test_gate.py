"""The gate's checks as pure functions: each passes and fails where it should, with its numbers; the
drafter is compared with the free methods on projected speedup at the serving point (its own passes
counted), with its untrained start on tokens per target forward; the verdict names, per held-out set, the
method and draft length to deploy and what to do next."""

from __future__ import annotations

import math

import pytest
from helpers.evaluation import serving_point

from draftsmith.core.config.stage_settings import GateSettings
from draftsmith.core.evaluation.checks import Check, order_checks
from draftsmith.core.evaluation.cost import DEVICES, ModelCost
from draftsmith.core.evaluation.projection import set_projection
from draftsmith.core.evaluation.report import format_checks, format_verdict
from draftsmith.core.evaluation.verdict import (
    PER_DRAFT,
    check_beats,
    check_beats_free,
    check_chat_template,
    check_export_convention,
    check_generalisation,
    check_speedup,
    check_still_learning,
    check_tau_gap,
    check_teacher_agreement,
    diagnose,
    fair_speed,
    learning_curve,
    on_prompts,
    per_prompt_counts,
    set_verdict,
    tau_tolerance,
    training_accuracy,
    verdict,
)
from draftsmith.stages.gate import GateFailed, enforce

# a Llama-3.1-8B-like target and its EAGLE-3 drafter (~5% of its bytes per pass), served on an H100
TARGET = ModelCost(7.5e9, 0.0, 1.0, 131072, 32)
DRAFTER = ModelCost(4e8, 0.0, 1.0, 4096, 1)
POINTS = [serving_point(DEVICES["H100-80GB"], b, 700) for b in (1, 32)]

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
FINGERPRINT = "872be49dbb638044"


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


def with_prompts(m: dict, accepted: list[int], drafts: list[int], tokens: int = 64) -> dict:
    """A method's results with per-prompt counts for prompts p0, p1, ... (each `tokens` long)."""
    rows = [
        {"id": f"p{i}", "tokens": tokens, "forwards": tokens - a, "accepted": a, "drafts": d}
        for i, (a, d) in enumerate(zip(accepted, drafts, strict=True))
    ]
    return {**m, "per_prompt": rows}


def run(methods: dict, n: int, device: str = "cpu") -> dict:
    return {"methods": methods, "prompt_ids": [f"p{i}" for i in range(n)], "num_prompts": n, "device": device}


# ---------------------------------------------------------------------------------- per-prompt counts


def test_per_prompt_counts_in_prompt_order():
    rows = [
        {"id": "b", "tokens": 9, "forwards": 6, "accepted": 3, "drafts": 4},
        {"id": "a", "tokens": 5, "forwards": 4, "accepted": 1, "drafts": 2},
    ]
    m = {"per_prompt": rows}
    assert per_prompt_counts(m, ["a", "b"]) == ([5, 9], [4, 6])  # tokens, forwards: the judged figure
    assert per_prompt_counts(m, ["a", "b"], PER_DRAFT) == ([1, 3], [2, 4])  # vLLM's tau terms
    assert per_prompt_counts({}, ["a"]) is None
    with pytest.raises(ValueError, match="lack prompt"):
        per_prompt_counts(m, ["a", "c"])


# --------------------------------------------------------------------------------------- alternatives

SETTINGS = GateSettings()
DRAFTS = [40] * 16
TOKENS = [64] * 16


def per_forward(accepted: list[int], tokens: list[int] = TOKENS) -> tuple[list[int], list[int]]:
    """(tokens, forwards) per prompt: each forward emits one token plus the drafts it accepted."""
    return tokens, [t - a for t, a in zip(tokens, accepted, strict=True)]


def counted(accepted: list[list[int]], drafted: bool | list[bool] = True, k: int = 3) -> dict:
    """A method's vLLM results from each prompt's accepted drafts per step (64 tokens a prompt); a step
    that did not draft (`drafted` False) accepts nothing."""
    rows = []
    for i, steps in enumerate(accepted):
        flags = drafted if isinstance(drafted, list) else [drafted] * len(steps)
        rows.append({"id": f"p{i}", "tokens": len(steps) + sum(steps), "forwards": len(steps),
                     "accepted": sum(steps), "drafts": sum(flags),
                     "accepted_per_pos": [sum(1 for a in steps if a > j) for j in range(k)]})  # fmt: skip
    return {"per_prompt": rows}


def projected(methods: dict[str, dict], k: int = 3) -> dict:
    results = {"num_draft_tokens": k, "methods": methods}
    return set_projection(results, TARGET, {"eagle3": DRAFTER}, POINTS, SETTINGS.bootstrap)


def steps(pattern: list[int], n: int = 40) -> list[int]:
    return [pattern[i % len(pattern)] for i in range(n)]


def test_beats_free_counts_the_drafters_passes():
    # the drafter accepts more per step than suffix decoding, but pays k passes of ~5% of the target each
    # (plus a forward's overhead): a small lead in tokens per forward does not pay for them
    trained = {**counted([steps([1, 0, 1, 2, 0, i % 2]) for i in range(16)]), "kind": "eagle3"}
    suffix = {**counted([steps([1, 0, 1, 0, 0, i % 2]) for i in range(16)], drafted=False), "kind": "suffix"}
    p = projected({"eagle3": trained, "suffix": suffix})
    ours, theirs = p["methods"]["eagle3"], p["methods"]["suffix"]
    per_forward = [o["tokens_per_forward"] for o in (ours["options"][2], theirs["options"][2])]
    assert per_forward[0] > per_forward[1]  # more tokens per target forward at k = 3 ...
    c = check_beats_free("chat", p, "block", SETTINGS)
    assert c.failed and "suffix" in c.value and "projected" in c.value and c.group == "alternatives"
    assert "concurrency 1" in c.threshold and c.heldout == "chat"
    assert check_beats_free("chat", p, "warn", SETTINGS).status == "warn"
    # ... the drafter's best k is shorter than 3: positions 2-3 rarely pay for their passes
    assert ours["chosen_k"] < 3
    # a drafter far ahead passes
    strong = {**counted([steps([3, 2, 3, 1]) for _ in range(16)]), "kind": "eagle3"}
    assert (
        check_beats_free("chat", projected({"eagle3": strong, "suffix": suffix}), "block", SETTINGS).status
        == "pass"
    )
    # nothing free measured: not computable
    assert check_beats_free("chat", projected({"eagle3": strong}), "block", SETTINGS).status == "skip"
    assert check_beats_free("chat", None, "block", SETTINGS).status == "skip"


def test_beats_untrained_on_tokens_per_forward():
    good = ("vLLM", per_forward([24 + i % 5 for i in range(16)]))  # ~1.6 tokens per forward
    c = check_beats("untrained", "heldout", good, ("vLLM", per_forward([4] * 16)), "block", SETTINGS)
    assert c.status == "pass" and c.blocking and "16 prompts" in c.value and "vLLM" in c.value
    assert "tokens per target forward" in c.value and "tokens per target forward" in c.threshold
    assert check_beats("untrained", "heldout", good, None, "block", SETTINGS).status == "skip"
    # a difference inside the noise does not pass: 1 accepted draft more on one prompt of 16
    tie = ("vLLM", per_forward([10] * 16))
    nudged = ("vLLM", per_forward([10] * 15 + [11]))
    assert check_beats("untrained", "heldout", nudged, tie, "block", SETTINGS).failed  # most resamples: a tie
    noisy = ("vLLM", per_forward([0, 20] * 8))
    noisy_plus = ("vLLM", per_forward([20, 1] * 8))  # same total + 1, prompt order swapped
    assert check_beats("untrained", "heldout", noisy_plus, noisy, "block", SETTINGS).failed


def test_speedup_blocks_on_gpu_only_in_auto():
    cpu = check_speedup("vLLM", 0.63, 0.8, "cpu", "auto", True)
    assert (
        cpu.status == "info" and not cpu.blocking and "informational" in cpu.value and "n-gram" in cpu.value
    )
    gpu = check_speedup("vLLM", 0.63, None, "cuda", "auto", True)
    assert gpu.failed and "cuda" in gpu.threshold
    assert check_speedup("vLLM", 1.8, None, "cuda", "auto", True).status == "pass"
    assert check_speedup("offline", 0.63, None, "cpu", "block", True).failed
    assert check_speedup("offline", 0.63, None, "cuda", "warn", True).status == "warn"
    assert check_speedup("vLLM", None, None, "cpu", "auto", True).status == "skip"


def test_speedup_judges_only_a_fair_figure():
    # engines beside other jobs: the ratio is not judged either way, in any mode, and says why
    for figure in (0.63, 1.8):
        for mode in ("auto", "block", "warn"):
            unfair = check_speedup("vLLM", figure, None, "cuda", mode, False)
            assert unfair.status == "skip" and not unfair.failed and "engines alone" in unfair.value
    assert fair_speed({"fair": True}) and not fair_speed({}) and not fair_speed({"fair": "yes"})


def test_settings_reject_unknown_checks_and_modes():
    assert GateSettings(modes={"beats_free": "warn"}).all_modes == {
        "beats_free": "warn",
        "beats_untrained": "block",
        "speedup": "auto",
    }
    with pytest.raises(ValueError, match="evaluate.gate.beats_free"):
        GateSettings(modes={"beats_free": "auto"})
    with pytest.raises(ValueError, match="beats_ngram is now evaluate.gate.beats_free"):
        GateSettings(modes={"beats_ngram": "warn"})
    with pytest.raises(ValueError, match=r"evaluate.gate: Additional properties .*'min_tau'"):
        GateSettings(modes={"min_tau": "block"})


# ------------------------------------------------------------------------------------------- learning

RISING = [
    {"kind": "train", "step": s, "acc": [0.6 + 0.001 * s, 0.5, 0.4], "positions": [100, 90, 80]}
    for s in range(40)
] + [
    {"kind": "val", "step": 20, "acc": [0.40, 0.30, 0.20]},
    {"kind": "resume", "step": 21},
    {"kind": "val", "step": 40, "acc": [0.45, 0.33, 0.22]},
]


def test_learning_curve():
    curve = learning_curve(RISING, last=10)
    assert curve["train_acc"][0] == pytest.approx(sum(0.6 + 0.001 * s for s in range(30, 40)) / 10)
    assert curve["train_acc"][1:] == pytest.approx([0.5, 0.4])
    assert curve["val_acc"] == [0.45, 0.33, 0.22] and curve["val_gain"] == pytest.approx(0.05)
    assert training_accuracy(RISING, last=10)["val_acc0"] == 0.45
    gen = check_generalisation(curve, 0.15)
    assert gen.status == "warn" and not gen.blocking and "gap 0.184" in gen.value
    assert check_generalisation(curve, 0.3).status == "pass"
    assert check_still_learning(curve, 0.01).status == "warn"
    assert check_still_learning(curve, 0.1).status == "pass"
    one_val = learning_curve(RISING[:41])
    assert one_val["val_gain"] is None and check_still_learning(one_val, 0.01).status == "skip"
    assert check_generalisation(learning_curve([]), 0.15).status == "skip"


# ------------------------------------------------------------------------------------------- contract


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


# -------------------------------------------------------------------------------------------- verdict


def _checks(
    free: str, untrained: str = "pass", overfit: str = "pass", rising: str = "pass", contract: str = "pass",
    heldout: str = "heldout",
):  # fmt: skip
    return [
        Check(f"beats_free ({heldout})", free, "v", "t", "w", free != "warn", "alternatives", heldout),
        Check(f"beats_untrained ({heldout})", untrained, "v", "t", "w", True, "alternatives", heldout),
        Check("export", contract, "v", "t", "w", True, "contract"),
        Check("generalisation", overfit, "gap", "t", "w", False, "learning"),
        Check("still_learning", rising, "gain", "t", "w", False, "learning"),
    ]


def fake_projection(speeds: dict[str, tuple[float, float, float]]) -> dict:
    """A set's projection with each method's chosen option at k = 2: (speedup, low, high) at concurrency 1
    (and 0.8x of it at 32)."""
    methods = {
        key: {"kind": key if key != "eagle3" else "eagle3", "chosen_k": 2, "options": [
            {}, {"projected_speedup": [v, 0.8 * v], "projected_intervals": [[lo, hi], [0.8 * lo, 0.8 * hi]],
                 "measured": True}]}
        for key, (v, lo, hi) in speeds.items()
    }  # fmt: skip
    values = {**{k: v[0] for k, v in speeds.items()}, "plain": 1.0}
    return {"methods": methods, "ranking": sorted(values, key=lambda k: -values[k]),
            "points": ["H100-80GB, concurrency 1, context 700 tokens", "H100-80GB, concurrency 32, context 700 tokens"],
            "concurrency": [1, 32]}  # fmt: skip


DRAFTER_WINS = fake_projection(
    {"eagle3": (1.6, 1.5, 1.7), "suffix": (1.2, 1.1, 1.3), "ngram": (1.1, 1.0, 1.2)}
)
SUFFIX_WINS = fake_projection(
    {"eagle3": (1.1, 1.0, 1.2), "suffix": (1.3, 1.2, 1.4), "ngram": (1.1, 1.0, 1.2)}
)
NOTHING_PAYS = fake_projection({"eagle3": (0.9, 0.8, 1.0), "suffix": (1.02, 0.97, 1.08)})


@pytest.mark.parametrize(
    "kw, projection, deploy, action",
    [
        ({"free": "pass"}, DRAFTER_WINS, "trained drafter", "deploy drafter"),
        ({"free": "fail"}, SUFFIX_WINS, "suffix decoding", "deploy suffix decoding"),
        ({"free": "warn"}, SUFFIX_WINS, "suffix decoding", "deploy suffix decoding"),  # a warning still loses
        ({"free": "fail", "overfit": "warn"}, SUFFIX_WINS, "suffix decoding", "more data"),
        ({"free": "fail", "rising": "warn"}, SUFFIX_WINS, "suffix decoding", "train longer"),
        ({"free": "fail", "overfit": "warn", "rising": "warn"}, SUFFIX_WINS, "suffix decoding", "more data"),
        ({"free": "pass", "contract": "fail"}, DRAFTER_WINS, "suffix decoding", "contract broken"),
        ({"free": "skip", "untrained": "fail", "rising": "warn"}, None, "plain decoding", "train longer"),
        ({"free": "pass", "untrained": "fail"}, DRAFTER_WINS, "suffix decoding", "contract broken"),
        ({"free": "fail"}, NOTHING_PAYS, "plain decoding", "no speculation"),
    ],
)
def test_set_verdict(kw, projection, deploy, action):
    v = set_verdict(_checks(**kw), "heldout", projection)
    assert (v["deploy"], v["action"]) == (deploy, action)
    if projection is DRAFTER_WINS and action == "deploy drafter":
        assert v["k"] == 2 and v["projected_speedup"] == [1.6, pytest.approx(1.28)]
        assert v["runner_up"]["method"] == "suffix"
    if action == "no speculation":
        assert v["runner_up"]["method"] == "suffix"  # 1.02x, but its interval reaches below 1.0


def with_room(projection: dict, ceiling: float, break_even: float | None) -> dict:
    """A projection with the trained drafter's room at each point: its ceiling, the best free method's
    speedup there (what it must beat), its break-even and measured acceptance per position."""
    free = {
        k: m["options"][1]["projected_speedup"] for k, m in projection["methods"].items() if k != "eagle3"
    }
    best = [max(free, key=lambda k: free[k][i]) for i in range(2)]
    room = {"ceiling": [ceiling, 0.8 * ceiling], "to_beat": [free[b][i] for i, b in enumerate(best)],
            "to_beat_method": best, "break_even": [break_even, None], "position_acceptance": [0.31, 0.2, 0.1]}  # fmt: skip
    return {**projection, "drafter_room": room}


@pytest.mark.parametrize(
    "kw", [{"rising": "warn"}, {"overfit": "warn"}, {"overfit": "warn", "rising": "warn"}]
)
def test_no_training_is_asked_for_where_the_ceiling_leaves_no_room(kw):
    """A perfect drafter (every draft accepted) projecting below the best free method: the verdict serves
    the free method and gives both figures, whatever the learning curves say; with room it says how."""
    capped = set_verdict(_checks("fail", **kw), "heldout", with_room(SUFFIX_WINS, 1.07, None))
    assert (capped["deploy"], capped["action"]) == ("suffix decoding", "deploy suffix decoding")
    reason = capped["reasons"][-1]
    assert reason.startswith("no room: ceiling 1.07x (every draft accepted, H100-80GB, concurrency 1")
    assert (
        "vs suffix decoding 1.30x" in reason and "no training can beat suffix decoding, so serve it" in reason
    )
    assert "acceptance per position 0.31 / 0.20 / 0.10 vs none reaches it" in reason
    assert capped["room"]["ceiling"] == 1.07 and capped["room"]["to_beat_method"] == "suffix"
    text = format_verdict(verdict(_checks("fail", **kw), {"heldout": with_room(SUFFIX_WINS, 1.07, None)}))
    assert text.startswith("VERDICT: DEPLOY suffix decoding k=2\n") and "TRAIN LONGER" not in text
    # room above the best free method: the learning curves choose the next step, the figures beside it
    roomy = set_verdict(_checks("fail", **kw), "heldout", with_room(SUFFIX_WINS, 2.4, 0.62))
    assert roomy["action"] == ("more data" if "overfit" in kw else "train longer")
    assert roomy["deploy"] == "suffix decoding"  # meanwhile, serve the free method
    assert roomy["reasons"][-1] == (
        "room: ceiling 2.40x (every draft accepted, H100-80GB, concurrency 1, context 700 tokens) vs suffix "
        "decoding 1.30x; acceptance per position 0.31 / 0.20 / 0.10 vs break-even 0.62"
    )
    head = format_verdict(verdict(_checks("fail", **kw), {"heldout": with_room(SUFFIX_WINS, 2.4, 0.62)}))
    assert head.splitlines()[0] == f"VERDICT: DEPLOY suffix decoding k=2; next: {roomy['action'].upper()}"


def test_the_verdict_gives_the_range_of_load_where_each_method_pays():
    best = [{"concurrency": c, "method": m, "k": k, "speedup": s} for c, m, k, s in (
        (1, "suffix", 3, 1.3), (2, "suffix", 3, 1.2), (4, "suffix", 2, 1.1), (8, "plain", 0, 1.0))]  # fmt: skip
    v = set_verdict(_checks("fail"), "heldout", {**SUFFIX_WINS, "policy": {"best": best}})
    assert v["by_load"] == best
    text = format_verdict(
        {"heldout": "heldout", "deploy": v["deploy"], "action": v["action"], "per_set": [v]}
    )
    assert "    by load: suffix decoding k=3 at 1-2, suffix decoding k=2 at 4, plain decoding at 8" in text


def test_verdict_names_the_better_method_per_set():
    checks = _checks("pass") + _checks("fail", heldout="humaneval")[:2]
    v = verdict(checks, {"heldout": DRAFTER_WINS, "humaneval": SUFFIX_WINS})
    assert v["heldout"] == "humaneval" and v["action"] == "deploy suffix decoding"  # the losing set's
    assert v["deploy"] == "per held-out set"
    assert [(s["heldout"], s["deploy"], s["k"]) for s in v["per_set"]] == [
        ("heldout", "trained drafter", 2),
        ("humaneval", "suffix decoding", 2),
    ]
    text = format_verdict(v)
    assert (
        text.splitlines()[0]
        == "VERDICT: deploy trained drafter k=2 on heldout; suffix decoding k=2 on humaneval"
    )
    assert "1.60x [1.50, 1.70] at 1, 1.28x [1.20, 1.36] at 32" in text
    assert "runner-up: suffix decoding k=2" in text
    # every set agreeing: one answer
    same = verdict(_checks("fail"), {"heldout": SUFFIX_WINS})
    assert same["deploy"] == "suffix decoding"
    assert format_verdict(same).startswith("VERDICT: DEPLOY suffix decoding k=2\n")  # what to serve, first


# ------------------------------------------------------------------------------------------ diagnosis


def test_diagnose_judges_vllm_per_prompt_counts_on_every_set():
    accepted = [0, 1, 2, 0, 1] * 40
    tau = 1 + sum(accepted) / len(accepted)
    eagle_off = with_prompts(method(tau, accepted), [5 + i % 3 for i in range(16)], DRAFTS)
    # vLLM's counts are what is judged: here the drafter wins in vLLM on heldout...
    eagle_vllm = with_prompts(
        method(tau, [], speedup=0.6, drafts=640), [30 + i % 3 for i in range(16)], DRAFTS
    )
    ngram_vllm = with_prompts(
        method(1.3, [], speedup=0.8, drafts=640), [10 + i % 4 for i in range(16)], DRAFTS
    )
    untrained_off = with_prompts(method(1.0, [0] * 50), [0] * 16, DRAFTS)
    split = {
        "offline": run({"eagle3": eagle_off, "untrained": untrained_off}, 16),
        "vllm": run({"eagle3": eagle_vllm, "ngram": ngram_vllm}, 16),
    }
    # ...and loses on the hand-written set, measured offline only
    hand = {
        "offline": run(
            {
                "eagle3": with_prompts(method(tau, accepted), [5 + i % 3 for i in range(16)], DRAFTS),
                "untrained": untrained_off,
                "ngram": with_prompts(method(2.0, [1] * 10), [40 + i % 3 for i in range(16)], DRAFTS),
            },
            16,
        ),
        "vllm": None,
    }
    rows = RISING
    # the serving projections: the drafter far ahead of n-gram lookup on heldout, behind suffix decoding on
    # the hand-written set
    weak_free = {**counted([steps([0, 0, 1, 0]) for _ in range(16)], drafted=False), "kind": "ngram"}
    strong_free = {**counted([steps([3, 0, 2, 0]) for _ in range(16)], drafted=False), "kind": "suffix"}
    drafter = {**counted([steps([3, 2, 3, 1]) for _ in range(16)]), "kind": "eagle3"}
    weak_drafter = {**counted([steps([1, 0, 0, 1]) for _ in range(16)]), "kind": "eagle3"}
    projections = {
        "heldout": projected({"eagle3": drafter, "ngram": weak_free}),
        "handwritten": projected({"eagle3": weak_drafter, "suffix": strong_free}),
    }
    sets = {"heldout": split, "handwritten": hand}
    checks = diagnose(sets, MANIFEST, EXPORT, [], FINGERPRINT, rows, SETTINGS, projections=projections)
    by = {c.name: c for c in checks}
    assert list(by) == [
        "beats_free (heldout)",
        "beats_untrained (heldout)",
        "beats_free (handwritten)",
        "beats_untrained (handwritten)",
        "speedup",
        "teacher_agreement",
        "chat_template",
        "export",
        "tau_gap (eagle3, heldout)",
        "tau_gap (eagle3, handwritten)",
        "generalisation",
        "still_learning",
    ]
    assert by["beats_free (heldout)"].status == "pass" and "n-gram" in by["beats_free (heldout)"].value
    assert "projected" in by["beats_free (heldout)"].value
    assert "vLLM vs offline" in by["beats_untrained (heldout)"].value  # untrained only measured offline
    assert by["beats_free (handwritten)"].failed and "suffix" in by["beats_free (handwritten)"].value
    assert by["speedup"].status == "skip" and "engines alone" in by["speedup"].value  # ran beside others
    assert by["tau_gap (eagle3, handwritten)"].status == "skip"
    v = verdict(checks, projections)
    assert v["heldout"] == "handwritten" and v["action"] == "more data"  # gap 0.19 > 0.15
    assert v["per_set"][1]["deploy"] == "suffix decoding"  # meanwhile, serve the free method
    with pytest.raises(GateFailed, match=r"beats_free \(handwritten\)"):
        enforce(checks)
    # beats_free as a warning (the default run's setting): the gate passes, the verdict still says it
    relaxed = GateSettings(modes={"beats_free": "warn"})
    checks = diagnose(sets, MANIFEST, EXPORT, [], FINGERPRINT, rows, relaxed, projections=projections)
    enforce(checks)
    assert verdict(checks, projections)["action"] == "more data"
    # on a GPU the slow drafter blocks, measured fairly; measured beside other jobs it is not judged
    gpu = {**split, "vllm": {**split["vllm"], "device": "cuda", "fair": True}}
    checks = diagnose({"heldout": gpu}, MANIFEST, EXPORT, [], FINGERPRINT, rows, relaxed)
    assert next(c for c in checks if c.name == "speedup").failed
    crowded = {**split, "vllm": {**split["vllm"], "device": "cuda"}}
    checks = diagnose({"heldout": crowded}, MANIFEST, EXPORT, [], FINGERPRINT, rows, relaxed)
    assert next(c for c in checks if c.name == "speedup").status == "skip"


def test_tau_gap_on_the_offline_prompts_only():
    # vLLM decoded 4 prompts, the offline contract check the first 2: compare on those 2
    served = with_prompts(method(1.5, [], drafts=80), [30, 30, 0, 0], [20, 20, 20, 20])
    sub = on_prompts(served, ["p0", "p1"])
    assert sub["tau"] == pytest.approx(2.5) and sub["drafts"] == 40
    assert on_prompts(served, ["p0", "p1", "p2", "p3"]) is served
    assert on_prompts(None, ["p0"]) is None and on_prompts({"tau": 1.2}, ["p0"]) == {"tau": 1.2}
    off = method(2.5, [3, 1] * 20)
    assert check_tau_gap("eagle3", off, sub, None).status == "pass"
    assert check_tau_gap("eagle3", off, served, None).failed  # all 4 prompts: a false alarm


def test_two_engines_pair_on_the_prompts_both_decoded():
    # vLLM measured the drafter on 16 prompts; the untrained drafter only offline, on the first 8
    eagle_vllm = with_prompts(method(1.6, [], drafts=640), [24] * 16, DRAFTS)
    untrained_off = with_prompts(method(1.0, [0] * 50), [0] * 8, [40] * 8)
    eagle_off = with_prompts(method(1.6, [0, 1] * 20), [24] * 8, [40] * 8)
    split = {
        "offline": {**run({"eagle3": eagle_off, "untrained": untrained_off}, 8)},
        "vllm": run({"eagle3": eagle_vllm}, 16),
    }
    checks = diagnose({"heldout": split}, MANIFEST, EXPORT, [], FINGERPRINT, RISING, SETTINGS)
    beats = next(c for c in checks if c.name == "beats_untrained (heldout)")
    assert beats.status == "pass" and "8 prompts" in beats.value and "vLLM vs offline" in beats.value


def test_draft_positions_beyond_the_trained_ttt_steps_warn():
    from draftsmith.core.evaluation.verdict import check_draft_positions

    assert check_draft_positions(3, 3).status == "pass"
    warn = check_draft_positions(5, 3)
    assert warn.status == "warn" and not warn.blocking and "positions 4..5 were never trained" in warn.where
    assert check_draft_positions(3, None).status == "skip"
    # diagnose lists it when the export records its training settings; a warning never blocks
    accepted = [0, 1, 2, 0, 1] * 40
    eagle = with_prompts(method(1 + sum(accepted) / len(accepted), accepted), [5] * 16, DRAFTS)
    offline = {**run({"eagle3": eagle}, 16), "num_draft_tokens": 5}
    export = {
        **EXPORT,
        "draftsmith": {**EXPORT.get("draftsmith", {}), "training": {"settings": {"ttt_steps": 3}}},
    }
    checks = diagnose({"heldout": {"offline": offline, "vllm": None}}, MANIFEST, export, [], FINGERPRINT,
                      RISING, SETTINGS)  # fmt: skip
    positions = next(c for c in checks if c.name == "draft_positions")
    assert positions.status == "warn"
    enforce([positions])
