"""bench.peer's convert stage: this run's shards and vocabulary in SpecForge's offline EAGLE-3 format."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsmith.core.data.loader import StreamingData
from draftsmith.core.data.manifest import load_manifest
from draftsmith.core.data.shards import Sample
from draftsmith.core.io.atomic import atomic_path, write_json
from draftsmith.core.model.layers import convert_layer_ids

TARGET_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja")  # fmt: skip
HEAD_FILE = "head.safetensors"


def specforge_sample(sample: Sample, loss_positions: str = "assistant") -> dict[str, Tensor]:
    """One sample in SpecForge's offline EAGLE-3 layout (`scripts/prepare_hidden_states.py`):
    input_ids [T] int64, loss_mask [T] int64 (ones on every token for loss_positions "all"),
    aux_hidden_state [1, T, A*H] (aux layers concatenated in id order), hidden_state [1, T, H] (the
    target's final state after its norm, what its lm_head reads), both in the stored dtype."""
    T, A, H = sample.aux.shape
    mask = torch.ones(T, dtype=torch.int64) if loss_positions == "all" else sample.loss_mask.to(torch.int64)
    return {
        "input_ids": sample.input_ids.to(torch.int64).clone(),
        "loss_mask": mask,
        "aux_hidden_state": sample.aux.reshape(1, T, A * H).clone(),
        "hidden_state": sample.final.reshape(1, T, H).clone(),
    }


def sample_from_specforge(raw: dict[str, Tensor], num_aux: int) -> Sample:
    """The inverse of `specforge_sample` (loss mask as bool): what the converter test round-trips."""
    _, T, AH = raw["aux_hidden_state"].shape
    return Sample(
        id="",
        input_ids=raw["input_ids"],
        loss_mask=raw["loss_mask"].bool(),
        aux=raw["aux_hidden_state"].reshape(T, num_aux, AH // num_aux),
        final=raw["hidden_state"].reshape(T, -1),
    )


def sample_file(folder: Path, i: int) -> Path:
    return folder / f"data_{i:05d}.ckpt"  # SpecForge lists feature files sorted by name


def write_samples(data: StreamingData, split: str, folder: Path, loss_positions: str) -> int:
    """Every sample of a split (draftsmith's split and truncation) as one .ckpt each, atomically."""
    refs = data.train if split == "train" else data.val
    for i in range(len(refs)):
        with atomic_path(sample_file(folder, i)) as tmp:
            torch.save(specforge_sample(data.sample(split, i), loss_positions), tmp)
    return len(refs)


def write_target_folder(target_dir: Path, out: Path) -> None:
    """What SpecForge reads of the target: its config and tokenizer, and lm_head + embedding behind a
    `model.safetensors.index.json` (it requires an index even for one file; a tied lm_head is written
    out as its own tensor)."""
    from safetensors.torch import save_file

    from draftsmith.core.model.target import load_target_head

    out.mkdir(parents=True, exist_ok=True)
    for name in TARGET_FILES:
        if (target_dir / name).is_file():
            shutil.copyfile(target_dir / name, out / name)
    head = load_target_head(target_dir)
    tensors = {"lm_head.weight": head.lm_head.clone(), "model.embed_tokens.weight": head.embed.clone()}
    with atomic_path(out / HEAD_FILE) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_json(
        out / "model.safetensors.index.json",
        {"metadata": {}, "weight_map": dict.fromkeys(tensors, HEAD_FILE)},
    )


def draft_config(
    target_config: dict[str, Any], draft_vocab_size: int, aux_ids_output: list[int]
) -> dict[str, Any]:
    """SpecForge's LlamaForCausalLMEagle3 config for this target, built as SpecForge builds one from a
    target (model_loading._generate_draft_config: the target's architecture fields, one layer, untied),
    with draftsmith's draft vocabulary size."""
    keep = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "max_position_embeddings", "rms_norm_eps", "hidden_act", "initializer_range", "attention_bias",
            "attention_dropout", "head_dim", "rope_theta", "rope_scaling", "rope_parameters",
            "bos_token_id", "eos_token_id", "pad_token_id")  # fmt: skip
    cfg = {k: target_config[k] for k in keep if target_config.get(k) is not None}
    cfg.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,
        use_cache=True,
        draft_vocab_size=int(draft_vocab_size),
        target_hidden_size=int(target_config["hidden_size"]),
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_ids_output), "use_aux_hidden_state": True},
    )
    cfg.setdefault("pad_token_id", 0)
    return cfg


def data_key(manifest: dict[str, Any], vocab_path: Path, settings: dict[str, Any]) -> str:
    """What the converted data depends on: the shards' content, the vocab map, and the split/truncation/
    positions settings."""
    h = hashlib.sha256()
    for shard in manifest["shards"]:
        h.update(str(shard.get("content_sha256") or shard["path"]).encode())
    h.update(hashlib.sha256(vocab_path.read_bytes()).hexdigest().encode())
    for k in ("max_seq_len", "val_fraction", "loss_positions", "seed"):
        h.update(f"{k}={settings[k]}".encode())
    return h.hexdigest()[:16]


def convert(
    manifest_path: Path, vocab_path: Path, settings: dict[str, Any], out: Path, fresh: bool
) -> dict[str, Any]:
    """This run's shards and vocabulary in SpecForge's offline format under out/ -> a summary."""
    from draftsmith.core.data.vocab import load_vocab_map
    from draftsmith.stages.train import TrainSettings

    manifest = load_manifest(manifest_path)
    key = data_key(manifest, vocab_path, settings)
    summary_path = out / "convert.json"
    if not fresh and summary_path.is_file() and json.loads(summary_path.read_text())["key"] == key:
        return json.loads(summary_path.read_text())
    t0 = time.perf_counter()
    for split in ("train", "val"):
        shutil.rmtree(out / split, ignore_errors=True)
    data = StreamingData.from_manifest(manifest, TrainSettings.from_dict(settings))
    counts = {s: write_samples(data, s, out / s, settings["loss_positions"]) for s in ("train", "val")}
    data.close()
    vocab = load_vocab_map(vocab_path)
    with atomic_path(out / "vocab_mapping.pt") as tmp:
        torch.save({"d2t": vocab["d2t"], "t2d": vocab["t2d"]}, tmp)
    target_dir = Path(manifest["target"])
    if not target_dir.is_absolute() and not target_dir.is_dir():
        target_dir = (manifest_path.parent.parent / target_dir).resolve()
    target_dir = target_dir.resolve()
    write_target_folder(target_dir, out / "target")
    ids_input = [int(i) for i in manifest["aux_layer_ids"]]
    ids_input = convert_layer_ids(ids_input, manifest.get("layer_convention", "input"), "input")
    ids_output = convert_layer_ids(ids_input, "input", "output")
    tcfg = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
    write_json(
        out / "draft_config.json",
        draft_config(tcfg.get("text_config", tcfg), vocab["d2t"].numel(), ids_output),
    )
    summary = {
        "key": key,
        "samples": counts,
        "tokens": {
            "train": sum(r.num_tokens for r in data.train),
            "val": sum(r.num_tokens for r in data.val),
        },
        "aux_layer_ids_input": ids_input,
        "aux_layer_ids_output": ids_output,
        "draft_vocab_size": int(vocab["d2t"].numel()),
        "loss_positions": settings["loss_positions"],
        "target": str(target_dir),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    write_json(summary_path, summary)
    return summary
