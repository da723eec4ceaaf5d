"""What every bench shares: alternating paired rounds, medians and paired ratios with an interval, the
machine a figure was measured on, base training settings, and the result as a table and a JSON file.

A bench imports it as `from bench import harness`; every bench runs from the repository root as
`python -m bench.<name>` (the peer benchmark: `python -m bench.peer`).

    rounds = alternating_rounds({"plain": run_plain, "writing": run_writing}, 12)
    ratios = paired_ratios(rounds["plain"], rounds["writing"])
    summary = ratio_summary(ratios)            # {"median", "low", "high", "rounds"}

Paired rounds: within a round the variants run back to back, and the order flips every round, so a
machine that swings between fast and slow spells slows both sides of a pair alike and no variant always
follows another; the ratio of each round's pair cancels what medians of rates taken apart do not.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from draftsmith.core.io.atomic import write_json

T = TypeVar("T")
R = TypeVar("R")

RESULTS = Path("results/bench")


# --------------------------------------------------------------------------------------- paired rounds


def round_order(names: Sequence[T], round_index: int) -> list[T]:
    """The variants in the order they run in round `round_index`: as given on even rounds, reversed on
    odd ones (no variant always follows another)."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def alternating_rounds(variants: Mapping[str, Callable[[], R]], rounds: int) -> dict[str, list[R]]:
    """Run every variant once per round, back to back, in `round_order` -> name -> its result per round."""
    results: dict[str, list[R]] = {name: [] for name in variants}
    for r in range(rounds):
        for name in round_order(list(variants), r):
            results[name].append(variants[name]())
    return results


def median(values: Iterable[float]) -> float:
    return statistics.median(values)


def paired_ratios(
    numerators: Sequence[T], denominators: Sequence[T], value: Callable[[T], float] = float
) -> list[float]:
    """value(numerator) / value(denominator) of each round's pair (the same round of both sides)."""
    return [value(a) / value(b) for a, b in zip(numerators, denominators, strict=True)]


def bootstrap_interval(
    values: Sequence[float], level: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, low, high): the mean of per-round values with a percentile bootstrap interval over rounds."""
    x = np.asarray(values, dtype=np.float64)
    means = x[np.random.default_rng(seed).integers(0, len(x), (resamples, len(x)))].mean(axis=1)
    tail = (1 - level) / 2
    return float(x.mean()), float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def ratio_summary(ratios: Sequence[float], interval: str = "minmax") -> dict[str, Any]:
    """The median of per-round ratios with an interval: "minmax" (the rounds' range, honest for a few
    rounds) or "bootstrap" (95% percentile bootstrap of the mean over rounds)."""
    if interval == "minmax":
        low, high = min(ratios), max(ratios)
    elif interval == "bootstrap":
        _, low, high = bootstrap_interval(ratios)
    else:
        raise ValueError(f"interval: minmax or bootstrap, not {interval!r}")
    return {"median": median(ratios), "low": low, "high": high, "rounds": list(ratios)}


def median_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    """The median wall time of `repeats` calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


# --------------------------------------------------------------------------------------------- machine


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (other work on the machine slows every clock)."""
    return [round(x, 2) for x in os.getloadavg()]


def machine(load_before: list[float]) -> dict[str, Any]:
    """What a figure was measured on: CPU, torch threads, cores, torch version, and the load averages
    before the run (taken by the bench at its start) and now."""
    import torch

    return {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "nproc": os.cpu_count(),
        "torch": torch.__version__,
        "load_average": {"before": load_before, "after": load_average()},
    }


# -------------------------------------------------------------------------------------------- settings


def base_settings(config_path: str | Path | None, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """draftsmith's train settings as the workflow merges them: schema < the config's `train` < overrides."""
    from draftsmith.core.config.config import section_from_file

    return section_from_file("train", Path(config_path) if config_path else None, dict(overrides))


# --------------------------------------------------------------------------------------------- results


def format_table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[Any]]) -> str:
    """A fixed-width table, columns joined by two spaces: each column is (header, the format spec of its
    cells, "[<>^]width[,][.precision][type]", e.g. "<12" or ">8.1f"); a header takes its cells'
    alignment (numbers: right) and width. A cell that is a string is aligned as its header."""

    def aligned(text: str, spec: str) -> str:
        match = re.match(r"([<>^]?)(\d*)", spec)
        align, width = match.group(1) or (">" if spec.rstrip("s")[-1:].isalpha() else "<"), match.group(2)
        return f"{text:{align}{width}}"

    lines = ["  ".join(aligned(h, spec) for h, spec in columns).rstrip()]
    for cells in rows:
        parts = [
            aligned(c, spec) if isinstance(c, str) else f"{c:{spec}}"
            for (_, spec), c in zip(columns, cells, strict=True)
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def result_path(name: str) -> Path:
    """The default JSON of bench `name`: results/bench/<name>.json."""
    return RESULTS / f"{name}.json"


def write_result(result: Mapping[str, Any], path: str | Path, echo: Callable[[str], None] = print) -> Path:
    """Write the result atomically as JSON and say where."""
    write_json(path, dict(result))
    echo(f"wrote {path}")
    return Path(path)
