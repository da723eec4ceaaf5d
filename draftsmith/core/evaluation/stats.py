"""Intervals over prompts for the evaluation's ratios.

Every figure the evaluation compares is a ratio of sums over prompts: tokens per target forward
(tokens / forwards), tau - 1 (accepted drafts / drafts), acceptance at a draft position (accepted there /
drafts). Prompts, not tokens, are the independent unit: a greedy loop accepts everything for many steps
in a row, so the interval comes from a percentile bootstrap that resamples prompts. A comparison of two
methods on the same prompts is paired: one resample of prompt indices serves both, so what the prompts
share (a prompt easy for every method) cancels out of the interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Counts = tuple[Sequence[float], Sequence[float]]  # (numerator, denominator) per prompt


def ratio_of_sums(numerators: np.ndarray, denominators: np.ndarray) -> np.ndarray:
    """sum(numerators) / sum(denominators) over the last axis; 0 where the denominator sums to 0."""
    num, den = numerators.sum(axis=-1), denominators.sum(axis=-1)
    return np.divide(num, den, out=np.zeros_like(num, dtype=float), where=den > 0)


def resample_indices(n: int, resamples: int, seed: int) -> np.ndarray:
    """[resamples, n] prompt indices drawn with replacement (seeded: the same draw for every method)."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def _quantiles(values: np.ndarray, level: float) -> tuple[float, float]:
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def bootstrap_ratio(
    numerators: Sequence[float],
    denominators: Sequence[float],
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(ratio, low, high): the ratio of sums over all prompts and its percentile bootstrap interval.
    Fewer than 2 prompts: an unbounded interval."""
    num, den = np.asarray(numerators, dtype=float), np.asarray(denominators, dtype=float)
    if num.shape != den.shape:
        raise ValueError(f"{num.size} numerators but {den.size} denominators")
    ratio = float(ratio_of_sums(num, den))
    if len(num) < 2:
        return ratio, -math.inf, math.inf
    idx = resample_indices(len(num), resamples, seed)
    return (ratio, *_quantiles(ratio_of_sums(num[idx], den[idx]), level))


def paired_difference(
    a: Counts, b: Counts, level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """(difference, low, high) of ratio(a) - ratio(b), each (numerators, denominators) per prompt of the
    same prompts in the same order, with its paired bootstrap interval."""
    (a_num, a_den), (b_num, b_den) = [tuple(np.asarray(x, dtype=float) for x in m) for m in (a, b)]
    if not (len(a_num) == len(a_den) == len(b_num) == len(b_den)):
        raise ValueError(f"a paired comparison needs the same prompts: {len(a_num)} vs {len(b_num)} prompts")
    diff = float(ratio_of_sums(a_num, a_den) - ratio_of_sums(b_num, b_den))
    if len(a_num) < 2:
        return diff, -math.inf, math.inf
    idx = resample_indices(len(a_num), resamples, seed)
    diffs = ratio_of_sums(a_num[idx], a_den[idx]) - ratio_of_sums(b_num[idx], b_den[idx])  # [R]
    return (diff, *_quantiles(diffs, level))


def bootstrap_tau(
    accepted: Sequence[float],
    drafts: Sequence[float],
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(tau, low, high): vLLM's tau = 1 + accepted / drafts with its bootstrap interval over prompts."""
    rate, lo, hi = bootstrap_ratio(accepted, drafts, level, resamples, seed)
    return 1.0 + rate, 1.0 + lo, 1.0 + hi
