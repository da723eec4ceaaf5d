"""memory.py: the activation model against bytes measured with saved_tensors_hooks, the target's weights
from config.json and safetensors headers, and the pre-flight plan of every shipped config."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from draftsmith.core.config.config import merged_config_files, text_config_json, with_defaults
from draftsmith.core.planning.memory import (
    CHECKPOINTED,
    GB,
    GIB,
    activation_bytes,
    device_memory,
    engine_layout,
    heads_error,
    plan_config,
    refusal,
    safetensors_bytes,
    target_size,
)

ROOT = Path(__file__).resolve().parents[3]
TARGETS = ROOT / "tests" / "data" / "target-configs"  # the real targets' config.json files


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("bench.memory")


@pytest.mark.parametrize("index", [0, 2, 9])  # 96 and 384 tokens, Kimi-like proportions
def test_activation_model_matches_saved_tensors(bench, index: int) -> None:
    """The per-token model predicts the bytes autograd saves for `ttt_loss` (bf16 autocast, every position
    valid, measured with saved_tensors_hooks on a 1/64-scale drafter) within 10%; on the CPU p is fp32."""
    case = bench.CASES[index]
    measured = bench.measure(case)
    predicted = activation_bytes(case.shape(), case.tokens, case.tokens, case.steps, False, p_bytes=4)
    assert abs(predicted / measured - 1) < 0.10, (case, measured, predicted)


@pytest.mark.parametrize("index", [1])
def test_checkpointed_model_matches_what_the_checkpoints_keep(bench, index: int) -> None:
    case = bench.CASES[index]
    measured = bench.measure(case, checkpoint_ttt=True)
    predicted = activation_bytes(
        case.shape(), case.tokens, case.tokens, case.steps, True, p_bytes=4, coefficients=CHECKPOINTED
    )
    assert abs(predicted / measured - 1) < 0.10, (case, measured, predicted)
    assert measured < bench.measure(case) / 3  # what checkpointing is for


def test_target_weights_from_config_json() -> None:
    """Parameter counts of the shipped targets from their config.json: Llama-3.1-8B 8.03 B, Qwen3-235B-A22B
    235 B (bf16), Kimi-K2.5 ~594 GB (routed experts int4 in groups of 32, the rest bf16)."""
    sizes = {
        name: target_size(text_config_json(TARGETS / name))
        for name in ("llama-3.1-8b", "qwen3-235b-a22b", "kimi-k2.5")
    }
    assert sizes["llama-3.1-8b"].weight_bytes / 2 == pytest.approx(8.03e9, rel=0.01)
    assert sizes["qwen3-235b-a22b"].weight_bytes / 2 == pytest.approx(235.1e9, rel=0.01)
    assert sizes["kimi-k2.5"].weight_bytes == pytest.approx(594e9, rel=0.02)
    # KV per token per GPU at TP 8: Llama 8 kv heads -> 1 each; latent attention replicated
    assert sizes["llama-3.1-8b"].kv_bytes_per_token(8) == 32 * 1 * 2 * 128 * 2
    assert sizes["kimi-k2.5"].kv_bytes_per_token(8) == 61 * (512 + 64) * 2


def test_safetensors_headers_give_the_weights_bytes(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {"model.layers.0.w": torch.zeros(3, 4), "lm_head.weight": torch.zeros(5, dtype=torch.bfloat16)},
        tmp_path / "a.safetensors",
    )
    save_file({"model.layers.1.w": torch.zeros(7, dtype=torch.float16)}, tmp_path / "b.safetensors")  # MTP
    assert safetensors_bytes(tmp_path, num_layers=1) == 3 * 4 * 4 + 5 * 2
    assert safetensors_bytes(tmp_path / "none", 1) is None


def test_device_memory_setting_preset_then_unknown() -> None:
    assert device_memory({"gpu_memory_gib": 10, "gpu_model": "H100-80GB"}, detect=False)[0] == 10 * GIB
    assert device_memory({"gpu_model": "H200-141GB"}, detect=False)[0] == pytest.approx(139.8 * GIB)
    assert device_memory({}, detect=False)[0] is None


def shipped(name: str, target: str, gpu: str) -> list:
    config = with_defaults(merged_config_files([ROOT / "configs" / f"{name}.yaml"]))
    config["target"]["model"] = str(TARGETS / target)
    return plan_config(config, device_memory({"gpu_model": gpu}, detect=False)[0])


@pytest.mark.parametrize(
    ("name", "target", "gpu"),
    [
        ("llama-3.1-8b", "llama-3.1-8b", "H100-80GB"),
        ("qwen3-235b-a22b", "qwen3-235b-a22b", "H100-80GB"),
        ("kimi-k2.5-8gpu", "kimi-k2.5", "H200-141GB"),  # its weights need H200s: the config says so
    ],
)
def test_every_shipped_gpu_config_fits_its_node(name: str, target: str, gpu: str) -> None:
    needs = shipped(name, target, gpu)
    assert {n.stage for n in needs} >= {"generate", "extract", "train"}
    assert refusal(needs, gpu) is None, refusal(needs, gpu)
    if gpu != "H100-80GB":
        assert "H200" in (ROOT / "configs" / f"{name}.yaml").read_text()


def test_a_stage_that_cannot_fit_stops_in_one_line_naming_it_and_the_setting() -> None:
    needs = shipped("kimi-k2.5-8gpu", "kimi-k2.5", "H100-80GB")
    line = refusal(needs, "H100-80GB")
    assert line.startswith("generate needs") and "GB per GPU" in line and "resources.generate.gpus" in line
    train = next(n for n in needs if n.stage == "train")
    assert train.fits and train.total < 80 * GB


def test_engine_layout_takes_the_fewest_gpus_that_hold_the_target() -> None:
    """A job's GPUs become data-parallel engines of the fewest GPUs (a power of two) that hold the target:
    Llama-3.1-8B one per H100 (8 engines), Qwen3-235B-A22B bf16 (470 GB) 8 per H100 and 4 per H200,
    Kimi-K2.5 all 8 H200s; a given tensor_parallel must divide the GPUs; no GPUs = one CPU engine."""
    sizes = {
        name: target_size(text_config_json(TARGETS / name)) for name in ("llama-3.1-8b", "qwen3-235b-a22b")
    }
    sizes["kimi-k2.5"] = target_size(text_config_json(TARGETS / "kimi-k2.5"))
    h100, h200 = (device_memory({"gpu_model": g}, detect=False)[0] for g in ("H100-80GB", "H200-141GB"))
    assert engine_layout(sizes["llama-3.1-8b"], 8, 8192, 0.9, h100, tensor_parallel=0) == (1, 8)
    assert engine_layout(sizes["qwen3-235b-a22b"], 8, 8192, 0.9, h100, tensor_parallel=0) == (8, 1)
    assert engine_layout(sizes["qwen3-235b-a22b"], 8, 8192, 0.9, h200, tensor_parallel=0) == (4, 2)
    # 128 requests in flight: 64 per engine of 4 would not fit their KV (25 GB in ~12 GB of room)
    assert engine_layout(sizes["qwen3-235b-a22b"], 8, 8192, 0.9, h200, in_flight=128, tensor_parallel=0) == (
        8,
        1,
    )
    assert engine_layout(sizes["llama-3.1-8b"], 8, 8192, 0.9, h100, in_flight=256, tensor_parallel=0) == (
        1,
        8,
    )
    assert engine_layout(sizes["kimi-k2.5"], 8, 8192, 0.92, h200, tensor_parallel=0) == (8, 1)
    assert engine_layout(sizes["llama-3.1-8b"], 8, 8192, 0.9, None, tensor_parallel=0) == (
        8,
        1,
    )  # memory unknown: as before
    assert engine_layout(sizes["llama-3.1-8b"], 8, 8192, 0.9, h100, tensor_parallel=2) == (2, 4)
    assert engine_layout(sizes["llama-3.1-8b"], 0, 8192, 0.9, h100, tensor_parallel=0) == (1, 1)
    with pytest.raises(ValueError, match="tensor_parallel 3 does not divide the job's 8 GPUs"):
        engine_layout(sizes["llama-3.1-8b"], 8, 8192, 0.9, h100, tensor_parallel=3)


def test_the_extraction_line_counts_vllms_hidden_state_cache():
    """Issue 43 item 13 (part): per token in flight, the captured layers (aux + final) x hidden x 2 bytes
    beside the KV cache: +82% over Kimi-K2.5's MLA KV, +25-67% on the GQA targets."""
    from draftsmith.core.planning.memory import hidden_state_bytes_per_token, plan

    folders = TARGETS
    kimi = target_size(text_config_json(folders / "kimi-k2.5"), None, "bfloat16")
    assert hidden_state_bytes_per_token(kimi, 4) == 4 * 7168 * 2
    assert round(hidden_state_bytes_per_token(kimi, 4) / kimi.kv_bytes_per_token(8), 2) == 0.82
    # per GPU, as the configs run them: Llama-8B on one GPU, Qwen3-235B's 4 kv heads at TP 8 (one each)
    for name, tp, share in (("llama-3.1-8b", 1, 0.25), ("qwen3-235b-a22b", 8, 0.68)):
        size = target_size(text_config_json(folders / name), None, "bfloat16")
        assert round(hidden_state_bytes_per_token(size, 4) / size.kv_bytes_per_token(tp), 2) == share, name
    config = with_defaults(
        {"extract": {"backend": "vllm", "max_seq_len": 8192}, "resources": {"extract": {"gpus": 8}}}
    )
    (extract,) = [n for n in plan(config, kimi, None, 141 * GIB) if n.stage == "extract"]
    assert extract.parts["hidden-state cache, one 8,192-token sequence"] == 8192 * 4 * 7168 * 2


