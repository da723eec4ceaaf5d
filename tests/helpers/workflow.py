"""The checkout and its commands: paths, the environment a command runs in, Snakemake and the CLI
run as a test runs them, the shared tiny run's record and the servers left listening."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
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
