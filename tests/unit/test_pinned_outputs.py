"""The outputs that do not depend on the CPU's arithmetic, pinned by digest: the tiny run's prompt
selection (tests/config.tiny.yaml's prompts section on the packaged prompts). The digests were taken from
a run of the code before the core/stages reorganisation (issue 34), so a refactor that changes what the
prompts stage writes fails here. Later stages' files hold floating-point states and timings: the tiny
workflow's run is compared with the earlier code's by content instead (docs/results.md)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from click.testing import CliRunner

from draftsmith.cli import main

TINY_PROMPTS = {"heldout_path": None, "max_prompt_chars": 1500, "max_prompts": 24, "num_heldout": 3,
                "path": None, "seed": 0, "source": "builtin"}  # fmt: skip
PINNED = {
    "train.jsonl": "d2baf5cac5eb3258083efb829a4655d90a47afd655923a45183033c9e85270be",
    "heldout.jsonl": "5e4a381b1f52abd6a405534e766d26ae01a5f05b2b29e47081d39b21a6b6d019",
}


def test_the_tiny_runs_prompt_files_are_the_pinned_bytes(tmp_path: Path) -> None:
    args = ["prompts", "--settings", json.dumps(TINY_PROMPTS), "--out-train", str(tmp_path / "train.jsonl"),
            "--out-heldout", str(tmp_path / "heldout.jsonl"), "--summary", str(tmp_path / "summary.json")]  # fmt: skip
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    digests = {name: hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() for name in PINNED}
    assert digests == PINNED
