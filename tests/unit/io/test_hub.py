"""Targets by Hugging Face Hub id (draftsmith/core/io/hub.py, rules/target.smk): what counts as a Hub id, the
start-up checks before and after the download, and what the workflow plans. Offline throughout: a
prepared Hub cache (tests/hubcache.py) stands in for the Hub."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
import twins
from helpers.workflow import REPO, cli_env
from hubcache import COMMIT, add_model_folder
from snakemake.api import SnakemakeApi
from snakemake.settings.types import ConfigSettings, DAGSettings, OutputSettings, Quietness, ResourceSettings

from draftsmith.core.config.config import is_hub_target, target_folder
from draftsmith.core.io.digests import smallest_readable
from draftsmith.core.io.hub import hub_target_dir, is_hub_id
from draftsmith.core.workflow.startup import target_checks

TINY = REPO / "tests" / "config.tiny.yaml"
AFTER_TRAINING = {"export", "evaluate_offline", "evaluate_vllm", "eval_summary", "gate", "all"}
QUIET = {Quietness.PROGRESS, Quietness.RULES, Quietness.HOST, Quietness.REASON}
REPO_ID = "someone/tiny-llama"
TWIN_DIR = f"resources/hub/{REPO_ID.replace('/', '--')}"
TWIN_VOCAB = 4096  # above the tiny config's draft vocabulary (2048)


def test_a_hub_id_is_owner_slash_name_and_no_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for value in ("meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3-235B-A22B", "moonshotai/Kimi-K2.5"):
        assert is_hub_id(value), value
    for value in ("/models/llama", "./models/llama", "llama", "a/b/c", "a/../b", "bad--owner/x", "x/"):
        assert not is_hub_id(value), value
    (tmp_path / "models" / "llama").mkdir(parents=True)
    assert not is_hub_id("models/llama")  # a local folder of that name wins
    assert not is_hub_target({"model": "resources/SmolLM2-135M-Instruct"})  # the embedded default
    assert (
        hub_target_dir("meta-llama/Llama-3.1-8B-Instruct")
        == "resources/hub/meta-llama--Llama-3.1-8B-Instruct"
    )
    assert hub_target_dir("o/n", "refs/pr/3") == "resources/hub/o--n@refs--pr--3"
    assert target_folder({"model": "o/n", "revision": None}) == "resources/hub/o--n"
    assert target_folder({"model": "models/llama", "revision": None}) == "models/llama"


# ----------------------------------------------------------------------------- a prepared Hub cache


@pytest.fixture(scope="module")
def twin_folder(tmp_path_factory) -> Path:
    """A tiny Llama-3 target folder (config.json, model.safetensors) as its owner would upload it."""
    folder = tmp_path_factory.mktemp("twin")
    twins.save("llama3", folder, vocab_size=TWIN_VOCAB)
    return folder


@pytest.fixture
def hub_cache(tmp_path, twin_folder, monkeypatch) -> Path:
    """A Hub cache holding REPO_ID, for this process and the commands it starts, offline."""
    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    add_model_folder(cache, REPO_ID, twin_folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def filled(**sections) -> dict:
    from snakemake.utils import validate

    config = copy.deepcopy(sections)
    validate(config, schema=str(REPO / "draftsmith" / "config.schema.yaml"))
    return config


def test_start_up_checks_wait_for_a_hub_target_not_downloaded_yet(tmp_path, monkeypatch):
    """No folder, no cache: nothing to check against yet; a warning says when the checks run. No
    network at start-up."""
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    config = filled(target={"model": REPO_ID}, extract={"aux_layers": [2, 999]})
    errors, warnings = target_checks(config)
    assert errors == []
    assert warnings[0].startswith(f"target.model: {REPO_ID} is not a local folder; as a Hugging Face Hub id")
    assert "rule target fetches it into resources/hub/someone--tiny-llama" in warnings[0]


def test_start_up_checks_read_a_hub_targets_config_from_the_cache_or_its_folder(
    tmp_path, hub_cache, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    vocab = {"size": 2048}
    errors, _ = target_checks(filled(target={"model": REPO_ID}, extract={"aux_layers": [1, 2]}, vocab=vocab))
    assert errors == []
    errors, _ = target_checks(filled(target={"model": REPO_ID}, extract={"aux_layers": [2, 9]}, vocab=vocab))
    assert errors[0].startswith(f"extract.aux_layers: [9] out of range: the target has {twins.LAYERS} layers")
    # once materialised, its own folder is read
    folder = tmp_path / TWIN_DIR
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 12, "vocab_size": 2000}))
    errors, _ = target_checks(filled(target={"model": REPO_ID}, extract={"aux_layers": [2, 9]}, vocab=vocab))
    assert errors == [  # 12 layers take [2, 9]; 2000 tokens are fewer than the draft vocabulary's 2048
        f"vocab.size: 2048 must be smaller than the target's vocabulary (2000 tokens in {TWIN_DIR})"
    ]


# ----------------------------------------------------------------------------- the workflow


def _workflow(api: SnakemakeApi, workdir: Path, changes: dict, forceall: bool = False):
    config = copy.deepcopy({"target": {"model": REPO_ID}, **changes})
    wf = api.workflow(
        snakefile=REPO / "Snakefile",
        workdir=workdir,
        resource_settings=ResourceSettings(cores=1),
        config_settings=ConfigSettings(config=config, configfiles=[TINY]),
    )
    return wf, wf.dag(dag_settings=DAGSettings(forceall=forceall))


def planned(workdir: Path, changes: dict) -> dict[str, list[str]]:
    """rule -> the inputs of its job, of every job a dry run plans with `changes` on the tiny config."""
    with SnakemakeApi(OutputSettings(quiet=QUIET)) as api:
        wf, dag = _workflow(api, workdir, changes)
        dag.execute_workflow(executor="local", pseudo_executor="dryrun")
        jobs = wf._workflow.dag.needrun_jobs(exclude_finished=False)
        return {job.rule.name: sorted(map(str, job.input)) for job in jobs}


def test_a_dry_run_shows_the_hub_target_pending(tmp_path, monkeypatch):
    """Not downloaded, not cached: the dry run plans rule target first and every stage reads its folder."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    jobs = planned(tmp_path, {})
    assert {"target", "prompts", "generate", "extract", "train", "gate"} <= set(jobs)
    assert jobs["target"] == []
    for rule in ("generate", "tokenize", "extract", "vocab"):
        assert TWIN_DIR in jobs[rule], rule


