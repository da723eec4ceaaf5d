"""train.hidden_states stream and hybrid through the real workflow: the tiny configuration up to the trained
drafter, with no shard in results/ and no extract job (the evaluation and exports are the files run's,
tests/e2e/test_workflow.py: what they read, the drafter, is made the same way). Transformers on the CPU
for generation and for the train job's engine: no vLLM engine start. One folder: hybrid after stream
reruns only the stream manifest and train."""

import json

import pytest
from helpers.workflow import snakemake

from draftsmith.core.export.formats import check_export

pytestmark = pytest.mark.slow
DRAFTER = "results/drafter/model.safetensors"


def planned(workdir, config) -> str:
    return snakemake(workdir, "-n", DRAFTER, "--config", *config).stdout


def test_the_tiny_run_trains_on_streamed_and_cached_states(tmp_path, target_model):
    (tmp_path / "target").symlink_to(target_model)
    results = tmp_path / "results"
    for mode in ("stream", "hybrid"):
        config = (
            "target={model: target, gguf_wheel: null}",
            # 5 training prompts, short answers: generation is most of this test's time
            "prompts={max_prompts: 8}",
            "generate={max_new_tokens: 24}",
            f"train={{hidden_states: {mode}, epochs: 2, max_steps: null}}",
        )
        plan = planned(tmp_path, config)
        assert "stream_manifest" in plan and "rule extract" not in plan and "rule manifest" not in plan
        if mode == "hybrid":  # the traces and tokens of the stream run are reused
            assert "rule generate" not in plan and "rule tokenize" not in plan
        snakemake(tmp_path, DRAFTER, "--config", *config)
        assert not (results / "hidden").exists() and not (results / "data_config.json").exists()
        manifest = json.loads((results / "stream_config.json").read_text())
        assert manifest["hidden_states"] == mode and manifest["shards"] == []
        summary = json.loads((results / "drafter" / "train_summary.json").read_text())
        hidden = summary["hidden_states"]
        assert hidden["hidden_states"] == mode and hidden["teacher_agreement"] > 0.9, hidden
        assert summary["steps"] == sum(summary["steps_per_epoch"]) and summary["epochs_completed"] == 2
        assert check_export(results / "drafter", target_num_layers=30, target_vocab_size=49152) == []
        assert "Nothing to be done" in planned(tmp_path, config)  # finished: nothing planned again
        if mode == "hybrid":  # epoch 1 read the cache: one prefill (validation's units aside)
            assert hidden["cache_bytes"] > 0 and hidden["prefilled_tokens"] <= manifest["num_tokens"], hidden
    # hybrid's cache is removed once every epoch is trained
    assert not list((results / "train" / "checkpoints").glob("run-*/hidden/shard-*.safetensors"))
