"""Generation stage: every prompt answered by the target, appended line by line, resumable.

One stage, three engines:
  transformers  in-process, batched (the default; CPU or GPU)
  openai        any OpenAI-compatible server (vLLM, SGLang): bounded concurrency, retries, reasoning fields
  vllm-server   the same client against a vLLM server this stage starts and always stops (engines/server.py)

Work goes to `<out>.partial`: one JSON line per finished conversation, written whole by one thread,
flushed and fsynced. A rerun after a crash or kill keeps every complete line (a torn last line is cut)
and skips those ids, so nothing is duplicated or lost. When every prompt is answered, the traces are
written to `<out>` atomically in prompt order and the partial file is removed. Failed prompts go to the
errors file with their reason; the summary (also JSON) counts done, truncated, errors, skipped,
reasoning captured, tokens and tokens/s.

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
import os
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tqdm import tqdm

from draftsmith.atomic import write_json, write_jsonl
from draftsmith.chat import render_prompt, template_fingerprint
from draftsmith.engines.openai import Answer, EndpointError, OpenAIClient, RequestFailed
from draftsmith.prompts import PromptError, conversation_answers, read_prompt_file

ENGINES = ("transformers", "openai", "vllm-server")


class GenerateError(RuntimeError):
    """The stage cannot finish (endpoint down, too many failures, mismatched template); says what to do."""


@dataclass
class GenerateSettings:
    """The `generate` config section (defaults and meanings in config.schema.yaml)."""

    engine: str = "transformers"
    max_new_tokens: int = 160
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    dtype: str = "bfloat16"
    batch_size: int = 32
    batch_tokens: int = 8192
    base_url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    concurrency: int = 8
    timeout_s: float = 600.0
    max_retries: int = 4
    backoff_s: float = 1.0
    max_consecutive_failures: int = 8
    request_token_ids: bool = True
    server_args: list[str] = field(default_factory=lambda: ["--enforce-eager"])
    server_startup_timeout_s: float = 900.0
    devices: list[str] | None = None
    reasoning: str = "auto"
    multi_turn: str = "regenerate"
    max_prompt_tokens: int = 0
    oversized_prompts: str = "skip"
    max_failed_fraction: float = 0.0
    original_answers_share: float = 0.0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GenerateSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known - {"gpus"})  # gpus is a Snakemake resource, not a setting
        if unknown:
            raise ValueError(f"unknown generate settings: {', '.join(unknown)}")
        settings = cls(**{k: v for k, v in values.items() if k in known})
        settings.check()
        return settings

    def check(self) -> None:
        choices = {
            "engine": ENGINES,
            "reasoning": ("auto", "required"),
            "multi_turn": ("regenerate", "last"),
            "oversized_prompts": ("skip", "error"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"generate.{key}: {getattr(self, key)!r} is not one of {list(allowed)}")
        if not 0 <= self.original_answers_share <= 1:
            raise ValueError(
                f"generate.original_answers_share: {self.original_answers_share} is not in [0, 1]"
            )
        if self.engine == "openai" and not self.base_url:
            raise ValueError("generate.base_url is required with engine 'openai' (e.g. http://host:8000/v1)")
        for key in (
            "concurrency",
            "batch_size",
            "batch_tokens",
            "max_new_tokens",
            "max_consecutive_failures",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"generate.{key} must be >= 1")

    def sampling(self) -> dict[str, Any]:
        """The request's sampling fields (same meaning as the transformers engine's)."""
        return {
            "max_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
        }


# ----------------------------------------------------------------------------- the resume file


def read_partial(path: Path) -> dict[str, dict]:
    """Complete lines of a partial traces file by id; a torn last line (a kill mid-write) is dropped."""
    done: dict[str, dict] = {}
    if not path.exists():
        return done
    with open(path, "rb") as fh:
        data = fh.read()
    good_end = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        done[row["id"]] = row
        good_end += len(line)
    if good_end != len(data):  # cut the torn tail so appends start on a clean line
        with open(path, "rb+") as fh:
            fh.truncate(good_end)
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


def generation_points(messages: list[dict], multi_turn: str = "regenerate") -> list[int]:
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
    line: int | None = None
    multi_turn: str = "regenerate"
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


def trace_row(conv: Conversation, engine: str, model: str, template: str) -> dict[str, Any]:
    """The traces.jsonl line of a finished conversation."""
    final_ids = conv.prompt_ids[-1] if conv.prompt_ids else None
    row: dict[str, Any] = {"id": conv.id, "messages": conv.context(len(conv.answers) - 1)}
    row.update(answer_record(conv.answers[-1], final_ids))
    if len(conv.answers) > 1:
        row["turns"] = [
            answer_record(a, ids) for a, ids in zip(conv.answers[:-1], conv.prompt_ids, strict=False)
        ]
    row["source"] = "regenerated"
    row["engine"], row["model"], row["template"] = engine, model, template
    return row


def uses_original(prompt_id: str, share: float, seed: int) -> bool:
    """Whether a prompt with a dataset conversation is trained on its original answers: a hash of
    (seed, id) below `share`, so the choice is stable across reruns and independent of prompt order."""
    h = int.from_bytes(hashlib.sha256(f"original/{seed}/{prompt_id}".encode()).digest()[:8], "big")
    return h / 2**64 < share


def original_row(prompt: dict, template: str) -> dict[str, Any] | None:
    """The trace of a prompt's dataset conversation as written (every answer a turn), or None when it
    has none. Token counts are 0: nothing was generated."""
    conversation = prompt.get("conversation") or []
    answers = conversation_answers(conversation)
    if not answers or answers != [i for i, m in enumerate(conversation) if m["role"] == "assistant"]:
        return None  # no answer, or an assistant turn before any question: regenerate instead

    def record(i: int) -> dict[str, Any]:
        text = conversation[i]["content"]
        return {"response": text, "prompt_tokens": 0, "completion_tokens": 0, "finish_reason": "original"}

    last = answers[-1]
    row: dict[str, Any] = {"id": prompt["id"], "messages": conversation[:last], **record(last)}
    if len(answers) > 1:
        row["turns"] = [record(i) for i in answers[:-1]]
    row |= {"source": "original", "engine": "dataset", "model": None, "template": template}
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


# ----------------------------------------------------------------------------- failures


@dataclass
class Failure:
    kind: str  # "oversized" (skipped by config) or "error"
    message: str
    status: int | None = None
    attempts: int = 0
    turn: int = 0


def oversized(n_prompt: int, max_new_tokens: int, max_prompt_tokens: int, context_len: int | None) -> bool:
    """Too long to answer in full: over `max_prompt_tokens` when that is set (> 0), else the prompt plus
    `max_new_tokens` do not fit the engine's context (a server silently shortens such answers)."""
    if max_prompt_tokens > 0:
        return n_prompt > max_prompt_tokens
    return context_len is not None and n_prompt + max_new_tokens > context_len


