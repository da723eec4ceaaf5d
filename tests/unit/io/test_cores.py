"""CPU cores per job (draftsmith.core.io.cores): leases and the confinement `draftsmith run` applies."""

import os
import subprocess
import sys

import pytest

from draftsmith.core.io import cores
from draftsmith.core.io.cores import confine_to_own_cores, job_threads, lease_cores


def test_two_leases_get_different_cores_and_a_third_none(tmp_path):
    first, second = lease_cores(1, [0, 1], tmp_path), lease_cores(1, [0, 1], tmp_path)
    assert (first.cores, second.cores) == ([0], [1])
    assert lease_cores(1, [0, 1], tmp_path).cores == []  # both held: the job runs where the system puts it
    first.release()
    assert lease_cores(1, [0, 1], tmp_path).cores == [0]  # released
    second.release()


def test_a_lease_takes_as_many_free_cores_as_asked(tmp_path):
    one, two = lease_cores(1, [2, 5, 7, 9], tmp_path), lease_cores(2, [2, 5, 7, 9], tmp_path)
    assert (one.cores, two.cores) == ([2], [5, 7])
    assert lease_cores(3, [2, 5, 7, 9], tmp_path).cores == [9]  # fewer than asked: what is free


def test_nothing_is_leased_where_the_job_may_use_every_core(tmp_path):
    assert lease_cores(2, [0, 1], tmp_path).cores == lease_cores(8, [0, 1], tmp_path).cores == []
    assert not list(tmp_path.iterdir())


def test_a_killed_holder_releases_its_lease(tmp_path):
    """The kernel drops a dead process's flock: a kill -9 leaves no core taken."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import pathlib, time; from draftsmith.core.io.cores import lease_cores\n"
         f"print(lease_cores(1, [0, 1], pathlib.Path({str(tmp_path)!r})).cores, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "[0]"
    assert lease_cores(1, [0, 1], tmp_path).cores == [1]
    holder.kill()
    holder.wait()
    assert lease_cores(1, [0, 1], tmp_path).cores == [0]


def test_the_jobs_threads_are_what_its_runner_set():
    assert job_threads({"OMP_NUM_THREADS": "3"}) == 3
    assert (
        job_threads({})
        is job_threads({"OMP_NUM_THREADS": "0"})
        is job_threads({"OMP_NUM_THREADS": "x"})
        is None
    )


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_a_job_and_what_it_starts_run_on_its_leased_cores(tmp_path):
    """Confined in a child (this process keeps its cores): the command it execs inherits the affinity and
    the lease, which a second job then cannot take. The child first takes every core of the machine (a
    test worker is pinned to its share, and an affinity may be widened), so this runs in the suite too."""
    cores = list(range(os.cpu_count() or 1))
    if len(cores) < 2:
        pytest.skip("one core: nothing to share")
    code = (
        "import os, pathlib, sys; from draftsmith.core.io.cores import confine_to_own_cores\n"
        f"os.sched_setaffinity(0, {cores!r})\n"
        f"lease = confine_to_own_cores({{'OMP_NUM_THREADS': '1'}}, pathlib.Path({str(tmp_path)!r}))\n"
        "os.execv(sys.executable, [sys.executable, '-c', "
        "'import os, time; print(sorted(os.sched_getaffinity(0)), flush=True); time.sleep(60)'])"
    )
    job = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline().strip() == f"[{cores[0]}]"
        assert lease_cores(1, cores, tmp_path).cores == [cores[1]]  # the exec'd job still holds its core
    finally:
        job.kill()
        job.wait()


def test_a_job_without_a_thread_count_or_with_every_core_is_left_alone(tmp_path):
    before = os.sched_getaffinity(0) if hasattr(os, "sched_setaffinity") else None
    assert confine_to_own_cores({}, tmp_path).cores == []
    assert confine_to_own_cores({"OMP_NUM_THREADS": "1024"}, tmp_path).cores == []
    if before is not None:
        assert os.sched_getaffinity(0) == before


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_a_lease_folder_that_cannot_be_made_leaves_the_job_unconfined(tmp_path, monkeypatch):
    """A lease only speeds a job up: where its folder cannot be made, the job runs unconfined."""
    monkeypatch.setattr(cores, "allowed_cores", lambda: [0, 1])  # a core to share, on any machine
    blocked = tmp_path / "a file"
    blocked.write_text("")
    assert confine_to_own_cores({"OMP_NUM_THREADS": "1"}, blocked / "leases").cores == []


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a folder away needs root")
def test_another_users_lease_folder_is_not_used(tmp_path):
    folder = tmp_path / "leases"
    folder.mkdir()
    os.chown(folder, 12345, -1)
    assert lease_cores(1, [0, 1], folder).cores == []
    assert not list(folder.iterdir())
