"""GPU slots per job (draftsmith/core/io/devices.py, `draftsmith run`): disjoint devices, waiting, release on death.

A fake device count (DRAFTSMITH_NUM_GPUS) stands in for the cards: the locking is the same either way.
"""

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from draftsmith.core.io.devices import (
    DeviceError,
    acquire,
    choose_slots,
    default_lock_dir,
    device_pool,
    lock_namespace,
    nvidia_smi_count,
    parse_visible,
    proc_stat,
)

HOLD = "import os, time; print(os.environ['CUDA_VISIBLE_DEVICES'], flush=True); time.sleep(120)"


def test_choose_slots_takes_the_lowest_free_or_waits():
    assert choose_slots(set(), 4, 2) == [0, 1]
    assert choose_slots({0, 1}, 4, 2) == [2, 3]
    assert choose_slots({0, 2}, 4, 2) == [1, 3]
    assert choose_slots({0, 1, 2}, 4, 2) is None
    assert choose_slots({0, 1, 2, 3}, 4, 0) == []
    with pytest.raises(DeviceError, match="5 GPUs asked for, but only 4"):
        choose_slots(set(), 4, 5)


def test_parse_visible_and_nvidia_smi():
    assert parse_visible(None) is None
    assert parse_visible("") == []
    assert parse_visible(" 2, 3 ") == ["2", "3"]
    assert parse_visible("GPU-8f1c,GPU-77aa") == ["GPU-8f1c", "GPU-77aa"]
    listing = (
        "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)\n"
        "  MIG 3g.40gb     Device  0: (UUID: MIG-a)\n"
        "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2)\n"
    )
    assert nvidia_smi_count(listing) == 2


def test_lock_namespace_is_per_host_and_per_slurm_allocation():
    assert lock_namespace({}, "node1") == "node1"
    assert lock_namespace({"SLURM_JOB_ID": "42"}, "node1") == "node1-slurm42"
    assert lock_namespace({}, "a/b c") == "a_b_c"


def test_lock_dir_is_node_local_inside_slurm_jobs():
    assert default_lock_dir({}) == Path(".snakemake/draftsmith-gpus")
    assert default_lock_dir({"DRAFTSMITH_GPU_LOCK_DIR": "/x", "SLURM_JOB_ID": "1"}) == Path("/x")
    inside = default_lock_dir({"SLURM_JOB_ID": "1", "TMPDIR": "/local/tmp"})
    assert inside == Path(f"/local/tmp/draftsmith-gpus-{os.getuid()}")


def test_pool_is_what_a_scheduler_gave_else_the_machine():
    assert device_pool({"CUDA_VISIBLE_DEVICES": "5,7", "SLURM_JOB_ID": "9"}, lambda: 8) == (
        ["5", "7"],
        "given by SLURM job 9",
    )
    pool, source = device_pool({}, lambda: 3)
    assert pool == ["0", "1", "2"] and source.startswith("on ")


def test_in_process_jobs_get_disjoint_devices_and_a_third_waits(tmp_path):
    """flock locks belong to open files, so even one process shows the contention exactly."""
    kw = {"env": {}, "lock_dir": tmp_path, "count": lambda: 4, "poll": 0.05, "say": lambda msg: None}
    a, b = acquire(2, **kw), acquire(2, **kw)
    assert sorted(a.devices + b.devices) == ["0", "1", "2", "3"]
    got = []
    waiter = threading.Thread(target=lambda: got.append(acquire(2, **kw)))
    waiter.start()
    time.sleep(0.3)
    assert not got, "a third gpu=2 job must wait while 4 of 4 devices are held"
    a.release()
    waiter.join(timeout=5)
    assert got and got[0].devices == a.devices
    b.release()
    got[0].release()


def test_jobs_inside_one_slurm_allocation_share_its_devices_disjointly(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "SLURM_JOB_ID": "17"}
    kw = {"env": env, "lock_dir": tmp_path, "count": lambda: 0, "say": lambda msg: None}
    a, b = acquire(2, **kw), acquire(2, **kw)
    assert (a.visible, b.visible) == ("4,5", "6,7")
    # another allocation (its own devices, maybe renumbered from 0 by a cgroup) never waits for this one
    other = acquire(2, **{**kw, "env": {"CUDA_VISIBLE_DEVICES": "4,5", "SLURM_JOB_ID": "18"}})
    assert other.visible == "4,5"
    for x in (a, b, other):
        x.release()
    with pytest.raises(DeviceError, match="asks for 5 GPUs but only 4 are available"):
        acquire(5, **kw)


# ---- the command, as the rules run it ------------------------------------------------------------------


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID")}
    env.update(DRAFTSMITH_NUM_GPUS="4", DRAFTSMITH_GPU_LOCK_DIR=str(tmp_path / "locks"), **extra)
    return env