def oversized_failure(
    turn: int, n_prompt: int, settings: GenerateSettings, context_len: int | None
) -> Failure:
    limit = settings.max_prompt_tokens or f"context {context_len} - {settings.max_new_tokens} new tokens"
    return Failure("oversized", f"prompt of turn {turn} has {n_prompt} tokens > {limit}", turn=turn)


class Renderer:
    """The target's chat template, thread-safe (a fast tokenizer must not encode from two threads)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.lock = threading.Lock()

    def __call__(self, messages: list[dict]) -> list[int]:
        with self.lock:
            return render_prompt(self.tokenizer, messages)


def check_served_prompt(served: list[int] | None, local: list[int], fingerprint: str) -> None:
    """The server must have rendered the prompt exactly as the target's template does (else: stop)."""
    if served is None or served == local:
        return
    at = next(
        (i for i, (a, b) in enumerate(zip(served, local, strict=False)) if a != b),
        min(len(served), len(local)),
    )
    raise EndpointError(
        f"the server rendered the prompt differently from the target's chat template ({fingerprint}): "
        f"{len(served)} vs {len(local)} tokens, first difference at token {at} "
        f"(server {served[at : at + 5]}, template {local[at : at + 5]}). Serve the same model folder with "
        "its own template (no --chat-template override), or the drafter learns another format."
    )


