"""A check of the acceptance gate, as summary.json records it, and the order checks are shown in: shared
by the gate, which makes them, and the report, which reads them back (without loading the gate)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Check:
    name: str
    status: str  # pass, fail, warn (failed, not blocking), info (reported, not judged), skip (not computable)
    value: str  # the measured number(s), formatted
    threshold: str  # what it is compared against
    where: str  # where to look when it fails
    blocking: bool = True
    group: str = ""  # alternatives | speed | contract | learning
    heldout: str | None = None  # the held-out set it was measured on

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    @property
    def missed(self) -> bool:
        """Failed, blocking or not."""
        return self.status in ("fail", "warn")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def order_checks(checks: list[Check]) -> list[Check]:
    """Failed checks first, then warnings, then the rest (stable within each group)."""
    rank = {"fail": 0, "warn": 1}
    return sorted(checks, key=lambda c: rank.get(c.status, 2))


def checks_of(summary: dict[str, Any]) -> list[Check]:
    return [Check(**c) for c in summary["checks"]]
