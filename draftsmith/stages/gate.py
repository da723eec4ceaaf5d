"""The gate stage (`draftsmith gate`): read the evaluation's summary.json, print the verdict, the table and
every check, and fail (exit 3) when a blocking one failed; else record gate.json. The checks and the
verdict themselves are computed with the summary (draftsmith.core.verdict)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith.core.atomic import write_json
from draftsmith.core.checks import Check, checks_of, order_checks
from draftsmith.core.report import format_checks, format_table, format_verdict
from draftsmith.core.verdict import passed


class GateFailed(RuntimeError):
    """A blocking check failed: the drafter would not pay for itself, or something upstream is broken."""


def gate_message(checks: list[Check]) -> str:
    failed = [c for c in order_checks(checks) if c.failed]
    head = "; ".join(f"{c.name}: {c.value} [{c.threshold}]" for c in failed)
    looks = " | ".join(f"{c.name} -> {c.where}" for c in failed)
    return f"the acceptance gate failed on {len(failed)} check(s): {head}. Where to look: {looks}"


def enforce(checks: list[Check]) -> None:
    """Raise GateFailed (naming the failed checks first) when a blocking check failed."""
    if not passed(checks):
        raise GateFailed(gate_message(checks))


def read_gate(summary_path: str | Path) -> tuple[str, list[Check], dict[str, Any]]:
    """The gate's report (verdict first, then the table and the diagnosis), the checks and the verdict of
    a summary.json."""
    summary = json.loads(Path(summary_path).read_text(encoding="utf-8"))
    checks = checks_of(summary)
    report = "\n\n".join([format_verdict(summary["verdict"]), format_table(summary), format_checks(checks)])
    return report, checks, summary["verdict"]


def enforce_and_record(
    checks: list[Check], out: str | Path | None, summary_verdict: dict[str, Any] | None = None
) -> None:
    """Raise GateFailed when a blocking check failed; else write `out` (gate.json), when given."""
    enforce(checks)
    if out:
        write_json(out, {"passed": True, "verdict": summary_verdict, "checks": [c.to_dict() for c in checks]})