# ----------------------------------------------------------------------------- engines


def run_transformers(
    convs: list[Conversation],
    settings: GenerateSettings,
    model: Any,
    tokenizer: Any,
    render: Renderer,
    on_result: Any,
) -> None:
    """Batched in-process generation; each batch advances all its conversations one turn at a time."""
    import torch

    from draftsmith.engines.hf import generate_batch

    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    context_len = getattr(model.config, "max_position_embeddings", None)
    first = [render(c.context()) for c in convs]
    widths = [len(ids) + settings.max_new_tokens for ids in first]
    for b, batch in enumerate(length_batches(widths, settings.batch_size, settings.batch_tokens)):
        torch.manual_seed(settings.seed + b)
        active = [convs[i] for i in batch]
        while active:
            ids = [render(c.context()) for c in active]
            keep = []
            for c, p in zip(active, ids, strict=True):
                if oversized(len(p), settings.max_new_tokens, settings.max_prompt_tokens, context_len):
                    on_result(c, oversized_failure(len(c.answers), len(p), settings, context_len))
                else:
                    keep.append((c, p))
            if not keep:
                break
            gens = generate_batch(
                model,
                [p for _, p in keep],
                settings.max_new_tokens,
                eos,
                pad,
                settings.temperature,
                settings.top_p,
            )
            active = []
            for (c, p), gen in zip(keep, gens, strict=True):
                text_ids = [t for t in gen.response_ids if t not in eos]
                c.prompt_ids.append(p)
                c.answers.append(
                    Answer(
                        text=tokenizer.decode(text_ids, skip_special_tokens=True),
                        reasoning=None,
                        finish_reason=gen.finish_reason,
                        prompt_tokens=len(p),
                        completion_tokens=len(gen.response_ids),
                        prompt_ids=p,
                        response_ids=gen.response_ids,
                    )
                )
                if c.done:
                    on_result(c, None)
                else:
                    active.append(c)


