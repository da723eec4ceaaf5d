"""The shipped configurations and every Snakemake command the documentation gives, planned as written
(Snakemake dry runs only).

The working folder is a fresh clone's layout (a copy of the tracked files, config.yaml included): each
`snakemake` command of README.md, docs/ and the config files' headers runs there as written, with `-n -p`
added. The real weights are not here: a Hub cache holding only each Hub target's config.json (the
language-model fields as shipped, which the start-up checks read: layers, vocabulary) stands in for a
machine that has fetched it, as `HF_HUB_OFFLINE=1` would read it.

Each planned stage's settings (its `--settings` JSON, the gate's modes, the held-out sets) must be the
config file's own values over the schema's defaults: config.yaml (the CPU demo's choices) is read only
when no --configfile is given.
"""

import copy
import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from helpers.workflow import REPO, cli_env
from hubcache import add_repo

from draftsmith import cli
from draftsmith.core.config.config import read_numbers, replaced_mappings, schema
from draftsmith.core.planning.hidden_plan import FREE_BYTES_ENV

pytestmark = pytest.mark.slow

# The fields of each Hub target's config.json the start-up checks read, as the model folders ship them.
# The Hub targets of the shipped configs, as their real config.json files (tests/data/target-configs).
TARGETS = REPO / "tests" / "data" / "target-configs"
TARGET_DIRS = {"moonshotai/Kimi-K2.5": "kimi-k2.5", "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
               "Qwen/Qwen3-235B-A22B": "qwen3-235b-a22b"}  # fmt: skip
NODE_DISK_BYTES = 30 * 10**12
# Where commands are documented: the pages, and each config file's header (`#   snakemake ...`).
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CONFIG_FILES = ["config.yaml", *(f"configs/{p.name}" for p in sorted((REPO / "configs").glob("*.yaml"))),
                "tests/config.tiny.yaml"]  # fmt: skip
# The settings section behind each command's --settings JSON.
SETTINGS_SECTION = {"target": "target", "prompts": "prompts", "generate": "generate", "tokenize": "extract",
                    "extract": "extract", "manifest": "extract", "vocab": "vocab", "train": "train",
                    "untrained-drafter": "train", "evaluate": "evaluate", "evaluate-vllm": "evaluate", "preflight": "evaluate",
                    "eval-summary": "evaluate"}  # fmt: skip


def _fenced_and_prose(text: str) -> tuple[list[str], str]:
    """The lines inside ``` fences, and the text outside them."""
    fenced, prose, inside = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        (fenced if inside else prose).append(line)
    return fenced, "\n".join(prose)


@cache
def documented_commands() -> dict[str, str]:
    """Every `snakemake` command the documentation gives (a fenced line, an inline code span, a config
    header's comment): command -> where it is first written (file:line)."""
    found: dict[str, str] = {}
    for path in [*DOC_FILES, *(REPO / name for name in CONFIG_FILES)]:
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(REPO)
        if path.suffix == ".md":
            fenced, prose = _fenced_and_prose(text)
            lines = [line for line in fenced if line.startswith("snakemake ")]
            # an inline span may wrap a line; Markdown reads the break as a space
            lines += [" ".join(m.group(1).split()) for m in re.finditer(r"`(snakemake [^`]+)`", prose)]
        else:
            lines = [m.group(1) for m in re.finditer(r"^#\s+(snakemake .*)$", text, re.M)]
        for line in lines:
            command = shlex.join(shlex.split(line, comments=True))
            found.setdefault(command, f"{where}")
    return found


