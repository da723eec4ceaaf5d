"""bench/cost.py: the calibration's glue (which step times the overhead split is fitted from, at the
batch the engine really ran) and the crossover comparison. The fitting itself: tests/unit/test_cost.py."""

import importlib.util
from pathlib import Path

import pytest

from draftsmith.core.cost import Device, ModelCost, step_seconds

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cost.py"
SMOL = ModelCost(1.35e8, 0.0, 1.0, 30 * 2 * 3 * 64 * 4, 30)
DRAFTER = ModelCost(2.6e7, 0.0, 1.0, 2 * 3 * 64 * 4, 1)


@pytest.fixture(scope="module")
def cost():
    spec = importlib.util.spec_from_file_location("bench_cost", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_split_is_fitted_at_the_batch_the_engine_ran(cost):
    truth = Device("cpu", 30.0, 0.35, 5.0, None, 1.0, 1.0, layer_overhead_ms=0.9, token_overhead_us=200.0)
    num_prompts, k, context = 8, 3, 300.0
    measured = {}
    for b in (1, 4, 16):  # 16 requests allowed, 8 prompts: the engine runs 8 at once
        point = cost.point_at(truth, min(b, num_prompts), context)
        measured[b] = {
            "plain": {"step_seconds": step_seconds("plain", 0, SMOL, point), "draft_share": 0.0},
            "eagle3": {"step_seconds": step_seconds("eagle3", k, SMOL, point, DRAFTER), "draft_share": 1.0},
        }
    cpu = {"bandwidth_gb_s": 30.0, "tflops": 0.35}
    device = cost.calibrate(cpu, measured, SMOL, DRAFTER, k, context, num_prompts)
    assert (device.overhead_ms, device.layer_overhead_ms, device.token_overhead_us) == pytest.approx(
        (5.0, 0.9, 200.0)
    )
    assert device.name.startswith("this-cpu") and device.bandwidth_efficiency == 1.0


def _row(b: int, method: str, predicted: float, measured: float) -> dict:
    return {"concurrency": b, "method": method, "predicted_speedup": predicted, "measured_speedup": measured}


def test_crossovers_predicted_against_measured_within_one_step(cost):
    rows = [
        _row(1, "eagle3", 1.2, 1.1), _row(4, "eagle3", 1.05, 0.95), _row(16, "eagle3", 0.8, 0.7),
        _row(1, "ngram", 1.1, 1.1), _row(4, "ngram", 1.1, 1.05), _row(16, "ngram", 1.02, 0.9),
        _row(1, "suffix", 1.2, 0.9), _row(4, "suffix", 1.1, 0.9), _row(16, "suffix", 1.1, 0.9),
    ]  # fmt: skip
    c = cost.crossovers(rows)
    assert c["eagle3"] == {"predicted": 4, "measured": 1, "within_one_step": True}
    # pays past 16 predicted, measured to stop after 4: two steps of the grid apart (4 -> 16 -> past it)
    assert c["ngram"] == {"predicted": None, "measured": 4, "within_one_step": False}
    assert c["suffix"] == {"predicted": None, "measured": 0, "within_one_step": False}  # never vs always
