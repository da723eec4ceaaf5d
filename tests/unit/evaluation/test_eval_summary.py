"""The evaluation summary as pure functions: tokens per target forward and vLLM's tau with intervals in
every row, the serving projection, the table and set loading."""

from __future__ import annotations

import json

import pytest
from helpers.evaluation import NGRAM, TRAINED, N, results, serving_point

from draftsmith.core.config.stage_settings import GateSettings
from draftsmith.core.evaluation.cost import DEVICES, ModelCost, projected_speedup
from draftsmith.core.evaluation.projection import set_projection
from draftsmith.core.evaluation.report import format_table, format_tsv
from draftsmith.stages.eval_summary import headline, intervals, load_sets, summary_rows


def test_rows_carry_intervals():
    iv = intervals(TRAINED, [f"p{i}" for i in range(N)], GateSettings())
    lo, hi = iv["tau_interval"]
    assert lo < TRAINED["tau"] < hi and hi - lo < 0.2
    lo, hi = iv["tokens_per_forward_interval"]
    assert lo < TRAINED["tokens_per_forward"] < hi
    for rate, (plo, phi) in zip(
        TRAINED["acceptance_rate_per_position"], iv["acceptance_intervals"], strict=True
    ):
        assert plo - 1e-12 <= rate <= phi + 1e-12  # float64 sums in another order
    assert intervals({**TRAINED, "per_prompt": None}, ["p0"], GateSettings())["tau_interval"] is None
    sets = {
        "heldout": {
            "offline": results({"eagle3": TRAINED, "ngram": NGRAM}),
            "vllm": results({"eagle3": TRAINED}),
        }
    }
    target = ModelCost(1e9, 0.0, 1.0, 1e5, 24)
    drafter = ModelCost(5e7, 0.0, 1.0, 4e3, 1)
    points = [serving_point(DEVICES["H100-80GB"], b, 600) for b in (1, 32)]
    projections = {"heldout": set_projection(sets["heldout"]["vllm"], target, {"eagle3": drafter}, points,
                                           GateSettings().bootstrap)}  # fmt: skip
    rows = summary_rows(sets, GateSettings(), projections)
    assert [(r["method"], r["measured_by"]) for r in rows] == [
        ("plain decoding", "offline"),
        ("plain decoding", "vLLM"),
        ("trained drafter", "offline"),
        ("trained drafter", "vLLM"),
        ("n-gram lookup", "offline"),
    ]
    plain, trained, served, ngram = rows[1], rows[2], rows[3], rows[4]
    assert plain["tokens_per_forward"] == 1.0 and plain["projected_speedup"] == [1.0, 1.0]
    # only the judged measurement (vLLM's) is projected: at its chosen k, at each concurrency
    assert trained["projected_speedup"] is None and ngram["projected_speedup"] is None
    k = served["k"]
    option = projections["heldout"]["methods"]["eagle3"]["options"][k - 1]
    assert served["projected_speedup"] == [
        pytest.approx(projected_speedup(option["tokens_per_forward"], "eagle3", k, target, p, drafter))
        for p in points
    ]
    lo, hi = served["projected_intervals"][0]
    assert lo < served["projected_speedup"][0] < hi
    # acceptance per position over every decode step: accepted there / target forwards
    assert served["per_step_acceptance"][0] == pytest.approx(
        sum(r["accepted_per_pos"][0] for r in TRAINED["per_prompt"]) / TRAINED["forwards"]
    )
    summary = {"rows": rows, "level": 0.95}
    text = format_table(summary)
    assert f"{TRAINED['tokens_per_forward']:.3f} ± " in text and f"{TRAINED['tau']:.3f} ± " in text
    assert "every step counted" in text and "draft steps only" in text
    assert format_tsv(summary).count("\n") == len(rows) + 1
    # the headline reads vLLM where it measured the set
    head = headline(rows, sets)["heldout"]
    assert head["measured_by"] == "vLLM" and list(head["methods"]) == ["eagle3"]


