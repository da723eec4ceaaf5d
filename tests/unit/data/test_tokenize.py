"""tokenize.py: broken trace lines named by file:line, dropped and truncated samples reported."""

from __future__ import annotations

import json
import logging

from click.testing import CliRunner
from helpers.workflow import REPO

from draftsmith.cli import main
from draftsmith.stages.tokenize import TokenizeSettings, tokenize_traces

TARGET = REPO / "resources" / "SmolLM2-135M-Instruct"


def _trace(i: str, question: str, answer: str = "Fine, thanks.") -> dict:
    return {"id": i, "messages": [{"role": "user", "content": question}], "response": answer}


def test_truncated_trace_line_names_file_and_line(target_model, tmp_path) -> None:
    traces = tmp_path / "traces.jsonl"
    line = json.dumps(_trace("a", "How are you?"))
    traces.write_text(line + "\n" + line[:30] + "\n")  # a copy cut short
    result = CliRunner().invoke(
        main,
        ["tokenize", "--target", str(target_model), "--traces", str(traces), "--out", str(tmp_path / "t.st")],
    )
    assert result.exit_code == 2, result.output
    assert f"{traces}:2: not a complete JSON trace" in result.output
    assert "line 1 column" not in result.output and not (tmp_path / "t.st").exists()


def test_dropped_and_truncated_samples_are_reported(target_model, tmp_path, caplog) -> None:
    from transformers import AutoTokenizer

    from draftsmith.core.data.chat import render_prompt

    tok = AutoTokenizer.from_pretrained(target_model)
    short = _trace("short", "Hi?")
    n = len(render_prompt(tok, short["messages"]))
    long = _trace("long", "Tell me everything about the history of the world. " * 4)  # prompt > max_seq_len
    traces = tmp_path / "traces.jsonl"
    traces.write_text("".join(json.dumps(t) + "\n" for t in (short, long)))
    with caplog.at_level(logging.INFO, logger="draftsmith.stages.tokenize"):
        summary = tokenize_traces(
            str(target_model),
            str(traces),
            str(tmp_path / "t.st"),
            TokenizeSettings(num_shards=1, max_seq_len=n + 3),
        )
    assert summary["samples"] == 1 and summary["dropped"] == 1 and summary["truncated"] == 2
    assert any(f"{traces}:2" in m and "'long' dropped" in m for m in caplog.messages)
    assert any(m.startswith("tokenize: 1 samples") and "{" not in m for m in caplog.messages)
