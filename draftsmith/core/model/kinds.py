"""The drafter kinds (train.drafter.kind), one `Kind` record each: what builds, trains, runs, writes, reads
and serves it, and what the model card calls it. Adding a kind = its files (model, loss, proposer, export
form) + one record here + the schema's enum (docs/changing.md).

This module imports nothing of draftsmith and no torch: the classes and functions a record names are
dotted paths, imported when used, so that the modules that only read a record (the cost model, vLLM's
speculative_config, the model card) and the model modules the records name may all import it."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# the layer of a DrafterConfig written before kinds existed (no "kind" key): EAGLE-3 by history, whatever
# the schema's default is now
LEGACY_KIND = "eagle3"


def resolve(dotted: str) -> Any:
    """The object a "module:attribute" path names (imported on first use)."""
    module, _, name = dotted.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Kind:
    name: str  # train.drafter.kind
    card_name: str  # what the model card calls it
    tag: str  # its Hub tag
    model: str  # the nn.Module class, built from a DrafterConfig
    loss: str  # the training objective, with objective.ttt_loss's signature
    proposer: str  # offline drafting as vLLM serves it: (drafter, embed) -> speculate.Proposer
    param_count: str  # DrafterConfig -> parameters of the model (printed before training)
    writer: str  # the vLLM export: export_formats.vllm.save_drafter's signature
    reader: str  # an export folder -> (model in eval mode, config.json)
    # how it drafts k tokens (cost.ModelCost.drafting): "chain" = k passes (EAGLE-3, 3.1); "parallel" =
    # one pass over the k catch-up and mask slots (P-EAGLE); "block" = one pass over the next token and k
    # mask slots (DFlash). Every non-chain kind drafts into mask slots (train.drafter.mask_token_id).
    drafting: str
    # what vLLM must be told beside a drafter of this kind that plain eagle3 does not say
    vllm_fields: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # the export forms written for it: those whose reader is known to serve it as trained
    forms: tuple[str, ...] = ("vllm",)
    # its own export form's checks (export_formats.check.check_dflash_export's signature); None: the
    # EAGLE-3 form's, which check_export makes itself
    checker: str | None = None
    # EAGLE 3.1's RMSNorm on each aux state and post-norm recurrence (fc_norm, norm_output)
    norms: bool = False
    layers: bool = False  # may stack more than one decoder layer (train.drafter.num_layers)

    @property
    def masked(self) -> bool:
        """Drafts into mask slots (a mask token id in its config)."""
        return self.drafting != "chain"

    def load(self, attribute: str) -> Callable[..., Any]:
        """The class or function one of the record's dotted paths names (model, loss, proposer, ...)."""
        return resolve(getattr(self, attribute))


EAGLE = "draftsmith.core.model.drafter:Eagle3Drafter"
EAGLE_COUNT = "draftsmith.core.model.drafter:param_count"
EAGLE_WRITER = "draftsmith.core.export.formats.vllm:save_eagle3"
EAGLE_READER = "draftsmith.core.export.formats.load:load_eagle3"
TTT_LOSS = "draftsmith.core.training.objective:ttt_loss"
# SGLang's EAGLE-3 reader has not been checked against EAGLE 3.1's norms or parallel drafting;
# speculators' format carries EAGLE 3.1's flags, which vLLM's reader of that format copies
KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("eagle3", "EAGLE-3", "eagle3", EAGLE, TTT_LOSS, "draftsmith.core.evaluation.speculate:Eagle3Proposer",
             EAGLE_COUNT, EAGLE_WRITER, EAGLE_READER, "chain", forms=("vllm", "sglang", "speculators")),
        Kind("eagle3.1", "EAGLE 3.1", "eagle3", EAGLE, TTT_LOSS, "draftsmith.core.evaluation.speculate:Eagle3Proposer",
             EAGLE_COUNT, EAGLE_WRITER, EAGLE_READER, "chain", forms=("vllm", "speculators"), norms=True),
        Kind("peagle", "P-EAGLE (parallel drafting)", "p-eagle", EAGLE, TTT_LOSS,
             "draftsmith.core.evaluation.speculate:PEagleProposer", EAGLE_COUNT, EAGLE_WRITER, EAGLE_READER, "parallel",
             MappingProxyType({"parallel_drafting": True})),
        Kind("dflash", "DFlash", "dflash", "draftsmith.core.model.dflash:DFlashDrafter",
             "draftsmith.core.training.objective_dflash:dflash_loss", "draftsmith.core.model.dflash:DFlashProposer",
             "draftsmith.core.model.dflash:dflash_param_count", "draftsmith.core.export.formats.vllm_dflash:save_dflash",
             "draftsmith.core.export.formats.vllm_dflash:load_dflash", "block",
             MappingProxyType({"method": "dflash"}), layers=True,
             checker="draftsmith.core.export.formats.check:check_dflash_export"),
    )
}  # fmt: skip


def kind(name: str) -> Kind:
    """The record of a kind; an unknown one is a one-line error naming the key."""
    if name not in KINDS:
        raise ValueError(f"train.drafter.kind={name!r} must be one of {list(KINDS)}")
    return KINDS[name]


def kind_of_export(config: dict[str, Any]) -> str:
    """The kind of an export from its config.json, read from the fields the engine reads (what it will
    serve, whatever a draftsmith block says): a DFlash architecture; a mask token id = parallel drafting
    (P-EAGLE); fc_norm with norm_output = EAGLE 3.1; else EAGLE-3. For speculators' format these fields
    stand at the top level too."""
    if any(str(a).startswith("DFlash") for a in config.get("architectures") or []):
        return "dflash"
    if config.get("mask_token_id", config.get("pard_token")) is not None:
        return "peagle"
    return "eagle3.1" if config.get("fc_norm") and config.get("norm_output") else "eagle3"


def new_drafter(cfg: Any) -> Any:
    """An untrained drafter of cfg's kind (a DrafterConfig; weights as its constructor draws them)."""
    return kind(cfg.kind).load("model")(cfg)


def drafter_loss(cfg: Any) -> Callable[..., Any]:
    """The training objective of cfg's kind, with `ttt_loss`'s signature."""
    return kind(cfg.kind).load("loss")


def drafter_proposer(drafter: Any, embed: Any) -> Any:
    """Offline drafting (a speculate.Proposer) as vLLM serves the drafter's kind."""
    return kind(drafter.cfg.kind).load("proposer")(drafter, embed)


def drafter_param_count(cfg: Any) -> int:
    """Parameters of the drafter cfg describes, as its kind counts them."""
    return int(kind(cfg.kind).load("param_count")(cfg))
