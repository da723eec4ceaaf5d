"""The gate stage (`draftsmith gate`): read the evaluation's summary.json, print the verdict, the table and
every check, and fail (exit 3) when a blocking one failed; else record gate.json. The checks and the
verdict themselves are computed with the summary (draftsmith.core.evaluation.verdict)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftsmith.core.config.stage_args import BAD_INPUT, GATE, arg
from draftsmith.core.evaluation.checks import Check, checks_of, order_checks
from draftsmith.core.evaluation.report import format_checks, format_table, format_verdict
from draftsmith.core.evaluation.verdict import passed
from draftsmith.core.io.atomic import write_json


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


class NotASummary(ValueError):
    """The file given is no evaluation summary this version reads (bad input)."""


@dataclasses.dataclass
class GatePaths:
    summary: str = arg("SUMMARY_PATH", "", required=True, exists=True)
    out: str | None = arg("--out", "Write the verdict here when the gate passes.")


Paths = GatePaths
EXITS = {NotASummary: BAD_INPUT, GateFailed: GATE}


def run(paths: GatePaths) -> Iterator[str]:
    """Print the verdict, the evaluation table and the diagnosis; exit 3 when a blocking check fails.

    The verdict names what to deploy per held-out set (chat and code can differ): the method and draft
    length with the highest projected wall-clock speedup at the serving point (evaluate.serving), with
    its interval at every concurrency and the runner-up. Checks: the trained drafter beats the best free
    method (suffix decoding, n-gram lookup) there in projected speedup, and its untrained start in tokens
    per target forward, on every held-out set (95% paired bootstrap interval over prompts above 0; vLLM's
    tau, which counts only steps that drafted, is shown, not compared); speedup over plain decoding
    (judged on a GPU, reported on a CPU); the contract (teacher agreement, chat-template fingerprint, the
    export's aux ids/convention/norm flags, vLLM vs offline tau); the learning curves (generalisation,
    still learning: warnings that choose the next action). Which checks block: evaluate.gate.
    """
    try:
        report, checks, verdict = read_gate(paths.summary)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        # gate.json, or a summary from another version: one line, not the formatter's traceback
        why = f"no {err}" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
        raise NotASummary(
            f"{paths.summary} is not an evaluation summary this version reads ({why}); "
            "give results/eval/summary.json"
        ) from None
    yield report
    enforce_and_record(checks, paths.out, verdict)
    yield "gate passed"
