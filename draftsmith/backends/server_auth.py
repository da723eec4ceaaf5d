"""The key on every route of the workflow's own vLLM server: an ASGI middleware vLLM runs outermost.

vLLM checks its API key only under /v1, /v2, /inference and /cohere (GUARDED_PREFIX in
vllm/entrypoints/serve/middleware/authenticate.py): /invocations (SageMaker's route to completions and
chat), /tokenize, /metrics and /health answer anyone who can connect. server.py starts vLLM with
`--middleware draftsmith.backends.server_auth.RequireKey` (a flag generate.server_args may not set);
vLLM adds it after its own middleware, so it runs first and sees every request before any route.

The key is the run's VLLM_API_KEY (server.server_env), compared in constant time. Without one, every
request is refused: a server the workflow started is never open. This module runs inside vLLM's API
process, so it imports only the standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]
]

KEY_ENV = "VLLM_API_KEY"
REFUSED = b'{"error": "Unauthorized"}'
POLICY_VIOLATION = 1008  # WebSocket close code: the request broke the server's policy


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8")).digest()


class RequireKey:
    """401 for any HTTP request (and a closed WebSocket) without `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        self.key_digest = _digest(key) if key else None

    def authorised(self, scope: Scope) -> bool:
        if self.key_digest is None:
            return False
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token), self.key_digest)
        return False

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket") or self.authorised(scope):  # lifespan: the app's own start-up
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": POLICY_VIOLATION})
            return
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(REFUSED)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": REFUSED})