def test_kimi_is_served_data_parallel_with_expert_parallelism_where_that_holds_more(tmp_path, monkeypatch):
    """Issue 43 item 12: an MLA target at TP 8 keeps eight copies of every sequence's latent KV; with the
    attention data parallel and the experts split over the 8 GPUs (--data-parallel-size 8
    --enable-expert-parallel) each GPU keeps only its own sequences'. The Kimi config's generation on
    8 x H200 is laid out so, `draftsmith plan` says so, and the server is started so. A GQA target
    (Qwen3-235B) is never laid out so."""
    from draftsmith.backends.server import VllmServerBackend
    from draftsmith.core.config.config import section_defaults
    from draftsmith.core.planning.memory import (
        generate_layout,
        plan_files,
        sequences_held,
        uses_expert_parallel,
    )
    from draftsmith.stages.generate import GenerateSettings

    kimi = target_size(text_config_json(TARGETS / "kimi-k2.5"), None, "bfloat16")
    config = with_defaults(merged_config_files([str(ROOT / "configs" / "kimi-k2.5-8gpu.yaml")]))
    h200 = 141 * GIB
    res = config["resources"]["generate"]
    args = config["generate"]["server_args"]
    assert generate_layout(args, res, kimi, h200) == (1, 8) and uses_expert_parallel(kimi, 1, 8)
    assert sequences_held(kimi, 1, 8, 32768, 0.92, h200) > 2 * sequences_held(kimi, 8, 1, 32768, 0.92, h200)
    qwen = target_size(text_config_json(TARGETS / "qwen3-235b-a22b"), None, "bfloat16")
    assert not qwen.mla_moe and not uses_expert_parallel(qwen, 1, 8)

    lines, stop = plan_files([str(ROOT / "configs" / "kimi-k2.5-8gpu.yaml")], str(TARGETS / "kimi-k2.5"),
                             "H200-141GB", None)  # fmt: skip
    assert stop is None
    assert "generate 8 engines x 1 GPUs" in lines[0]
    assert "--data-parallel-size 8 --enable-expert-parallel" in lines[0]

    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    values = {**section_defaults("generate"), **config["generate"], "dtype": "bfloat16", "gpus": 8,
              "gpu_memory_gib": 141, "concurrency": 128}  # fmt: skip
    settings = GenerateSettings.from_dict(values)
    cmd = VllmServerBackend.server(settings, str(TARGETS / "kimi-k2.5"), str(tmp_path / "log")).command()
    assert cmd[cmd.index("--data-parallel-size") + 1] == "8" and "--enable-expert-parallel" in cmd
    assert "--tensor-parallel-size" not in cmd and cmd[cmd.index("--api-server-count") + 1] == "8"


