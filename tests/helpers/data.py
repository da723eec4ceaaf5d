"""Tiny training data (a random target's shards, manifest and vocab map), damaged data, and extraction's
tokens files and engines compared."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from draftsmith.core.data.shards import Sample, iter_samples, read_header, verify_shard, write_shard
from draftsmith.core.data.vocab import save_vocab_map
from draftsmith.core.model.layers import capture_aux, stack_aux
from draftsmith.core.model.target import file_sha256
from draftsmith.stages.vocab import build_vocab_map

from .workflow import DEFAULT_TARGET

TINY_AUX_IDS = [1, 2, 3]


TINY_VOCAB, TINY_DRAFT_VOCAB, TINY_LAYERS, TINY_HIDDEN = 256, 128, 4, 64


def make_tiny_data(root: Path) -> dict:
    """A tiny random target, greedy traces of it as shards, the manifest and the vocab map."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)  # tiny matmuls: more threads only add spin-waiting on a busy machine
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=TINY_HIDDEN,
        intermediate_size=128,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.1,  # peaked next-token distributions, so greedy traces are learnable
    )
    model = LlamaForCausalLM(config).eval()
    target_dir = root / "target"
    model.save_pretrained(target_dir)

    gen = torch.Generator().manual_seed(1)
    prompt_len, longest = 5, 35
    ids = torch.randint(0, TINY_VOCAB, (24, prompt_len), generator=gen)
    with torch.no_grad():
        for _ in range(longest - prompt_len):  # greedy continuations: the target's own traces
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        with capture_aux(model, TINY_AUX_IDS) as captured:
            final = model.model(ids).last_hidden_state  # after the final norm
        aux = stack_aux(captured, TINY_AUX_IDS)
    samples = []
    for i in range(24):
        n = int(torch.randint(15, longest + 1, (1,), generator=gen))  # causal: a prefix keeps its states
        mask = torch.arange(n) >= prompt_len
        samples.append(
            Sample(
                f"sample-{i}",
                ids[i, :n],
                mask,
                aux[i, :n].to(torch.bfloat16),
                final[i, :n].to(torch.bfloat16),
            )
        )
    shards = []
    for k, part in enumerate((samples[:12], samples[12:])):
        path = root / "hidden" / f"shard-{k}.safetensors"
        meta = {"aux_layer_ids": TINY_AUX_IDS, "layer_convention": "input", "dtype": "bfloat16"}
        write_shard(
            path, part, meta, codec=("none", "zstd-planes")[k], level=1, storage_dtype="bfloat16"
        )  # both codecs
        shards.append(
            {
                "path": f"hidden/shard-{k}.safetensors",
                "num_samples": len(part),
                "num_tokens": sum(s.num_tokens for s in part),
                "bytes": path.stat().st_size,  # what `draftsmith train` verifies before training
                "sha256": file_sha256(path),
                "content_sha256": verify_shard(path),
                "teacher_agreement": None,
            }
        )
    manifest = {
        "version": 2,
        "target": str(target_dir),
        "hidden_size": TINY_HIDDEN,
        "num_layers": TINY_LAYERS,
        "vocab_size": TINY_VOCAB,
        "aux_layer_ids": TINY_AUX_IDS,
        "layer_convention": "input",
        "num_aux": len(TINY_AUX_IDS),
        "min_teacher_agreement": 0.9,
        "shards": shards,
    }
    manifest_path = root / "data_config.json"
    manifest_path.write_text(json.dumps(manifest))
    masked = torch.cat([s.input_ids[s.loss_mask] for s in samples])
    vocab_path = root / "vocab_map.pt"
    save_vocab_map(vocab_path, build_vocab_map(masked, TINY_VOCAB, TINY_DRAFT_VOCAB))
    return {
        "manifest": manifest_path,
        "vocab": vocab_path,
        "target": target_dir,
        "root": root,
        "samples": samples,
    }


