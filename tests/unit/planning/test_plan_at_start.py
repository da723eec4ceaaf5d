"""The memory plan runs before any GPU job on a first run (issue 43 item 4): a Hub target not downloaded
yet is planned from its config.json in the Hub cache, or from the shipped tests/data/target-configs for
the shipped configs' ids, so Kimi-K2.5 on 8 H100s stops at `snakemake -n` with the figure instead of
after a ~600 GB download and a 25-minute load."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from helpers.workflow import REPO, cli_env
from hubcache import add_repo

KIMI = REPO / "configs" / "kimi-k2.5-8gpu.yaml"
KIMI_CONFIG = REPO / "tests" / "data" / "target-configs" / "kimi-k2.5" / "config.json"


def dry_run(tmp_path, overlay: dict, cache, offline: bool = True) -> subprocess.CompletedProcess:
    """`snakemake -n` of the Kimi config with `overlay` over it, with the Hub cache `cache`, offline (else
    with a Hub address nothing answers at: no request leaves this machine)."""
    work = tmp_path / "run"
    work.mkdir(exist_ok=True)
    (tmp_path / "overlay.yaml").write_text(yaml.safe_dump(overlay))
    env = {k: v for k, v in cli_env().items() if not k.startswith("HF_")}
    env.update(
        HF_HUB_CACHE=str(cache),
        **({"HF_HUB_OFFLINE": "1"} if offline else {"HF_ENDPOINT": "http://127.0.0.1:9"}),
    )
    cmd = ["snakemake", "-n", "--snakefile", str(REPO / "Snakefile"), "--directory", str(work),
           "--configfile", str(KIMI), str(tmp_path / "overlay.yaml"), "--cores", "1", "--resources", "gpu=8"]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work, timeout=300)


def test_a_hub_id_with_only_its_config_json_in_the_offline_cache_is_planned_at_start(tmp_path):
    cache = tmp_path / "hub"
    add_repo(cache, "acme/kimi-copy", {"config.json": KIMI_CONFIG})  # an id no shipped config names
    proc = dry_run(
        tmp_path, {"target": {"model": "acme/kimi-copy"}, "resources": {"gpu_model": "H200-141GB"}}, cache
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GPU memory per GPU (resources.gpu_model H200-141GB):" in proc.stderr
    assert "no GPU memory plan" not in proc.stderr


@pytest.mark.parametrize("cached", [False, True], ids=["shipped config.json", "Hub cache"])
def test_kimi_on_8_h100s_is_refused_at_a_dry_run_with_the_figure(tmp_path, cached):
    cache = tmp_path / "hub"
    cache.mkdir()
    if cached:
        add_repo(cache, "moonshotai/Kimi-K2.5", {"config.json": KIMI_CONFIG})
    # not cached: not offline either (the target job will download it), so the shipped config.json plans it
    proc = dry_run(tmp_path, {"resources": {"gpu_model": "H100-80GB"}}, cache, offline=cached)
    assert proc.returncode != 0
    assert "generate needs 80.6 GB per GPU but has 78.2 GB (resources.gpu_model H100-80GB)" in proc.stderr


def test_each_gpu_job_checks_its_own_line_of_the_plan_before_vllm_loads(monkeypatch):
    """The extraction job and the generation server, on 8 H100s with Kimi-K2.5: one line with the figure,
    before any engine (the plan at start may have had no config.json, or another device)."""
    from draftsmith.backends.server import ServerError, VllmServerBackend
    from draftsmith.core.config.config import section_defaults
    from draftsmith.stages.extract import job_layout
    from draftsmith.stages.generate import GenerateSettings

    target = str(KIMI_CONFIG.parent)
    with pytest.raises(
        ValueError, match=r"^extract needs 79\.\d GB per GPU but has 76\.5 GB .*checked again by the job"
    ):
        job_layout(target, "bfloat16", "vllm", 8, 8192, None, 0, {"gpu_model": "H100-80GB"})
    values = {**section_defaults("generate"), "backend": "vllm-server", "dtype": "bfloat16", "gpus": 8,
              "gpu_memory_gib": 79.2, "server_args": ["--max-model-len", "32768"]}  # fmt: skip
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    with pytest.raises(ServerError, match=r"generate needs 80\.6 GB per GPU but has \d+\.\d GB"):
        VllmServerBackend.server(GenerateSettings.from_dict(values), target, "server.log")


def test_an_evaluation_runtime_short_of_the_plan_is_a_warning_at_start(tmp_path):
    """Issue 43 item 3: the evaluation's engine loads x load time against resources.evaluate.runtime."""
    cache = tmp_path / "hub"
    add_repo(cache, "moonshotai/Kimi-K2.5", {"config.json": KIMI_CONFIG})
    overlay = {"resources": {"gpu_model": "H200-141GB", "evaluate": {"runtime": 60}}}
    proc = dry_run(tmp_path, overlay, cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning: evaluation time (estimate): preflight 7 engine loads ~200 min" in proc.stderr
    assert "resources.evaluate.runtime 60 min TOO SHORT" in proc.stderr


def test_a_train_job_whose_plan_line_does_not_fit_refuses_before_loading_anything(tmp_path, monkeypatch):
    """Issue 43 item 4, the train job: Kimi-K2.5's drafter on 8 H100s (nvidia-smi's 79.2 GiB) with each
    rank's share in one pass (resources.train.micro_batch_tokens: 0) refuses in one line with the plan's
    own figure, before its share of the shards is decoded, the target's head loaded or the drafter built;
    in the shipped passes of 8,192 tokens it fits."""
    import json

    import torch
    from helpers.data import make_tiny_data

    import draftsmith.stages.train as train_stage
    from draftsmith.core.config.config import merged_config_files, text_config_json, with_defaults
    from draftsmith.core.data.vocab import save_vocab_map, vocab_maps
    from draftsmith.core.planning.memory import GB, plan_config

    data = make_tiny_data(tmp_path / "data")
    manifest = json.loads(Path(data["manifest"]).read_text())
    manifest.update(target=str(KIMI_CONFIG.parent), num_aux=3, hidden_size=7168)
    kimi_manifest = tmp_path / "data" / "kimi_data_config.json"  # beside the shards its paths name
    kimi_manifest.write_text(json.dumps(manifest))
    vocab = tmp_path / "vocab_map.pt"
    d2t, t2d = vocab_maps(torch.arange(32000), 163840)
    save_vocab_map(vocab, {"d2t": d2t, "t2d": t2d})

    config = with_defaults(merged_config_files([str(KIMI)]))
    config["resources"]["train"]["micro_batch_tokens"] = 0
    config["resources"]["gpu_memory_gib"] = 79.2
    (need,) = [
        n
        for n in plan_config(config, 79.2 * 2**30, text_config_json(KIMI_CONFIG.parent))
        if n.stage == "train"
    ]
    assert not need.fits  # what `draftsmith plan` prints for this config

    def loads(*a, **k):
        raise AssertionError("loaded before the plan's line was checked")

    for name in ("verify_share", "init_distributed", "load_target_head", "build_drafter"):
        monkeypatch.setattr(train_stage, name, loads)
    monkeypatch.setattr("draftsmith.core.planning.memory.detect_gpu_memory_gib", lambda: 79.2)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "3")
    settings = train_stage.TrainSettings.from_dict({**config["train"], "micro_batch_tokens": 0, "threads": 1})
    with pytest.raises(ValueError) as err:
        train_stage.train(kimi_manifest, vocab, tmp_path / "out", tmp_path / "ckpt", tmp_path / "m.jsonl",
                          settings, device="cuda")  # fmt: skip
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        f"train needs {need.total / GB:.1f} GB per GPU but has "
    )
    assert "(nvidia-smi (79.2 GiB)): change resources.train.micro_batch_tokens" in message
    assert message.endswith("(the memory plan, checked again by the job)")
    shipped = train_stage.TrainSettings.from_dict(
        {**config["train"], "micro_batch_tokens": 8192, "threads": 1}
    )
    train_stage.check_memory(kimi_manifest, vocab, shipped, 8)  # fits: no error