def dry_run_args(command: str) -> list[str]:
    """The command as a dry run that prints each job's shell command; a report needs a finished run, so
    `--report FILE` is left out (what the rest plans is still checked)."""
    words = shlex.split(command)
    assert words[0] == "snakemake", command
    if "--report" in words:
        i = words.index("--report")
        del words[i : i + 2]
    return ["snakemake", "-n", "-p", *[w for w in words[1:] if w not in ("-n", "-p")]]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A fresh clone's layout: the tracked files as this checkout has them, and nothing else (without
    git, e.g. an unpacked archive: every file but what .gitignore names)."""
    root = tmp_path_factory.mktemp("clone")
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True
        )
        names = [name for name in listed.stdout.split("\0") if name and (REPO / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        names = None
    if names is None:
        ignored = [p.strip().strip("/") for p in (REPO / ".gitignore").read_text().splitlines() if p.strip()]
        shutil.copytree(REPO, root, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git", *ignored))
    for name in names or ():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name)
    assert (root / "config.yaml").is_file() and (root / "profiles" / "default").is_dir()
    return root


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """cli_env with a Hub cache holding the Hub targets' config.json only, no Hub, and no AWS credentials
    (the Kubernetes profile's bucket is the placeholder its comment tells you to replace)."""
    cache = tmp_path_factory.mktemp("hub-cache")
    for repo_id, folder in TARGET_DIRS.items():
        add_repo(cache, repo_id, {"config.json": (TARGETS / folder / "config.json").read_bytes()})
    environ = {k: v for k, v in cli_env().items() if not k.startswith(("AWS_", "HF_"))}
    missing = str(cache / "none")
    environ.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", AWS_EC2_METADATA_DISABLED="true",
                   AWS_SHARED_CREDENTIALS_FILE=missing, AWS_CONFIG_FILE=missing)  # fmt: skip
    # planned as on a GPU node's local NVMe (a DGX H100's 30 TB), where train.hidden_states auto keeps
    # the states as files; this machine's disk streams them (test_states_that_do_not_fit_the_disk_stream)
    environ[FREE_BYTES_ENV] = str(NODE_DISK_BYTES)
    return environ


@pytest.fixture(scope="module")
def plans(clone, env):
    """command -> its dry run in the clone (run once, on first use)."""
    done: dict[str, subprocess.CompletedProcess] = {}

    def plan(command: str) -> subprocess.CompletedProcess:
        if command not in done:
            args = dry_run_args(command)
            done[command] = subprocess.run(
                args, capture_output=True, text=True, env=env, cwd=clone, timeout=300
            )
        return done[command]

    return plan


@pytest.mark.parametrize("command", sorted(documented_commands()))
def test_every_documented_command_plans_as_written(plans, command):
    proc = plans(command)
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    if "profiles/kubernetes" in command:
        # Its storage is the placeholder bucket: the plan gets as far as looking there, so the config and
        # the profile were read and the jobs planned.
        assert proc.returncode != 0 and "s3://YOUR-BUCKET/draftsmith/" in output, output
        return
    if folder := re.search(r"target=\{model: (/models/[^}]+)\}", command):
        # Weights on disk that this machine lacks: the one complaint is that folder, set by --config.
        error = f"invalid configuration:\n  --config: target.model: {folder.group(1)} is not a folder"
        assert proc.returncode != 0 and error in proc.stderr, output
        assert proc.stderr.count("\n  ") == 1, output
        return
    assert proc.returncode == 0, f"{command} ({documented_commands()[command]}):\n{output}"


def test_every_config_file_has_a_documented_command():
    for name in CONFIG_FILES[1:]:
        assert config_command(name), f"{name}: no documented `snakemake ... --configfile {name}`"


def config_command(name: str) -> str | None:
    """The documented command that runs config file `name` alone (config.yaml: the one without any
    --configfile), preferring one that names the node's GPUs."""
    commands = [
        c for c in documented_commands()
        if c.startswith("snakemake ") and "--workflow-profile" not in c and "--config " not in c
        and "--report" not in c and "--forcerun" not in c and "--lint" not in c and "--unlock" not in c
        and (shlex.split(c)[shlex.split(c).index("--configfile") + 1:] == [name] if "--configfile" in c
             else name == "config.yaml")
    ]  # fmt: skip
    return max(commands, key=lambda c: ("gpu=" in c, "--cores" in c), default=None)


def jobs_of(proc: subprocess.CompletedProcess) -> list[dict]:
    """The planned jobs of a dry run: [{rule, gpu, shell}] in the order Snakemake prints them."""
    jobs = []
    for block in re.split(r"\n(?=\[[^\]]+\]\n(?:local)?(?:rule|checkpoint) )", proc.stdout + proc.stderr):
        rule = re.search(r"^(?:local)?(?:rule|checkpoint) (\w+):", block, re.M)
        if not rule:
            continue
        gpu = re.search(r"resources: .*\bgpu=(\d+)", block)
        shell = re.search(r"^Shell command: (.*)$", block, re.M)
        jobs.append(
            {
                "rule": rule.group(1),
                "gpu": int(gpu.group(1)) if gpu else 0,
                "shell": shell.group(1) if shell else "",
            }
        )
    return jobs


# ------------------------------------------------------ settings: the file's over the schema's defaults


def schema_defaults(spec: dict) -> dict:
    """Every default: a section of settings key by key, anything else (a mapping of entries) whole."""
    return {
        key: schema_defaults(sub) if sub.get("additionalProperties", True) is False else copy.deepcopy(
            sub.get("default"))
        for key, sub in spec["properties"].items()
    }  # fmt: skip