def run_openai(
    convs: list[Conversation],
    settings: GenerateSettings,
    client: OpenAIClient,
    render: Renderer,
    fingerprint: str,
    on_result: Any,
) -> str | None:
    """Answer conversations with `settings.concurrency` requests in flight; returns why it stopped early.

    Each worker thread takes one conversation at a time and runs its turns in order. Only the calling
    thread handles results (writes lines), so a kill can tear at most the line being written.
    """
    work: queue.Queue[Conversation] = queue.Queue()
    for c in convs:
        work.put(c)
    results: queue.Queue[tuple[Conversation, Failure | None]] = queue.Queue()
    stop = threading.Event()
    fatal: list[str] = []

    def answer(conv: Conversation) -> Failure | None:
        while not conv.done:
            turn = len(conv.answers)
            local = render(conv.context())
            if oversized(
                len(local), settings.max_new_tokens, settings.max_prompt_tokens, client.max_model_len
            ):
                return oversized_failure(turn, len(local), settings, client.max_model_len)
            try:
                ans = client.chat(conv.context(), stop)
            except RequestFailed as err:
                return Failure("error", str(err), err.status, err.attempts, turn)
            check_served_prompt(ans.prompt_ids, local, fingerprint)
            if settings.reasoning == "required" and not ans.reasoning:
                return Failure(
                    "error",
                    "no reasoning in the reply (generate.reasoning: required); start vLLM with "
                    "--reasoning-parser NAME, or set reasoning: auto for a model that does not think",
                    turn=turn,
                )
            conv.prompt_ids.append(local)
            conv.answers.append(ans)
        return None

    def worker() -> None:
        while not stop.is_set():
            try:
                conv = work.get_nowait()
            except queue.Empty:
                return
            try:
                results.put((conv, answer(conv)))
            except EndpointError as err:  # the endpoint is wrong for every prompt: stop everything
                fatal.append(str(err))
                stop.set()
            except Exception as err:  # a bug or an unexpected reply: do not silently fail 10,000 prompts
                fatal.append(f"{type(err).__name__}: {err} (prompt {conv.id})")
                stop.set()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(settings.concurrency)]
    for t in threads:
        t.start()
    consecutive = 0
    while True:
        try:
            conv, failure = results.get(timeout=0.2)
        except queue.Empty:
            # Stopping, or every worker has finished and handed in its last result: done.
            if (stop.is_set() or not any(t.is_alive() for t in threads)) and results.empty():
                break
            continue
        on_result(conv, failure)
        if failure is None:
            consecutive = 0
        elif failure.kind == "error":  # a skipped oversized prompt says nothing about the endpoint
            consecutive += 1
            if consecutive >= settings.max_consecutive_failures and not stop.is_set():
                fatal.append(
                    f"{consecutive} requests in a row failed (generate.max_consecutive_failures); "
                    f"the last: {failure.message}"
                )
                stop.set()
    # Workers still in a request are daemons: their answers are redone on the next run.
    return fatal[0] if fatal else None


# ----------------------------------------------------------------------------- helpers kept from v1


