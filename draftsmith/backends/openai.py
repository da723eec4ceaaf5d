"""The `openai` back-end: any OpenAI-compatible chat endpoint (vLLM, SGLang) over plain HTTP.

httpx, blocking, one request per worker thread: all a generation stage needs, with full control of what
is retried. httpx follows redirects but drops the API key on one to another origin (urllib's handler
would send it on). Policy:

- connection errors, timeouts, 408, 429 and 5xx are transient: retried with exponential backoff;
- 401/403/404 mean a wrong key, URL or model name: the whole stage stops at once (`EndpointError`);
- other 4xx (e.g. a prompt too long) fail that prompt only (`RequestFailed`, recorded in the errors file);
- a preflight `GET /v1/models` must succeed and list the model before the first prompt is sent.

vLLM returns the exact token ids when asked (`"return_token_ids": true`); the reasoning of thinking
models comes back apart from the answer in `message.reasoning` (vLLM) or `message.reasoning_content`
(SGLang, older vLLM).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from draftsmith.backends.common import Answer, Failure, oversized, oversized_failure

# Statuses worth another try: the server is busy, restarting or briefly overloaded.
TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
# Statuses that no retry and no other prompt will fix: the endpoint itself is wrong.
FATAL_STATUS = {401, 403, 404}


class EndpointError(RuntimeError):
    """The endpoint is unusable (down, wrong URL, key or model): stop the stage, do not retry prompts."""


class RequestFailed(RuntimeError):
    """One request failed for good (after retries, or a non-retryable 4xx); `status` is None for I/O."""

    def __init__(self, message: str, status: int | None = None, attempts: int = 1):
        super().__init__(message)
        self.status = status
        self.attempts = attempts


# ----------------------------------------------------------------------------- small pure policies


def classify_status(status: int) -> str:
    """'ok', 'retry', 'fatal' (endpoint is wrong) or 'fail' (this request only) for an HTTP status."""
    if 200 <= status < 300:
        return "ok"
    if status in TRANSIENT_STATUS or status >= 500:
        return "retry"
    if status in FATAL_STATUS:
        return "fatal"
    return "fail"


def backoff_seconds(attempt: int, base: float = 1.0, cap: float = 30.0) -> float:
    """Delay before retry number `attempt` (1, 2, ...): base, 2*base, 4*base ... capped."""
    return min(cap, base * 2 ** (attempt - 1))


def split_reasoning(message: dict[str, Any]) -> tuple[str, str | None]:
    """(answer, reasoning) of a chat completion message; reasoning is None when the server sent none.

    Servers name the field `reasoning` (vLLM >= 0.10) or `reasoning_content` (SGLang, DeepSeek API,
    older vLLM); `content` is null when a thinking model spent every token on reasoning.
    """
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    return message.get("content") or "", reasoning


def parse_completion(body: dict[str, Any]) -> Answer:
    """An Answer from a /v1/chat/completions response body (raises ValueError on an unknown shape)."""
    try:
        choice = body["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"not a chat completion: {json.dumps(body)[:300]}") from None
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length"):  # "abort", "error", None: not an answer to learn from
        raise ValueError(f"finish_reason {finish!r} (expected 'stop' or 'length')")
    text, reasoning = split_reasoning(message)
    usage = body.get("usage") or {}
    response_ids = choice.get("token_ids")
    prompt_ids = body.get("prompt_token_ids")
    return Answer(
        text=text,
        reasoning=reasoning,
        finish_reason=finish,
        prompt_tokens=int(usage.get("prompt_tokens") or len(prompt_ids or [])),
        completion_tokens=int(usage.get("completion_tokens") or len(response_ids or [])),
        prompt_ids=[int(t) for t in prompt_ids] if prompt_ids is not None else None,
        response_ids=[int(t) for t in response_ids] if response_ids is not None else None,
    )


def normalize_base_url(url: str) -> str:
    """'http://host:8000', '.../v1' or '.../v1/' -> 'http://host:8000/v1'."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


