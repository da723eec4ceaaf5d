"""Generation stage: every prompt answered by the target, appended line by line, resumable.

The back-end (transformers in-process, an OpenAI-compatible server, or a vLLM server this stage
starts) comes from `backends.open_backend`; this module does not depend on which.

Work goes to `<out>.partial`: one JSON line per finished conversation, written whole by one thread,
flushed and fsynced. A rerun after a crash or kill keeps every complete line (a torn last line is cut)
and skips those ids, so nothing is duplicated or lost. When every prompt is answered, the traces are
written to `<out>` atomically in prompt order and the partial file is removed. Failed prompts go to the
errors file with their reason; the summary (also JSON) counts done, truncated, errors, skipped,
reasoning captured, tokens and tokens/s. A garbled line in the partial file costs only that prompt.

Multi-turn prompts (several user turns): each assistant turn is regenerated in order against the model's
own earlier answers (`multi_turn: regenerate`), so every answer a drafter learns from is the target's.
One trace per conversation: `messages` holds the final context with the regenerated turns, `response`
the last answer and `turns` the earlier answers with their token ids (tokenize masks them all).

Original answers: a share of the prompts that carry their dataset conversation (`original_answers_share`,
chosen by a hash of the id) is not generated: its trace is the conversation as written, every answer a
turn, with `source: original` (regenerated traces have `source: regenerated`). The teacher is still the
target's softmax on its own final state, so such text teaches the target's distribution at ~1/10 the
cost; only its argmax agrees less with the text (the target did not write it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from draftsmith.backends import open_backend
from draftsmith.backends.common import Answer, Failure
from draftsmith.backends.openai import EndpointError
from draftsmith.backends.server import ServerError
from draftsmith.core.config.stage_args import BAD_INPUT, FAILED, arg
from draftsmith.core.config.stage_settings import GenerateSettings
from draftsmith.core.data.chat import render_prompt, template_fingerprint
from draftsmith.core.data.prompt_sources import PromptError, conversation_answers, read_prompt_file
from draftsmith.core.io.atomic import atomic_path, write_json, write_jsonl

log = logging.getLogger(__name__)

TRUNCATED_WARN_SHARE = 0.2  # warn when more answers than this stop at max_new_tokens


class GenerateError(RuntimeError):
    """The stage cannot finish (endpoint down, too many failures, mismatched template); says what to do."""


# ----------------------------------------------------------------------------- the resume file


def read_partial(path: Path) -> dict[str, dict]:
    """Complete lines of a partial traces file by id.

    A torn last line (a kill mid-write) is cut. A garbled line elsewhere (a disk or copy error) loses
    only itself: it is reported by line number and dropped, its prompt is answered again, and the
    file is rewritten with the good lines so that appends start clean."""
    done: dict[str, dict] = {}
    if not path.exists():
        return done
    with open(path, "rb") as fh:
        data = fh.read()
    lines = data.splitlines(keepends=True)
    good: list[bytes] = []
    bad: list[int] = []
    for line_no, line in enumerate(lines, start=1):
        if not line.endswith(b"\n"):  # torn tail: only ever the last line
            break
        try:
            row = json.loads(line)
            done[str(row["id"])] = row
            good.append(line)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            bad.append(line_no)
    for line_no in bad:
        log.warning("%s:%d: not a complete trace line; dropped, its prompt is generated again", path, line_no)
    if len(good) != len(lines):  # rewrite without the torn or garbled lines
        with atomic_path(path) as tmp:
            tmp.write_bytes(b"".join(good))
    return done


class TraceSink:
    """Appends rows to the partial file, one whole line per write, each made durable before the next."""

    def __init__(self, path: Path):
        self.fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, row: dict) -> None:
        self.fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.fh.flush()
        os.fsync(self.fh.fileno())

    def close(self) -> None:
        self.fh.close()


# ----------------------------------------------------------------------------- prompts and turns


def prompt_line_numbers(path: str | Path) -> list[int]:
    """Line number of each prompt in a validated prompt JSONL (blank lines hold no prompt)."""
    lines = []
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            text = raw.decode("utf-8", errors="replace")
            if line_no == 1:
                text = text.removeprefix("\ufeff")
            if text.strip():
                lines.append(line_no)
    return lines


def generation_points(messages: list[dict], multi_turn: str) -> list[int]:
    """Message indices where the target answers, in order; the last is len(messages) (the final answer).

    With "regenerate" every assistant message of the prompt is answered anew at its position, against
    the regenerated history; with "last" the prompt's assistant messages are kept as given context.
    """
    end = len(messages)
    if multi_turn == "last":
        return [end]
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"] + [end]


@dataclass
class Conversation:
    """One prompt being answered turn by turn."""

    prompt: dict
    line: int | None
    multi_turn: str  # generate.multi_turn
    answers: list[Answer] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)  # locally rendered prompt of each turn

    @property
    def id(self) -> str:
        return self.prompt["id"]

    @property
    def points(self) -> list[int]:
        return generation_points(self.prompt["messages"], self.multi_turn)

    @property
    def done(self) -> bool:
        return len(self.answers) == len(self.points)

    def context(self, turn: int | None = None) -> list[dict]:
        """Messages asked for answer number `turn` (default: the next one): the prompt up to that point,
        earlier assistant messages replaced by the regenerated answers."""
        turn = len(self.answers) if turn is None else turn
        points = self.points
        upto = points[turn]
        regenerated = {i: a for i, a in zip(points, self.answers[:turn], strict=False)}
        return [
            {"role": "assistant", "content": regenerated[i].text} if i in regenerated else dict(m)
            for i, m in enumerate(self.prompt["messages"][:upto])
        ]

    def where(self, prompts_path: str | Path) -> str:
        return f"{prompts_path}:{self.line}" if self.line else str(prompts_path)


def answer_record(answer: Answer, prompt_ids: list[int] | None) -> dict[str, Any]:
    """The per-turn fields of a trace (also the top-level fields for the final answer)."""
    rec: dict[str, Any] = {"response": answer.text}
    if answer.reasoning is not None:
        rec["reasoning"] = answer.reasoning
    if answer.response_ids is not None:
        # The served prompt ids when the server returned them (checked equal to ours), else our render.
        rec["prompt_token_ids"] = answer.prompt_ids if answer.prompt_ids is not None else prompt_ids
        rec["response_token_ids"] = answer.response_ids
    rec["prompt_tokens"] = answer.prompt_tokens
    rec["completion_tokens"] = answer.completion_tokens
    rec["finish_reason"] = answer.finish_reason
    return rec


def trace_row(conv: Conversation, backend: str, model: str, template: str) -> dict[str, Any]:
    """The traces.jsonl line of a finished conversation."""
    final_ids = conv.prompt_ids[-1] if conv.prompt_ids else None
    row: dict[str, Any] = {"id": conv.id, "messages": conv.context(len(conv.answers) - 1)}
    row.update(answer_record(conv.answers[-1], final_ids))
    if len(conv.answers) > 1:
        row["turns"] = [
            answer_record(a, ids) for a, ids in zip(conv.answers[:-1], conv.prompt_ids, strict=False)
        ]
    row["source"] = "regenerated"
    row["backend"], row["model"], row["template"] = backend, model, template
    return row


def uses_original(prompt_id: str, share: float, seed: int) -> bool:
    """Whether a prompt with a dataset conversation is trained on its original answers: a hash of
    (seed, id) below `share`, so the choice is stable across reruns and independent of prompt order."""
    h = int.from_bytes(hashlib.sha256(f"original/{seed}/{prompt_id}".encode()).digest()[:8], "big")
    return h / 2**64 < share


def original_row(prompt: dict, template: str) -> dict[str, Any] | None:
    """The trace of a prompt's dataset conversation as written (every answer a turn, with its reasoning
    where the record has one, e.g. served traffic), or None when it has none. Token counts are 0:
    nothing was generated."""
    conversation = prompt.get("conversation") or []
    answers = conversation_answers(conversation)
    if not answers or answers != [i for i, m in enumerate(conversation) if m["role"] == "assistant"]:
        return None  # no answer, or an assistant turn before any question: regenerate instead

    def record(i: int) -> dict[str, Any]:
        rec: dict[str, Any] = {"response": conversation[i]["content"]}
        if conversation[i].get("reasoning"):
            rec["reasoning"] = conversation[i]["reasoning"]
        return rec | {"prompt_tokens": 0, "completion_tokens": 0, "finish_reason": "original"}

    last = answers[-1]
    # earlier answers as context, as a regenerated trace holds them: text only, their reasoning in `turns`
    context = [{"role": m["role"], "content": m["content"]} for m in conversation[:last]]
    row: dict[str, Any] = {"id": prompt["id"], "messages": context, **record(last)}
    if len(answers) > 1:
        row["turns"] = [record(i) for i in answers[:-1]]
    row |= {"source": "original", "backend": "dataset", "model": None, "template": template}
    return row


def row_answers(row: dict) -> list[dict]:
    """Every answer of a trace row: earlier turns, then the final one."""
    return [*row.get("turns", []), row]


def summarize(rows: list[dict], generated_now: int, new_tokens: int, seconds: float) -> dict[str, Any]:
    """Counts over the finished traces (all of them, also those from an earlier interrupted run)."""
    answers = [a for r in rows for a in row_answers(r)]
    captured = sum(any(a.get("reasoning") for a in row_answers(r)) for r in rows)
    return {
        "samples": len(rows),
        "done": len(rows),
        "original_answers": sum(r.get("source") == "original" for r in rows),
        "generated_now": generated_now,
        "turns": len(answers),
        "truncated": sum(any(a["finish_reason"] == "length" for a in row_answers(r)) for r in rows),
        "reasoning_captured": captured,
        "reasoning_capture_rate": round(captured / len(rows), 4) if rows else 0.0,
        "prompt_tokens": sum(a["prompt_tokens"] for a in answers),
        "completion_tokens": sum(a["completion_tokens"] for a in answers),
        "tokens": new_tokens,  # generated in this run
        "seconds": round(seconds, 2),
        "tokens_per_second": round(new_tokens / seconds, 1) if seconds > 0 else None,
    }


# ----------------------------------------------------------------------------- the stage


class Renderer:
    """The target's chat template, thread-safe (a fast tokenizer must not encode from two threads)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.lock = threading.Lock()

    def __call__(self, messages: list[dict]) -> list[int]:
        with self.lock:
            return render_prompt(self.tokenizer, messages)


