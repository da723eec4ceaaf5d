"""bench/harness.py: the pure parts every bench's figures rest on (pairing order, medians, paired ratios
and their intervals, the table)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def harness():
    return importlib.import_module("bench.harness")


def test_rounds_alternate_the_order_and_pair_by_round(harness) -> None:
    calls: list[str] = []

    def variant(name: str, values: list[float]):
        it = iter(values)
        return lambda: calls.append(name) or next(it)

    runs = harness.alternating_rounds(
        {"a": variant("a", [1, 2, 3, 4]), "b": variant("b", [10, 20, 30, 40])}, 4
    )
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]  # no variant always runs first
    assert runs == {"a": [1, 2, 3, 4], "b": [10, 20, 30, 40]}  # each round's results, in round order
    assert harness.round_order(["x", "y", "z"], 1) == ["z", "y", "x"]


def test_median_and_paired_ratios(harness) -> None:
    assert harness.median([3.0, 1.0, 2.0]) == 2.0
    assert harness.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    base = [{"s": 2.0}, {"s": 3.0}, {"s": 9.0}]
    other = [{"s": 1.0}, {"s": 2.0}, {"s": 3.0}]
    assert harness.paired_ratios(base, other, lambda r: r["s"]) == [2.0, 1.5, 3.0]
    with pytest.raises(ValueError):  # a ratio needs the same rounds on both sides
        harness.paired_ratios([1.0, 2.0], [1.0])


def test_ratio_intervals_on_a_hand_example(harness) -> None:
    ratios = [1.1, 1.3, 0.9, 1.2, 1.0]
    assert harness.ratio_summary(ratios) == {"median": 1.1, "low": 0.9, "high": 1.3, "rounds": ratios}
    boot = harness.ratio_summary(ratios, "bootstrap")
    assert boot["median"] == 1.1
    assert 0.9 <= boot["low"] < 1.1 < boot["high"] <= 1.3  # the mean's interval lies within the rounds
    mean, low, high = harness.bootstrap_interval([2.0, 2.0, 2.0])
    assert (mean, low, high) == (2.0, 2.0, 2.0)  # no spread, no interval
    with pytest.raises(ValueError):
        harness.ratio_summary(ratios, "quartiles")


def test_table_aligns_headers_with_their_cells(harness) -> None:
    table = harness.format_table([("name", "<6"), ("tok/s", ">7.1f"), ("n", ">3d")], [["a", 12.34, 5]])
    assert table.splitlines() == ["name      tok/s    n", "a          12.3    5"]


def test_result_written_as_json_where_named(harness, tmp_path: Path) -> None:
    lines: list[str] = []
    path = harness.write_result({"x": 1}, tmp_path / "r.json", lines.append)
    assert json.loads(path.read_text()) == {"x": 1}
    assert lines == [f"wrote {path}"]
    assert harness.result_path("cost") == Path("results/bench/cost.json")
    m = harness.machine([0.5, 0.4, 0.3])
    assert m["load_average"]["before"] == [0.5, 0.4, 0.3] and len(m["load_average"]["after"]) == 3
    assert m["threads"] >= 1 and m["cpu"]
