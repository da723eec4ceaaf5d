"""The rules' arguments (draftsmith.core.workflow.rule_args), called as rules/common.smk calls them, on
configs with every default filled in as Snakemake's validate() leaves them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from draftsmith.core.config.config import with_defaults
from draftsmith.core.config.stage_settings import ManifestSettings, PromptSettings, TrainSettings
from draftsmith.core.workflow import rule_args

HELDOUT = "results/prompts/heldout.jsonl"  # rule prompts' held-out output, as common.smk passes it


def config(**sections: dict) -> dict:
    """The schema's defaults with `sections` merged over them."""
    return with_defaults(sections)


def test_settings_json_is_stable_json_of_the_keys_a_command_reads() -> None:
    c = config(train={"lr": 0.01})
    values = json.loads(rule_args.settings_json(c, TrainSettings))
    assert values["lr"] == 0.01 and rule_args.settings_json(c, TrainSettings).startswith("{")
    assert json.loads(
        rule_args.settings_json(c, ManifestSettings, only=["min_teacher_agreement"])
    ).keys() == {"min_teacher_agreement"}
    assert "lr" not in json.loads(rule_args.settings_json(c, TrainSettings, drop=["lr"]))
    assert json.loads(rule_args.ops_json(c, TrainSettings)) == json.loads(
        rule_args.ops_json(config(), TrainSettings)
    )


def test_prompt_settings_drop_what_does_not_apply() -> None:
    builtin = json.loads(rule_args.prompt_settings(config(prompts={"source": "builtin"})))
    assert not {"split", "subset", "revision", "columns", "code_prompts"} & builtin.keys()
    dataset = json.loads(
        rule_args.prompt_settings(
            config(prompts={"source": "dataset", "path": "o/n", "columns": {"prompt": "q"}})
        )
    )
    assert {"split", "subset", "revision", "columns"} <= dataset.keys()
    assert set(dataset) <= set(PromptSettings.schema_paths)


def test_code_wheels_only_when_code_prompts_are_asked_for() -> None:
    assert rule_args.code_wheel_name("attrs==25.1.0") == "attrs_25.1.0"
    off = config(prompts={"code_prompts": 0, "code_wheels": ["attrs==25.1.0"]})
    assert rule_args.code_wheels(off) == {} and rule_args.code_wheel_options(off) == []
    on = config(prompts={"code_prompts": 8, "code_wheels": ["attrs==25.1.0", "six>=1"]})
    assert rule_args.code_wheels(on) == {"attrs_25.1.0": "attrs==25.1.0", "six_1": "six>=1"}
    assert rule_args.code_wheel_options(on) == [
        "--code-wheel", "resources/data/code/attrs_25.1.0.whl", "--code-wheel", "resources/data/code/six_1.whl"
    ]  # fmt: skip


def test_prompt_inputs_follow_the_source(tmp_path: Path) -> None:
    assert rule_args.prompt_wheel_option(config(prompts={"source": "sharegpt"})) == [
        "--wheel",
        "resources/data/sharegpt.whl",
    ]
    assert rule_args.prompt_wheel_option(config(prompts={"source": "builtin"})) == []
    jsonl = config(prompts={"source": "jsonl", "path": "p.jsonl", "heldout_path": "h.jsonl"})
    assert rule_args.prompt_source_inputs(jsonl) == ["p.jsonl", "h.jsonl"]
    local = tmp_path / "chats.parquet"
    local.write_bytes(b"")
    assert rule_args.prompt_source_inputs(config(prompts={"source": "dataset", "path": str(local)})) == [
        str(local)
    ]
    assert rule_args.prompt_source_inputs(config(prompts={"source": "dataset", "path": "org/chats"})) == []


