"""Extraction engines: the transformers engine's batching, the vLLM engine's layer bookkeeping and final
norm, and both engines on the same samples of the real target (vLLM in a subprocess)."""

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers.data import greedy_samples, random_sequences, vllm_extract, worst_cosines, write_sample_tokens
from helpers.model import fp_tolerance
from safetensors.torch import save_file

from draftsmith.backends.hf import HfExtractor, capture_states, pad_right
from draftsmith.backends.vllm_extract import read_target_tensor, rms_norm, vllm_layer_ids
from draftsmith.core.data.shards import iter_samples, read_shard_meta, remove_stale_temp_files
from draftsmith.stages.extract import ExtractSettings, extract_shard, should_compile


def test_vllm_layer_ids_keep_the_configured_order():
    # vLLM returns ascending ids, the final (pre-norm) id L last
    assert vllm_layer_ids([2, 15, 27], 30) == ([2, 15, 27, 30], [0, 1, 2])
    assert vllm_layer_ids([27, 2, 15], 30) == ([2, 15, 27, 30], [2, 0, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_llama_norm(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    norm = norm.to(dtype)
    x = (torch.randn(7, 64) * 30).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, norm.weight, 1e-5), norm(x))


def test_read_target_tensor_single_and_sharded(tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    single.mkdir()
    sharded.mkdir()
    a, b = torch.randn(3), torch.randn(2, 2)
    save_file({"model.norm.weight": a, "lm_head.weight": b}, str(single / "model.safetensors"))
    save_file({"model.norm.weight": a}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"lm_head.weight": b}, str(sharded / "model-00002-of-00002.safetensors"))
    index = '{"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors", "lm_head.weight": "model-00002-of-00002.safetensors"}}'
    (sharded / "model.safetensors.index.json").write_text(index)
    for folder in (single, sharded):
        assert torch.equal(read_target_tensor(folder, "model.norm.weight"), a)
        assert torch.equal(read_target_tensor(folder, "lm_head.weight"), b)
        with pytest.raises(KeyError, match="no tensor 'nope'"):
            read_target_tensor(folder, "nope")


def test_hf_extractor_batch_rows_equal_single_sequences(tiny_llama):
    seqs = [torch.randint(0, 256, (n,)) for n in (5, 11, 8)]
    assert pad_right(seqs).shape == (3, 11) and pad_right(seqs)[0, 5:].eq(0).all()
    extractor = HfExtractor(tiny_llama, [3, 1])
    batched = extractor.capture(seqs)
    for seq, (aux, final) in zip(seqs, batched, strict=True):
        ref_aux, ref_final = capture_states(tiny_llama, seq[None], [3, 1])
        assert aux.shape == (seq.numel(), 2, 64)
        # fp32, batched vs single rows through every layer (4 chained matmuls each)
        cfg = tiny_llama.config
        depth, scale = 4 * cfg.num_hidden_layers, ref_final.abs().max()
        tol = fp_tolerance(torch.float32, depth, cfg.intermediate_size, scale)
        torch.testing.assert_close(aux, ref_aux[0], **tol)
        torch.testing.assert_close(final, ref_final[0], **tol)
    extractor.close()
    extractor._captured.clear()
    tiny_llama(torch.randint(0, 256, (1, 4)))
    assert extractor._captured == {}  # close() removed the hooks


def test_should_compile():
    assert not should_compile("auto", "transformers", 10.0)  # a tiny shard: the compile would dominate
    assert should_compile("auto", "transformers", 3600.0)
    assert should_compile("on", "transformers", 1.0) and not should_compile("off", "transformers", 1e9)
    assert not should_compile("on", "vllm", 1e9)  # vLLM compiles (or not) by itself
    with pytest.raises(ValueError, match="auto, on or off"):
        should_compile("yes", "transformers", 1.0)


def test_remove_stale_temp_files_only_touches_that_shard(tmp_path):
    keep = [tmp_path / "shard-1.safetensors", tmp_path / ".shard-10.safetensors.abc.data", tmp_path / "x"]
    stale = [tmp_path / ".shard-1.safetensors.abc.data", tmp_path / ".shard-1.safetensors.x.tmp"]
    for p in keep + stale:
        p.write_bytes(b"1")
    (tmp_path / ".shard-1.safetensors.job-q").mkdir()
    (tmp_path / ".shard-1.safetensors.job-q" / "f").write_bytes(b"1")
    removed = remove_stale_temp_files(tmp_path / "shard-1.safetensors")
    assert len(removed) == 3
    assert sorted(tmp_path.iterdir()) == sorted(keep)


@pytest.mark.slow
def test_engines_in_processes_of_their_own_share_one_queue(tmp_path, target_model):
    """Two spawned engines (on the CPU here: CUDA_VISIBLE_DEVICES "" each) take 3 shards from one queue,
    each shard once and sealed, with the content one in-process engine gives; an engine that fails is
    one line naming it, its devices and its shard."""
    from draftsmith.core.data.shards import verify_shard
    from draftsmith.core.io.digests import intact
    from draftsmith.stages.extract import (
        EngineFailed,
        ShardQueue,
        run_engine,
        run_engine_processes,
        stashed_path,
    )

    tokens = tmp_path / "tokens.safetensors"
    write_sample_tokens(tokens, *random_sequences([30] * 6), [[0, 2], [2, 4], [4, 6]])
    settings = ExtractSettings.from_dict(
        {"batch_tokens": 300, "compile": "off", "threads": 1, "dtype": "float32"}
    )  # the schema's codec zstd-planes, level 1, bfloat16 storage, transformers, no GPUs
    kw = {"target": str(target_model), "tokens_path": str(tokens), "settings": settings, "max_model_len": 31}
    spawned, inline = tmp_path / "spawned", tmp_path / "inline"
    spawned.mkdir(), inline.mkdir()
    run_engine_processes(ShardQueue([0, 1, 2]), ["", ""], {**kw, "stash": spawned})
    run_engine(ShardQueue([0, 1, 2]), **kw, stash=inline)
    for k in range(3):
        assert intact(stashed_path(spawned, k)), k
        assert verify_shard(stashed_path(spawned, k)) == verify_shard(stashed_path(inline, k)), k
    assert sorted(p.name for p in spawned.iterdir() if not p.name.startswith(".")) == [
        f"shard-{k}.safetensors" for k in range(3)
    ]  # the engines' scratch folders are gone
    with pytest.raises(EngineFailed) as failed:
        run_engine_processes(ShardQueue([5]), ["", ""], {**kw, "stash": spawned})
    message = str(failed.value)
    # either engine may take the one shard first: the line names whichever failed
    assert re.match(
        r"extraction engine [01] of 2 \(CUDA devices none\) failed: shard 5: ValueError: shard 5", message
    ), message
    assert "\n" not in message and "a rerun reuses them" in message


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_and_transformers_engines_agree_on_the_real_target(tmp_path, target_model):
    if importlib.util.find_spec("vllm") is None:  # looked up, not imported: vLLM runs in a subprocess
        pytest.skip("the vllm extra is not installed")
    ids, masks = greedy_samples(target_model)
    tokens = tmp_path / "tokens.safetensors"
    write_sample_tokens(tokens, ids, masks, [[0, len(ids)]])

    hf_out, vllm_out = tmp_path / "hf" / "shard-0.safetensors", tmp_path / "vllm" / "shard-0.safetensors"
    hf_stats = extract_shard(
        str(target_model),
        str(tokens),
        0,
        str(hf_out),
        ExtractSettings.from_dict(
            {"dtype": "float32", "batch_tokens": 4096, "codec": "none", "compile": "off"}
        ),
    )
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env |= {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    env |= {"HF_HOME": str(tmp_path / "hf-home")}
    proc = vllm_extract(target_model, tokens, vllm_out, env)
    assert "vllm back-end" in proc.stderr  # the CLI logs to stderr
    worst = worst_cosines(hf_out, vllm_out, len(ids))  # aux layers 2, 15, 27, then the final (normed) state
    assert min(worst) >= 0.99, worst
    assert all(s.aux.shape == (s.num_tokens, 3, 576) for s in iter_samples(vllm_out))
    # Greedy answers: the stored final state must reproduce them (vLLM's own last state is pre-norm).
    vllm_stats = read_shard_meta(vllm_out)["stats"]
    assert vllm_stats["backend"] == "vllm" and hf_stats["backend"] == "transformers"
    assert hf_stats["teacher_agreement"] > 0.95
    assert abs(vllm_stats["teacher_agreement"] - hf_stats["teacher_agreement"]) < 0.02