def _start(tmp_path: Path, gpus: int, code: str, **extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "draftsmith.cli",
        "run",
        "--gpus",
        str(gpus),
        "--",
        sys.executable,
        "-c",
        code,
    ]
    return subprocess.Popen(
        cmd, env=_env(tmp_path, **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _line(stream, timeout: float) -> str | None:
    """One line from a pipe, or None when none comes within `timeout` seconds."""
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline().strip() if ready else None


def test_concurrent_jobs_disjoint_third_waits_killed_jobs_devices_come_back(tmp_path):
    procs = []
    try:
        a, b = _start(tmp_path, 2, HOLD), _start(tmp_path, 2, HOLD)
        procs += [a, b]
        # generous waits: they bound only a failure, and a loaded machine starts Python slowly
        got_a, got_b = _line(a.stdout, 120), _line(b.stdout, 120)
        assert got_a and got_b, (got_a, got_b)
        assert sorted(got_a.split(",") + got_b.split(",")) == ["0", "1", "2", "3"]
        assert f"CUDA_VISIBLE_DEVICES={got_a} (2 of 4 GPUs" in _line(a.stderr, 5)

        c = _start(tmp_path, 2, HOLD)
        procs.append(c)
        assert "waiting for 2 free GPUs of 4" in (_line(c.stderr, 120) or "")
        assert _line(c.stdout, 1.0) is None, "the third job started without free devices"

        a.send_signal(signal.SIGKILL)  # no cleanup runs: the kernel drops a's locks
        a.wait(timeout=10)
        assert _line(c.stdout, 120) == got_a
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_signals_and_exit_code_are_the_jobs_own(tmp_path):
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(5))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    p = _start(tmp_path, 1, code)
    try:
        assert _line(p.stdout, 30) == "ready"
        p.send_signal(signal.SIGTERM)  # what Snakemake sends a job it cancels
        assert p.wait(timeout=10) == 5
    finally:
        p.kill()


def test_zero_gpus_hides_every_device(tmp_path):
    code = "import os, sys; print(repr(os.environ['CUDA_VISIBLE_DEVICES'])); sys.exit(7)"
    p = _start(tmp_path, 0, code, CUDA_VISIBLE_DEVICES="0,1")
    out, err = p.communicate(timeout=30)
    assert (p.returncode, out.strip()) == (7, "''")
    assert "no GPU for this job" in err


def test_scheduler_assignment_is_used_and_a_shortfall_named(tmp_path):
    code = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    p = _start(tmp_path, 2, code, CUDA_VISIBLE_DEVICES="3,5", SLURM_JOB_ID="77")
    out, err = p.communicate(timeout=30)
    assert (p.returncode, out.strip()) == (0, "3,5")
    assert "given by SLURM job 77" in err
    p = _start(tmp_path, 3, code, CUDA_VISIBLE_DEVICES="3,5", SLURM_JOB_ID="77")
    out, err = p.communicate(timeout=30)
    assert p.returncode == 2
    assert "asks for 3 GPUs but only 2 are available (CUDA_VISIBLE_DEVICES=3,5)" in err


def test_default_lock_dir_is_beside_the_workflow(tmp_path):
    env = _env(tmp_path)
    del env["DRAFTSMITH_GPU_LOCK_DIR"]
    cmd = [sys.executable, "-m", "draftsmith.cli", "run", "--gpus", "1", "--", "true"]
    subprocess.run(cmd, env=env, cwd=tmp_path, check=True, capture_output=True)
    names = {p.name for p in (tmp_path / ".snakemake" / "draftsmith-gpus").iterdir()}
    assert any(name.endswith("-gpu0.lock") for name in names), names


def test_a_lock_file_planted_as_a_link_is_refused_and_its_target_untouched(tmp_path):
    """In a shared temporary folder another user could link a lock name to a file of ours."""
    import socket

    victim = tmp_path / "victim"
    locks = tmp_path / "locks"
    locks.mkdir()
    (locks / f"{lock_namespace({}, socket.gethostname())}-gpu0.lock").symlink_to(victim)
    kw = {"env": {}, "lock_dir": locks, "count": lambda: 1, "say": lambda msg: None}
    with pytest.raises(DeviceError, match="is a symbolic link, not a lock file"):
        acquire(1, **kw)
    assert not victim.exists()


def test_a_lock_folder_that_is_a_link_is_refused_unless_named_as_shared(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    kw = {"lock_dir": tmp_path / "link", "count": lambda: 1, "say": lambda msg: None}
    with pytest.raises(DeviceError, match="is a link or another user's folder"):
        acquire(1, env={}, **kw)
    acquire(1, env={"DRAFTSMITH_GPU_LOCK_DIR": str(tmp_path / "link")}, **kw).release()


# ---- a job dies with its run ---------------------------------------------------------------------------

# A parent that starts `draftsmith run -- sleep 60` (through a shell and a pipe, as a rule's shell command
# does), prints the job's pid and waits: kill -9 of it must end the job.
PARENT = """
import subprocess, sys, time
shell = sys.argv[1] == "shell"
cmd = [sys.executable, "-m", "draftsmith.cli", "run", "--gpus", "0", "--", "sleep", "60"]
if shell:  # Snakemake's way: bash -c '... | tee log'; kill -9 of Snakemake leaves that shell alive
    cmd = ["bash", "-c", " ".join(cmd) + " | cat"]
proc = subprocess.Popen(cmd)
time.sleep(60)
"""


def _job_pid(parent: int, deadline: float) -> int:
    """The pid of the `sleep 60` under `parent` (draftsmith run execs into it)."""
    while time.monotonic() < deadline:
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                argv = cmdline.read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[:2] == [b"sleep", b"60"] and _descends(int(cmdline.parent.name), parent):
                return int(cmdline.parent.name)
        time.sleep(0.1)
    raise AssertionError("the job never started")


def _descends(pid: int, ancestor: int) -> bool:
    from draftsmith.core.io.devices import proc_stat

    while (stat := proc_stat(pid)) is not None and pid > 1:
        if stat[1] == ancestor:
            return True
        pid = stat[1]
    return False


def _gone(pid: int, within: float) -> bool:
    from draftsmith.core.io.devices import proc_stat

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        stat = proc_stat(pid)
        if stat is None or stat[0] == "Z":
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("shell", ["direct", "shell"])
def test_a_job_dies_with_its_killed_snakemake(tmp_path, shell):
    """kill -9 of the Snakemake stand-in (a script named snakemake): its job ends within seconds, whether
    draftsmith run is its child (the parent-death signal) or runs under a shell that survives it (the
    watcher of the Snakemake ancestor)."""
    fake = tmp_path / "snakemake"
    fake.write_text(f"#!{sys.executable}\n{PARENT}")
    fake.chmod(0o755)
    owner = subprocess.Popen([str(fake), shell], env=_env(tmp_path))
    job = None
    try:
        job = _job_pid(owner.pid, time.monotonic() + 30)
        owner.kill()
        owner.wait()
        assert _gone(job, within=10), f"job {job} outlived its Snakemake"
    finally:
        owner.kill()
        if job is not None and proc_stat(job) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(job, signal.SIGKILL)


def test_snakemake_owner_is_the_nearest_snakemake_ancestor(tmp_path):
    from draftsmith.core.io.devices import is_snakemake, snakemake_owner

    proc = tmp_path / "proc"
    table = {
        10: (1, b"/venv/bin/python\0/venv/bin/snakemake\0--cores\0"),
        20: (10, b"bash\0-c\0x\0"),
        30: (20, b"draftsmith\0run\0"),
    }
    for pid, (ppid, argv) in table.items():
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} (x y) S {ppid} " + "0 " * 17 + "777 0\n")
        (proc / str(pid) / "cmdline").write_bytes(argv)
    assert is_snakemake(10, proc) and not is_snakemake(20, proc)
    assert snakemake_owner(30, proc) == 10
    assert snakemake_owner(10, proc) is None


def test_a_streamed_jobs_engine_sees_its_ranks_gpu_or_the_first_engine_gpus():
    """Issue 45 item 2: engine_gpus 0 = the rank's own GPU; N = the first N, the trainer on GPU N."""
    from draftsmith.core.io.devices import engine_visible_devices, trainer_index, visible_devices

    assert engine_visible_devices("4,5,6,7", 0, 2) == ["6"]
    assert engine_visible_devices("4,5,6,7", 3, trainer_index(3, 0)) == ["4", "5", "6"]
    assert trainer_index(3, 0) == 3 and trainer_index(0, 1) == 1
    assert engine_visible_devices(None, 2, 2) == ["0", "1"]
    with pytest.raises(DeviceError, match="CUDA_VISIBLE_DEVICES=''"):
        engine_visible_devices("", 0, 0)
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    with visible_devices(["3"]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before


def test_a_process_tree_is_the_process_and_every_live_descendant():
    """What `kill_tree`, the vLLM child's timeout and the fault bench signal: the process, its children,
    theirs (in a session of their own too)."""
    from draftsmith.core.io.devices import process_tree

    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], start_new_session=True); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.time() + 20
        while time.time() < deadline and len(process_tree(proc.pid)) < 2:
            time.sleep(0.05)
        tree = process_tree(proc.pid)
        assert tree[0] == proc.pid and len(tree) == 2, tree
    finally:
        for pid in reversed(process_tree(proc.pid)):
            os.kill(pid, signal.SIGKILL)
        proc.wait()
    assert process_tree(proc.pid) == [proc.pid]  # gone: only the pid asked for