def file_over_defaults(name: str) -> dict:
    """What config file `name` says, over the schema's defaults: its settings key by key, its mappings
    of entries (evaluate.heldout_sets, ...) whole. Written from the schema, not the workflow's code."""
    entries = set(replaced_mappings())

    def over(base: dict, top: dict, path: tuple = ()) -> None:
        for key, value in top.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict) and (*path, key) not in entries:
                over(base[key], value, (*path, key))
            else:
                base[key] = copy.deepcopy(value)

    config = schema_defaults(schema())
    over(config, yaml.safe_load((REPO / name).read_text(encoding="utf-8")) or {})
    return read_numbers(config)


def planned_settings(shell: str) -> list[tuple[str, dict]]:
    """(section, values) of each settings JSON a job's command carries."""
    words = shlex.split(shell)
    if words[:1] != ["draftsmith"]:
        return []
    command = words[words.index("draftsmith", 1) + 1] if words[:2] == ["draftsmith", "run"] else words[1]
    found = []
    for i, word in enumerate(words[:-1]):
        if word == "--settings":
            assert command in SETTINGS_SECTION, f"which section is `draftsmith {command} --settings`?"
            found.append((SETTINGS_SECTION[command], json.loads(words[i + 1])))
        if word == "--target-source":
            found.append(("target", json.loads(words[i + 1])))
    return found


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_each_stage_gets_the_files_settings_over_the_schema_defaults(plans, name):
    """Planned as documented, from the repository root with config.yaml present: every stage's settings,
    the gate's modes and the held-out sets are the file's over the schema's defaults, nothing of the
    demo's config.yaml unless it is the file."""
    command = config_command(name)
    proc = plans(command)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    want = file_over_defaults(name)
    jobs = jobs_of(proc)
    checked = set()
    for job in jobs:
        for section, values in planned_settings(job["shell"]):
            expected = {key: want[section][key] for key in values}
            assert values == expected, (name, job["rule"], section)
            checked.add(job["rule"])
    assert {"prompts", "generate", "tokenize", "extract", "vocab", "train"} <= checked, (name, checked)
    (summary,) = [job["shell"] for job in jobs if job["rule"] == "eval_summary"]
    assert dict(planned_settings(summary))["evaluate"]["gate"] == want["evaluate"]["gate"], name
    sets = {m for job in jobs for m in re.findall(r"results/eval/(\w+)/(?:offline|vllm)\.json", job["shell"])}
    assert sets == set(want["evaluate"]["heldout_sets"]), name


def test_a_documented_config_override_reaches_its_stage(plans):
    """README's `--config 'train={...}'`: those keys over the demo's train section, the rest unchanged."""
    (command,) = [c for c in documented_commands() if "--config 'train=" in c]
    proc = plans(command)
    (train,) = [job["shell"] for job in jobs_of(proc) if job["rule"] == "train"]
    ((_, values),) = planned_settings(train)
    override = yaml.safe_load(shlex.split(command)[-1].split("=", 1)[1])
    assert values == {**file_over_defaults("config.yaml")["train"], **override}


def test_the_demo_keeps_its_choices_and_no_other_config_gets_them():
    """config.yaml's training choices (chosen for a 2-core CPU) are its own; the GPU configs and the
    tiny one take the schema's."""
    demo = file_over_defaults("config.yaml")
    assert (demo["train"]["optimizer"], demo["train"]["loss_positions"]) == ("muon", "all")
    for name in ("configs/llama-3.1-8b.yaml", "configs/qwen3-235b-a22b.yaml", "configs/kimi-k2.5-8gpu.yaml",
                 "tests/config.tiny.yaml"):  # fmt: skip
        config = file_over_defaults(name)
        assert config["generate"]["original_answers_share"] == 0.0, name
        assert (config["train"]["optimizer"], config["train"]["loss_positions"]) == ("adamw", "assistant"), (
            name
        )


# ------------------------------------------------------ the GPU configs: what each stage reserves and runs

GPU_CONFIGS = {"kimi-k2.5-8gpu": "moonshotai/Kimi-K2.5", "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
               "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B"}  # fmt: skip