def test_engine_layout_chooses_only_splits_of_the_heads_vllm_accepts() -> None:
    """6 GPUs for a 32-head target: never one engine of 6 (vLLM refuses it), engines of 2 at most, also
    where the device's memory is unknown; MLA (Kimi) is split by its 64 query heads alone."""
    llama = target_size(text_config_json(TARGETS / "llama-3.1-8b"))
    kimi = target_size(text_config_json(TARGETS / "kimi-k2.5"))
    h100 = device_memory({"gpu_model": "H100-80GB"}, detect=False)[0]
    assert llama.attention_heads == 32 and kimi.attention_heads == 64 and kimi.kv_heads == 0
    assert engine_layout(llama, 6, 8192, 0.9, None, tensor_parallel=0) == (2, 3)
    assert engine_layout(llama, 6, 8192, 0.9, h100, tensor_parallel=0) == (1, 6)
    assert engine_layout(llama, 7, 8192, 0.9, None, tensor_parallel=0) == (1, 7)
    assert engine_layout(kimi, 6, 8192, 0.9, h100, tensor_parallel=0) == (
        2,
        3,
    )  # does not fit: the plan says so, vLLM would load it
    assert engine_layout(kimi, 8, 8192, 0.9, None, tensor_parallel=0) == (8, 1)
    assert heads_error(6, 32, 8) == "6 does not divide the target's 32 attention heads"
    assert heads_error(16, 32, 8) is None and heads_error(4, 32, 8) is None
    assert heads_error(4, 64, 6) == "4 neither divides nor is a multiple of the target's 6 key-value heads"


