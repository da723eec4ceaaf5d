"""The evaluation's time from the plan (issue 43 item 3): engine loads per job x (load + compile + decode),
against each shipped GPU config's resources.evaluate.runtime; and vLLM's compile cache kept between the
job's engines, in a stable folder beside the kept runs."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers.workflow import DEFAULT_TARGET, REPO

from draftsmith.core.config.config import text_config_json, with_defaults
from draftsmith.core.planning.memory import evaluation_engines, evaluation_minutes, runtime_line, target_size

TARGETS = REPO / "tests" / "data" / "target-configs"
GPU_CONFIGS = {
    "kimi-k2.5-8gpu": "kimi-k2.5",
    "llama-3.1-8b": "llama-3.1-8b",
    "qwen3-235b-a22b": "qwen3-235b-a22b",
}


def shipped(name: str) -> dict:
    return with_defaults(yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text()))


def test_the_engine_count_follows_the_methods_and_the_remeasures():
    config = with_defaults({})
    config["evaluate"].update(ngram=True, suffix=True, num_draft_tokens=3, remeasure_chosen_k=False)
    assert evaluation_engines(config) == {
        "preflight": 3,
        "evaluate": 1,
    }  # plain + n-gram + suffix; the drafter
    config["evaluate"].update(remeasure_chosen_k=True, heldout_sets={"a": "heldout"})
    # one shorter k per method and set at most: n-gram, suffix (pre-flight); drafter, n-gram, suffix
    assert evaluation_engines(config) == {"preflight": 5, "evaluate": 4}
    config["evaluate"].update(suffix=False, ngram=False)
    assert evaluation_engines(config) == {"preflight": 1, "evaluate": 2}


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_each_shipped_gpu_configs_evaluation_runtime_covers_its_plan(name):
    config = shipped(name)
    size = target_size(text_config_json(TARGETS / GPU_CONFIGS[name]), None, config["target"]["dtype"])
    need = max(evaluation_minutes(config, size).values())
    assert config["resources"]["evaluate"]["runtime"] >= need, (name, need)
    assert "covers it" in runtime_line(config, size)


def test_a_runtime_short_of_the_plan_is_said():
    config = shipped("kimi-k2.5-8gpu")
    config["resources"]["evaluate"]["runtime"] = 60
    size = target_size(text_config_json(TARGETS / "kimi-k2.5"), None, "bfloat16")
    assert "TOO SHORT" in runtime_line(config, size)


@pytest.mark.usefixtures("target_model")
def test_the_engines_share_one_compile_cache_beside_the_kept_runs(monkeypatch, tmp_path):
    """Every engine of the pre-flight and of the evaluation gets results/eval/.vllm-cache (VLLM_CACHE_ROOT
    under it), not a fresh temporary folder per job."""
    import draftsmith.stages.evaluate.vllm_runner as runner
    from draftsmith.stages.evaluate import EvaluateSettings
    from draftsmith.stages.evaluate.stage import evaluate_vllm

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Hi."}) + "\n")
    caches = []

    def fake(**request):
        caches.append(request["cache_dir"])
        raise RuntimeError("recorded")

    monkeypatch.setattr(runner, "run_vllm_subprocess", fake)
    settings = EvaluateSettings(max_new_tokens=4, num_draft_tokens=2)
    runs = tmp_path / "results" / "eval" / ".runs"
    for _ in range(2):  # two jobs
        with pytest.raises(RuntimeError, match="recorded"):
            evaluate_vllm(
                DEFAULT_TARGET, {}, {"s": prompts}, {"s": tmp_path / "v.json"}, settings, None, runs
            )
    assert caches == [str(tmp_path / "results" / "eval" / ".vllm-cache")] * 2
    assert runner.vllm_env(caches[0], {})["VLLM_CACHE_ROOT"].startswith(caches[0])


def test_a_cpu_engines_kv_cache_is_sized_to_what_it_holds(tmp_path):
    """Each GiB of CPU KV cache past the first costs ~13 s of engine start here: an engine gets what its
    prompts, answers and drafts need at once (whole GiB, vLLM's unit), at least 1, at most the old fixed 2."""
    import draftsmith.stages.evaluate.vllm_runner as runner
    from draftsmith.backends.common import cpu_kv_cache_gib, vllm_child_env

    assert cpu_kv_cache_gib(46_080, 1_000) == "1"
    assert cpu_kv_cache_gib(46_080, 30_000) == "2"  # 1.29 GiB
    assert cpu_kv_cache_gib(46_080, 10**7) == "2"  # the cap
    # SmolLM2-135M's shape: 30 layers x 3 KV heads x 64, float32 = 46,080 bytes a token (a quarter more kept)
    shape = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152, "num_attention_heads": 9}
    (tmp_path / "config.json").write_text(json.dumps(shape | {"num_key_value_heads": 3}))
    few, many = [[1] * 100] * 2, [[1] * 100] * 140  # a test's 2 prompts; the demo's 140
    assert runner.engine_kv_cache_gib(str(tmp_path), "float32", few, 64, 3) == "1"
    assert runner.engine_kv_cache_gib(str(tmp_path), "float32", many, 64, 3) == "2"
    assert runner.engine_kv_cache_gib(str(tmp_path / "missing"), "float32", few, 64, 3) == "2"
    assert vllm_child_env({}, cpu=True, kv_cache_gib="1")["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # the user's own setting wins
    assert (
        vllm_child_env({"VLLM_CPU_KVCACHE_SPACE": "5"}, cpu=True, kv_cache_gib="1")["VLLM_CPU_KVCACHE_SPACE"]
        == "5"
    )
