"""The methods the evaluation measures, one `Method` record each: the key offline.json and vllm.json use,
what tables, plots and verdicts call it, and what it is: free or not, how it proposes offline, how vLLM is
told to run it at a draft length k, which action deploys it, which settings it reads. The verdict, the
projection, the serving policy and vLLM's speculative_config derive from these records; adding a free
method = its proposer + one record here + its schema keys (docs/changing.md).

Imports nothing of draftsmith but the kinds registry's `resolve` and no torch: the classes and functions
a record names are dotted paths, imported when used."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from draftsmith.core.model.kinds import resolve

# cost.step_seconds' kind of a method that drafts with a drafter model (its shape says how it drafts)
DRAFTED = "eagle3"


@dataclass(frozen=True)
class Method:
    key: str  # as in offline.json / vllm.json "methods"
    label: str  # in tables and verdicts
    short: str  # in plot ticks and one-line comparisons
    color: str  # matplotlib colour in every plot
    # what cost.step_seconds prices a step of it as: DRAFTED, a free method's key, or "hybrid"
    cost: str | None = None
    free: bool = False  # the engine serves it without a drafter model (the verdict's alternatives)
    served: bool = True  # an engine serves it (False: a control or an offline-only projection)
    per_batch_k: bool = False  # vLLM takes a k per batch size for it (num_speculative_tokens_per_batch_size)
    deploy: str | None = None  # the verdict's action when it is the fastest choice
    measure: str | None = None  # the evaluate.<flag> that turns its measurement on
    settings: str | None = None  # the evaluate.<key> its own settings live under (a free method's)
    proposer: str | None = (
        None  # offline proposer class, `.from_settings(its settings)`; drafters: their kind's
    )
    vllm: str | None = None  # engines.<function>(drafter, k, settings) -> vLLM's speculative_config at k

    def own_settings(self, given: dict[str, Any]) -> dict[str, Any]:
        """Its settings: the given ones over the schema's defaults of evaluate.<settings>."""
        if self.settings is None:
            return dict(given)
        from draftsmith.core.config.settings import schema_default

        return {**schema_default(f"evaluate.{self.settings}"), **given}

    def vllm_config(self, drafter: str | None, k: int, settings: dict[str, Any]) -> dict[str, Any]:
        """vLLM's speculative_config for this method at draft length k."""
        if self.vllm is None:
            raise ValueError(f"method {self.key!r} is measured offline only: vLLM has no config for it")
        return resolve(self.vllm)(drafter, k, self.own_settings(settings))

    def offline_proposer(self, settings: dict[str, Any]) -> Any:
        """The method's offline proposer (a speculate.Proposer) from its settings (a free method's)."""
        if self.proposer is None:
            raise ValueError(f"method {self.key!r} proposes with a drafter: build it from its kind")
        factory: Callable[[dict[str, Any]], Any] = resolve(self.proposer).from_settings
        return factory(self.own_settings(settings))


PLAIN = Method("plain", "plain decoding", "plain", "tab:blue", deploy="no speculation")
DRAFTER_CONFIG = "draftsmith.core.evaluation.engines:drafter_config"
METHODS = {
    m.key: m
    for m in (
        Method("eagle3", "trained drafter", "trained", "tab:green", DRAFTED, per_batch_k=True,
               deploy="deploy drafter", vllm=DRAFTER_CONFIG),
        Method("untrained", "untrained drafter", "untrained", "tab:gray", DRAFTED, served=False,
               vllm=DRAFTER_CONFIG),
        Method("ngram", "n-gram lookup", "n-gram", "tab:purple", "ngram", free=True, per_batch_k=True,
               deploy="deploy n-gram", measure="ngram", settings="ngram_lookup",
               proposer="draftsmith.core.evaluation.speculate:NgramProposer", vllm="draftsmith.core.evaluation.engines:ngram_config"),
        Method("suffix", "suffix decoding", "suffix", "tab:orange", "suffix", free=True,
               deploy="deploy suffix decoding", measure="suffix", settings="suffix_decoding",
               proposer="draftsmith.core.evaluation.speculate:SuffixProposer", vllm="draftsmith.core.evaluation.engines:suffix_config"),
        Method("hybrid", "hybrid: suffix decoding, else the drafter", "hybrid", "tab:brown", "hybrid",
               served=False, measure="hybrid"),
    )
}  # fmt: skip
ORDER = tuple(METHODS)
FREE_METHODS = tuple(k for k, m in METHODS.items() if m.free)  # what the engine serves without a drafter
# who measured a row: draftsmith's own speculative decoding, or real vLLM
MEASURED_BY = ("offline", "vLLM")


def method(key: str) -> Method:
    """The method of a key; a key no table knows is shown as itself (a drafter's, priced as one)."""
    return METHODS.get(key) or Method(key, key, key, "tab:olive", DRAFTED)


def ordered(keys: set[str] | list[str]) -> list[str]:
    """Known methods in their fixed order, then the rest sorted."""
    keys = set(keys)
    return [k for k in ORDER if k in keys] + sorted(keys - set(ORDER))
