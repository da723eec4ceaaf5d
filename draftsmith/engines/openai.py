"""The `openai` engine: any OpenAI-compatible chat endpoint (vLLM, SGLang) over plain HTTP.

Standard library only (urllib + threads): one blocking request per worker thread is all a generation
stage needs, and it keeps full control of what is retried. Policy:

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
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

# Statuses worth another try: the server is busy, restarting or briefly overloaded.
TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
# Statuses that no retry and no other prompt will fix: the endpoint itself is wrong.
FATAL_STATUS = {401, 403, 404}


@dataclass
class Answer:
    """One assistant turn produced by an engine."""

    text: str  # the answer without the reasoning
    reasoning: str | None  # the thinking text when the server returned it apart, else None
    finish_reason: str  # "stop" or "length" (truncated at max_new_tokens)
    prompt_tokens: int
    completion_tokens: int
    prompt_ids: list[int] | None = None  # what the engine actually fed the model, when it says
    response_ids: list[int] | None = None  # generated ids incl. the stop token, when it says


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
        timeout_s: float = 600.0,
        max_retries: int = 4,
        backoff_base_s: float = 1.0,
        sampling: dict[str, Any] | None = None,
        request_token_ids: bool = True,
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

    @classmethod
    def from_env(cls, base_url: str, api_key_env: str | None, **kw: Any) -> OpenAIClient:
        """The API key is read from the named environment variable, never from config files."""
        key = None
        if api_key_env:
            key = os.environ.get(api_key_env)
            if not key:
                raise EndpointError(f"environment variable {api_key_env} (generate.api_key_env) is not set")
        return cls(base_url, api_key=key, **kw)

    def _request(self, method: str, path: str, payload: dict | None, timeout: float) -> tuple[int, Any]:
        """(status, parsed JSON or text); raises OSError (incl. timeouts) for transport failures."""
        data = json.dumps(payload).encode("utf-8") if payload is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        text = raw.decode("utf-8", errors="replace")
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
        except (OSError, ValueError) as err:
            raise EndpointError(f"cannot reach {self.base_url}/models: {_reason(err)}") from None
        if status in (401, 403):
            raise EndpointError(f"{self.base_url}/models: HTTP {status}, the API key was refused")
        if status != 200 or not isinstance(body, dict) or not isinstance(body.get("data"), list):
            raise EndpointError(
                f"{self.base_url}/models: HTTP {status}, not an OpenAI-compatible server: {str(body)[:200]}"
            )
        served = {m.get("id"): m for m in body["data"] if isinstance(m, dict)}
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
            except (OSError, ValueError) as err:  # refused, reset, timed out, bad HTTP
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
    if isinstance(err, urllib.error.URLError) and not isinstance(err, urllib.error.HTTPError):
        err = err.reason if isinstance(err.reason, BaseException) else err
    if isinstance(err, TimeoutError | socket.timeout):
        return "timed out"
    return f"{type(err).__name__}: {err}"


def _error_message(reply: Any) -> str:
    """The server's own error text (OpenAI shape {"error": {"message": ...}}) or the raw body, short."""
    if isinstance(reply, dict) and isinstance(reply.get("error"), dict):
        return str(reply["error"].get("message", reply["error"]))[:500]
    if isinstance(reply, dict) and "detail" in reply:  # FastAPI validation errors
        return str(reply["detail"])[:500]
    return str(reply)[:500]