def default_errors_path(out_path: str | Path) -> Path:
    out = Path(out_path)
    return out.with_name(out.stem.replace("traces", "generate") + "_errors.jsonl")


class Progress:
    """Generated tokens against an estimate of the stage's total, for an honest ETA: max_new_tokens per
    answer to start with, then the mean length of the answers finished so far."""

    def __init__(self, answers: int, max_new_tokens: int, enabled: bool = True):
        self.answers_left, self.max_new_tokens = answers, max_new_tokens
        self.finished_answers, self.finished_tokens = 0, 0
        self.n, self.total = 0, answers * max_new_tokens  # tokens so far, estimated tokens in all
        self.bar = tqdm(
            total=self.total, desc="generate", unit="tok", unit_scale=True, dynamic_ncols=True,
            mininterval=1.0, disable=not enabled,
        )  # fmt: skip

    def tokens(self, n: int) -> None:
        """n more tokens generated (a back-end reports them as they come)."""
        self.n += n
        self.bar.update(n)

    def finished(self, answers: int, tokens: int, dropped: int = 0) -> None:
        """A conversation is done: `answers` answered with `tokens` tokens, `dropped` answers never will be."""
        self.finished_answers += answers
        self.finished_tokens += tokens
        self.answers_left -= answers + dropped
        mean = self.finished_tokens / self.finished_answers if self.finished_answers else self.max_new_tokens
        self.total = max(self.n, round(self.finished_tokens + self.answers_left * mean))
        self.bar.total = self.total
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def describe(summary: dict[str, Any], max_new_tokens: int) -> str:
    """The stage's one-line summary, for people."""
    skipped = sum(summary["skipped"].values())
    return (
        f"generate: {summary['done']} traces ({summary['generated_now']} now), "
        f"{summary['truncated']} truncated at {max_new_tokens} tokens, {summary['errors']} errors, "
        f"{skipped} skipped; reasoning captured {summary['reasoning_capture_rate']:.0%}; "
        f"{summary['tokens']} new tokens in {summary['seconds']:.0f} s ({summary['tokens_per_second'] or 0:.0f} tok/s)"
    )