def length_batches(lengths: list[int], batch_size: int, batch_tokens: int | None = None) -> list[list[int]]:
    """Indices grouped into batches of similar length (less padding, same results): at most
    `batch_size` rows, and at most `batch_tokens` padded tokens (rows x the longest) so a few very long
    prompts do not pad a whole batch to their width. A row longer than the budget gets a batch alone."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        last = batches[-1] if batches else None
        fits = last is not None and len(last) < batch_size
        if fits and batch_tokens is not None:
            fits = (len(last) + 1) * lengths[i] <= batch_tokens  # sorted: lengths[i] is the widest
        if fits:
            last.append(i)
        else:
            batches.append([i])
    return batches


def eos_token_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


# ----------------------------------------------------------------------------- the stage


def default_errors_path(out_path: str | Path) -> Path:
    out = Path(out_path)
    return out.with_name(out.stem.replace("traces", "generate") + "_errors.jsonl")


def generate_traces(
    target: str,
    prompts_path: str,
    out_path: str,
    summary_path: str,
    settings: GenerateSettings | None = None,
    errors_path: str | None = None,
    server_log: str | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Answer every prompt of `prompts_path` with the target; see the module docstring.

    Raises PromptError (bad prompt file, or an oversized prompt with oversized_prompts: error) and
    GenerateError (the stage stopped; finished traces stay in the partial file for the rerun).
    """
    from transformers import AutoTokenizer

    from draftsmith.target import check_target_dir

    settings = settings or GenerateSettings()
    if overrides:  # keyword form, e.g. generate_traces(..., max_new_tokens=8, batch_size=4)
        settings = GenerateSettings.from_dict({**settings.__dict__, **overrides})
    settings.check()
    prompts = read_prompt_file(prompts_path)
    lines = prompt_line_numbers(prompts_path)
    out = Path(out_path)
    errors_file = Path(errors_path) if errors_path else default_errors_path(out)
    partial_path = out.with_name(out.name + ".partial")
    done = read_partial(partial_path)
    tokenizer = AutoTokenizer.from_pretrained(check_target_dir(target))
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
    print(
        f"generate ({settings.engine}): {len(prompts)} prompts, {len(done)} already done, "
        f"{len(originals)} with their original answers, {len(todo)} to go",
        flush=True,
    )

    failures: dict[str, Failure] = {}
    by_id = {c.id: c for c in todo}
    state = {"new_tokens": 0, "generated": 0}
    bar = tqdm(total=len(todo), desc="generate", unit="prompt", dynamic_ncols=True)
    sink = TraceSink(partial_path)
    for pid, row in originals.items():
        sink.write(row)
        done[pid] = row
    engine_model = {"name": str(target)}
    start = time.perf_counter()

    def on_result(conv: Conversation, failure: Failure | None) -> None:
        if failure is not None:
            if failure.kind == "oversized" and settings.oversized_prompts == "error":
                failure.kind = "error"
            failures[conv.id] = failure
        else:
            row = trace_row(conv, settings.engine, engine_model["name"], fingerprint)
            sink.write(row)
            done[conv.id] = row
            state["new_tokens"] += sum(a.completion_tokens for a in conv.answers)
            state["generated"] += 1
        bar.update(1)
        elapsed = time.perf_counter() - start
        bar.set_postfix(tok_s=f"{state['new_tokens'] / max(elapsed, 1e-9):.0f}", failed=len(failures))

    fatal, startup = None, None
    try:
        if not todo:
            pass  # all answered (earlier run, or original answers): start no engine
        elif settings.engine == "transformers":
            import torch

            from draftsmith.target import load_target

            model, hf_tokenizer = load_target(target, getattr(torch, settings.dtype))
            start = time.perf_counter()
            run_transformers(todo, settings, model, hf_tokenizer, render, on_result)
            del model
        elif settings.engine == "openai":
            client = OpenAIClient.from_env(
                settings.base_url,
                settings.api_key_env,
                model=settings.model,
                timeout_s=settings.timeout_s,
                max_retries=settings.max_retries,
                backoff_base_s=settings.backoff_s,
                sampling=settings.sampling(),
                request_token_ids=settings.request_token_ids,
            )
            client.check()
            engine_model["name"] = client.model
            start = time.perf_counter()
            fatal = run_openai(todo, settings, client, render, fingerprint, on_result)
        else:
            from draftsmith.engines.server import VllmServer

            log = server_log or str(out.with_name("vllm-server.log"))
            with VllmServer(
                target,
                devices=settings.devices,
                extra_args=settings.server_args,
                log_path=log,
                dtype=settings.dtype,
                seed=settings.seed,
                startup_timeout_s=settings.server_startup_timeout_s,
            ) as server:
                startup = server.startup_seconds
                client = OpenAIClient(
                    server.base_url,
                    model=server.served_name,
                    timeout_s=settings.timeout_s,
                    max_retries=settings.max_retries,
                    backoff_base_s=settings.backoff_s,
                    sampling=settings.sampling(),
                )
                client.check()
                start = time.perf_counter()
                fatal = run_openai(todo, settings, client, render, fingerprint, on_result)
    except EndpointError as err:
        fatal = str(err)
    finally:
        sink.close()
        bar.close()
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
        print(f"generate: {row['where']} ({row['id']}): {row['kind']}: {row['error']}", flush=True)
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
        "engine": settings.engine,
        "model": engine_model["name"],
        **summarize(rows, state["generated"], state["new_tokens"], elapsed),
        "errors": n_errors,
        "skipped": dict(skipped),
        "server_startup_seconds": round(startup, 1) if startup is not None else None,
        "template": fingerprint,
        "errors_file": str(errors_file),
    }
    write_json(summary_path, summary)
    print(
        f"generate: {summary['done']} traces ({summary['truncated']} truncated at {settings.max_new_tokens} "
        f"tokens, {n_errors} errors, {sum(skipped.values())} skipped), reasoning captured "
        f"{summary['reasoning_capture_rate']:.0%}, {summary['tokens']} new tokens, "
        f"{summary['tokens_per_second']} tok/s",
        flush=True,
    )
    return summary