def test_load_sets_checks_the_prompts_match(tmp_path):
    off, served = tmp_path / "off.json", tmp_path / "vllm.json"
    off.write_text(json.dumps(results({"eagle3": TRAINED})))
    served.write_text(json.dumps({**results({"eagle3": TRAINED}), "prompt_ids": ["x"] * N}))
    with pytest.raises(ValueError, match="decoded different prompts"):
        load_sets({"heldout": off}, {"heldout": served})
    with pytest.raises(ValueError, match="without offline results"):
        load_sets({"heldout": off}, {"other": served})
    assert load_sets({"heldout": off}, {})["heldout"]["vllm"] is None
    # the offline contract check decodes the first few of vLLM's prompts (evaluate.offline_num_prompts)
    more = {**results({"eagle3": TRAINED}), "prompt_ids": results({})["prompt_ids"] + ["extra"]}
    served.write_text(json.dumps(more))
    assert load_sets({"heldout": off}, {"heldout": served})["heldout"]["vllm"]["prompt_ids"][-1] == "extra"
    served.write_text(json.dumps({**more, "prompt_ids": ["extra"] + results({})["prompt_ids"]}))
    with pytest.raises(ValueError, match="decoded different prompts"):
        load_sets({"heldout": off}, {"heldout": served})


def test_without_the_offline_decoder_vllm_alone_fills_the_summary(tmp_path):
    """evaluate.offline: false (a target only vLLM can hold): the summary has vLLM's rows only, and the
    offline-vs-vLLM contract check says it could not be made instead of comparing vLLM with itself."""
    from draftsmith.core.evaluation.verdict import diagnose

    served = tmp_path / "vllm.json"
    vllm = {**results({"eagle3": {**TRAINED, "kind": "eagle3"}}), "temperature": 0.0}
    vllm["methods"]["eagle3"]["outputs_equal_plain"] = N
    served.write_text(json.dumps(vllm))
    sets = load_sets({}, {"heldout": served})
    assert sets["heldout"]["offline_measured"] is False
    rows = summary_rows(sets, GateSettings())
    assert {r["measured_by"] for r in rows} == {"vLLM"}
    manifest = {"teacher_agreement": 0.99, "min_teacher_agreement": 0.9}
    checks = {c.name: c for c in diagnose(sets, manifest, {}, [], None, [], GateSettings())}
    gap = checks["tau_gap (eagle3, heldout)"]
    assert gap.status == "skip" and "offline decoder" in gap.value


def test_summary_has_the_serving_policy_and_the_drafters_break_even_per_set():
    """Per held-out set: the policy over the concurrency grid, and the drafter's measured acceptance per
    position against its break-even and ceiling at the first concurrency, every existing field kept."""
    from helpers.evaluation import tiny_summary

    from draftsmith.core.evaluation.policy import position_acceptance

    summary = json.loads(json.dumps(tiny_summary()))  # as summary.json holds it
    for name, heldout in summary["heldout_sets"].items():
        assert {"prompts", "num_prompts", "max_new_tokens", "plain_tokens", "vllm_measured"} <= set(heldout)
        policy = heldout["policy"]
        assert policy["grid"] == [1, 2, 4, 8, 16, 32]
        assert [b["concurrency"] for b in policy["best"]] == policy["grid"]
        assert set(policy["crossover"]) == {"eagle3", "ngram"}  # the untrained drafter is never served
        # n-gram lookup is the best free method here at every load
        assert policy["ranges"] == {"ngram": [1, 32]} and policy["crossover"]["ngram"] is None
        room = heldout["acceptance_vs_break_even"]
        rows = summary["rows"]
        trained = next(r for r in rows if r["heldout"] == name and r["key"] == "eagle3")
        assert room["point"].startswith("H100-80GB, concurrency 1")
        # n-gram's 1.86x at concurrency 1 is above even a perfect drafter's ceiling: no acceptance will do
        assert room["to_beat"]["method"] == "ngram" and room["to_beat"]["speedup"] == pytest.approx(
            summary["headline"][name]["methods"]["ngram"]["projected_speedup"][0]
        )
        assert room["ceiling"] < room["to_beat"]["speedup"] and room["break_even"] is None
        assert len(room["position_acceptance"]) == len(trained["acceptance_per_position"])
    # acceptance per position given the one before, from the measured counts
    counts = [sum(col) for col in zip(*(r["accepted_per_pos"] for r in TRAINED["per_prompt"]), strict=True)]
    drafts = sum(r["drafts"] for r in TRAINED["per_prompt"])
    assert summary["heldout_sets"]["heldout"]["acceptance_vs_break_even"][
        "position_acceptance"
    ] == pytest.approx(position_acceptance(counts, drafts))