def generate_traces(
    target: str,
    prompts_path: str,
    out_path: str,
    summary_path: str,
    settings: GenerateSettings | None = None,
    errors_path: str | None = None,
    server_log: str | None = None,
    progress: bool = True,
    **overrides: Any,
) -> dict[str, Any]:
    """Answer every prompt of `prompts_path` with the target; see the module docstring.

    Raises PromptError (bad or empty prompt file, or an oversized prompt with oversized_prompts: error)
    and GenerateError (the stage stopped; finished traces stay in the partial file for the rerun).
    """
    from draftsmith.core.model.target import check_target_dir, load_tokenizer

    settings = settings or GenerateSettings()
    if overrides:  # keyword form, e.g. generate_traces(..., max_new_tokens=8, batch_size=4)
        settings = GenerateSettings.from_dict({**settings.__dict__, **overrides})
    settings.check()
    prompts = read_prompt_file(prompts_path)
    if not prompts:
        raise PromptError(f"{prompts_path}: no prompts (the file holds no prompt line)")
    lines = prompt_line_numbers(prompts_path)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    errors_file = Path(errors_path) if errors_path else default_errors_path(out)
    partial_path = out.with_name(out.name + ".partial")
    done = read_partial(partial_path)
    tokenizer = load_tokenizer(check_target_dir(target))
    fingerprint = template_fingerprint(tokenizer)
    stale = [i for i, row in done.items() if row.get("template") != fingerprint]
    if stale:  # traces from another template must not be mixed in
        raise GenerateError(
            f"{partial_path}: {len(stale)} traces were rendered with another chat template; delete the file to restart"
        )
    render = Renderer(tokenizer)
    originals = {}  # the dataset's own answers: written below without generation
    if settings.original_answers_share > 0:
        for p in prompts:
            if p["id"] not in done and uses_original(p["id"], settings.original_answers_share, settings.seed):
                row = original_row(p, fingerprint)
                if row is not None:
                    originals[p["id"]] = row
    todo = [
        Conversation(p, line, settings.multi_turn)
        for p, line in zip(prompts, lines, strict=True)
        if p["id"] not in done and p["id"] not in originals
    ]
    if settings.oversized_prompts == "error" and settings.max_prompt_tokens > 0:
        for c in todo:  # fail before any work, naming the line
            n = len(render(c.context()))
            if n > settings.max_prompt_tokens:
                raise PromptError(
                    f"{c.where(prompts_path)}: prompt {c.id!r} has {n} tokens > generate.max_prompt_tokens "
                    f"{settings.max_prompt_tokens} (set generate.oversized_prompts: skip to skip such prompts)"
                )
    log.info(
        "generate (%s): %d prompts, %d already done, %d with their original answers, %d to go",
        settings.backend,
        len(prompts),
        len(done),
        len(originals),
        len(todo),
    )

    failures: dict[str, Failure] = {}
    by_id = {c.id: c for c in todo}
    generated, new_tokens = 0, 0
    fatal, backend = None, None
    sink = TraceSink(partial_path)
    for pid, row in originals.items():  # the dataset's answers need no back-end
        sink.write(row)
        done[pid] = row
    if todo:  # everything answered already (or by the dataset): start no back-end
        try:
            backend = open_backend(
                settings, target, render, fingerprint, server_log or str(out.with_name("vllm-server.log"))
            )
        except (EndpointError, ServerError) as err:
            sink.close()
            raise GenerateError(str(err)) from None
    bar = Progress(sum(len(c.points) for c in todo), settings.max_new_tokens, enabled=progress)
    start = time.perf_counter()  # after loading the model or starting the server
    try:
        for conv, failure in backend.results(todo, bar.tokens) if backend else ():
            if failure is not None:
                if failure.kind == "oversized" and settings.oversized_prompts == "error":
                    failure.kind = "error"
                failures[conv.id] = failure
                bar.finished(0, 0, dropped=len(conv.points))
            else:
                assert backend is not None  # results come from it
                row = trace_row(conv, settings.backend, backend.model, fingerprint)
                sink.write(row)
                done[conv.id] = row
                tokens = sum(a.completion_tokens for a in conv.answers)
                new_tokens, generated = new_tokens + tokens, generated + 1
                bar.finished(len(conv.answers), tokens)
        fatal = backend.stopped if backend else None
    except EndpointError as err:
        fatal = str(err)
    finally:
        sink.close()
        bar.close()
        if backend:
            backend.close()
    elapsed = time.perf_counter() - start

    error_rows = [
        {
            "id": cid,
            "where": by_id[cid].where(prompts_path),
            "kind": f.kind,
            "error": f.message,
            "status": f.status,
            "attempts": f.attempts,
            "turn": f.turn,
        }
        for cid, f in failures.items()
    ]
    write_jsonl(errors_file, error_rows)
    n_errors = sum(f.kind == "error" for f in failures.values())
    for row in error_rows[:5]:
        log.warning("%s (%s): %s: %s", row["where"], row["id"], row["kind"], row["error"])
    if fatal:
        raise GenerateError(
            f"stopped: {fatal}\n{len(done)} traces are kept in {partial_path}; fix the cause and rerun to "
            f"continue ({n_errors} failed prompts listed in {errors_file})"
        )
    if n_errors > settings.max_failed_fraction * len(prompts):
        raise GenerateError(
            f"{n_errors} of {len(prompts)} prompts failed (listed in {errors_file}); rerun to retry them "
            f"(the {len(done)} finished traces in {partial_path} are kept), or raise generate.max_failed_fraction"
        )
    rows = [done[p["id"]] for p in prompts if p["id"] in done]
    write_jsonl(out, rows)
    partial_path.unlink(missing_ok=True)
    skipped = Counter(f.kind for f in failures.values() if f.kind != "error")
    summary = {
        "backend": settings.backend,
        "model": backend.model if backend else str(target),
        **summarize(rows, generated, new_tokens, elapsed),
        "errors": n_errors,
        "skipped": dict(skipped),
        "server_startup_seconds": round(backend.startup_seconds, 1)
        if backend and backend.startup_seconds
        else None,
        "template": fingerprint,
        "errors_file": str(errors_file),
    }
    write_json(summary_path, summary)
    log.info("%s", describe(summary, settings.max_new_tokens))
    warn_truncated(summary, settings.max_new_tokens)
    return summary


