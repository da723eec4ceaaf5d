"""Intervals over prompts: they cover, narrow with more prompts, are reproducible, and a paired
comparison cancels what the prompts share."""

from __future__ import annotations

import math

import numpy as np
import pytest

from draftsmith.core.evaluation.stats import bootstrap_ratio, bootstrap_tau, paired_difference, ratio_of_sums


def test_ratio_of_sums_is_zero_without_a_denominator():
    assert ratio_of_sums(np.array([3.0, 1.0]), np.array([2.0, 2.0])) == pytest.approx(1.0)
    assert bootstrap_ratio([0, 0], [0, 0]) == (0.0, 0.0, 0.0)


def test_bootstrap_interval_covers_and_narrows_with_prompts():
    rng = np.random.default_rng(1)
    drafts = rng.integers(20, 60, size=200)
    accepted = rng.binomial(drafts * 3, 0.15)  # tau ~1.45
    tau, lo, hi = bootstrap_tau(accepted[:10].tolist(), drafts[:10].tolist())
    assert tau == pytest.approx(1 + accepted[:10].sum() / drafts[:10].sum())
    assert lo < tau < hi
    _, lo2, hi2 = bootstrap_tau(accepted.tolist(), drafts.tolist())
    assert hi2 - lo2 < (hi - lo) / 2.5  # 20x the prompts: about sqrt(20) = 4.5x narrower
    # reproducible (seeded), and unbounded from a single prompt
    assert bootstrap_tau(accepted[:10].tolist(), drafts[:10].tolist()) == (tau, lo, hi)
    assert bootstrap_tau([5], [10])[1:] == (-math.inf, math.inf)
    with pytest.raises(ValueError, match="numerators"):
        bootstrap_ratio([1, 2], [3])


def test_paired_difference_cancels_what_prompts_share():
    # prompts differ a lot in difficulty; method a is accepted a little more than b on every prompt
    drafts = [40] * 12
    b_acc = [2, 80, 5, 60, 10, 90, 3, 70, 8, 100, 4, 50]
    a_acc = [x + 4 for x in b_acc]
    diff, lo, hi = paired_difference((a_acc, drafts), (b_acc, drafts))
    assert diff == pytest.approx(48 / 480)
    assert 0 < lo <= diff <= hi  # paired: the shared difficulty cancels
    # unpaired intervals of the two ratios overlap widely: comparing them would call it a tie
    _, a_lo, _ = bootstrap_ratio(a_acc, drafts)
    _, _, b_hi = bootstrap_ratio(b_acc, drafts)
    assert a_lo < b_hi
    with pytest.raises(ValueError, match="same prompts"):
        paired_difference((a_acc, drafts), (b_acc[:5], drafts[:5]))
