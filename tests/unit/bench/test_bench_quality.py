"""bench/quality.py: the learning-curve bench splits one vLLM batch back into its held-out sets and
compares against the run's own n-gram figures."""

import importlib

import pytest


@pytest.fixture(scope="module")
def quality():
    return importlib.import_module("bench.quality")


def _counts(accepted: int, drafts: int, per_pos: list[int], tokens: int = 10) -> dict:
    return {"tokens": tokens, "forwards": tokens - accepted, "accepted": accepted, "drafts": drafts,
            "accepted_per_pos": per_pos}  # fmt: skip


def test_figures_by_set_splits_the_batch_by_span(quality):
    counts = [_counts(2, 4, [2, 0, 0]), _counts(0, 4, [0, 0, 0]), _counts(6, 2, [2, 2, 2])]
    out = quality.figures_by_set({"a": (0, 2), "b": (2, 3)}, counts, 3, 0.95)
    assert out["a"]["tokens_per_forward"] == pytest.approx(20 / 18)  # every forward counted
    assert out["a"]["tau"] == pytest.approx(1 + 2 / 8)
    assert out["a"]["acceptance_per_position"] == pytest.approx([0.25, 0.0, 0.0])
    lo, hi = out["a"]["tau_interval"]
    assert 1.0 <= lo <= out["a"]["tau"] <= hi <= 1.5  # resampling 2 prompts: 1 + {0, 2, 4} / 8
    assert out["b"]["tau"] == pytest.approx(4.0)
    assert out["b"]["tau_interval"][0] == float("-inf")  # one prompt: no interval


def test_heldout_reference_reads_vllm_prompt_count_and_ngram(quality):
    summary = {
        "heldout_sets": {"heldout": {"prompts": "p.jsonl", "num_prompts": 8}, "own": {"prompts": "o.jsonl", "num_prompts": 8}},
        "rows": [
            {"heldout": "heldout", "measured_by": "offline", "key": "ngram", "prompts": 8, "tokens_per_forward": 9.0,
             "tokens_per_forward_interval": None},
            {"heldout": "heldout", "measured_by": "vLLM", "method": "plain decoding", "prompts": 16},
            {"heldout": "heldout", "measured_by": "vLLM", "key": "ngram", "prompts": 16, "tokens_per_forward": 1.2,
             "tokens_per_forward_interval": [1.1, 1.3]},
            {"heldout": "own", "measured_by": "vLLM", "key": "trained", "prompts": 42, "tokens_per_forward": 1.2,
             "tokens_per_forward_interval": [1.1, 1.3]},
        ],
    }  # fmt: skip
    sets = quality.heldout_reference(summary)
    assert sets["heldout"] == {
        "prompts": "p.jsonl",
        "num_prompts": 16,
        "ngram": 1.2,
        "ngram_interval": [1.1, 1.3],
    }
    assert sets["own"]["num_prompts"] == 42 and sets["own"]["ngram"] is None


def test_plot_draws_tau_per_set_and_accuracy_per_step(quality, tmp_path):
    sets = {"heldout": {"num_prompts": 16, "ngram": 1.1, "ngram_interval": [1.05, 1.15]}}
    rows = [
        {"epochs": 1, "trained_tokens": n, "val_acc": [0.2, None, 0.1],
         "vllm": {"heldout": {"tokens_per_forward": 1.2, "tokens_per_forward_interval": [1.1, 1.3]}}}
        for n in (1000, 2000)
    ] + [{"epochs": 1, "trained_tokens": 500, "val_acc": [0.1, 0.1, 0.1], "vllm": None}]  # fmt: skip
    quality.plot(rows, sets, tmp_path / "q.png")
    assert (tmp_path / "q.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_row_takes_the_runs_trained_drafter_from_vllm_rows(quality):
    train_summary = {"epochs": 3, "train_samples": 10, "val_samples": 2, "trained_tokens": 900, "steps": 12,
                     "val_acc": [0.3, 0.2, 0.1], "train_acc": [0.4, 0.3, 0.2], "wall_s": 61.23}  # fmt: skip
    eval_summary = {
        "rows": [
            {"heldout": "heldout", "measured_by": "offline", "key": "eagle3", "tau": 9.0},
            {"heldout": "heldout", "measured_by": "vLLM", "key": "eagle3", "tokens_per_forward": 1.45,
             "tokens_per_forward_interval": [1.35, 1.55], "tau": 1.5, "tau_interval": [1.4, 1.6],
             "acceptance_per_position": [0.3, 0.1, 0.1]},
            {"heldout": "heldout", "measured_by": "vLLM", "key": "ngram", "tau": 2.0},
        ]
    }  # fmt: skip
    row = quality.run_row(train_summary, eval_summary)
    assert (row["fraction"], row["epochs"], row["trained_tokens"]) == (1.0, 3, 900)
    assert row["vllm"] == {
        "heldout": {"tokens_per_forward": 1.45, "tokens_per_forward_interval": [1.35, 1.55], "tau": 1.5,
                  "tau_interval": [1.4, 1.6], "acceptance_per_position": [0.3, 0.1, 0.1]}
    }  # fmt: skip
    assert quality.run_row(train_summary, {"rows": []})["vllm"] is None