# ----------------------------------------------------------------------------- the client


class OpenAIClient:
    """A small blocking client for one model on one OpenAI-compatible server; safe to share by threads."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        *,
        timeout_s: float,
        max_retries: int,
        backoff_base_s: float,
        request_token_ids: bool,
        sampling: dict[str, Any] | None = None,
    ):
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.sampling = dict(sampling or {})
        self.request_token_ids = request_token_ids
        self.max_model_len: int | None = None  # filled by check() when the server reports it
        # thread-safe, pooled; on a redirect to another origin httpx drops the Authorization header
        self.http = httpx.Client(follow_redirects=True, limits=httpx.Limits(max_keepalive_connections=64))

    def close(self) -> None:
        self.http.close()

    @classmethod
    def from_env(cls, base_url: str, api_key_env: str | None, **kw: Any) -> OpenAIClient:
        """The API key is read from the named environment variable, never from config files; not from
        the Hugging Face token's, and sent only over https or to this machine (loopback)."""
        from draftsmith.core.config.config import api_key_env_error, api_key_url_error

        key = None
        if api_key_env:
            if reason := api_key_env_error(api_key_env) or api_key_url_error(base_url, api_key_env):
                raise EndpointError(f"generate.api_key_env: {reason}")
            key = os.environ.get(api_key_env)
            if not key:
                raise EndpointError(f"environment variable {api_key_env} (generate.api_key_env) is not set")
        return cls(base_url, api_key=key, **kw)

    def _request(self, method: str, path: str, payload: dict | None, timeout: float) -> tuple[int, Any]:
        """(status, parsed JSON or text); raises httpx.RequestError (incl. timeouts) for transport failures."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(payload).encode("utf-8") if payload is not None else None
        resp = self.http.request(method, self.base_url + path, content=data, headers=headers, timeout=timeout)
        status, text = resp.status_code, resp.content.decode("utf-8", errors="replace")
        try:
            return status, json.loads(text)
        except json.JSONDecodeError:
            return status, text

    def check(self) -> list[str]:
        """Preflight: the server answers /v1/models and serves `self.model` (picked if it serves one).

        Raises EndpointError with what to fix. Returns the served model names.
        """
        try:
            status, body = self._request("GET", "/models", None, timeout=min(self.timeout_s, 30.0))
        except (httpx.RequestError, ValueError) as err:
            raise EndpointError(f"cannot reach {self.base_url}/models: {_reason(err)}") from None
        if status in (401, 403):
            raise EndpointError(f"{self.base_url}/models: HTTP {status}, the API key was refused")
        if status != 200 or not isinstance(body, dict) or not isinstance(body.get("data"), list):
            raise EndpointError(
                f"{self.base_url}/models: HTTP {status}, not an OpenAI-compatible server: {str(body)[:200]}"
            )
        served = {m["id"]: m for m in body["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)}
        if self.model is None:
            if len(served) != 1:
                raise EndpointError(
                    f"{self.base_url} serves {sorted(served)}; name one with generate.model / --model"
                )
            self.model = next(iter(served))
        if self.model not in served:
            raise EndpointError(
                f"{self.base_url} does not serve model {self.model!r}; it serves {sorted(served)}"
            )
        max_len = served[self.model].get("max_model_len")
        self.max_model_len = int(max_len) if isinstance(max_len, int) else None
        return sorted(served)

    def payload(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        body = {"model": self.model, "messages": messages, **self.sampling}
        if self.request_token_ids:
            body["return_token_ids"] = True  # vLLM: the exact ids served; other servers ignore it
        return body

    def chat(self, messages: list[dict[str, str]], stop: Any = None) -> Answer:
        """One chat completion with retries. Raises RequestFailed (this prompt) or EndpointError (all).

        `stop` is an optional threading.Event: set, it ends the retry loop early (the stage is stopping).
        """
        body = self.payload(messages)
        last = ""
        for attempt in range(1, self.max_retries + 2):
            status = None
            try:
                status, reply = self._request("POST", "/chat/completions", body, timeout=self.timeout_s)
            except (httpx.RequestError, ValueError) as err:  # refused, reset, timed out, bad HTTP
                last, kind = _reason(err), "retry"
            else:
                kind = classify_status(status)
                if kind == "ok":
                    try:
                        return parse_completion(reply)
                    except ValueError as err:
                        raise RequestFailed(str(err), status, attempt) from None
                last = f"HTTP {status}: {_error_message(reply)}"
            if kind == "fatal":
                raise EndpointError(f"{self.base_url}/chat/completions (model {self.model!r}): {last}")
            if kind == "fail" or attempt > self.max_retries:
                break
            delay = backoff_seconds(attempt, self.backoff_base_s)
            if stop is not None and stop.wait(delay):
                break
            if stop is None:
                time.sleep(delay)
        raise RequestFailed(last, status, attempt)


def _reason(err: BaseException) -> str:
    if isinstance(err, httpx.TimeoutException):
        return "timed out"
    return f"{type(err).__name__}: {err}"


def _error_message(reply: Any) -> str:
    """The server's own error text (OpenAI shape {"error": {"message": ...}}) or the raw body, short."""
    if isinstance(reply, dict) and isinstance(reply.get("error"), dict):
        return str(reply["error"].get("message", reply["error"]))[:500]
    if isinstance(reply, dict) and "detail" in reply:  # FastAPI validation errors
        return str(reply["detail"])[:500]
    return str(reply)[:500]


