"""How the suite's tests are spread over pytest-xdist workers: the order groups are handed out in, and
where the time went (tests/conftest.py's hooks call these)."""

from __future__ import annotations

from collections.abc import Iterable

# The longest groups, longest first (`make test` prints each group's seconds: "test groups by time").
# pytest-xdist hands groups out in the order they are collected (scripts/test.sh: --no-loadscope-reorder):
# a long group handed out last keeps one worker busy while the other has nothing left to do. Seconds on
# a 2-core AVX-512 BF16 EPYC, .ci/run of commit 5a1b396.
LONGEST_GROUPS = (
    "test_families",  # ~430 s: 7 twins through vLLM
    "tiny_run",  # ~400 s: the shared run (311 s) and the tests that read it
    "test_slurm",  # ~240 s
    "test_dflash_vllm",  # ~150 s
    "unit.training.test_distributed",  # ~125 s
    "test_eval_context_vllm",  # ~100 s
    "test_vllm_export",  # ~100 s
    "test_extract_backends",  # ~100 s
    "test_kimi_workflow",  # ~95 s
)


def group_order(groups: list[str]) -> dict[str, int]:
    """Each group's place in the hand-out order: LONGEST_GROUPS first, then the rest by their number of
    tests, most first (pytest-xdist's own order), ties in collection order."""
    counts: dict[str, int] = {}
    for group in groups:
        counts[group] = counts.get(group, 0) + 1
    listed = [g for g in LONGEST_GROUPS if g in counts]
    rest = sorted((g for g in counts if g not in LONGEST_GROUPS), key=lambda g: -counts[g])
    return {group: rank for rank, group in enumerate(listed + rest)}


def busy_seconds(reports: Iterable) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of set-up, call and tear-down per pytest-xdist worker and per group (the `@group` suffix
    pytest-xdist gives a grouped test's id), from the session's reports."""
    workers: dict[str, float] = {}
    groups: dict[str, float] = {}
    for report in reports:
        node = getattr(report, "node", None)
        duration = getattr(report, "duration", None)
        if node is None or duration is None:
            continue
        worker = getattr(getattr(node, "gateway", None), "id", "?")
        workers[worker] = workers.get(worker, 0.0) + duration
        group = report.nodeid.rpartition("@")[2] if "@" in report.nodeid else "(none)"
        groups[group] = groups.get(group, 0.0) + duration
    return workers, groups
