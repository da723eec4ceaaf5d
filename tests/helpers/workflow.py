"""The checkout and its commands: paths, the environment a command runs in, Snakemake and the CLI
run as a test runs them, the shared tiny run's record and the servers left listening; how the suite's
tests are spread over pytest-xdist workers (the order groups are handed out in, where the time went)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from click.testing import CliRunner

from draftsmith.cli import main

REPO = Path(__file__).resolve().parents[2]


DEFAULT_TARGET = REPO / "resources" / "SmolLM2-135M-Instruct"


TINY_CONFIG = REPO / "tests" / "config.tiny.yaml"


def cli_env() -> dict[str, str]:
    """The environment for running this venv's `draftsmith` and `snakemake` commands in a subprocess."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def snakemake(
    workdir: Path, *args: str, check: bool = True, timeout: float = 1800
) -> subprocess.CompletedProcess:
    """This checkout's workflow in `workdir` with the tiny configuration on 2 cores; a failure (with
    check) raises AssertionError with the tail of Snakemake's output."""
    cmd = ["snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(TINY_CONFIG), "--cores", "2", *args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=workdir, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


@dataclass(frozen=True)
class TinyRun:
    """A finished run of the whole workflow (tests/config.tiny.yaml) on the real default target.

    `config`: the `--config` values it ran with; every later Snakemake call on it passes them again (the
    same values: nothing reruns). Tests read it; a test that changes files works on `copy(...)`."""

    workdir: Path
    config: tuple[str, ...]

    @property
    def results(self) -> Path:
        return self.workdir / "results"

    def snakemake(
        self, *args: str, extra: tuple[str, ...] = (), check: bool = True
    ) -> subprocess.CompletedProcess:
        """Snakemake on this run: `args` (targets, -n, ...), then `--config` with this run's values and
        `extra` ones (last: --config takes every argument after it)."""
        return snakemake(self.workdir, *args, "--config", *self.config, *extra, check=check)

    def copy(self, dest: Path) -> TinyRun:
        """The run folder copied to `dest` (timestamps and Snakemake's records kept, so the copy is as
        finished as the run); its config still names the run's target and prompt file."""
        shutil.copytree(self.workdir, dest, symlinks=True)
        return TinyRun(dest, self.config)


def listeners() -> list[tuple[str, str, set[int]]]:
    """(netid, local address:port, pids) of every listening TCP and UDP socket on this machine (`ss -ltunpH`:
    the pids are shown for this user's processes)."""
    out = subprocess.run(["ss", "-ltunpH"], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        fields = line.split()
        rows.append((fields[0], fields[4], {int(p) for p in re.findall(r"pid=(\d+)", line)}))
    return rows


def cli(*args) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, f"draftsmith {' '.join(map(str, args))}:\n{result.output[-3000:]}"
    return result.output


# The longest groups, longest first (`make test` prints each group's seconds: "test groups by time").
# pytest-xdist hands groups out in the order they are collected (scripts/test.sh: --no-loadscope-reorder):
# a long group handed out last keeps one worker busy while the other has nothing left to do. Seconds on
# a 2-core AVX-512 BF16 EPYC, .ci/run of commit 5a1b396.
LONGEST_GROUPS = (
    "test_families",  # ~430 s: 7 twins through vLLM
    "tiny_run",  # ~400 s: the shared run (311 s) and the tests that read it
    "test_slurm",  # ~240 s
    "test_dflash_vllm",  # ~150 s
    "unit.training.test_distributed",  # ~125 s
    "test_eval_context_vllm",  # ~100 s
    "test_vllm_export",  # ~100 s
    "test_extract_backends",  # ~100 s
    "test_kimi_workflow",  # ~95 s
)


def group_order(groups: list[str]) -> dict[str, int]:
    """Each group's place in the hand-out order: LONGEST_GROUPS first, then the rest by their number of
    tests, most first (pytest-xdist's own order), ties in collection order."""
    counts: dict[str, int] = {}
    for group in groups:
        counts[group] = counts.get(group, 0) + 1
    listed = [g for g in LONGEST_GROUPS if g in counts]
    rest = sorted((g for g in counts if g not in LONGEST_GROUPS), key=lambda g: -counts[g])
    return {group: rank for rank, group in enumerate(listed + rest)}


def busy_seconds(reports: Iterable) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of set-up, call and tear-down per pytest-xdist worker and per group (the `@group` suffix
    pytest-xdist gives a grouped test's id), from the session's reports."""
    workers: dict[str, float] = {}
    groups: dict[str, float] = {}
    for report in reports:
        node = getattr(report, "node", None)
        duration = getattr(report, "duration", None)
        if node is None or duration is None:
            continue
        worker = getattr(getattr(node, "gateway", None), "id", "?")
        workers[worker] = workers.get(worker, 0.0) + duration
        group = report.nodeid.rpartition("@")[2] if "@" in report.nodeid else "(none)"
        groups[group] = groups.get(group, 0.0) + duration
    return workers, groups
