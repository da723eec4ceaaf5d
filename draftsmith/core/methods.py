"""The methods the evaluation measures, named once: the keys offline.json and vllm.json use, and what
tables, plots and verdicts call them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    key: str  # as in offline.json / vllm.json "methods"
    label: str  # in tables and verdicts
    short: str  # in plot ticks and one-line comparisons
    color: str  # matplotlib colour in every plot


PLAIN = Method("plain", "plain decoding", "plain", "tab:blue")
METHODS = {
    m.key: m
    for m in (
        Method("eagle3", "trained drafter", "trained", "tab:green"),
        Method("untrained", "untrained drafter", "untrained", "tab:gray"),
        Method("ngram", "n-gram lookup", "n-gram", "tab:purple"),
        Method("suffix", "suffix decoding", "suffix", "tab:orange"),
        Method("hybrid", "hybrid: suffix decoding, else the drafter", "hybrid", "tab:brown"),
    )
}
ORDER = tuple(METHODS)
# who measured a row: draftsmith's own speculative decoding, or real vLLM
MEASURED_BY = ("offline", "vLLM")


def method(key: str) -> Method:
    """The method of a key; a key no table knows is shown as itself."""
    return METHODS.get(key) or Method(key, key, key, "tab:olive")


def ordered(keys: set[str] | list[str]) -> list[str]:
    """Known methods in their fixed order, then the rest sorted."""
    keys = set(keys)
    return [k for k in ORDER if k in keys] + sorted(keys - set(ORDER))