def by_rule(jobs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for job in jobs:
        out.setdefault(job["rule"], []).append(job)
    return out


@pytest.fixture(scope="module", params=sorted(GPU_CONFIGS))
def plan(request, plans, tmp_path_factory):
    """A GPU config planned as documented (on an 8-GPU node), and a folder to run its commands in, where
    the target's folder is as rule target materialises it (its config.json)."""
    name = request.param
    proc = plans(config_command(f"configs/{name}.yaml"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workdir = tmp_path_factory.mktemp(name)
    target = workdir / "resources" / "hub" / GPU_CONFIGS[name].replace("/", "--")
    target.mkdir(parents=True)
    # the real target's config.json (the engine layout sizes it)
    shutil.copy(TARGETS / TARGET_DIRS[GPU_CONFIGS[name]] / "config.json", target / "config.json")
    return name, by_rule(jobs_of(proc)), workdir


def test_every_stage_is_planned(plan):
    name, jobs, _ = plan
    expected = {"target", "prompts", "generate", "tokenize", "extract", "vocab", "manifest", "train",
                "evaluate_vllm", "eval_summary", "gate"}  # fmt: skip
    assert expected <= set(jobs), (name, sorted(jobs))
    # the Hub target is downloaded by a job of no GPUs, the id and revision its settings
    assert [j["gpu"] for j in jobs["target"]] == [0]
    assert f'"model": "{GPU_CONFIGS[name]}"' in jobs["target"][0]["shell"]


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_states_that_do_not_fit_the_disk_stream(clone, env, name):
    """Issue 45: on a 2 TB disk each GPU config's states (2.7-4.7 TB bound) cannot be written; auto
    streams them into the train job, says so in one line, and plans no extraction."""
    command = dry_run_args(config_command(f"configs/{name}.yaml"))
    proc = subprocess.run(command, capture_output=True, text=True, cwd=clone, timeout=300,
                          env={**env, FREE_BYTES_ENV: str(2 * 10**12)})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "train.hidden_states auto -> stream: the states do not fit the disk" in proc.stderr, proc.stderr
    jobs = by_rule(jobs_of(proc))
    assert "extract" not in jobs and "manifest" not in jobs and "stream_manifest" in jobs, sorted(jobs)
    assert "--manifest results/stream_config.json" in jobs["train"][0]["shell"]


def test_gpu_reservations(plan):
    name, jobs, _ = plan
    node = name != "llama-3.1-8b"  # the huge targets take the whole node per GPU job
    for stage in ("generate", "extract", "train", "evaluate_vllm"):
        gpus = 8 if node or stage in ("generate", "extract") else 1  # generate, extract: the node's 8
        assert {j["gpu"] for j in jobs[stage]} == {gpus}, (name, stage, jobs[stage])
        assert all(f"draftsmith run --gpus {gpus} --" in j["shell"] for j in jobs[stage])
    (extract,) = jobs["extract"]  # one extraction job for every shard
    assert '"backend": "vllm"' in extract["shell"]
    assert all(j["gpu"] == 0 for j in jobs["tokenize"] + jobs["vocab"] + jobs["manifest"])


def test_huge_targets_stay_out_of_the_workflow_processes(plan):
    """Kimi and Qwen3-235B: no offline evaluation (it would load the target with transformers); the
    vLLM measurement feeds the summary, and the untrained baseline (measured offline only: a random
    drafter accepts next to nothing) is not built. Llama-3.1-8B is measured both ways, on every held-out
    set; its untrained baseline is built from the target's embedding, norm and lm_head only."""
    name, jobs, _ = plan
    if name == "llama-3.1-8b":
        assert [j["gpu"] for j in jobs["untrained_drafter"]] == [0]
        # heldout, handwritten, humaneval, mtbench
        assert [j["gpu"] for j in jobs["evaluate_offline"]] == [1, 1, 1, 1]
        return
    assert "evaluate_offline" not in jobs and "untrained_drafter" not in jobs
    shell = jobs["eval_summary"][0]["shell"]
    assert "--vllm heldout=results/eval/heldout/vllm.json" in shell and "--offline" not in shell


def test_target_specific_settings(plan):
    name, jobs, _ = plan
    generate, extract, train = (
        jobs["generate"][0]["shell"],
        jobs["extract"][0]["shell"],
        jobs["train"][0]["shell"],
    )
    if name == "kimi-k2.5-8gpu":
        assert '"--reasoning-parser", "kimi_k2"' in generate and '"--trust-remote-code"' in generate
        assert '"aux_layers": [2, 30, 58]' in extract
        assert '"rope": {"rope_theta": 1000000.0, "rope_type": "default"}' in train
    if name == "qwen3-235b-a22b":
        assert '"--reasoning-parser", "qwen3"' in generate
        assert '"aux_layers": [2, 47, 91]' in extract
    assert '"backend": "vllm-server"' in generate


# ------------------------------------------------------ what each GPU stage's planned command runs


def run_planned(job: dict, workdir, monkeypatch, recorded: str) -> tuple[tuple, dict]:
    """Run a planned `draftsmith run --gpus N -- draftsmith CMD ...` line's command in this process, with
    N devices visible as `draftsmith run` leaves them and the library function `recorded` replaced by a
    recorder: (args, kwargs) the stage would have called it with."""
    gpus = int(re.search(r"draftsmith run --gpus (\d+) --", job["shell"]).group(1))
    monkeypatch.chdir(workdir)
    # the words bash passes the command (quotes removed, $(...) expanded), as the job's shell would
    command = job["shell"].split(" -- ", 1)[1].split(" 2>&1 | tee ")[0]
    words = subprocess.run(
        ["bash", "-c", f'printf "%s\\0" {command}'], capture_output=True, text=True, check=True
    )
    args = words.stdout.split("\0")[:-1]
    assert args[0] == "draftsmith", args
    for path in (
        "results/prompts/train.jsonl",
        "results/prompts/heldout.jsonl",
        "results/tokens.safetensors",
    ):
        (workdir / path).parent.mkdir(parents=True, exist_ok=True)
        (workdir / path).touch()
    for flag, value in zip(args, args[1:], strict=False):  # held-out sets' files, benchmarks' included
        if flag == "--prompts":  # name=path (vLLM's, the summary's) or a path (one set's offline job)
            path = workdir / value.split("=", 1)[-1]
            if not path.exists():  # never touch a real file (the packaged set, through the link below)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
    for folder in ("results/drafter", "results/eval/untrained_drafter"):
        (workdir / folder).mkdir(parents=True, exist_ok=True)
    # the packaged held-out set is planned relative to the working folder the plan was made in (the clone)
    if not (workdir / "draftsmith").exists():
        (workdir / "draftsmith").symlink_to(REPO / "draftsmith")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(gpus)))
    monkeypatch.setenv("DRAFTSMITH_TRUST_REMOTE_CODE", "0")
    ev = importlib.import_module("draftsmith.stages.evaluate")
    monkeypatch.setattr(ev, "checked_drafters", lambda drafter, untrained, target: {"eagle3": drafter})
    monkeypatch.setattr(ev, "export_draft_positions_warning", lambda *a: None)
    calls = []
    module, name = recorded.rsplit(".", 1)
    monkeypatch.setattr(importlib.import_module(module), name, lambda *a, **kw: calls.append((a, kw)))
    result = CliRunner().invoke(cli.main, args[1:], catch_exceptions=False)
    assert result.exit_code == 0 and calls, result.output
    return calls[0]


def test_generate_serves_the_target_on_all_the_jobs_gpus(plan, monkeypatch):
    """The vLLM server the planned generate command starts on an 8-H100 node (nvidia-smi's answer; Kimi's on
    8 H200s): all 8 GPUs, Llama-3.1-8B as 8 data-parallel engines of 1, Qwen3-235B as one engine of 8 (its
    expert parallel then has EP = TP), Kimi as 8 data-parallel engines with expert parallelism, the target's
    dtype, CUDA graphs (no --enforce-eager), the memory share."""
    from draftsmith.backends.server import VllmServerBackend

    name, jobs, workdir = plan
    (job,) = jobs["generate"]
    args, _ = run_planned(job, workdir, monkeypatch, "draftsmith.stages.generate.generate_traces")
    target, settings = args[0], args[4]  # generate_traces(target, prompts, out, summary, settings)
    # Kimi needs H200s (the job checks the plan's line again and refuses H100s): there, data-parallel
    # attention with expert parallelism (memory.engine_layout, issue 43 item 12)
    kimi = name == "kimi-k2.5-8gpu"
    monkeypatch.setattr(
        "draftsmith.core.planning.memory.detect_gpu_memory_gib", lambda: 139.8 if kimi else 79.2
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    cmd = VllmServerBackend.server(settings, target, "server.log").command()
    flags = dict(zip(cmd, cmd[1:], strict=False))
    tp, dp = (None, "8") if name != "qwen3-235b-a22b" else ("8", None)
    assert (flags.get("--tensor-parallel-size"), flags.get("--data-parallel-size")) == (tp, dp), cmd
    assert flags["--dtype"] == "bfloat16" and "--enforce-eager" not in cmd, cmd
    assert flags["--gpu-memory-utilization"] == ("0.92" if kimi else "0.9"), cmd
    assert ("--enable-expert-parallel" in cmd) == (name != "llama-3.1-8b"), cmd


def test_extract_runs_vllm_over_the_nodes_8_gpus_in_bfloat16_with_cuda_graphs(plan, monkeypatch):
    """One extraction job for every shard, on all 8 GPUs (engines of the memory plan's layout)."""
    name, jobs, workdir = plan
    (job,) = jobs["extract"]
    args, kw = run_planned(job, workdir, monkeypatch, "draftsmith.stages.extract.extract_shards")
    assert args[2] == [
        f"results/hidden/shard-{k}.safetensors" for k in range(8 if name == "llama-3.1-8b" else 16)
    ]
    settings = args[3]  # extract_shards(target, tokens, outs, settings, device=...)
    assert (settings.backend, settings.gpus, settings.dtype, settings.vllm_eager) == (
        "vllm",
        8,
        "bfloat16",
        False,
    )
    assert settings.gpu_memory_utilization == 0.9 and settings.tensor_parallel == 0


def test_each_extraction_engine_has_the_threads_to_compress_a_gpus_states(plan, monkeypatch):
    """resources.extract.threads is the job's (the planned --threads, which Snakemake caps at --cores: here
    the test machine's), shared by the engines of the memory plan's layout (on H100s; Kimi's on H200s):
    each GPU engine gets at least 4, 3 to compress ~1 GB/s of states at ~0.4 GB per CPU-second
    (bench/extract.py --only-writer) and one for vLLM's engine core (issue 43 item 9); Llama-3.1-8B runs
    8 engines of 1 GPU."""
    from draftsmith.core.config.config import section_defaults
    from draftsmith.core.training.distributed import rank_threads
    from draftsmith.stages.extract import job_layout

    name, jobs, workdir = plan
    (job,) = jobs["extract"]
    args, _ = run_planned(job, workdir, monkeypatch, "draftsmith.stages.extract.extract_shards")
    target, settings = args[0], args[3]
    config = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    max_seq_len = config["extract"].get("max_seq_len", section_defaults("extract")["max_seq_len"])
    threads = config["resources"]["extract"]["threads"]
    # Snakemake caps a job's threads at the cores it may use (this test worker's share)
    assert f"--threads {min(threads, len(os.sched_getaffinity(0)))} " in job["shell"]
    device = {"gpu_memory_gib": 139.8 if name == "kimi-k2.5-8gpu" else 79.2}
    _, engines = job_layout(target, settings.dtype, settings.backend, settings.gpus, max_seq_len,
                            settings.gpu_memory_utilization, settings.tensor_parallel, device)  # fmt: skip
    assert engines == (8 if name == "llama-3.1-8b" else 1), engines
    assert rank_threads(threads, engines) >= 4, (name, threads, engines)


def test_vllm_evaluation_is_the_served_setup(plan, monkeypatch):
    """Target dtype (not float32), CUDA graphs, TP over the job's GPUs, the configured load time limit."""
    from draftsmith.stages.evaluate import vllm_engine

    name, jobs, workdir = plan
    args, _ = run_planned(
        jobs["evaluate_vllm"][0], workdir, monkeypatch, "draftsmith.stages.evaluate.evaluate_vllm"
    )
    kw = vllm_engine(args[4])  # evaluate_vllm(target, drafters, prompts, outs, settings, log_dir)
    gpus = 1 if name == "llama-3.1-8b" else 8
    assert (kw["tensor_parallel_size"], kw["dtype"], kw["enforce_eager"]) == (gpus, "bfloat16", False), kw
    assert kw["gpu_memory_utilization"] == 0.9
    assert kw["timeout_s"] == (900 if name == "llama-3.1-8b" else 3600)


def test_offline_evaluation_runs_on_the_jobs_gpu(plan, monkeypatch):
    """Llama-3.1-8B's offline decoder on the GPU its job holds (the huge targets have none planned)."""
    name, jobs, workdir = plan
    if name != "llama-3.1-8b":
        assert "evaluate_offline" not in jobs
        return
    from draftsmith.stages.evaluate.stage import offline_device

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    args, _ = run_planned(
        jobs["evaluate_offline"][0], workdir, monkeypatch, "draftsmith.stages.evaluate.evaluate_offline"
    )
    settings = args[4]  # evaluate_offline(target, drafters, prompts, out, settings)
    assert offline_device(settings.gpus) == "cuda"