def test_the_workflow_materialises_a_hub_target_offline_and_checks_it(tmp_path, hub_cache):
    """`snakemake` itself: rule target links the cached files into resources/hub/... and checks its
    config.json against the settings the workflow hands it; HF_TOKEN reaches the job but no log, file
    or command line."""
    token = "hf_doNotLeakThisToken123"
    env = {**cli_env(), "HF_TOKEN": token}
    cmd = ["snakemake", "-s", str(REPO / "Snakefile"), "--configfile", str(TINY), "--cores", "1"]
    cmd += ["--config", f"target={{model: {REPO_ID}}}", "--", TWIN_DIR]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    folder = tmp_path / TWIN_DIR
    assert sorted(p.name for p in folder.iterdir() if p.name != ".snakemake_timestamp") == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    blob = (hub_cache / "models--someone--tiny-llama" / "snapshots").glob("*/model.safetensors")
    assert (folder / "model.safetensors").stat().st_ino == next(blob).resolve().stat().st_ino  # linked
    log = (tmp_path / "logs" / "target.log").read_text()
    assert f"target: {REPO_ID} at commit " in log
    assert 'its config.json allows {"aux_layers": null, "vocab_size": 2048}' in log  # the tiny config's
    written = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_relative_to(folder)]
    for path in [*written, *folder.iterdir()]:
        assert token.encode() not in path.read_bytes(), path
    assert token not in run.stdout + run.stderr


def test_a_new_vocabulary_size_reruns_no_download(tmp_path, hub_cache):
    """A finished run on a Hub target: the checks travel in the environment, not as params, so a new
    vocab.size reruns what the vocabulary feeds and not the target."""
    # every output made (empty), then recorded with Snakemake's touch executor, as in test_rules.py
    with SnakemakeApi(OutputSettings(quiet=QUIET)) as api:
        wf, dag = _workflow(api, tmp_path, {})
        dag.execute_workflow(executor="local", pseudo_executor="dryrun")
        for job in wf._workflow.dag.needrun_jobs(exclude_finished=False):
            for out in job.output:
                path = tmp_path / str(out)
                if out.is_directory:
                    path.mkdir(parents=True, exist_ok=True)
                else:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(smallest_readable(path.suffix))  # what the start parses
    (tmp_path / TWIN_DIR / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "vocab_size": 8192}))
    with SnakemakeApi(OutputSettings(quiet=QUIET)) as api:
        _, dag = _workflow(api, tmp_path, {}, forceall=True)
        dag.execute_workflow(executor="local", pseudo_executor="touch")
    assert planned(tmp_path, {}) == {}
    assert set(planned(tmp_path, {"vocab": {"size": 1000}})) == {
        "vocab",
        "train",
        "untrained_drafter",
        "preflight",  # it costs the planned drafter by its draft vocabulary (its runs are kept)
        *AFTER_TRAINING,
    }
    assert set(planned(tmp_path, {"target": {"model": REPO_ID, "revision": COMMIT}})) >= {
        "target",
        "generate",
    }


def test_the_target_job_refuses_settings_the_downloaded_config_rules_out(tmp_path, hub_cache):
    """A Hub target not yet downloaded at start-up is checked by its own job (DRAFTSMITH_TARGET_CHECKS,
    as the workflow sets it): each bad setting named, exit 2, nothing written."""
    out = tmp_path / "out"
    run = subprocess.run(
        ["draftsmith", "target", "--out", str(out), "--model", REPO_ID],
        env={**cli_env(), "DRAFTSMITH_TARGET_CHECKS": '{"aux_layers": [2, 7], "vocab_size": 4096}'},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2, run.stderr
    assert "extract.aux_layers: [7] out of range: the target has 4 layers" in run.stderr
    assert (
        f"vocab.size: 4096 must be smaller than the target's vocabulary (4096 tokens in {REPO_ID})"
        in run.stderr
    )
    assert not out.exists()
