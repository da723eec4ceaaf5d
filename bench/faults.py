"""The fault matrix: run every fault scenario against the real workflow and print what happened.

    python bench/faults.py [--json results/bench/faults.json] [-k EXPR]

The scenarios and the outcome each must have live in tests/e2e/test_faults.py and
tests/e2e/test_extract_kill.py (one place: the assertions are the matrix); this runs them with pytest
and tabulates fault, outcome and seconds. Exit status: pytest's (0 = every fault handled as designed;
an expected failure, marked xfail, is a check that lands with another change).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import click

from draftsmith.atomic import write_json

REPO = Path(__file__).resolve().parents[1]
MODULES = ["tests/e2e/test_extract_kill.py", "tests/e2e/test_faults.py"]


def outcome(case: ET.Element) -> tuple[str, str]:
    """(outcome, first line of its message) of one junit testcase."""
    for tag, name in (("failure", "FAILED"), ("error", "ERROR"), ("skipped", "skipped")):
        node = case.find(tag)
        if node is not None:
            message = (node.get("message") or "").strip().splitlines()
            if tag == "skipped" and node.get("type") == "pytest.xfail":
                name = "xfail"
            return name, message[0][:100] if message else ""
    return "passed", ""


@click.command()
@click.option("--json", "json_path", default="results/bench/faults.json", show_default=True)
@click.option("-k", "select", default=None, help="pytest -k expression: run some faults only.")
def main(json_path: str, select: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "faults.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *MODULES,
        ]
        rc = subprocess.run([*cmd, *(["-k", select] if select else [])], cwd=REPO).returncode
        cases = ET.parse(junit).getroot().iter("testcase") if junit.is_file() else []
        rows = []
        for case in cases:
            result, message = outcome(case)
            name = case.get("name", "")
            rows.append(
                {"fault": name, "outcome": result, "seconds": float(case.get("time", 0)), "note": message}
            )
    print(f"\n{'fault':78s} {'outcome':8s} {'seconds':>8s}")
    for row in rows:
        print(f"{row['fault'][:78]:78s} {row['outcome']:8s} {row['seconds']:8.1f}")
        if row["note"] and row["outcome"] != "passed":
            print(f"    {row['note']}")
    write_json(json_path, {"pytest_exit": rc, "faults": rows})
    print(f"wrote {json_path}")
    sys.exit(rc)


if __name__ == "__main__":
    main()
