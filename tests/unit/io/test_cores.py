"""Cores leased to CPU engines (draftsmith.core.io.cores) and the binding vLLM children get from them."""

import subprocess
import sys

from draftsmith.backends import common
from draftsmith.backends.common import job_cores
from draftsmith.core.io.cores import lease_cores


def test_two_leases_get_different_cores_and_a_third_none(tmp_path):
    with lease_cores(1, [0, 1], tmp_path) as first, lease_cores(1, [0, 1], tmp_path) as second:
        assert (first, second) == ([0], [1])
        with lease_cores(1, [0, 1], tmp_path) as third:
            assert third == []  # both held: the engine binds as vLLM would
    with lease_cores(1, [0, 1], tmp_path) as again:
        assert again == [0]  # released when the block ended


def test_a_lease_takes_as_many_free_cores_as_asked(tmp_path):
    with lease_cores(1, [2, 5, 7, 9], tmp_path) as one, lease_cores(2, [2, 5, 7, 9], tmp_path) as two:
        assert (one, two) == ([2], [5, 7])
        with lease_cores(3, [2, 5, 7, 9], tmp_path) as rest:
            assert rest == [9]  # fewer than asked: what is free


def test_nothing_is_leased_where_the_job_may_use_every_core(tmp_path):
    with lease_cores(2, [0, 1], tmp_path) as cores, lease_cores(8, [0, 1], tmp_path) as more:
        assert cores == more == []
    assert not list(tmp_path.iterdir())


def test_a_killed_holder_releases_its_lease(tmp_path):
    """The kernel drops a dead process's flock: a kill -9 leaves no core taken."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from draftsmith.core.io.cores import lease_cores\n"
         f"with lease_cores(1, [0, 1], __import__('pathlib').Path({str(tmp_path)!r})) as c:\n"
         "    print(c, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "[0]"
    with lease_cores(1, [0, 1], tmp_path) as cores:
        assert cores == [1]
    holder.kill()
    holder.wait()
    with lease_cores(1, [0, 1], tmp_path) as cores:
        assert cores == [0]


def test_a_cpu_engine_is_bound_to_the_jobs_leased_cores(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "lease_cores", lambda n: lease_cores(n, [0, 1], tmp_path))
    child = {"VLLM_TARGET_DEVICE": "cpu"}
    with (
        job_cores(child, {"OMP_NUM_THREADS": "1"}) as first,
        job_cores(child, {"OMP_NUM_THREADS": "1"}) as second,
    ):
        assert first["VLLM_CPU_OMP_THREADS_BIND"] == "0"
        assert second["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in child


def test_an_engine_keeps_vllms_binding_where_nothing_is_to_share(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "lease_cores", lambda n: lease_cores(n, [0, 1], tmp_path))
    cpu = {"VLLM_TARGET_DEVICE": "cpu"}
    cases = [
        (cpu, {}, 1),  # no thread count: run by hand
        (cpu, {"OMP_NUM_THREADS": "2"}, 1),  # every core
        (cpu, {"OMP_NUM_THREADS": "1"}, 2),  # two processes: one list each, vLLM's to make
        ({**cpu, "VLLM_CPU_OMP_THREADS_BIND": "1"}, {"OMP_NUM_THREADS": "1"}, 1),  # the user's own
        ({"VLLM_TARGET_DEVICE": "cuda"}, {"OMP_NUM_THREADS": "1"}, 1),  # a GPU
    ]
    for child, parent, processes in cases:
        with job_cores(child, parent, processes) as env:
            assert env == child