def warn_truncated(summary: dict[str, Any], max_new_tokens: int) -> bool:
    """Warn (-> True) when more than TRUNCATED_WARN_SHARE of the traces stop at max_new_tokens: the drafter
    would learn from answers cut short, and never see how the target ends one."""
    share = summary["truncated"] / summary["samples"] if summary["samples"] else 0.0
    if share <= TRUNCATED_WARN_SHARE:
        return False
    log.warning(
        "%.0f%% of the traces (%d of %d) were cut at generate.max_new_tokens = %d; raise it unless short "
        "answers are what the drafter should learn",
        100 * share, summary["truncated"], summary["samples"], max_new_tokens,
    )  # fmt: skip
    return True


@dataclass
class GeneratePaths:
    target: str = arg("--target", "Target model folder.", kind="dir", required=True, exists=True)
    prompts: str = arg("--prompts", "Prompt JSONL (the prompts stage's).", required=True, exists=True)
    out: str = arg("--out", "traces.jsonl to write.", required=True, sealed=True)
    summary: str = arg("--summary", "Summary JSON to write.", required=True, sealed=True)
    errors: str | None = arg(
        "--errors",
        "Failed/skipped prompts as JSONL, with file:line and reason [default: generate_errors.jsonl "
        "beside --out].",
    )
    gpu_memory_gib: float | None = arg(
        "--gpu-memory-gib",
        "Each GPU's memory for the engine layout; 0 or unset = nvidia-smi on this machine.",
        kind="float",
        minimum=0,
    )
    devices: str | None = arg(
        "--devices",
        "vllm-server: GPU ids for CUDA_VISIBLE_DEVICES, e.g. 0,1 [default: inherited].",
        kind="text",
    )
    server_log: str | None = arg("--server-log", "vllm-server: its log file.")


Settings, Paths = GenerateSettings, GeneratePaths
EXITS = {PromptError: BAD_INPUT, GenerateError: FAILED}


def run(paths: GeneratePaths, settings: GenerateSettings) -> list[str]:
    """Answer every prompt with the target and append the traces, resumably.

    A rerun after a crash or kill skips the ids already finished (kept in OUT.partial). Examples:

    \b
      draftsmith generate --target T --prompts p.jsonl --out traces.jsonl --summary s.json
      draftsmith generate ... --backend openai --base-url http://127.0.0.1:8000/v1 --concurrency 16
      draftsmith generate ... --backend vllm-server --server-args '["--max-model-len","4096"]' --devices 0,1
    """
    from draftsmith.core.model.precision import compute_dtype

    devices = [d.strip() for d in paths.devices.split(",") if d.strip()] if paths.devices else None
    settings = replace(
        settings,
        dtype=compute_dtype(settings.dtype),
        devices=devices,
        gpu_memory_gib=paths.gpu_memory_gib or None,  # 0: ask nvidia-smi here
    )
    generate_traces(
        paths.target,
        paths.prompts,
        paths.out,
        paths.summary,
        settings,
        errors_path=paths.errors,
        server_log=paths.server_log,
    )
    return []
