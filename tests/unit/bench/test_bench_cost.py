"""bench/cost.py: the calibration's glue (every run's wall time priced as the model prices it, at the batch the
engine really ran), the re-analysis of saved runs (--from-json) and the crossover comparison. The fitting
itself: tests/unit/evaluation/test_cost.py."""

import importlib.util
import json
from dataclasses import asdict
from pathlib import Path

import pytest
from click.testing import CliRunner

from draftsmith.core.evaluation.cost import Device, ModelCost, run_seconds
from draftsmith.core.io.atomic import write_json

BENCH = Path(__file__).resolve().parents[3] / "bench" / "cost.py"
SMOL = ModelCost(1.35e8, 0.0, 1.0, 30 * 2 * 3 * 64 * 4, 30)
DRAFTER = ModelCost(2.6e7, 0.0, 1.0, 2 * 3 * 64 * 4, 1)


@pytest.fixture(scope="module")
def cost():
    spec = importlib.util.spec_from_file_location("bench_cost", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TRUTH = Device("cpu", 30.0, 0.35, 5.0, None, 1.0, 1.0, layer_overhead_ms=0.9, token_overhead_us=200.0)
LOOKUPS = {"ngram": 2500.0, "suffix": 300.0}
# per method: draft length, tokens per target forward, share of steps that drafted
RUNS = {"plain": (0, 1.0, 0.0), "eagle3": (3, 1.3, 1.0), "ngram": (3, 1.1, 0.1), "suffix": (3, 1.15, 0.4)}


def measured_runs(cost, num_prompts: int = 8, context: float = 300.0, prompt_tokens: float = 8 * 284) -> dict:
    """Runs as vLLM would time them were the model exact: 8 prompts of 32 new tokens at B = 1, 4, 16 (the
    engine runs at most 8 at once), each run's seconds from cost.run_seconds at the true device."""
    measured = {}
    for b in (1, 4, 16):
        running = min(b, num_prompts)
        point = cost.point_at(TRUTH, running, context, LOOKUPS)
        measured[b] = {}
        for method, (k, per_forward, share) in RUNS.items():
            forwards = [32 / per_forward] * num_prompts
            drafter = DRAFTER if method == "eagle3" else None
            seconds = run_seconds(
                method, k, SMOL, point, sum(forwards) / running, prompt_tokens, drafter, share or 1.0
            )
            measured[b][method] = {"tokens": 32 * num_prompts, "seconds": seconds,
                                   "tokens_per_s": 32 * num_prompts / seconds,
                                   "per_prompt": [[32] * num_prompts, forwards], "tokens_per_forward": per_forward,
                                   "draft_share": share, "outputs_equal_plain": num_prompts}  # fmt: skip
    return measured


def test_the_split_and_the_lookups_are_fitted_from_whole_runs_at_the_batch_the_engine_ran(cost):
    cpu = {"bandwidth_gb_s": 30.0, "tflops": 0.35, "name": "a CPU"}
    device, lookups = cost.calibrate(cpu, measured_runs(cost), SMOL, DRAFTER, 3, 300.0, 8, 8 * 284)
    assert (device.overhead_ms, device.layer_overhead_ms, device.token_overhead_us) == pytest.approx(
        (5.0, 0.9, 200.0)
    )
    assert lookups == pytest.approx(LOOKUPS)
    assert device.name == "this-cpu (a CPU)" and device.bandwidth_efficiency == 1.0


def test_from_json_reanalyses_saved_runs_without_an_engine(cost, tmp_path):
    saved = {"cpu": {"bandwidth_gb_s": 30.0, "tflops": 0.35}, "k": 3, "num_prompts": 8, "max_new_tokens": 32,
             "context_tokens": 300.0, "vllm_seconds": 1.0, "machine": {"cpu": "a CPU"},
             "measured": {str(b): runs for b, runs in measured_runs(cost).items()},
             "models": {"target": asdict(SMOL), "drafter": asdict(DRAFTER)}}  # fmt: skip
    write_json(tmp_path / "saved.json", saved)  # no prompt_tokens: from the mean context (284 + 32 / 2)
    out, profile = tmp_path / "cost.json", tmp_path / "this-cpu.json"
    result = CliRunner().invoke(cost.main, ["--from-json", str(tmp_path / "saved.json"), "--json", str(out),
                                            "--profile", str(profile)])  # fmt: skip
    assert result.exit_code == 0, result.output
    analysed = json.loads(out.read_text())
    assert len(analysed["rows"]) == 9 and analysed["fit"] == {"terms": 5, "nonzero": 5, "observations": 12}
    for row in analysed["rows"]:  # the model made the runs: it predicts them, held out as well
        assert row["error"] == pytest.approx(0, abs=1e-6) and row["held_out_error"] == pytest.approx(
            0, abs=1e-6
        )
        assert row["outputs_equal_plain"] == 8
    written = json.loads(profile.read_text())
    assert written["method_lookup_us"] == pytest.approx(LOOKUPS)
    assert written["device"]["name"] == "this-cpu (a CPU)" and written["measured"]["concurrency"] == [
        1,
        4,
        16,
    ]
    assert "OFF BY MORE THAN ONE STEP" not in result.output


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
