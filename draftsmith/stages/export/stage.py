"""The export stage: from the trained vLLM export, the SGLang and speculators forms, each written
atomically and checked against what its engine reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from draftsmith.core.evaluation.engines import trained_ttt_steps
from draftsmith.core.export.formats.check import check_export
from draftsmith.core.export.formats.common import (
    CONFIG_NAME,
    DTYPES,
    WEIGHTS_NAME,
    draftsmith_block,
    write_files,
)
from draftsmith.core.export.formats.sglang import sglang_config
from draftsmith.core.export.formats.speculators import speculators_export_config, speculators_names
from draftsmith.core.io.atomic import atomic_dir, write_text
from draftsmith.core.model.drafter import DrafterConfig
from draftsmith.core.model.kinds import KINDS, kind

NOT_WRITTEN = "NOT_WRITTEN.md"


def not_written_note(engine: str, kind: str) -> str:
    served = ", ".join(k.name for k in KINDS.values() if engine in k.forms)
    return (
        f"# No {engine} form for this drafter\n\ndraftsmith writes the {engine} form for {served} drafters only; "
        f"this one is {kind!r}, which draftsmith has not checked that {engine} serves as trained. Serve the vLLM "
        "export (results/drafter/), which vLLM's own code loads in draftsmith's tests.\n"
    )


def export_engines(
    drafter_dir: str | Path,
    sglang_dir: str | Path,
    speculators_dir: str | Path,
    target_embedding: torch.Tensor,
    num_draft_tokens: int | None,
    verifier_architectures: list[str] | None = None,
) -> dict[str, Path]:
    """From the trained vLLM export, write the SGLang and speculators forms (the same tensors, bit for
    bit; only names and config differ), each atomically and each passing its engine's checks -> the
    folders written. A form not written for the drafter's kind (its `Kind.forms`) is a folder with a note.

    The speculators form also carries the target's input embedding [V, Ht] as `embed_tokens.weight`,
    as speculators' own checkpoints do: its loader fills a missing one with zeros, not the verifier's."""
    drafter_dir = Path(drafter_dir)
    problems = check_export(drafter_dir, engine="vllm")
    if problems:
        raise ValueError(f"{drafter_dir} is not a valid vLLM export: " + "; ".join(problems))
    config = json.loads((drafter_dir / CONFIG_NAME).read_text(encoding="utf-8"))
    block = config["draftsmith"] if "drafter_config" in (config.get("draftsmith") or {}) else None
    if block is None:
        raise ValueError(f"{drafter_dir / CONFIG_NAME} has no draftsmith block: not a draftsmith export")
    cfg = DrafterConfig.from_dict(block["drafter_config"])
    input_ids = [int(i) for i in block["aux_layer_ids_input"]]
    target = block["target"]
    dtype = DTYPES[config.get("torch_dtype", "bfloat16")]
    extra = {k: v for k, v in block.items() if k not in draftsmith_block(cfg, "vllm", [], "", None)}
    tensors = load_file(str(drafter_dir / WEIGHTS_NAME))
    if num_draft_tokens is None:
        num_draft_tokens = trained_ttt_steps(config) or 3
    if tuple(target_embedding.shape) != (cfg.target_vocab_size, cfg.hidden_size):
        raise ValueError(
            f"the target's embedding has shape {list(target_embedding.shape)}, the drafter needs "
            f"[{cfg.target_vocab_size}, {cfg.hidden_size}]"
        )
    outs = {"sglang": Path(sglang_dir), "speculators": Path(speculators_dir)}
    for engine in [e for e in outs if e not in kind(cfg.kind).forms]:
        with atomic_dir(outs.pop(engine)) as tmp:
            write_text(tmp / NOT_WRITTEN, not_written_note(engine, cfg.kind))
    forms = {}
    if "sglang" in outs:
        forms["sglang"] = (sglang_config(cfg, input_ids, target, dtype, extra), tensors)
    if "speculators" in outs:
        forms["speculators"] = (
            speculators_export_config(
                cfg, input_ids, target, num_draft_tokens, verifier_architectures, dtype, extra
            ),
            {**speculators_names(tensors), "embed_tokens.weight": target_embedding.to(dtype).contiguous()},
        )
    for engine, (engine_config, engine_tensors) in forms.items():
        with atomic_dir(outs[engine]) as tmp:
            write_files(tmp, engine_config, engine_tensors)
            problems = check_export(tmp, engine=engine)
            if problems:
                raise RuntimeError(f"the {engine} export failed its own checks: {problems}")
    return outs


class ExportError(ValueError):
    """The trained export or the target cannot make the engine exports (bad input: exit 2)."""


def export_stage(
    drafter_dir: str | Path,
    sglang_dir: str | Path,
    speculators_dir: str | Path,
    target_path: str | Path,
    num_draft_tokens: int | None,
    summary_path: str | Path | None = None,
) -> dict[str, Path]:
    """The export stage: check the trained vLLM export against the target (layer count and vocabulary
    from its text config, so wrappers such as Kimi-K2.5 keep them under `text_config`), then write the
    SGLang and speculators forms, each checked against the target as well, and with the evaluation's
    `summary_path` the model card of every export (README.md, the trained one's included). Raises
    ExportError for an export or target that cannot be exported, RuntimeError when a written form fails
    its checks."""
    from draftsmith.core.model.target import load_target_head, text_config_dict
    from draftsmith.stages.export.card import SummaryError, render_cards

    if summary_path is not None:  # a junk summary is refused before any export is written
        folders = {"vllm": drafter_dir, "sglang": sglang_dir, "speculators": speculators_dir}
        try:
            render_cards(summary_path, folders, target_path)
        except SummaryError as err:
            raise ExportError(str(err)) from None
    target = text_config_dict(target_path)
    layers, vocab_size = target.get("num_hidden_layers"), target.get("vocab_size")
    if layers is None or vocab_size is None:
        raise ExportError(
            f"{Path(target_path) / CONFIG_NAME}: no num_hidden_layers or vocab_size (nor under text_config)"
        )
    problems = check_export(
        drafter_dir, target_num_layers=layers, target_vocab_size=vocab_size, engine="vllm"
    )
    if problems:
        raise ExportError(f"{drafter_dir} is not a valid vLLM export: " + "; ".join(problems))
    architectures = _architectures(target_path)
    try:
        embedding = load_target_head(target_path).embed
        outs = export_engines(
            drafter_dir, sglang_dir, speculators_dir, embedding, num_draft_tokens, architectures
        )
    except ValueError as err:
        raise ExportError(str(err)) from err
    for engine, path in outs.items():
        problems = check_export(path, target_num_layers=layers, target_vocab_size=vocab_size, engine=engine)
        if problems:
            raise RuntimeError(f"the {engine} export {path} fails its checks: " + "; ".join(problems))
    if summary_path is not None:
        from draftsmith.stages.export.card import write_cards

        write_cards(summary_path, {"vllm": Path(drafter_dir), **outs}, target_path)
    return outs


def _architectures(target_path: str | Path) -> list[str] | None:
    """The target's own architectures (the wrapper's, for a multimodal target): speculators' verifier."""
    config: dict[str, Any] = json.loads((Path(target_path) / CONFIG_NAME).read_text(encoding="utf-8"))
    return config.get("architectures")