# ----------------------------------------------------------------------------- the back-end


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


class OpenAIChatBackend:
    """Answers conversations through an OpenAIClient with `settings.concurrency` requests in flight."""

    startup_seconds: float | None = None

    def __init__(
        self, client: OpenAIClient, settings: Any, render: Callable[[list[dict]], list[int]], fingerprint: str
    ):
        self.client, self.settings, self.render, self.fingerprint = client, settings, render, fingerprint
        self.model = str(client.model)

    @classmethod
    def open(
        cls, settings: Any, render: Callable[[list[dict]], list[int]], fingerprint: str
    ) -> OpenAIChatBackend:
        """The configured endpoint, checked (it lists the model) before any prompt is sent."""
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
        return cls(client, settings, render, fingerprint)

    def close(self) -> None:
        self.client.close()

    stopped: str | None = None  # why results() stopped early, once it has

    def results(
        self, convs: list[Any], on_tokens: Callable[[int], None]
    ) -> Iterator[tuple[Any, Failure | None]]:
        """(conversation, None when answered in full, else the failure), as they finish; sets `stopped`
        when the endpoint fails for good.

        Each worker thread takes one conversation at a time and runs its turns in order. Only the
        calling thread handles results (writes lines), so a kill can tear at most the line being written.
        """
        settings, client, render, fingerprint = self.settings, self.client, self.render, self.fingerprint
        work: queue.Queue[Any] = queue.Queue()
        for c in convs:
            work.put(c)
        results: queue.Queue[tuple[Any, Failure | None]] = queue.Queue()
        stop = threading.Event()
        fatal: list[str] = []

        def answer(conv: Any) -> Failure | None:
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
        try:
            while True:
                try:
                    conv, failure = results.get(timeout=0.2)
                except queue.Empty:
                    # Stopping, or every worker has finished and handed in its last result: done.
                    if (stop.is_set() or not any(t.is_alive() for t in threads)) and results.empty():
                        break
                    continue
                if failure is None:
                    on_tokens(sum(a.completion_tokens for a in conv.answers))
                yield conv, failure
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
        finally:
            stop.set()  # also when the caller stops reading: no new requests
        # Workers still in a request are daemons: their answers are redone on the next run.
        self.stopped = fatal[0] if fatal else None
