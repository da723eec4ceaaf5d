"""The workflow on a real SLURM cluster, and the Kubernetes profile's dry run.

The SLURM test needs the single-node cluster of scripts/slurm-up.sh (partition `gpu`, fake GPUs declared as
character devices): CI (.ci/run) and `make slurm-check` start it, as root. Elsewhere the test skips,
unless DRAFTSMITH_SLURM=1 says the cluster must be there (then a missing cluster fails it).
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.workflow import REPO

from draftsmith.core.data.shards import iter_samples

TARGET = REPO / "resources" / "SmolLM2-135M-Instruct"
TINY = REPO / "tests" / "config.tiny.yaml"
# The tiny configuration, smaller still (6 prompts, 16 new tokens, float32: twice as fast as bfloat16 on
# a CPU; shards store bfloat16 either way): this runs twice, through SLURM and locally. Extraction asks
# for 2 GPUs, so SLURM must hand the extraction job (one for every shard) 2 (fake) GPUs of the node's.
CONFIG = [
    f"target={{model: {TARGET}, gguf_wheel: null, dtype: float32}}",
    "prompts={max_prompts: 6, num_heldout: 2}",
    "generate={max_new_tokens: 16}",
    "resources={extract: {threads: 1, gpus: 2}}",
    # what this test compares is the runs, not the methods: no suffix decoding, no re-measured draft lengths
    "evaluate={suffix: false, remeasure_chosen_k: false}",
]
DATA = ["results/data_config.json", "results/vocab_map.pt"]
RUN_TIMEOUT_S = 900
BF16_ULP = 2**-7  # relative spacing of bfloat16 values near 1


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES" and not k.startswith("SLURM_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def _fake_gpu_cluster() -> str | None:
    """None when the cluster of scripts/slurm-up.sh answers, else why not."""
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-p", "gpu", "-o", "%a %G"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"no SLURM here ({err}); start one with `make slurm-check` (root)"
    if out.returncode != 0 or not out.stdout.startswith("up gpu:fake:"):
        return f"no partition 'gpu' with fake GPUs (sinfo: {(out.stdout + out.stderr).strip()!r}); see scripts/slurm-up.sh"
    return None


@pytest.fixture(scope="module")
def cluster():
    why = _fake_gpu_cluster()
    if why and os.environ.get("DRAFTSMITH_SLURM") == "1":
        pytest.fail(f"DRAFTSMITH_SLURM=1 but {why}")
    if why:
        pytest.skip(why)


def _start(workdir: Path, *args: str, env: dict[str, str]) -> tuple[subprocess.Popen, float, Path]:
    """The data stages of the workflow in workdir, started: the process, when, and the file its output goes
    to (a pipe nobody reads while the other run goes on would stall it); a hung Snakemake ignores SIGTERM,
    hence timeout -k."""
    cmd = ["timeout", "-k", "10", str(RUN_TIMEOUT_S), "snakemake", *DATA]
    cmd += ["--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir), "--configfile", str(TINY)]
    cmd += [*args, "--config", *CONFIG]
    output = workdir / "snakemake.out"
    with open(output, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env, cwd=workdir)
    return proc, time.monotonic(), output


def _finish(run: tuple[subprocess.Popen, float, Path]) -> float:
    """The wall seconds of a run of _start, once it ended; AssertionError with the tail of its output
    when it failed (no job of a failed SLURM run is left in the queue)."""
    proc, started, output = run
    proc.wait()
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        text = output.read_text()
        run_id = re.search(r"SLURM run ID: (\S+)", text)
        if run_id:  # leave no job of ours behind in the queue
            subprocess.run(["scancel", "--name", run_id.group(1)], check=False)
        raise AssertionError(f"{' '.join(map(str, proc.args))} failed ({proc.returncode}):\n{text[-8000:]}")
    return seconds


def _samples(results: Path) -> dict[str, object]:
    return {
        s.id: s
        for path in sorted((results / "hidden").glob("shard-*.safetensors"))
        for s in iter_samples(path)
    }


def _assignment(logs: Path, pattern: str) -> re.Match:
    log = logs / "extract.log"
    m = re.search(pattern, log.read_text())
    assert m, f"{log} names no device assignment:\n{log.read_text()[:2000]}"
    return m


@pytest.mark.slow
def test_slurm_run_matches_local_run_and_gives_extraction_its_gpus(cluster, tmp_path_factory):
    slurm_dir, local_dir = tmp_path_factory.mktemp("slurm"), tmp_path_factory.mktemp("local")
    # Both runs side by side: the SLURM run spends most of its time waiting on the queue and its status checks
    slurm_run = _start(
        slurm_dir,
        "--workflow-profile",
        str(REPO / "profiles" / "slurm"),
        # this cluster keeps no accounting database: job states come from squeue (see the profile)
        "--slurm-status-command",
        "squeue",
        "--slurm-init-seconds-before-status-checks",
        "2",
        "--max-threads",
        "2",  # the node's CPUs: the profile's threads would not fit
        "--jobs",
        "4",
        env=_env(),
    )
    try:
        # The same work locally, on 4 fake GPUs: the extraction job takes 2 of them through the lock files.
        local_s = _finish(
            _start(local_dir, "--cores", "2", "--resources", "gpu=4", env=_env(DRAFTSMITH_NUM_GPUS="4"))
        )
    except BaseException:
        slurm_run[0].terminate()  # timeout hands SIGTERM on: Snakemake cancels its SLURM jobs
        slurm_run[0].wait(timeout=60)
        raise
    slurm_s = _finish(slurm_run)

    slurm, local = slurm_dir / "results", local_dir / "results"
    assert (slurm / "traces.jsonl").read_bytes() == (local / "traces.jsonl").read_bytes()
    vs, vl = torch.load(slurm / "vocab_map.pt"), torch.load(local / "vocab_map.pt")
    assert torch.equal(vs["d2t"], vl["d2t"]) and torch.equal(vs["t2d"], vl["t2d"])
    samples_s, samples_l = _samples(slurm), _samples(local)
    assert samples_s.keys() == samples_l.keys() and len(samples_s) == 4
    for sid, a in samples_s.items():
        b = samples_l[sid]
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask), sid
        for x, y in ((a.aux, b.aux), (a.final, b.final)):
            torch.testing.assert_close(x.float(), y.float(), rtol=2 * BF16_ULP, atol=2 * BF16_ULP, msg=sid)
    manifest = json.loads((slurm_dir / "results" / "data_config.json").read_text())
    assert manifest["teacher_agreement"] > 0.9

    # The extraction job (every shard) was one SLURM job, asked for --gpus=2 and was given two devices.
    given = _assignment(
        slurm_dir / "logs", r"CUDA_VISIBLE_DEVICES=(\d+),(\d+) \(2 of 2 GPUs given by SLURM job (\d+)\)"
    )
    assert "CUDA_VISIBLE_DEVICES= (no GPU for this job)" in (slurm_dir / "logs" / "generate.log").read_text()
    taken = _assignment(local_dir / "logs", r"CUDA_VISIBLE_DEVICES=(\d+),(\d+) \(2 of 4 GPUs on ")

    print(
        f"\nside by side: SLURM run {slurm_s:.0f} s, local run {local_s:.0f} s; extraction devices: "
        f"SLURM job {given.group(3)} -> {given.group(1)},{given.group(2)}; locally {taken.group(1)},{taken.group(2)}"
    )


# ---- Kubernetes: no cluster here, but the profile, its storage mapping and the pods' requests ---------


@pytest.fixture
def s3_endpoint():
    """A local S3 (moto): the profile's storage provider checks its inputs there during the dry run."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "moto server did not start"
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_kubernetes_profile_lints_and_dry_runs_against_s3(tmp_path, s3_endpoint):
    # dummy credentials for the local endpoint; never ask an instance-metadata service
    env = _env(
        AWS_ACCESS_KEY_ID="test",
        AWS_SECRET_ACCESS_KEY="test",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    base = ["snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path)]
    base += ["--workflow-profile", str(REPO / "profiles" / "kubernetes"), "--configfile", str(TINY)]
    lint = subprocess.run([*base, "--lint"], capture_output=True, text=True, env=env, timeout=300)
    assert lint.returncode == 0, lint.stdout[-3000:] + lint.stderr[-3000:]

    cmd = [
        *base,
        "-n",
        "--storage-s3-endpoint-url",
        s3_endpoint,
        "--config",
        "resources={extract: {gpus: 2}}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "Using workflow specific profile" in out and "kubernetes" in out
    extract = re.search(r"rule extract:\n(.*?)\nShell command: ([^\n]*)", out, re.S)
    assert extract, out[-6000:]
    job, shell = extract.groups()
    # every file goes through the bucket; the pod asks for 2 NVIDIA GPUs and the rule's memory
    assert "s3://YOUR-BUCKET/draftsmith/results/tokens.safetensors (retrieve from storage)" in job
    assert "gpu=2" in job and "gpu_manufacturer=nvidia" in job and "mem_mb=8000" in job
    assert shell.startswith("draftsmith run --gpus 2 -- draftsmith extract ")
    # one job for every shard (the tiny config's 2)
    assert len(re.findall(r"rule extract:", out)) == 1
    assert all(f"results/hidden/shard-{k}.safetensors" in shell for k in (0, 1)), shell
