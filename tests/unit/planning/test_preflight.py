"""The pre-flight (draftsmith.core.planning.preflight): the best choice without training at each load, a planned
drafter's cost before it exists, and the one line that says whether a drafter can pay."""

from __future__ import annotations

import pytest
from helpers.evaluation import serving_point

from draftsmith.core.evaluation.cost import DEVICES, ModelCost
from draftsmith.core.planning.memory import drafter_shape
from draftsmith.core.planning.preflight import (
    blocked_message,
    free_best,
    outlook_line,
    planned_drafter_cost,
    set_outlook,
)
from draftsmith.stages.evaluate.stage import remeasure_targets

H100 = DEVICES["H100-80GB"]
# the default target (SmolLM2-135M) as tests/unit/evaluation/test_policy.py has it
SMOL_135M = ModelCost(135e6, 0.0, 1.0, 30 * 2 * 3 * 64 * 2, 30)
SMOL_CONFIG = {
    "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
    "num_hidden_layers": 30, "vocab_size": 49152,
}  # fmt: skip
PLAN = {"drafter": {"kind": "eagle3"}, "vocab_size": 4096, "aux_layers": None}


def _rows(tokens: int, forwards: int, per_pos: list[int], drafts: int) -> list[dict]:
    return [{"id": "p", "tokens": tokens, "forwards": forwards, "accepted": tokens - forwards,
             "drafts": drafts, "accepted_per_pos": per_pos}]  # fmt: skip


def test_the_planned_drafter_costs_what_its_shape_says():
    cost = planned_drafter_cost(PLAN, SMOL_CONFIG, 2.0)
    shape = drafter_shape({"train": {"drafter": {}}, "vocab": {"size": 4096}}, SMOL_CONFIG, 3)
    assert cost.dense_parameters == shape.params()
    assert (cost.layers, cost.drafting, cost.kv_bytes_per_token) == (1, "chain", 2 * 3 * 64 * 2.0)
    assert (
        planned_drafter_cost({**PLAN, "drafter": {"kind": "peagle"}}, SMOL_CONFIG, 2.0).drafting == "parallel"
    )
    block = planned_drafter_cost({**PLAN, "drafter": {"kind": "dflash", "num_layers": 2}}, SMOL_CONFIG, 2.0)
    assert (block.drafting, block.layers, block.dense_parameters) == ("block", 2, 2 * shape.params())


def test_plain_decoding_is_the_choice_when_no_free_method_pays():
    points = [serving_point(H100, 1, 500)]
    # a free method that never drafts: 1.0 tokens per forward, plus its lookup
    rows = _rows(60, 60, [0, 0, 0], 0)
    assert free_best({"ngram": {"per_prompt": rows}}, 3, SMOL_135M, points) == [
        {"method": "plain", "k": 0, "speedup": 1.0}
    ]
    good = _rows(100, 50, [40, 10, 0], 50)
    best = free_best({"ngram": {"per_prompt": rows}, "suffix": {"per_prompt": good}}, 3, SMOL_135M, points)
    assert best[0]["method"] == "suffix" and best[0]["speedup"] > 1.5


def test_a_small_target_leaves_no_room_and_the_line_names_what_to_serve():
    """The issue's figure: for a 135M target on an H100 even a perfect drafter projects about 1.05x, below
    suffix decoding measured at 1.26x; no training can change that."""
    points = [serving_point(H100, b, 500) for b in (1, 8)]
    drafter = planned_drafter_cost(PLAN, SMOL_CONFIG, 2.0)
    suffix = _rows(126, 100, [20, 5, 1], 40)
    outlook = set_outlook({"suffix": {"per_prompt": suffix}}, 3, SMOL_135M, drafter, points)
    assert outlook["any_room"] is False and outlook["room"] == [False, False]
    assert outlook["drafter"]["ceiling"][0] == pytest.approx(1.07, abs=0.02)
    line = outlook_line("heldout", outlook, "H100-80GB")
    assert line.startswith("heldout: serve suffix (k = ") and "no drafter can beat it at any load" in line
    assert "out of reach" in line
    message = blocked_message({"heldout": outlook})
    assert message.startswith("pre-flight: no drafter can beat the best choice without training at any")
    assert "heldout: suffix (k = 3) 1.24x, a perfect drafter 1.07x" in message and "\n" not in message