def test_shards_and_train_ranks() -> None:
    assert rule_args.hidden_shards(config(extract={"num_shards": 2})) == [
        "results/hidden/shard-0.safetensors",
        "results/hidden/shard-1.safetensors",
    ]
    gpus = config(resources={"train": {"gpus": 5, "engine_gpus": 4}})
    assert (
        rule_args.train_processes(gpus, stream=True) == 1
        and rule_args.train_processes(gpus, stream=False) == 5
    )
    assert rule_args.train_processes(config(), stream=False) == 1  # a CPU: one rank
    assert rule_args.gpu_memory_gib(config()) == "0"
    assert rule_args.gpu_memory_gib(config(resources={"gpu_memory_gib": 80})) == "80.0"


def test_heldout_sets_name_their_prompt_files_and_counts() -> None:
    sets = {"heldout": "heldout", "handwritten": "handwritten", "humaneval": "humaneval", "mine": "my.jsonl"}
    c = config(evaluate={"heldout_sets": sets, "num_prompts": 10, "set_num_prompts": {"humaneval": 3}})
    files = rule_args.heldout_prompt_inputs(c, HELDOUT)
    assert files["prompts_heldout"] == HELDOUT and files["prompts_mine"] == "my.jsonl"
    assert files["prompts_humaneval"] == "resources/data/humaneval.jsonl"
    assert files["prompts_handwritten"].endswith("draftsmith/data/heldout_handwritten.jsonl")
    assert [rule_args.set_num_prompts(c, name) for name in sets] == [10, 10, 3, 10]
    options = rule_args.vllm_set_options(c, HELDOUT)
    assert options[:6] == [
        "--prompts", f"heldout={HELDOUT}", "--out", "heldout=results/eval/heldout/vllm.json",
        "--set-num-prompts", "heldout=10",
    ]  # fmt: skip
    assert "--out" not in rule_args.vllm_set_options(c, HELDOUT, outputs=False)


def test_the_offline_run_is_the_contract_check_where_vllm_measures() -> None:
    both = config(evaluate={"vllm": True, "num_prompts": 10, "offline_num_prompts": 4})
    assert rule_args.offline_options(both, "heldout") == ["--num-prompts", "4", "--no-ngram"]
    assert (
        rule_args.offline_num_prompts(
            config(evaluate={"num_prompts": 3, "offline_num_prompts": 0}), "heldout"
        )
        == 3
    )
    alone = config(evaluate={"vllm": False, "offline": True, "num_prompts": 7, "ngram": True})
    assert rule_args.offline_options(alone, "heldout") == ["--num-prompts", "7", "--ngram"]
    sets = alone["evaluate"]["heldout_sets"]
    assert rule_args.eval_summary_sets(alone) == [
        arg for name in sets for arg in ("--offline", f"{name}=results/eval/{name}/offline.json")
    ]
    assert rule_args.eval_summary_sets(config(evaluate={"offline": False, "vllm": True}))[0] == "--vllm"


def test_serving_profile_and_drafter_plan(tmp_path: Path) -> None:
    profile = str(tmp_path / "profile.json")
    serving = {"device": "this-cpu", "profile": profile}
    assert rule_args.serving_profile_input(config(evaluate={"serving": serving})) == {
        "serving_profile": profile
    }
    assert rule_args.serving_profile_input(config(evaluate={"serving": {"profile": profile}})) == {}
    plan = json.loads(rule_args.drafter_plan(config(vocab={"size": 1024})))
    assert plan["vocab_size"] == 1024 and set(plan) == {"drafter", "vocab_size", "aux_layers"}


def test_what_the_snakefile_imports_at_every_parse_imports_no_torch() -> None:
    """rules/common.smk imports these at every parse (cluster jobs parse it too): torch would slow each."""
    modules = ["draftsmith.core.workflow.rule_args", "draftsmith.core.workflow.startup",
               "draftsmith.core.planning.memory", "draftsmith.core.planning.hidden_plan",
               "draftsmith.core.evaluation.cost", "draftsmith.core.io.digests", "draftsmith.core.io.runlock"]  # fmt: skip
    probe = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"
