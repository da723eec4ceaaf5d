"""The shipped configs for real targets plan as intended on an 8-GPU node (Snakemake dry runs only). The
real weights are not here: each target is stood in for by a folder holding only its config.json, the
language-model fields as shipped, which the workflow's start-up checks read (layers, vocabulary).

    snakemake -n --configfile configs/<name>.yaml --cores all --resources gpu=8
"""

import json
import re
import subprocess

import pytest
import yaml
from conftest import REPO, cli_env

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
    for block in re.split(r"\n(?=\[[^\]]+\]\n(?:local)?rule )", proc.stdout + proc.stderr):
        rule = re.search(r"^(?:local)?rule (\w+):", block, re.M)
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
    return request.param, by_rule(dry_run(request.param, tmp_path_factory.mktemp(request.param)))


def test_every_stage_is_planned(plan):
    name, jobs = plan
    expected = {"prompts", "generate", "tokenize", "extract", "vocab", "manifest", "train",
                "evaluate_vllm", "eval_summary", "gate"}  # fmt: skip
    assert expected <= set(jobs), (name, sorted(jobs))


def test_gpu_reservations(plan):
    name, jobs = plan
    node = name != "llama-3.1-8b"  # the huge targets take the whole node per GPU job
    want = 8 if node else 1
    for stage in ("generate", "extract", "train", "evaluate_vllm"):
        assert {j["gpu"] for j in jobs[stage]} == {want}, (name, stage, jobs[stage])
        assert all(f"draftsmith run --gpus {want} --" in j["shell"] for j in jobs[stage])
    assert len(jobs["extract"]) == (16 if node else 8)
    assert all('"engine": "vllm"' in j["shell"] for j in jobs["extract"])
    # a job reserving 8 of 8 GPUs runs alone: the shards of a huge target extract one at a time
    assert all(j["gpu"] == 0 for j in jobs["tokenize"] + jobs["vocab"] + jobs["manifest"])


def test_huge_targets_stay_out_of_the_workflow_processes(plan):
    """Kimi and Qwen3-235B: no offline evaluation (it would load the target with transformers); the
    vLLM measurement feeds the summary. Llama-3.1-8B is measured both ways, on every held-out set. The
    untrained baseline is built from the target's embedding, norm and lm_head only, and served by vLLM."""
    name, jobs = plan
    assert [j["gpu"] for j in jobs["untrained_drafter"]] == [0]
    if name == "llama-3.1-8b":
        assert [j["gpu"] for j in jobs["evaluate_offline"]] == [1, 1]  # split and handwritten
        return
    assert "evaluate_offline" not in jobs
    shell = jobs["eval_summary"][0]["shell"]
    assert "--offline split=results/eval/split/vllm.json" in shell and "offline.json" not in shell


def test_target_specific_settings(plan):
    name, jobs = plan
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
    assert '"engine": "vllm-server"' in generate
