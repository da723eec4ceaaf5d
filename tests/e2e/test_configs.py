"""The shipped configs for real targets plan as intended on an 8-GPU node (Snakemake dry runs only). The
real weights are not here: each target is stood in for by a folder holding only its config.json, the
language-model fields as shipped, which the workflow's start-up checks read (layers, vocabulary).

    snakemake -n --configfile configs/<name>.yaml --cores all --resources gpu=8
"""

import importlib
import json
import re
import subprocess

import pytest
import yaml
from click.testing import CliRunner
from conftest import REPO, cli_env

from draftsmith import cli

pytestmark = pytest.mark.slow


# The fields of each target's config.json the start-up checks read, as the model folders ship them.
TARGET_CONFIGS = {
    "kimi-k2.5-8gpu": {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": {"model_type": "deepseek_v3", "num_hidden_layers": 61, "vocab_size": 163840,
                        "hidden_size": 7168, "kv_lora_rank": 512},
    },
    "llama-3.1-8b": {"model_type": "llama", "num_hidden_layers": 32, "vocab_size": 128256, "hidden_size": 4096},
    "qwen3-235b-a22b": {"model_type": "qwen3_moe", "num_hidden_layers": 94, "vocab_size": 151936,
                        "hidden_size": 4096},
}  # fmt: skip


def dry_run(name: str, workdir) -> list[dict]:
    """The planned jobs of a dry run: [{rule, gpu, shell}] in the order Snakemake prints them."""
    config = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    target = workdir / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET_CONFIGS[name]))
    config["target"]["model"] = str(target)
    configfile = workdir / "config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    cmd = ["snakemake", "-n", "-p", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(configfile), "--cores", "all", "--resources", "gpu=8"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=workdir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
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


def by_rule(jobs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for job in jobs:
        out.setdefault(job["rule"], []).append(job)
    return out


@pytest.fixture(scope="module", params=["kimi-k2.5-8gpu", "llama-3.1-8b", "qwen3-235b-a22b"])
def plan(request, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(request.param)
    return request.param, by_rule(dry_run(request.param, workdir)), workdir


def test_every_stage_is_planned(plan):
    name, jobs, _ = plan
    expected = {"prompts", "generate", "tokenize", "extract", "vocab", "manifest", "train",
                "evaluate_vllm", "eval_summary", "gate"}  # fmt: skip
    assert expected <= set(jobs), (name, sorted(jobs))


def test_gpu_reservations(plan):
    name, jobs, _ = plan
    node = name != "llama-3.1-8b"  # the huge targets take the whole node per GPU job
    want = 8 if node else 1
    for stage in ("generate", "extract", "train", "evaluate_vllm"):
        assert {j["gpu"] for j in jobs[stage]} == {want}, (name, stage, jobs[stage])
        assert all(f"draftsmith run --gpus {want} --" in j["shell"] for j in jobs[stage])
    assert len(jobs["extract"]) == (16 if node else 8)
    assert all('"backend": "vllm"' in j["shell"] for j in jobs["extract"])
    # a job reserving 8 of 8 GPUs runs alone: the shards of a huge target extract one at a time
    assert all(j["gpu"] == 0 for j in jobs["tokenize"] + jobs["vocab"] + jobs["manifest"])


def test_huge_targets_stay_out_of_the_workflow_processes(plan):
    """Kimi and Qwen3-235B: no offline evaluation (it would load the target with transformers); the
    vLLM measurement feeds the summary. Llama-3.1-8B is measured both ways, on every held-out set. The
    untrained baseline is built from the target's embedding, norm and lm_head only, and served by vLLM."""
    name, jobs, _ = plan
    assert [j["gpu"] for j in jobs["untrained_drafter"]] == [0]
    if name == "llama-3.1-8b":
        assert [j["gpu"] for j in jobs["evaluate_offline"]] == [1, 1]  # split and handwritten
        return
    assert "evaluate_offline" not in jobs
    shell = jobs["eval_summary"][0]["shell"]
    assert "--vllm split=results/eval/split/vllm.json" in shell and "--offline" not in shell


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
    for folder in ("results/drafter", "results/eval/untrained_drafter"):
        (workdir / folder).mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(gpus)))
    monkeypatch.setenv("DRAFTSMITH_TRUST_REMOTE_CODE", "0")
    monkeypatch.setattr(cli, "_drafters", lambda drafter, untrained, target: {"eagle3": drafter})
    monkeypatch.setattr(cli, "_warn_draft_positions", lambda *a: None)
    calls = []
    module, name = recorded.rsplit(".", 1)
    monkeypatch.setattr(importlib.import_module(module), name, lambda *a, **kw: calls.append((a, kw)))
    result = CliRunner().invoke(cli.main, args[1:], catch_exceptions=False)
    assert result.exit_code == 0 and calls, result.output
    return calls[0]


def test_generate_serves_the_target_tensor_parallel_over_the_jobs_gpus(plan, monkeypatch):
    """The vLLM server the planned generate command starts: TP = the job's GPUs (Qwen3-235B's expert
    parallel then has EP = TP), the target's dtype, CUDA graphs (no --enforce-eager), the memory share."""
    from draftsmith.backends.server import VllmServerBackend

    name, jobs, workdir = plan
    (job,) = jobs["generate"]
    args, _ = run_planned(job, workdir, monkeypatch, "draftsmith.generate.generate_traces")
    target, settings = args[0], args[4]  # generate_traces(target, prompts, out, summary, settings)
    cmd = VllmServerBackend.server(settings, target, "server.log").command()
    flags = dict(zip(cmd, cmd[1:], strict=False))
    gpus = 1 if name == "llama-3.1-8b" else 8
    assert flags.get("--tensor-parallel-size") == (str(gpus) if gpus > 1 else None), cmd
    assert flags["--dtype"] == "bfloat16" and "--enforce-eager" not in cmd, cmd
    assert flags["--gpu-memory-utilization"] == ("0.92" if name == "kimi-k2.5-8gpu" else "0.9"), cmd
    assert ("--enable-expert-parallel" in cmd) == (name == "qwen3-235b-a22b"), cmd


def test_extract_runs_vllm_tensor_parallel_in_bfloat16_with_cuda_graphs(plan, monkeypatch):
    name, jobs, workdir = plan
    _, kw = run_planned(jobs["extract"][0], workdir, monkeypatch, "draftsmith.extract.extract_shard")
    gpus = 1 if name == "llama-3.1-8b" else 8
    assert (kw["backend"], kw["gpus"], kw["dtype"], kw["vllm_eager"]) == ("vllm", gpus, "bfloat16", False), kw
    assert kw["gpu_memory_utilization"] == 0.9


def test_vllm_evaluation_is_the_served_setup(plan, monkeypatch):
    """Target dtype (not float32), CUDA graphs, TP over the job's GPUs, the configured load time limit."""
    name, jobs, workdir = plan
    _, kw = run_planned(jobs["evaluate_vllm"][0], workdir, monkeypatch, "draftsmith.evaluate.evaluate_vllm")
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
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    _, kw = run_planned(
        jobs["evaluate_offline"][0], workdir, monkeypatch, "draftsmith.evaluate.evaluate_offline"
    )
    assert kw["device"] == "cuda"