def make_stream_manifest(data: dict, root: Path, mode: str = "stream", **extract: Any) -> Path:
    """make_tiny_data's samples as a tokens file (two shards) and its stream manifest (train.hidden_states
    stream or hybrid: no shards, the train job captures the states), fp32 compute -> its path."""
    from draftsmith.stages.manifest import ManifestSettings, build_stream_manifest

    samples = data["samples"]
    tokens = root / "tokens.safetensors"
    write_sample_tokens(
        tokens,
        [s.input_ids.tolist() for s in samples],
        [s.loss_mask.int().tolist() for s in samples],
        [[0, len(samples) // 2], [len(samples) // 2, len(samples)]],
    )
    values = {"aux_layers": TINY_AUX_IDS, "dtype": "float32", "min_teacher_agreement": 0.5, **extract}
    out = root / "stream_config.json"
    build_stream_manifest(
        str(tokens), str(out), str(data["target"]), ManifestSettings.from_dict(values), mode
    )
    return out


def flip_state_bit(path: Path) -> None:
    """Flip one bit in the middle of a shard's encoded states (in test_manifest.py's shards: inside sample
    1 of 3, lengths 6, 7, 8). The file keeps its size and, unlike before content digests, its header."""
    data_start, entries, _ = read_header(path)
    start, end = entries["blob"]["data_offsets"]
    data = bytearray(path.read_bytes())
    data[data_start + (start + end) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def random_sequences(lengths: list[int], seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Random token ids with the second half of each sample loss-masked: crash safety does not depend
    on the words (but no teacher can agree with them)."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]
    return ids, [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]


def write_sample_tokens(
    path: Path, ids: list[list[int]], masks: list[list[int]], shards: list[list[int]]
) -> None:
    """A tokens.safetensors of these samples as `draftsmith tokenize` writes it, with the given shard plan."""
    from draftsmith.core.data.tokens import write_tokens

    lengths = [len(s) for s in ids]
    meta = {
        "sample_ids": [f"s{i}" for i in range(len(ids))],
        "template": "test",
        "target": str(DEFAULT_TARGET),
        "max_seq_len": max(lengths),
        "shards": shards,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    write_tokens(path, [t for s in ids for t in s], [m for s in masks for m in s], offsets, meta)


def greedy_samples(target: Path, n: int = 4, new_tokens: int = 24) -> tuple[list[int], list[list[int]]]:
    """Chat prompts answered greedily by the target (fp32): a real teacher-agreement check."""
    from draftsmith.core.data.chat import render_prompt
    from draftsmith.core.model.target import load_target

    model, tokenizer = load_target(target, torch.float32)
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain what a prime number is in two sentences.",
        "List three uses of a paperclip.",
    ][:n]
    ids, masks = [], []
    for q in questions:
        prompt = render_prompt(tokenizer, [{"role": "user", "content": q}])
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)[0]
        ids.append(out.tolist())
        masks.append([0] * len(prompt) + [1] * (out.numel() - len(prompt)))
    return ids, masks


def vllm_extract(
    target: Path, tokens: Path, out: Path, env: dict, *options: str
) -> subprocess.CompletedProcess:
    """`draftsmith extract --backend vllm` (fp32, uncompressed) of shard 0 in a subprocess; asserts success."""
    cmd = ["draftsmith", "extract", "--backend", "vllm", "--target", str(target), "--tokens", str(tokens),
           "--shard", "0", "--out", str(out), "--dtype", "float32", "--codec", "none", *options]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def worst_cosines(hf_out: Path, vllm_out: Path, num_samples: int) -> list[float]:
    """The lowest per-token cosine between two shards of the same samples: per aux layer, then the final
    normed state."""
    hf = {s.id: s for s in iter_samples(hf_out)}
    vl = {s.id: s for s in iter_samples(vllm_out)}
    assert hf.keys() == vl.keys() and len(hf) == num_samples
    num_aux = next(iter(hf.values())).aux.shape[1]
    worst = [1.0] * (num_aux + 1)
    for key, a in hf.items():
        b = vl[key]
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert a.aux.shape == b.aux.shape
        for slot in range(num_aux):
            cos = F.cosine_similarity(a.aux[:, slot].float(), b.aux[:, slot].float(), dim=-1)
            worst[slot] = min(worst[slot], cos.min().item())
        worst[-1] = min(worst[-1], F.cosine_similarity(a.final.float(), b.final.float(), dim=-1).min().item())
    return worst