def test_past_the_free_methods_crossover_a_perfect_drafter_could_still_pay():
    """At 32 requests suffix decoding's verify steps cost more than its drafts save (plain decoding is the
    choice there), while a perfect drafter would still gain: the pre-flight says up to which load."""
    points = [serving_point(H100, b, 500) for b in (1, 8, 32)]
    drafter = planned_drafter_cost(PLAN, SMOL_CONFIG, 2.0)
    suffix = _rows(126, 100, [20, 5, 1], 40)
    outlook = set_outlook({"suffix": {"per_prompt": suffix}}, 3, SMOL_135M, drafter, points)
    assert outlook["free_best"][2]["method"] == "plain" and outlook["room"] == [False, False, True]
    assert "a drafter could pay at concurrency 32" in outlook_line("heldout", outlook, "H100-80GB")


def test_a_large_target_leaves_room_and_says_up_to_which_load():
    llama = ModelCost(8.03e9 - 0.525e9, 0.0, 1.0, 32 * 2 * 8 * 128 * 2, 32)
    drafter = ModelCost(0.4e9, 0.0, 1.0, 2 * 8 * 128 * 2, 1)
    points = [serving_point(H100, b, 700) for b in (1, 8, 32)]
    ngram = _rows(110, 100, [8, 2, 0], 30)
    outlook = set_outlook({"ngram": {"per_prompt": ngram}}, 3, llama, drafter, points)
    assert outlook["room"][0] and outlook["any_room"]
    a = outlook["drafter"]["break_even"][0]
    assert 0 < a < 1
    assert f"per-position acceptance >= {a:.2f}" in outlook_line("chat", outlook, "H100-80GB")


@pytest.mark.parametrize(
    ("best", "expected"),
    [
        # the winner far ahead of the rest: its estimate at k cannot change what is deployed
        ({"eagle3": (1, 0.62), "suffix": (3, 1.26), "ngram": (3, 1.10)}, {}),
        # two methods within 10%: the one at a shorter k is measured there
        ({"eagle3": (1, 1.20), "suffix": (3, 1.26)}, {"eagle3": 1}),
        # near plain decoding's 1.0x: deploy or not hangs on it
        ({"ngram": (2, 1.04)}, {"ngram": 2}),
        # at the longest k already: nothing to re-measure
        ({"eagle3": (3, 1.20), "suffix": (3, 1.21)}, {}),
    ],
)
def test_only_an_estimate_that_could_change_the_decision_is_measured_again(best, expected):
    assert remeasure_targets(best, 3, 0.1) == expected


def test_this_cpus_projection_is_added_where_its_profile_exists(tmp_path):
    from draftsmith.core.io.atomic import write_json
    from draftsmith.stages.eval_summary import _preflight_brief
    from draftsmith.stages.evaluate.preflight import this_cpu_view

    profile = tmp_path / "this-cpu.json"
    serving = {"device": "H100-80GB", "profile": str(profile), "concurrency": [1, 8]}
    assert this_cpu_view(serving) is None  # no profile measured: the GPU projection alone
    write_json(profile, {"device": {"bandwidth_gb_s": 28.9, "tflops": 0.35, "overhead_ms": 4.0,
                                    "layer_overhead_ms": 1.1, "token_overhead_us": 350.0},
                         "bytes_per_parameter": 4.0, "lookup_us": 20.0})  # fmt: skip
    assert this_cpu_view(serving) == {**serving, "device": "this-cpu"}
    assert this_cpu_view({**serving, "device": "this-cpu"}) is None  # already the point that decides
    # the report leads with the serving point's lines, then this CPU's
    sets = {"a": {"line": "a: H100", "this_cpu": {"line": "a: this CPU"}}, "b": {"line": "b: H100"}}
    assert _preflight_brief({"sets": sets})["lines"] == ["a: H100", "b: H100", "a: this CPU"]
