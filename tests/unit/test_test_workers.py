"""The test suite's own machinery: tests marked with one xdist_group run on one pytest-xdist worker
(scripts/test.sh's `--dist loadgroup`), so a fixture they share (the tiny run, a module's family twin) is
built once, not once per worker."""

import os
import subprocess
import sys

GROUPED = """
import os
import pytest

@pytest.mark.xdist_group("shared")
@pytest.mark.parametrize("i", range(4))
def test_member(i):
    with open(os.path.join(os.environ["GROUP_OUT"], f"ran-{i}"), "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])

@pytest.mark.parametrize("i", range(4))
def test_other(i):
    pass
"""


def test_one_xdist_group_runs_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    out = tmp_path / "out"
    out.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
         "--rootdir", str(tmp_path), str(tmp_path / "test_grouped.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "GROUP_OUT": str(out)},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    workers = {(out / f"ran-{i}").read_text() for i in range(4)}
    assert len(workers) == 1, f"one group ran on workers {sorted(workers)}"


def test_the_longest_groups_are_handed_out_first_then_the_largest():
    from helpers.workflow import LONGEST_GROUPS, group_order

    first, second = LONGEST_GROUPS[1], LONGEST_GROUPS[0]
    collected = ["small", "big", "big", "big", first, "one", second, "small"]
    order = group_order(collected)
    assert sorted(order, key=order.get) == [second, first, "big", "small", "one"]


def test_busy_seconds_add_up_by_worker_and_by_group():
    from types import SimpleNamespace

    from helpers.workflow import busy_seconds

    def report(worker: str, nodeid: str, seconds: float) -> SimpleNamespace:
        return SimpleNamespace(
            node=SimpleNamespace(gateway=SimpleNamespace(id=worker)), nodeid=nodeid, duration=seconds
        )

    reports = [report("gw0", "t.py::a@tiny_run", 300.0), report("gw0", "t.py::b@tiny_run", 20.0),
               report("gw1", "u.py::c@u", 5.5), SimpleNamespace(nodeid="no worker", duration=1.0)]  # fmt: skip
    workers, groups = busy_seconds(reports)
    assert workers == {"gw0": 320.0, "gw1": 5.5} and groups == {"tiny_run": 320.0, "u": 5.5}
