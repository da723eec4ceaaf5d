"""bench/faults.py's case runner: a case that waits on stdin, outlives its time limit or leaves processes
behind cannot hang the table or leave anything running; the table's cells stay one cell each."""

from __future__ import annotations

import importlib
import json
import os
import time
from pathlib import Path

import pytest

# The case's process runs this instead of a probe: each case name is one behaviour. `spawn` starts a
# sleeper in a session of its own (as the vLLM server does) and records its pid.
RUNNER = """
import os, subprocess, sys, time
case, checkout, root, out = sys.argv[1:]
def spawn():
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    open(root + ".pid", "w").write(str(child.pid))
if case == "stdin":
    open(out, "w").write(f"read {len(sys.stdin.read())} bytes")
elif case == "hangs":
    spawn(); time.sleep(300)
elif case == "leaves":
    spawn(); open(out, "w").write("done | left a sleeper")
else:
    sys.exit("no outcome")
"""


@pytest.fixture(scope="module")
def faults():
    return importlib.import_module("bench.faults")


def gone(pid: int) -> bool:
    """Whether `pid` has died within 5 s (SIGKILL is asynchronous; a zombie, not yet reaped by its dead
    parent's reaper, counts as dead)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def test_a_case_reads_no_terminal(faults, tmp_path) -> None:
    outcome, _ = faults.probe_case("stdin", tmp_path, tmp_path / "probe-0", 60, runner=RUNNER)
    assert outcome == "read 0 bytes"  # stdin is /dev/null: end of file at once, not a wait


def test_a_case_past_its_limit_is_killed_with_what_it_started(faults, tmp_path) -> None:
    start = time.monotonic()
    outcome, seconds = faults.probe_case("hangs", tmp_path, tmp_path / "probe-0", 3, runner=RUNNER)
    assert outcome == "timeout (3 s)"
    assert seconds < 60 and time.monotonic() - start < 60
    pid = int((tmp_path / "probe-0.pid").read_text())
    assert gone(pid)  # the sleeper left the case's session, and died with it all the same


def test_processes_a_finished_case_leaves_are_killed(faults, tmp_path) -> None:
    outcome, _ = faults.probe_case("leaves", tmp_path, tmp_path / "probe-0", 60, runner=RUNNER)
    assert outcome == "done | left a sleeper"
    pid = int((tmp_path / "probe-0.pid").read_text())
    assert gone(pid)
    assert faults.marked(f"{os.getpid()}-{tmp_path.name}-probe-0") == []


def test_a_case_without_an_outcome_says_how_it_ended(faults, tmp_path) -> None:
    outcome, _ = faults.probe_case("unknown", tmp_path, tmp_path / "probe-0", 60, runner=RUNNER)
    assert outcome == "probe crashed, exit 1: no outcome"


def test_the_table_keeps_one_cell_per_outcome(faults) -> None:
    rows = [{"case": "a | b", "before": "exit 2: x|y\nz", "after": "ok"}]
    table = faults.probe_table(rows, ["before", "after"])
    assert table.splitlines() == [
        "| case | before | after |",
        "|---|---|---|",
        "| a \\| b | exit 2: x\\|y z | ok |",
    ]
    assert (
        faults.probe_table([{"case": "c", "after": "ok"}], ["after"]).splitlines()[0] == "| case | outcome |"
    )


def test_the_rows_so_far_are_written_as_json_and_markdown(faults, tmp_path) -> None:
    rows = [{"case": "c", "before": "exit 1", "before_s": 2.0, "after": "exit 2", "after_s": 1.0}]
    run = {"timeout_s": 300.0, "jobs": 2, "load_before": [0.5, 0.5, 0.5], "start": time.monotonic()}
    faults.write_probe_rows(rows, ["before", "after"], run, str(tmp_path / "faults.json"))
    written = json.loads((tmp_path / "faults.json").read_text())
    assert written["probes"] == rows and written["cases"] == 1 and written["jobs"] == 2
    assert written["machine"]["load_average"]["before"] == [0.5, 0.5, 0.5]
    assert (tmp_path / "faults.md").read_text() == faults.probe_table(rows, ["before", "after"])
