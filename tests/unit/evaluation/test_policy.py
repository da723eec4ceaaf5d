"""The serving policy (draftsmith.core.evaluation.policy): a drafter's ceiling and break-even from the cost model's own
step times, the best method and k per concurrency, the crossover, and vLLM's per-batch-size schedule."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers.evaluation import serving_point

from draftsmith.core.evaluation.cost import (
    DEVICES,
    ModelCost,
    ServingPoint,
    draft_length_options,
    drafting_seconds,
    forward_seconds,
    projected_speedup,
    step_seconds,
)
from draftsmith.core.evaluation.policy import (
    TOLERANCE,
    break_even,
    ceiling,
    chain_tokens,
    concurrency_grid,
    drafter_room,
    methods_at_k,
    position_acceptance,
    serving_policy,
    suffix_cutoff,
    vllm_schedule,
    with_shape,
)

H100 = DEVICES["H100-80GB"]
# Llama-3.1-8B and its EAGLE-3 drafter, as tests/unit/evaluation/test_cost.py has them
LLAMA_8B = ModelCost(8.03e9 - 0.525e9, 0.0, 1.0, 32 * 2 * 8 * 128 * 2, 32)
EAGLE3_8B = ModelCost(0.4e9, 0.0, 1.0, 2 * 8 * 128 * 2, 1)
# the default run's target (SmolLM2-135M: 30 layers, 3 KV heads of 64, the tied embedding read as its
# lm_head) and a one-layer drafter of it (a layer, fc 3H -> H, a 32k-token head: ~23M parameters)
SMOL_135M = ModelCost(135e6, 0.0, 1.0, 30 * 2 * 3 * 64 * 2, 30)
SMOL_DRAFTER = ModelCost(23e6, 0.0, 1.0, 2 * 3 * 64 * 2, 1)


def point(b: int = 1, context: float = 700) -> ServingPoint:
    return serving_point(H100, b, context)


GRID = [point(b) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)]


def test_concurrency_grid_is_powers_of_two_to_the_largest_and_the_configured_values():
    assert concurrency_grid({"concurrency": [1, 8, 32]}) == [1, 2, 4, 8, 16, 32]
    assert concurrency_grid({"concurrency": [256]}) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert concurrency_grid({"concurrency": [12, 1]}) == [1, 2, 4, 8, 12]


def test_the_ceiling_is_k_plus_one_tokens_a_forward_with_the_shapes_own_passes():
    p = point()
    plain = step_seconds("plain", 0, LLAMA_8B, p)
    for k in (1, 3):
        expected = (k + 1) * plain / (forward_seconds(LLAMA_8B, p, 1 + k) + drafting_seconds(EAGLE3_8B, p, k))
        assert ceiling(LLAMA_8B, EAGLE3_8B, k, p) == pytest.approx(expected)
    # at k = 3 one pass (P-EAGLE over 2k slots, DFlash over 1+k) costs less than three chained ones
    chain, parallel, block = (
        ceiling(LLAMA_8B, with_shape(EAGLE3_8B, s), 3, p) for s in ("chain", "parallel", "block")
    )
    assert chain < parallel <= block
    with pytest.raises(ValueError, match="drafting shape 'tree'"):
        with_shape(EAGLE3_8B, "tree")


def test_a_perfect_drafter_of_a_135m_target_barely_pays_on_an_h100():
    """Issue 42's figures: each drafter pass costs about a target step of a 135M model (the per-forward
    overhead dominates both), so even every draft accepted projects ~1.05x at k = 1, ~1.07x at k = 3."""
    ceilings = [ceiling(SMOL_135M, SMOL_DRAFTER, k, point(1, 600)) for k in (1, 2, 3)]
    assert ceilings[0] == pytest.approx(1.05, abs=0.02) and ceilings[2] == pytest.approx(1.07, abs=0.02)
    # suffix decoding measured at 1.19 tokens per forward on chat: no drafter can match it there
    suffix = projected_speedup(1.19, "suffix", 3, SMOL_135M, point(1, 600))
    assert max(ceilings) < suffix
    assert all(break_even(SMOL_135M, SMOL_DRAFTER, k, point(1, 600), suffix) is None for k in (1, 2, 3))


def test_break_even_is_the_acceptance_that_matches_the_speedup_to_beat():
    p = point()
    factor = projected_speedup(1.0, "eagle3", 1, LLAMA_8B, p, EAGLE3_8B)  # speedup per token a forward
    # k = 1: 1 + a tokens a forward, so a = to_beat / factor - 1
    a = break_even(LLAMA_8B, EAGLE3_8B, 1, p, 1.5)
    assert a == pytest.approx(1.5 / factor - 1, abs=TOLERANCE)
    for k, to_beat in ((2, 1.6), (3, 1.9), (3, 2.5)):
        a = break_even(LLAMA_8B, EAGLE3_8B, k, p, to_beat)
        reached = projected_speedup(chain_tokens(a, k), "eagle3", k, LLAMA_8B, p, EAGLE3_8B)
        assert reached >= to_beat  # reaches it; and a - TOLERANCE does not: the smallest such a
        assert (
            projected_speedup(chain_tokens(a - TOLERANCE, k), "eagle3", k, LLAMA_8B, p, EAGLE3_8B) < to_beat
        )
    # a harder target to beat needs more acceptance
    assert break_even(LLAMA_8B, EAGLE3_8B, 3, p, 1.9) < break_even(LLAMA_8B, EAGLE3_8B, 3, p, 2.5)
    # above the ceiling no acceptance will do; below what no acceptance gives, any will
    assert break_even(LLAMA_8B, EAGLE3_8B, 3, p, ceiling(LLAMA_8B, EAGLE3_8B, 3, p) + 0.01) is None
    assert break_even(LLAMA_8B, EAGLE3_8B, 3, p, 0.5) == 0.0
    assert chain_tokens(0.5, 3) == pytest.approx(1.875) and chain_tokens(1.0, 3) == 4


def test_measured_acceptance_per_position_is_given_the_one_before():
    assert position_acceptance([6, 4, 3], 10) == pytest.approx([0.6, 4 / 6, 0.75])
    assert position_acceptance([2, 0, 0], 8) == [0.25, 0.0, 0.0]
    assert position_acceptance([0, 0], 0) == [0.0, 0.0]


def test_drafter_room_takes_the_best_ceiling_and_the_easiest_break_even_over_k():
    points = [point(1), point(64)]
    room = drafter_room(LLAMA_8B, EAGLE3_8B, 3, points, [1.5, 1.2])
    assert [o["k"] for o in room["by_k"]] == [1, 2, 3] and room["shape"] == "chain"
    for i, (p, to_beat) in enumerate(zip(points, [1.5, 1.2], strict=True)):
        assert room["ceiling"][i] == max(ceiling(LLAMA_8B, EAGLE3_8B, k, p) for k in (1, 2, 3))
        reachable = [
            a for a in (break_even(LLAMA_8B, EAGLE3_8B, k, p, to_beat) for k in (1, 2, 3)) if a is not None
        ]
        assert room["break_even"][i] == min(reachable)
    assert drafter_room(SMOL_135M, SMOL_DRAFTER, 3, [point()], [1.2])["break_even"] == [None]


def rows(accepted: list[int], n: int = 8, drafts: int = 50) -> list[dict]:
    """Per-prompt counts at K = len(accepted): 50 forwards, `accepted` steps accepting position i."""
    return [
        {"tokens": 50 + sum(accepted), "forwards": 50, "drafts": drafts, "accepted_per_pos": accepted}
    ] * n


def test_the_policy_serves_the_best_method_and_k_per_load_and_plain_past_the_crossover():
    measured = {
        "eagle3": {"kind": "eagle3", "max_k": 3, "per_prompt": rows([30, 15, 7])},
        "suffix": {"kind": "suffix", "max_k": 3, "per_prompt": rows([8, 4, 2], drafts=12)},
        "ngram": {"kind": "ngram", "max_k": 3, "per_prompt": rows([4, 1, 0], drafts=10)},
    }
    policy = serving_policy(measured, LLAMA_8B, {"eagle3": EAGLE3_8B}, GRID)
    assert policy["grid"] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    # every figure is draft_length_options' own, each method at its best k per concurrency
    for key, m in measured.items():
        options = draft_length_options(m["per_prompt"], 3, m["kind"], LLAMA_8B, GRID, EAGLE3_8B)
        for i, at in enumerate(policy["methods"][key]):
            assert at["speedup"] == max(o["projected_speedup"][i] for o in options)
    for i, best in enumerate(policy["best"]):
        speeds = {key: at[i]["speedup"] for key, at in policy["methods"].items()}
        top = max(speeds, key=speeds.get)
        if speeds[top] > 1.0:
            assert (best["method"], best["k"], best["speedup"]) == (
                top,
                policy["methods"][top][i]["k"],
                speeds[top],
            )
        else:
            assert (best["method"], best["k"], best["speedup"]) == ("plain", 0, 1.0)
    # this drafter wins at every load, at a shorter draft as the batch grows (its passes cost more)
    assert policy["ranges"] == {"eagle3": [1, 256]}
    ks = [b["k"] for b in policy["best"]]
    assert ks[0] == 2 and ks[-1] == 1 and ks == sorted(ks, reverse=True)
    # the crossover: the last concurrency that still pays, plain decoding at every one past it
    assert policy["crossover"] == {"eagle3": None, "suffix": 64, "ngram": 16}
    for key, at in policy["methods"].items():
        c = policy["crossover"][key] or 256
        assert all(e["speedup"] > 1.0 for e in at if e["concurrency"] == c)
        assert all(e["speedup"] <= 1.0 for e in at if e["concurrency"] > c)
    import json

    assert json.loads(json.dumps(policy)) == policy  # JSON-able as summary.json writes it
    # without the drafter: suffix decoding at low load, plain decoding past its crossover
    free = serving_policy({k: m for k, m in measured.items() if k != "eagle3"}, LLAMA_8B, {}, GRID)
    assert free["ranges"] == {"suffix": [1, 64], "plain": [128, 256]}
    assert free["best"][-1] == {"concurrency": 256, "method": "plain", "k": 0, "speedup": 1.0}


def test_methods_at_k_takes_what_could_be_served():
    results = {"num_draft_tokens": 3, "methods": {
        "eagle3": {"kind": "eagle3", "per_prompt": rows([4, 2, 1])},
        "untrained": {"kind": "eagle3", "per_prompt": rows([0, 0, 0])},  # a control, never served
        "hybrid": {"kind": "hybrid", "per_prompt": rows([4, 2, 1])},  # offline projection only
        "ngram": {"per_prompt": rows([4, 2, 1])},  # before kinds
        "suffix": {"kind": "suffix", "per_prompt": [{"tokens": 1, "forwards": 1, "drafts": 0}]},  # no counts
    }}  # fmt: skip
    measured = methods_at_k(results, {"eagle3": EAGLE3_8B, "untrained": EAGLE3_8B})
    assert sorted(measured) == ["eagle3", "ngram"]
    assert measured["ngram"]["kind"] == "ngram" and measured["eagle3"]["max_k"] == 3
    assert sorted(methods_at_k(results, {})) == ["ngram"]  # a drafter without its shape is not costed


def _policy(ngram: list[tuple[int, int, float]], suffix_speeds: list[float]) -> dict:
    concurrency = [c for c, _, _ in ngram]
    suffix = [
        {"concurrency": c, "k": 3, "speedup": s} for c, s in zip(concurrency, suffix_speeds, strict=True)
    ]
    methods = {"ngram": [{"concurrency": c, "k": k, "speedup": s} for c, k, s in ngram], "suffix": suffix}
    from draftsmith.core.evaluation.policy import crossover

    return {
        "grid": concurrency,
        "methods": methods,
        "crossover": {k: crossover(v) for k, v in methods.items()},
    }


NGRAM_BY_LOAD = [(1, 3, 1.5), (2, 3, 1.4), (4, 2, 1.2), (8, 2, 1.05), (16, 1, 0.98), (32, 1, 0.9)]


def test_vllm_schedule_covers_every_batch_size_and_turns_off_past_the_crossover():
    policy = _policy(NGRAM_BY_LOAD, [1.3, 1.2, 1.1, 0.95, 0.9, 0.8])
    schedule = vllm_schedule(policy, "ngram")
    # a grid point's k holds from just past the one before it: the larger batch's choice
    assert schedule == [[1, 2, 3], [3, 8, 2], [9, 32, 0]]
    assert policy["crossover"]["ngram"] == 8
    # pays everywhere at one k: one range
    assert vllm_schedule(_policy([(1, 3, 1.5), (2, 3, 1.4)], [1.2, 1.1]), "ngram") == [[1, 2, 3]]
    # suffix decoding: vLLM serves a static k only, so the policy gives where to stop serving it
    assert vllm_schedule(policy, "suffix") is None and suffix_cutoff(policy) == 4
    assert suffix_cutoff(_policy([(1, 3, 1.5), (2, 3, 1.4)], [1.2, 1.1])) is None
    assert suffix_cutoff(_policy([(1, 3, 1.5)], [0.9])) == 0  # never pays
    assert vllm_schedule(policy, "eagle3") is None  # not measured


def test_vllms_own_validator_expands_the_schedule_as_the_policy_means():
    """vLLM's validate_and_normalize_dynamic_sd_schedule and dense lookup (vllm/v1/spec_decode/dynamic/
    utils.py, read from the installed vLLM without importing vLLM itself)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM not installed")
    path = Path(spec.origin).parent / "v1" / "spec_decode" / "dynamic" / "utils.py"
    if not path.is_file():
        pytest.skip(f"this vLLM has no {path.name} for per-batch-size draft lengths")
    module_spec = importlib.util.spec_from_file_location("vllm_dynamic_sd_utils", path)
    utils = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(utils)
    schedule = vllm_schedule(_policy(NGRAM_BY_LOAD, [1.0] * 6), "ngram")
    dense = utils.build_dynamic_sd_schedule_lookup(schedule, 32, 3)
    assert dense[1:3] == [3, 3] and dense[3:9] == [2] * 6 and dense[9:] == [0] * 24
