"""A junk input file is one line naming it and exit 2, never a traceback (issue 44): export given a junk
summary.json (refused before any export is written), eval-summary given junk JSON, vocab given a junk
tokens file. Train's junk vocab map and full disk: tests/unit/training/test_train.py."""

from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.workflow import DEFAULT_TARGET

from draftsmith.cli import main

TARGET = str(DEFAULT_TARGET)
# the default target, materialised once per session where a fresh clone has none yet (conftest)
pytestmark = pytest.mark.usefixtures("target_model")


def _one_line(result, name: Path) -> str:
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    line = result.output.strip()
    assert "\n" not in line and "Traceback" not in line, line
    assert line.startswith(f"error: {name}: "), line
    return line


@pytest.mark.parametrize("summary", [b"{junk", b"{}", b"[1]"])
def test_export_refuses_a_junk_summary_before_writing_any_export(tmp_path, summary):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    junk = tmp_path / "summary.json"
    junk.write_bytes(summary)
    args = ["export", "--drafter", drafter, "--target", TARGET, "--summary", junk]
    args += ["--out-sglang", tmp_path / "sglang", "--out-speculators", tmp_path / "spec"]
    line = _one_line(CliRunner().invoke(main, [str(a) for a in args]), junk)
    assert "--forcerun eval_summary" in line
    assert not (tmp_path / "sglang").exists() and not (tmp_path / "spec").exists()


def test_eval_summary_names_a_junk_measurement(tmp_path):
    junk = tmp_path / "vllm.json"
    junk.write_text("{junk")
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    args = ["eval-summary", "--vllm", f"heldout={junk}", "--manifest", junk, "--drafter", drafter]
    args += ["--target", TARGET, "--metrics", junk, "--out", tmp_path / "eval"]
    line = _one_line(CliRunner().invoke(main, [str(a) for a in args]), junk)
    assert "not valid JSON" in line


def test_vocab_names_a_junk_tokens_file(tmp_path):
    junk = tmp_path / "tokens.safetensors"
    junk.write_bytes(b"junk")
    args = ["vocab", "--tokens", junk, "--target", TARGET, "--out", tmp_path / "vocab_map.pt"]
    line = _one_line(CliRunner().invoke(main, [str(a) for a in args]), junk)
    assert "not a tokens file" in line and "--forcerun tokenize" in line
