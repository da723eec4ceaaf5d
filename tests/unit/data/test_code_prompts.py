"""Code prompts from a wheel's documented functions: which functions qualify, the request and its
original answer, a seeded choice, and their place in the training prompts only."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from draftsmith.core.data.code_prompts import CodePromptError, code_prompts, wheel_code_prompts
from draftsmith.core.data.prompt_sources import parse_record
from draftsmith.stages.prompts import PromptSettings, prepare_prompts

MODULE = '''
import functools


@functools.lru_cache
def chunked(items, size):
    """Split items into lists of at most size.

    >>> chunked([1, 2, 3], 2)
    [[1, 2], [3]]
    """
    out = []
    for i in range(0, len(items), size):
        out.append(items[i : i + size])
    return out


def _private(x):
    """Not offered: private."""
    y = x
    z = y
    return z


def undocumented(x):
    y = x
    z = y
    w = z
    return w


def only_a_docstring():
    """No body to complete: left out, however long its docstring is.

    More.
    More.
    """


def short(x):
    """Too short."""
    return x
'''


def make_wheel(path: Path, modules: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, source in modules.items():
            zf.writestr(name, source)
    return path


def test_documented_public_functions_become_requests_with_their_source_as_answer(tmp_path):
    wheel = make_wheel(tmp_path / "lib-1.0-py3-none-any.whl",
                       {"lib/core.py": MODULE, "lib/tests/test_core.py": MODULE})  # fmt: skip
    [record] = wheel_code_prompts(wheel)
    assert record["id"] == "code:lib-1.0-py3-none-any.whl:lib/core.py:chunked"
    request, answer = record["conversation"]
    assert record["messages"] == [request] and request["role"] == "user" and answer["role"] == "assistant"
    # the stub: decorator, signature and docstring, fenced; the answer: the whole function, fenced
    assert request["content"].startswith("Complete the following Python function.\n\n```python\n@functools")
    assert (
        request["content"].endswith('    [[1, 2], [3]]\n    """\n```')
        and "out = []" not in request["content"]
    )
    assert answer["content"].startswith("```python\n@functools.lru_cache\ndef chunked(items, size):")
    assert answer["content"].endswith("    return out\n```")
    parsed = parse_record(json.loads(json.dumps(record)), "x")  # what the prompts stage reads back
    assert parsed["conversation"][1]["content"] == answer["content"]


def test_the_choice_is_seeded_and_asking_for_too_many_names_the_count(tmp_path):
    funcs = "".join(
        f'\ndef f{i}(x):\n    """Doc {i}."""\n    a = x\n    b = a\n    return b + {i}\n' for i in range(20)
    )
    wheel = make_wheel(tmp_path / "many.whl", {"many/m.py": funcs})
    first = [r["id"] for r in code_prompts([wheel], 5, seed=0)]
    assert first == [r["id"] for r in code_prompts([wheel], 5, seed=0)] and len(set(first)) == 5
    assert first != [r["id"] for r in code_prompts([wheel], 5, seed=1)]
    with pytest.raises(CodePromptError, match="21 asked, but the code wheels hold 20"):
        code_prompts([wheel], 21, seed=0)
    with pytest.raises(CodePromptError, match="not a readable wheel"):
        wheel_code_prompts(tmp_path / "missing.whl")


def test_code_prompts_join_the_training_prompts_only(tmp_path):
    wheel = make_wheel(tmp_path / "lib.whl", {"lib/core.py": MODULE})
    settings = PromptSettings.from_dict(
        {"source": "builtin", "max_prompts": 10, "num_heldout": 3, "max_prompt_chars": 0, "code_prompts": 1}
    )
    summary = prepare_prompts(
        str(tmp_path / "train.jsonl"), str(tmp_path / "heldout.jsonl"), settings, None, [str(wheel)]
    )
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    heldout = (tmp_path / "heldout.jsonl").read_text()
    assert summary["code_prompts"] == 1 and summary["train"] == 7 + 1
    assert train[-1]["id"].startswith("code:") and "code:" not in heldout