def streamed(name: str, target: str, gpu: str, **train_resources) -> list:
    """The plan of a shipped config with train.hidden_states stream and resources.train changed."""
    config = with_defaults(
        merged_config_files([ROOT / "configs" / f"{name}.yaml"]) | {"train": {"hidden_states": "stream"}}
    )
    config["target"]["model"] = str(TARGETS / target)
    config["resources"]["train"].update(train_resources)
    return plan_config(config, device_memory({"gpu_model": gpu}, detect=False)[0])


def test_a_streamed_train_job_plans_its_engine_beside_each_trainer_rank_at_the_share_left():
    """Issue 45 item 2: engine_gpus 0 puts an engine on each of the job's GPUs beside its trainer rank;
    the engine's vLLM share is what 95% of the device leaves after the trainer, and both lines fit
    together or are refused together. No extract line: the extract job does not run."""
    from draftsmith.core.planning.memory import TRAIN_UTILIZATION, stream_engine_share

    needs = streamed("llama-3.1-8b", "llama-3.1-8b", "H100-80GB")
    stages = [n.stage for n in needs]
    assert "extract" not in stages and "train" not in stages
    engine, trainer = (
        next(n for n in needs if n.stage.startswith(f"train: {w}")) for w in ("engine", "trainer")
    )
    memory = device_memory({"gpu_model": "H100-80GB"}, detect=False)[0]
    share = stream_engine_share(trainer.total, memory)
    assert share == pytest.approx(TRAIN_UTILIZATION - trainer.total / memory)
    assert engine.budget == pytest.approx(share * memory)
    assert trainer.budget == pytest.approx(TRAIN_UTILIZATION * memory - engine.total)
    assert engine.fits and trainer.fits and engine.total + trainer.total <= TRAIN_UTILIZATION * memory
    assert any(f"gpu_memory_utilization {share:.2f}" in note for note in engine.notes)
    assert refusal(needs, "H100-80GB") is None


def test_a_target_too_large_to_share_a_gpu_is_refused_naming_engine_gpus_and_split_fits():
    """Kimi-K2.5 (~594 GB) cannot sit beside a trainer on one GPU: refused in one line naming
    resources.train.engine_gpus; on GPUs of its own (a split of its heads) the plan gives the engine and
    the trainer a line each; a split vLLM refuses stops at start."""
    needs = streamed("kimi-k2.5-8gpu", "kimi-k2.5", "H200-141GB")
    line = refusal(needs, "H200-141GB")
    assert line.startswith("train: engine (each GPU) needs") and "resources.train.engine_gpus" in line
    split = streamed("kimi-k2.5-8gpu", "kimi-k2.5", "H200-141GB", gpus=9, engine_gpus=8)
    engine, trainer = (next(n for n in split if n.stage == f"train: {w}") for w in ("engine", "trainer"))
    assert engine.gpus == 8 and trainer.gpus == 1 and engine.fits and trainer.fits
    from draftsmith.core.workflow.startup import tensor_parallel_errors

    config = with_defaults(
        merged_config_files([ROOT / "configs" / "kimi-k2.5-8gpu.yaml"])
        | {"train": {"hidden_states": "stream"}}
    )
    config["resources"]["train"].update(gpus=8, engine_gpus=7)
    errors = tensor_parallel_errors(config, 64, 0, "kimi-k2.5")
    assert (
        "resources.train.engine_gpus: 7 GPUs per vLLM engine, but 7 does not divide the target's 64"
        in errors[0]
    )


def test_files_mode_plans_no_engine_in_the_train_job():
    needs = shipped("llama-3.1-8b", "llama-3.1-8b", "H100-80GB")
    assert "train" in [n.stage for n in needs] and not any(n.stage.startswith("train:") for n in needs)
