"""Generation through OpenAI-compatible servers.

Two kinds of tests:
- a tiny OpenAI-compatible HTTP server written here (a test double of the network, on 127.0.0.1) drives
  retries, timeouts, a wrong or dead endpoint, reasoning fields, multi-turn requests and a kill/resume;
- the real vLLM server on the default target (marked vllm + slow): the `openai` engine against a running
  server, and the `vllm-server` mode that starts and stops its own.
"""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from unittest import mock

import pytest
from helpers.evaluation import CLIENT_SETTINGS, openai_client
from helpers.workflow import REPO, listeners

from draftsmith.backends.openai import (
    EndpointError,
    OpenAIClient,
    RequestFailed,
    backoff_seconds,
    classify_status,
    normalize_base_url,
    parse_completion,
    split_reasoning,
)
from draftsmith.backends.server import VllmServer, group_alive, server_command, server_gpus
from draftsmith.core.data.prompt_sources import PromptError
from draftsmith.stages.generate import GenerateError, GenerateSettings, generate_traces

TARGET = REPO / "resources" / "SmolLM2-135M-Instruct"


def _env(**extra):
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


# ----------------------------------------------------------------------------- a local OpenAI-compatible double


class FakeOpenAI:
    """/v1/models and /v1/chat/completions on 127.0.0.1; `reply(body, n)` decides each answer.

    The default reply echoes the last user message, so answers are deterministic per prompt.
    """

    def __init__(self, reply=None, model="m", max_model_len=None, delay=0.0):
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.reply = reply or self.echo
        self.model, self.max_model_len, self.delay = model, max_model_len, delay
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    card = {"id": fake.model, "object": "model"}
                    if fake.max_model_len:
                        card["max_model_len"] = fake.max_model_len
                    self._send(200, {"object": "list", "data": [card]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append(body)
                    n = len(fake.requests)
                time.sleep(fake.delay)
                if body.get("model") != fake.model:
                    self._send(
                        404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}}
                    )
                    return
                status, reply = fake.reply(body, n)
                if status is None:  # hang up without an answer
                    self.close_connection = True
                    return
                self._send(status, reply)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @staticmethod
    def completion(content, reasoning=None, finish="stop", key="reasoning", extra=None):
        message = {"role": "assistant", "content": content, key: reasoning}
        body = {
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 5, "completion_tokens": len(content.split()) + 1},
        }
        return {**body, **(extra or {})}

    def echo(self, body, n):
        return 200, self.completion("echo: " + body["messages"][-1]["content"][:30])

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    servers = []

    def make(**kw):
        servers.append(FakeOpenAI(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def write_prompts(path, n=6, extra=()):
    lines = [json.dumps({"id": f"p{i}", "prompt": f"Question number {i}?"}) for i in range(n)]
    path.write_text("\n".join([*lines, *map(json.dumps, extra)]) + "\n", encoding="utf-8")
    return path


def run_stage(tmp_path, url, prompts=None, **kw):
    settings = GenerateSettings(backend="openai", base_url=url, max_new_tokens=16, backoff_s=0.01, **kw)
    prompts = prompts or write_prompts(tmp_path / "p.jsonl")
    summary = generate_traces(
        str(TARGET), str(prompts), str(tmp_path / "traces.jsonl"), str(tmp_path / "s.json"), settings
    )
    rows = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    return summary, rows


def errors(tmp_path):
    path = tmp_path / "generate_errors.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


# ----------------------------------------------------------------------------- pure policies


def test_retry_policy():
    assert [classify_status(s) for s in (200, 400, 401, 404, 408, 422, 429, 500, 503)] == [
        "ok",
        "fail",
        "fatal",
        "fatal",
        "retry",
        "fail",
        "retry",
        "retry",
        "retry",
    ]
    assert [backoff_seconds(a, 1.0, cap=5.0) for a in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]
    assert (
        normalize_base_url("http://h:8000/") == normalize_base_url("http://h:8000/v1") == "http://h:8000/v1"
    )


def test_reasoning_fields_of_both_server_families():
    assert split_reasoning({"content": "4", "reasoning": "2+2"}) == ("4", "2+2")  # vLLM
    assert split_reasoning({"content": "4", "reasoning_content": "2+2"}) == ("4", "2+2")  # SGLang
    assert split_reasoning({"content": None, "reasoning": "still thinking"}) == ("", "still thinking")
    assert split_reasoning({"content": "4"}) == ("4", None)


def test_parse_completion_keeps_served_token_ids():
    body = FakeOpenAI.completion("hi", extra={"prompt_token_ids": [1, 2]})
    body["choices"][0]["token_ids"] = [7, 2]
    ans = parse_completion(body)
    assert (ans.text, ans.prompt_ids, ans.response_ids, ans.finish_reason) == ("hi", [1, 2], [7, 2], "stop")
    with pytest.raises(ValueError, match="finish_reason 'abort'"):
        parse_completion(FakeOpenAI.completion("x", finish="abort"))
    with pytest.raises(ValueError, match="not a chat completion"):
        parse_completion({"object": "error"})


def test_server_command_derives_tensor_parallel_and_respects_overrides():
    cmd = server_command(
        "/m", 1234, devices=["0", "1"], dtype="bfloat16", seed=3, extra_args=["--enforce-eager"]
    )
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[-1] == "--enforce-eager"
    cmd = server_command(
        "/m", 1, devices=["0", "1"], dtype="bfloat16", extra_args=["--dtype=float32", "-tp", "1"]
    )
    assert "--dtype" not in cmd and "--dtype=float32" in cmd
    assert "--tensor-parallel-size" not in server_command("/m", 1, devices=["0"])


@pytest.mark.parametrize(
    "args",
    [["--host", "0.0.0.0"], ["--host=0.0.0.0"], ["--hos", "0.0.0.0"], ["--api-key", "k"], ["--port=1"]],
)
def test_server_args_cannot_move_the_address_or_set_the_key(args):
    with pytest.raises(RuntimeError, match="set by the workflow"):
        server_command("/m", 1234, extra_args=["--enforce-eager", *args])
    assert server_command("/m", 1234, host="0.0.0.0")[5:7] == ["--host", "0.0.0.0"]  # the explicit setting


# What each refused form would have done in vLLM's own parser: (arguments, the setting it changes).
RESERVED_FORMS = [
    (["--api_key", ""], "api_key"),
    (["--api_key=k"], "api_key"),
    (["--api-key.x", "k"], "api_key"),
    (["--api-k", "k"], "api_key"),
    (["--served_model_name", "x"], "served_model_name"),
    (["--served-model", "x"], "served_model_name"),
    (["--ho", "0.0.0.0"], "host"),
    (["--port=1234"], "port"),
    (["--config=f.yaml"], "config"),
]


@pytest.mark.vllm
def test_the_refused_server_args_are_what_vllms_parser_reads_as_the_reserved_settings(tmp_path):
    """The check (draftsmith.core.config.config.server_args_error) against vLLM's FlexibleArgumentParser: each form
    it refuses does set host, port, key, served name or config file there; a --config file sets the key."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from draftsmith.core.config.config import server_args_error

    def parsed(args):
        return vars(make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "/m", *args]))

    plain = parsed([])
    for args, dest in RESERVED_FORMS:
        assert parsed(args)[dest] != plain[dest], args
        assert server_args_error(args) is not None, args
    config = tmp_path / "f.yaml"
    config.write_text("api-key: from-a-file\n")
    assert parsed(["--config", str(config)])["api_key"] == ["from-a-file"]
    assert server_args_error(["--config", str(config)]) is not None


def test_the_server_spans_the_jobs_gpus_with_expert_parallel_over_them():
    """resources.generate.gpus -> --tensor-parallel-size; with --enable-expert-parallel vLLM's MoE layers
    use EP = TP (draftsmith/backends/vllm_api.py checks that in vLLM's source); the memory share on GPUs."""
    args = ["--enable-expert-parallel"]
    cmd = server_command("/m", 1, tensor_parallel=8, gpu_memory_utilization=0.85, extra_args=args)
    flags = dict(zip(cmd, cmd[1:], strict=False))
    assert flags["--tensor-parallel-size"] == "8" and "--enable-expert-parallel" in cmd
    assert flags["--gpu-memory-utilization"] == "0.85"
    cpu = server_command("/m", 1, gpu_memory_utilization=0.85)  # a CPU job: no GPU-only flags
    assert "--gpu-memory-utilization" not in cpu and "--tensor-parallel-size" not in cpu
    mine = server_command("/m", 1, tensor_parallel=8, gpu_memory_utilization=0.85, data_parallel=2,
                          extra_args=["--gpu-memory-utilization", "0.5", "-tp", "4", "-dp", "1"])  # fmt: skip
    assert mine.count("--gpu-memory-utilization") == 1 and "--tensor-parallel-size" not in mine
    assert "--data-parallel-size" not in mine
    dp = server_command("/m", 1, tensor_parallel=2, data_parallel=4)
    assert dict(zip(dp, dp[1:], strict=False))["--data-parallel-size"] == "4"


def test_the_server_runs_data_parallel_engines_of_the_fewest_gpus_that_hold_the_target(tmp_path):
    """resources.generate.gpus 8 for Llama-3.1-8B on H100s: 8 engines of 1 GPU behind one server
    (--data-parallel-size 8, no --tensor-parallel-size), as `draftsmith plan` lays it out; Qwen3-235B-A22B
    bf16 spans all 8; --tensor-parallel-size in server_args or resources.generate.tensor_parallel decide."""
    from draftsmith.backends.server import VllmServerBackend, server_layout
    from draftsmith.core.config.config import section_defaults
    from draftsmith.stages.generate import GenerateSettings

    targets = Path(__file__).resolve().parents[1] / "data" / "target-configs"
    values = {**section_defaults("generate"), "backend": "vllm-server", "dtype": "bfloat16"}
    settings = GenerateSettings.from_dict({**values, "gpus": 8, "gpu_memory_gib": 79.2})
    assert server_layout(settings, targets / "llama-3.1-8b", 8) == (1, 8)
    assert server_layout(settings, targets / "qwen3-235b-a22b", 8) == (8, 1)
    two = GenerateSettings.from_dict({**values, "gpus": 8, "gpu_memory_gib": 79.2, "tensor_parallel": 2})
    assert server_layout(two, targets / "llama-3.1-8b", 8) == (2, 4)
    given = GenerateSettings.from_dict(
        {**values, "gpus": 8, "gpu_memory_gib": 79.2, "server_args": ["-tp", "4"]}
    )
    assert server_layout(given, targets / "llama-3.1-8b", 8) == (4, 2)
    with mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}):
        server = VllmServerBackend.server(settings, str(targets / "llama-3.1-8b"), str(tmp_path / "log"))
    cmd = server.command()
    flags = dict(zip(cmd, cmd[1:], strict=False))
    assert flags["--data-parallel-size"] == "8" and "--tensor-parallel-size" not in cmd


def test_server_gpus_is_the_jobs_gpus_and_short_devices_are_named():
    assert server_gpus(8, None, "0,1,2,3,4,5,6,7") == 8
    assert server_gpus(0, None, "") == 1
    assert server_gpus(2, ["4", "5", "6"], None) == 3  # devices given by hand decide
    assert server_gpus(4, None, None) == 4  # CUDA_VISIBLE_DEVICES unset: trust the count
    with pytest.raises(ValueError, match=r"resources.generate.gpus is 8 but only 2 GPU\(s\) are visible"):
        server_gpus(8, None, "0,1")


# ----------------------------------------------------------------------------- the client against the double


def test_transient_errors_are_retried_then_succeed(fake):
    srv = fake(
        reply=lambda body, n: (
            (503, {"error": {"message": "busy"}}) if n < 3 else (200, FakeOpenAI.completion("ok"))
        )
    )
    client = openai_client(srv.url, "m", max_retries=4, backoff_base_s=0.01)
    assert client.chat([{"role": "user", "content": "hi"}]).text == "ok"
    assert len(srv.requests) == 3


def test_client_errors_are_not_retried(fake):
    srv = fake(reply=lambda body, n: (400, {"error": {"message": "prompt too long"}}))
    client = openai_client(srv.url, "m", max_retries=4, backoff_base_s=0.01)
    with pytest.raises(RequestFailed, match="HTTP 400: prompt too long") as err:
        client.chat([{"role": "user", "content": "hi"}])
    assert err.value.status == 400 and len(srv.requests) == 1


def test_timeout_is_retried_and_reported(fake):
    srv = fake(delay=1.0)
    client = openai_client(srv.url, "m", timeout_s=0.2, max_retries=1, backoff_base_s=0.01)
    with pytest.raises(RequestFailed, match="timed out") as err:
        client.chat([{"role": "user", "content": "hi"}])
    assert err.value.attempts == 2


def test_wrong_model_or_dead_endpoint_stop_at_once(fake, tmp_path):
    srv = fake(model="served")
    with pytest.raises(EndpointError, match=r"does not serve model 'other'; it serves \['served'\]"):
        openai_client(srv.url, "other").check()
    client = openai_client(srv.url)
    assert client.check() == ["served"] and client.model == "served"  # the only model is picked
    client.model = "other"  # a 404 mid-run (e.g. the model was swapped) is fatal, not per prompt
    with pytest.raises(EndpointError, match="does not exist"):
        client.chat([{"role": "user", "content": "hi"}])
    srv.close()
    with pytest.raises(EndpointError, match="cannot reach"):
        openai_client(srv.url, "served").check()
    # the stage turns it into one clear stop before any prompt is sent
    with pytest.raises(GenerateError, match="cannot reach"):
        run_stage(tmp_path, srv.url)


class Recorder(BaseHTTPRequestHandler):
    """Answers /v1/models like an OpenAI server and records each request's Authorization header;
    `redirect_to` set, it redirects every request there instead (307 keeps the method)."""

    seen: list = []
    redirect_to: str | None = None

    def log_message(self, *args):
        pass

    def do_GET(self):
        type(self).seen.append(self.headers.get("Authorization"))
        if self.redirect_to:
            self.send_response(307)
            self.send_header("Location", self.redirect_to + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = json.dumps({"object": "list", "data": [{"id": "m"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _recorder(redirect_to=None):
    handler = type("H", (Recorder,), {"seen": [], "redirect_to": redirect_to})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, handler, f"http://127.0.0.1:{httpd.server_address[1]}"


def test_the_api_key_is_not_sent_on_to_another_origin_after_a_redirect():
    """An endpoint that redirects elsewhere (another port is another origin) must not receive the key."""
    elsewhere, seen_elsewhere, elsewhere_url = _recorder()
    redirector, seen_here, here_url = _recorder(redirect_to=elsewhere_url)
    try:
        assert openai_client(here_url + "/v1", api_key="sk-secret").check() == ["m"]  # followed
        assert seen_here.seen == ["Bearer sk-secret"] and seen_elsewhere.seen == [None]
        openai_client(elsewhere_url + "/v1", api_key="sk-secret").check()  # sent where it was meant for
        assert seen_elsewhere.seen == [None, "Bearer sk-secret"]
    finally:
        for httpd in (elsewhere, redirector):
            httpd.shutdown()
            httpd.server_close()


def test_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("DRAFTSMITH_TEST_KEY", raising=False)
    with pytest.raises(EndpointError, match="DRAFTSMITH_TEST_KEY"):
        OpenAIClient.from_env("http://127.0.0.1:1", "DRAFTSMITH_TEST_KEY", **CLIENT_SETTINGS)
    monkeypatch.setenv("DRAFTSMITH_TEST_KEY", "sk-test")
    assert (
        OpenAIClient.from_env("http://127.0.0.1:1", "DRAFTSMITH_TEST_KEY", **CLIENT_SETTINGS).api_key
        == "sk-test"
    )


# ----------------------------------------------------------------------------- the stage against the double


def test_stage_writes_traces_summary_and_reasoning(fake, tmp_path):
    def reply(body, n):
        q = body["messages"][-1]["content"]
        key = "reasoning" if n % 2 else "reasoning_content"
        return 200, FakeOpenAI.completion("answer to " + q, reasoning="thinking about " + q, key=key)

    srv = fake(reply=reply)
    summary, rows = run_stage(tmp_path, srv.url, concurrency=3)
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(6)]  # prompt order, whatever finished first
    assert all(r["reasoning"] == "thinking about " + r["messages"][-1]["content"] for r in rows)
    assert rows[0]["response"] == "answer to Question number 0?" and rows[0]["backend"] == "openai"
    assert summary["reasoning_capture_rate"] == 1.0 and summary["errors"] == 0
    assert json.loads((tmp_path / "s.json").read_text())["done"] == 6
    assert errors(tmp_path) == [] and not (tmp_path / "traces.jsonl.partial").exists()
    body = srv.requests[0]
    assert body["max_tokens"] == 16 and body["temperature"] == 0.0 and body["return_token_ids"] is True


def test_truncated_answers_are_flagged(fake, tmp_path, caplog):
    srv = fake(reply=lambda body, n: (200, FakeOpenAI.completion("cut", finish="length")))
    with caplog.at_level(logging.WARNING, logger="draftsmith.stages.generate"):
        summary, rows = run_stage(tmp_path, srv.url)
    assert summary["truncated"] == 6 and rows[0]["finish_reason"] == "length"
    assert any(
        "100% of the traces (6 of 6) were cut at generate.max_new_tokens = 16" in m for m in caplog.messages
    )


def test_out_into_a_missing_folder_is_created(fake, tmp_path):
    srv = fake()
    summary, rows = run_stage(
        tmp_path / "new" / "deeper", srv.url, prompts=write_prompts(tmp_path / "p.jsonl")
    )
    assert summary["done"] == 6 and len(rows) == 6


def test_empty_prompt_file_is_bad_input(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(PromptError, match="empty.jsonl: no prompts"):
        run_stage(tmp_path, "http://127.0.0.1:1/v1", prompts=empty)
    args = ["draftsmith", "generate", "--target", str(TARGET), "--prompts", str(empty)]
    args += ["--out", str(tmp_path / "t.jsonl"), "--summary", str(tmp_path / "s.json")]
    proc = subprocess.run(args, env=_env(), capture_output=True, text=True)
    assert proc.returncode == 2 and "empty.jsonl: no prompts" in proc.stderr, proc.stderr[-2000:]


def test_a_garbled_partial_line_costs_only_its_prompt(fake, tmp_path, caplog):
    """Finished traces after a garbled line are kept; only that line's prompt is asked again."""
    srv = fake()
    (tmp_path / "first").mkdir()
    run_stage(tmp_path / "first", srv.url)
    lines = (tmp_path / "first" / "traces.jsonl").read_text().splitlines(keepends=True)
    partial = tmp_path / "traces.jsonl.partial"
    partial.write_text("".join(lines[:2]) + lines[2][:40] + "\x00garbage\n" + "".join(lines[3:]))
    srv.requests.clear()
    with caplog.at_level(logging.WARNING, logger="draftsmith.stages.generate"):
        summary, rows = run_stage(tmp_path, srv.url)
    assert [r["messages"][-1]["content"] for r in srv.requests] == ["Question number 2?"]
    assert summary["done"] == 6 and summary["generated_now"] == 1 and [r["id"] for r in rows][2] == "p2"
    assert any(f"{partial}:3: not a complete trace line" in m for m in caplog.messages)


def test_a_server_that_fails_to_start_reports_the_cause(tmp_path, monkeypatch):
    """The stage's error names the cause from the server's log, not a traceback."""
    (tmp_path / "standin.py").write_text(
        "import sys; print('INFO loading'); print('ERROR [core.py:1] ValueError: No available memory for the "
        "cache blocks', flush=True); print('INFO shutting down'); sys.exit(1)"
    )
    import draftsmith.backends.server as server

    monkeypatch.setattr(server, "API_SERVER_MODULE", "standin")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    settings = GenerateSettings(backend="vllm-server", max_new_tokens=4, server_startup_timeout_s=60)
    with pytest.raises(GenerateError) as err:
        generate_traces(
            str(TARGET), str(write_prompts(tmp_path / "p.jsonl")), str(tmp_path / "t.jsonl"),
            str(tmp_path / "s.json"), settings, server_log=str(tmp_path / "server.log"),
        )  # fmt: skip
    first = str(err.value).splitlines()[0]
    assert (
        first
        == "vLLM server exited with code 1 before it was healthy: ValueError: No available memory for the cache blocks"
    )
    assert "INFO shutting down" in str(err.value)


def test_multi_turn_regenerates_each_turn_against_own_history(fake, tmp_path):
    srv = fake()
    conv = {
        "id": "mt",
        "messages": [
            {"role": "user", "content": "First?"},
            {"role": "assistant", "content": "someone else's answer"},
            {"role": "user", "content": "Second?"},
        ],
    }
    prompts = write_prompts(tmp_path / "p.jsonl", n=0, extra=[conv])
    summary, [row] = run_stage(tmp_path, srv.url, prompts=prompts)
    first, second = srv.requests
    assert first["messages"] == conv["messages"][:1]
    assert second["messages"][1] == {"role": "assistant", "content": "echo: First?"}  # its own answer
    assert row["messages"] == second["messages"] and row["response"] == "echo: Second?"
    assert row["turns"][0]["response"] == "echo: First?" and summary["turns"] == 2


def test_failed_prompts_go_to_the_errors_file_with_file_and_line(fake, tmp_path):
    def reply(body, n):
        if "number 2" in body["messages"][-1]["content"]:
            return 400, {"error": {"message": "unprocessable prompt"}}
        return 200, FakeOpenAI.completion("fine")

    srv = fake(reply=reply)
    prompts = write_prompts(tmp_path / "p.jsonl")
    with pytest.raises(GenerateError, match="1 of 6 prompts failed"):
        run_stage(tmp_path, srv.url, prompts=prompts)
    [err] = errors(tmp_path)
    assert err["id"] == "p2" and err["where"] == f"{prompts}:3" and "unprocessable prompt" in err["error"]
    assert err["status"] == 400
    partial = tmp_path / "traces.jsonl.partial"
    assert len(partial.read_text().splitlines()) == 5  # kept for the rerun, which only retries p2
    n_before = len(srv.requests)
    summary, rows = run_stage(tmp_path, srv.url, prompts=prompts, max_failed_fraction=0.2)
    assert len(srv.requests) == n_before + 1 and summary["errors"] == 1
    assert [r["id"] for r in rows] == ["p0", "p1", "p3", "p4", "p5"]


def test_a_dead_endpoint_mid_run_stops_after_consecutive_failures(fake, tmp_path):
    srv = fake(reply=lambda body, n: (500, {"error": {"message": "engine dead"}}))
    prompts = write_prompts(tmp_path / "p.jsonl", n=200)
    with pytest.raises(GenerateError, match="3 requests in a row failed.*engine dead"):
        run_stage(
            tmp_path, srv.url, prompts=prompts, concurrency=2, max_retries=1, max_consecutive_failures=3
        )
    # far from 200 silent failures: at most the in-flight prompts past the limit, each tried twice
    assert len(srv.requests) <= (3 + 2) * 2
    assert not (tmp_path / "traces.jsonl").exists()


def test_a_server_with_another_template_is_refused(fake, tmp_path):
    srv = fake(reply=lambda body, n: (200, FakeOpenAI.completion("x", extra={"prompt_token_ids": [1, 2, 3]})))
    with pytest.raises(GenerateError, match="rendered the prompt differently"):
        run_stage(tmp_path, srv.url)


def test_reasoning_required_catches_a_server_without_parser(fake, tmp_path):
    srv = fake()
    with pytest.raises(GenerateError, match="no reasoning in the reply"):
        run_stage(tmp_path, srv.url, reasoning="required", max_consecutive_failures=2)


def test_oversized_prompts_are_skipped_and_counted_or_refused(fake, tmp_path):
    srv = fake(max_model_len=60)  # the server's context: a prompt + 16 new tokens must fit
    long = {"id": "long", "prompt": "word " * 200}
    prompts = write_prompts(tmp_path / "p.jsonl", n=3, extra=[long])
    summary, rows = run_stage(tmp_path, srv.url, prompts=prompts)
    assert [r["id"] for r in rows] == ["p0", "p1", "p2"] and summary["skipped"] == {"oversized": 1}
    [err] = errors(tmp_path)
    assert err["kind"] == "oversized" and err["where"] == f"{prompts}:4"
    assert len(srv.requests) == 3  # never sent
    with pytest.raises(
        PromptError, match=rf"{prompts}:4: prompt 'long' has \d+ tokens > generate.max_prompt_tokens 100"
    ):
        run_stage(tmp_path / "x", srv.url, prompts=prompts, max_prompt_tokens=100, oversized_prompts="error")


def test_bad_prompt_file_is_an_error_naming_file_and_line(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": "broken"\n', encoding="utf-8")
    from click.testing import CliRunner

    from draftsmith.cli import main

    args = ["generate", "--target", str(TARGET), "--prompts", str(prompts)]
    args += ["--out", str(tmp_path / "t.jsonl"), "--summary", str(tmp_path / "s.json")]
    result = CliRunner().invoke(main, [*args, "--backend", "openai", "--base-url", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and f"{prompts}:2: invalid JSON" in result.output


LOGGED_CLI = (
    "import logging, sys; logging.basicConfig(level=logging.INFO); from draftsmith.cli import main; "
    "sys.argv[0] = 'draftsmith'; main()"
)


def test_kill_during_openai_generation_resumes_without_duplicates_or_losses(fake, tmp_path):
    """SIGKILL mid-run (requests in flight, lines being appended); the rerun asks only for what is missing."""
    srv = fake(delay=0.3)  # 40 prompts take ~6 s at concurrency 2: time to kill in the middle
    prompts = write_prompts(tmp_path / "p.jsonl", n=40)
    args = ["draftsmith", "generate", "--target", str(TARGET), "--prompts", str(prompts)]
    args += ["--out", str(tmp_path / "traces.jsonl"), "--summary", str(tmp_path / "s.json")]
    args += ["--backend", "openai", "--base-url", srv.url, "--concurrency", "2", "--max-new-tokens", "8"]
    proc = subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    partial = tmp_path / "traces.jsonl.partial"
    deadline = time.time() + 120
    while time.time() < deadline and (not partial.exists() or partial.read_text().count("\n") < 10):
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert not (tmp_path / "traces.jsonl").exists()
    text = partial.read_text()
    complete = text[: text.rfind("\n") + 1]  # a line torn by the kill is cut by the rerun
    before = {json.loads(line)["id"]: line for line in complete.splitlines()}
    assert 10 <= len(before) < 40, "the kill came too late to test a resume"
    asked_before = len(srv.requests)
    # the CLI with logging configured the way a rule's log receives it (stderr)
    logged = [sys.executable, "-c", LOGGED_CLI, *args[1:]]
    out = subprocess.run(logged, env=_env(), capture_output=True, text=True, check=True).stderr
    assert f"{len(before)} already done, 0 with their original answers, {40 - len(before)} to go" in out
    assert len(srv.requests) - asked_before == 40 - len(before)  # no finished id asked again
    rows = (tmp_path / "traces.jsonl").read_text().splitlines()
    ids = [json.loads(line)["id"] for line in rows]
    assert ids == [f"p{i}" for i in range(40)]  # every prompt once, in prompt order
    assert all(line in rows for line in before.values())  # lines from before the kill kept verbatim
    assert not partial.exists()


# ----------------------------------------------------------------------------- server lifecycle (stand-in)

# Serves /health on --port and, like vLLM's api_server, runs a child (EngineCore) that it stops on SIGTERM.
STAND_IN = """
import argparse, http.server, signal, subprocess, sys
p = argparse.ArgumentParser(); p.add_argument("--port", type=int); a, _ = p.parse_known_args()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
def term(*_):
    child.terminate(); child.wait(); sys.exit(0)
signal.signal(signal.SIGTERM, term)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", a.port), H).serve_forever()
"""

OWNER = """
import sys, time
from draftsmith.backends.server import VllmServer
srv = VllmServer("model", log_path=sys.argv[1], module="standin", startup_timeout_s=60, stop_grace_s=5).start()
print(srv.pid, flush=True)
time.sleep(600)
"""


def _wait_gone(pgid, seconds=20):
    deadline = time.time() + seconds
    while time.time() < deadline and group_alive(pgid):
        time.sleep(0.1)
    return not group_alive(pgid)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_server_never_outlives_its_owner(tmp_path, how):
    """A killed generate job takes its server and the server's children with it (no 81 GB left on GPU 0)."""
    (tmp_path / "standin.py").write_text(STAND_IN)
    env = _env(PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    log = tmp_path / "server.log"
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(log)], env=env, stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    lines = []
    while not lines or not lines[-1].strip().isdigit():  # vllm-server: ... lines, then the pid
        line = owner.stdout.readline()
        assert line, "owner exited before the server was healthy: " + log.read_text()
        lines.append(line)
    pgid = int(lines[-1])
    assert group_alive(pgid)
    owner.send_signal(getattr(signal, how))
    owner.wait(timeout=30)
    assert _wait_gone(pgid), f"server group {pgid} still running after the owner got {how}"


# Serves /health and writes the API key it was given and its own command line, then idles like vLLM.
KEY_STAND_IN = """
import argparse, http.server, os, sys
p = argparse.ArgumentParser(); p.add_argument("--port", type=int); p.add_argument("--host"); a, _ = p.parse_known_args()
open(os.environ["KEY_FILE"], "a").write(os.environ.get("VLLM_API_KEY", "") + " " + a.host + "\\n")
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer((a.host, a.port), H).serve_forever()
"""


def test_each_server_run_requires_its_own_random_api_key(tmp_path, monkeypatch):
    (tmp_path / "standin.py").write_text(KEY_STAND_IN)
    monkeypatch.setenv("VLLM_API_KEY", "inherited")  # never passed on: the run's own key replaces it
    keys = []
    for _ in range(2):
        srv = VllmServer(
            "m", log_path=tmp_path / "s.log", module="standin", startup_timeout_s=60, stop_grace_s=5
        )
        srv.env = _env(PYTHONPATH=str(tmp_path), KEY_FILE=str(tmp_path / "keys"))
        with srv:
            cmdline = Path(f"/proc/{srv.pid}/cmdline").read_bytes().decode()
            keys.append(srv.api_key)
            assert srv.api_key not in cmdline and srv.api_key not in (tmp_path / "s.log").read_text()
    assert (tmp_path / "keys").read_text().split() == [keys[0], "127.0.0.1", keys[1], "127.0.0.1"]
    assert keys[0] != keys[1] and len(keys[0]) >= 32


def test_server_that_dies_at_start_fails_fast_with_its_log(tmp_path):
    (tmp_path / "standin.py").write_text("import sys; print('CUDA out of memory', flush=True); sys.exit(3)")
    srv = VllmServer("m", log_path=tmp_path / "s.log", module="standin", startup_timeout_s=60)
    srv.env = _env(PYTHONPATH=str(tmp_path))
    t0 = time.time()
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*CUDA out of memory"):
        srv.start()
    assert time.time() - t0 < 30 and srv.proc is None


# ----------------------------------------------------------------------------- the real vLLM server

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
VLLM_ARGS = ["--enforce-eager", "--max-model-len", "1024"]


def _vllm_env(tmp):
    return _env(VLLM_CACHE_ROOT=str(tmp / "vllm-cache"), HF_HOME=str(tmp / "hf"), **VLLM_ENV)


REAL_OWNER = """
import json, sys, time
from draftsmith.backends.server import VllmServer
srv = VllmServer(sys.argv[1], extra_args=json.loads(sys.argv[2]), log_path=sys.argv[3], dtype="bfloat16", seed=0)
srv.start()
print("READY", srv.pid, srv.base_url, srv.api_key, flush=True)
time.sleep(3600)
"""


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """A real vLLM server owned by another process; the teardown SIGKILLs that owner (a crashed rule)
    and checks that the server and its EngineCore still go away."""
    tmp = tmp_path_factory.mktemp("vllm")
    log = tmp / "server.log"
    owner = subprocess.Popen(
        [sys.executable, "-c", REAL_OWNER, str(TARGET), json.dumps(VLLM_ARGS), str(log)],
        env=_vllm_env(tmp),
        stdout=subprocess.PIPE,
        text=True,
    )
    line = owner.stdout.readline()
    while line and not line.startswith("READY"):
        line = owner.stdout.readline()
    if not line:
        owner.wait()
        pytest.fail("vLLM server did not start:\n" + log.read_text()[-4000:])
    _, pid, base_url, api_key = line.split()
    yield base_url, api_key
    owner.kill()
    owner.wait()
    assert _wait_gone(int(pid), 90), f"vLLM server {pid} outlived its SIGKILLed owner; log {log}"


@pytest.mark.vllm
@pytest.mark.slow
def test_openai_engine_against_real_vllm(vllm_server, tmp_path, monkeypatch):
    base_url, api_key = vllm_server
    # the server takes its run's key only: another local user cannot use it
    with pytest.raises(EndpointError, match="HTTP 401, the API key was refused"):
        openai_client(base_url).check()
    prompts = REPO / "draftsmith" / "data" / "prompts.jsonl"
    subset = tmp_path / "p.jsonl"
    subset.write_text("".join(prompts.read_text().splitlines(keepends=True)[:4]))
    monkeypatch.setenv("DRAFTSMITH_TEST_KEY", api_key)
    settings = GenerateSettings(
        backend="openai",
        base_url=base_url,
        api_key_env="DRAFTSMITH_TEST_KEY",
        max_new_tokens=24,
        concurrency=4,
    )
    summary = generate_traces(
        str(TARGET), str(subset), str(tmp_path / "t.jsonl"), str(tmp_path / "s.json"), settings
    )
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and summary["errors"] == 0 and summary["model"] == "target"
    from transformers import AutoTokenizer

    from draftsmith.core.data.chat import render_prompt

    tok = AutoTokenizer.from_pretrained(TARGET)
    for row in rows:
        # the served tokens are stored, and vLLM rendered the prompt exactly as the target's template
        assert row["prompt_token_ids"] == render_prompt(tok, row["messages"])
        assert 0 < len(row["response_token_ids"]) <= 24
        assert (
            tok.decode(row["response_token_ids"], skip_special_tokens=True).strip() == row["response"].strip()
        )
        assert row["finish_reason"] == "length" or row["response_token_ids"][-1] == tok.eos_token_id


def _tree(pid: int) -> set[int]:
    """A process, its process group (the server's session) and all their descendants, from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()
        parents[int(stat.parent.name)] = (int(fields[1]), int(fields[2]))  # ppid, pgrp
    tree = {pid} | {p for p, (_, pgrp) in parents.items() if pgrp == os.getpgid(pid)}
    grown = True
    while grown:
        more = {p for p, (ppid, _) in parents.items() if ppid in tree} - tree
        tree |= more
        grown = bool(more)
    return tree


@pytest.mark.vllm
@pytest.mark.slow
def test_the_workflows_server_needs_its_key_on_every_route_and_listens_on_loopback_only(vllm_server):
    """vLLM checks the key under /v1 only: /invocations (SageMaker's chat and completions) and /tokenize
    answered anyone. The workflow's middleware (backends/server_auth.py) refuses them without the run's
    key. The server's process tree (API server, engine core, worker) listens on one socket: the HTTP port
    on 127.0.0.1. Its engine's torch.distributed groups of one process open none (backends/
    vllm_one_process.py; gloo's listened on 15 ports of 127.0.0.1), and its processes talk over ZMQ ipc."""
    import httpx

    base_url, api_key = vllm_server
    root = base_url.removesuffix("/v1")
    chat = {"model": "target", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    routes = [("POST", "/invocations", chat), ("POST", "/tokenize", {"model": "target", "prompt": "Hello"})]
    routes += [("GET", path, None) for path in ("/health", "/ping", "/metrics", "/version", "/v1/models")]
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": api_key}):
            refused = httpx.request(method, root + path, json=body, headers=headers, timeout=60)
            assert refused.status_code == 401, (path, headers, refused.status_code, refused.text[:200])
        key = {"Authorization": f"Bearer {api_key}"}  # /metrics redirects to /metrics/, same origin
        served = httpx.request(
            method, root + path, json=body, headers=key, timeout=300, follow_redirects=True
        )
        assert served.status_code == 200, (path, served.status_code, served.text[:300])
        if path == "/invocations":
            assert served.json()["choices"][0]["message"]["role"] == "assistant"
        if path == "/tokenize":
            assert served.json()["count"] > 0
    port = int(root.rsplit(":", 1)[1])
    sockets = listeners()
    http = [pids for _, local, pids in sockets if local == f"127.0.0.1:{port}"]
    assert len(http) == 1 and http[0], sockets
    tree = set().union(*(_tree(pid) for pid in http[0]))
    assert len(tree) >= 3, tree  # the API server, its engine core and the engine's worker
    ours = [(netid, local) for netid, local, pids in sockets if pids & tree]
    print("listeners of the server's process tree:", ours)
    assert ours == [("tcp", f"127.0.0.1:{port}")], ours


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_server_mode_end_to_end_and_stopped(tiny_run):
    """The `vllm-server` mode starts and stops its own server: the shared tiny run's generate job
    (tests/conftest.py tiny_run) ran `draftsmith generate --backend vllm-server` on the real target."""
    results = tiny_run.results
    logged = (tiny_run.workdir / "logs" / "generate.log").read_text()  # the CLI's logging (stderr) and stdout
    pid = int(logged.split("vllm-server: pid ")[1].split()[0])
    assert f"vllm-server: stopped (pid {pid})" in logged  # logged once the server's whole group is gone
    assert not group_alive(pid)  # the server and its EngineCore are gone when the command returns
    summary = json.loads((results / "generate_summary.json").read_text())
    prompts = (results / "prompts" / "train.jsonl").read_text().splitlines()
    assert (
        summary["done"] == len(prompts)
        and summary["backend"] == "vllm-server"
        and summary["server_startup_seconds"] > 0
    )
    rows = [json.loads(line) for line in (results / "traces.jsonl").read_text().splitlines()]
    assert len(rows) == len(prompts)
    assert all(r["response_token_ids"] and r["backend"] == "vllm-server" for r in rows)
