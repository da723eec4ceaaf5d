"""A lock left by a killed Snakemake (draftsmith/core/io/runlock.py): stale or still in use, said at start."""

from pathlib import Path

from draftsmith.core.io.runlock import lock_advice


def _proc(root: Path, pid: int, ppid: int, cwd: Path, argv: list[str], state: str = "S") -> None:
    entry = root / str(pid)
    entry.mkdir(parents=True)
    (entry / "stat").write_text(f"{pid} (x) {state} {ppid} " + "0 " * 17 + "5 0\n")
    (entry / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (entry / "cwd").symlink_to(cwd)


def test_a_lock_of_a_dead_snakemake_says_unlock_and_an_orphan_says_wait(tmp_path):
    run, proc = tmp_path / "run", tmp_path / "proc"
    (run / ".snakemake" / "locks").mkdir(parents=True)
    _proc(proc, 100, 1, run, ["/venv/bin/python", "/venv/bin/snakemake", "--cores", "1"])  # this run
    _proc(proc, 200, 1, tmp_path, ["/venv/bin/snakemake"])  # elsewhere
    _proc(proc, 300, 1, run, ["vim", "x"])  # works here, runs neither
    assert lock_advice(run, 100, ["snakemake"], proc) is None  # no lock
    (run / ".snakemake" / "locks" / "0.output.lock").write_text("results/x\n")
    advice = lock_advice(run, 100, ["snakemake"], proc)
    assert "no longer runs on this machine" in advice and "`snakemake --unlock`, then run again" in advice
    assert lock_advice(run, 100, ["snakemake", "--unlock"], proc) is None
    # an orphaned job of the killed run still writes: not yet
    _proc(proc, 400, 1, run, ["/venv/bin/python", "/venv/bin/draftsmith", "extract", "--tokens", "t"])
    advice = lock_advice(run, 100, ["snakemake"], proc)
    assert (
        "process 400 (/venv/bin/python /venv/bin/draftsmith extract" in advice
        and "wait until it ends" in advice
    )
