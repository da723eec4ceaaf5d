"""Back-ends that run the target for a stage, behind one interface: generate answers, capture hidden
states. (An "engine" in draftsmith is a serving engine an export is written for: vLLM, SGLang, speculators.)

The generate stage asks `open_backend(settings, target, ...)` for a `ChatBackend` and never branches on
which one it got:

  transformers  in-process, batched (backends/hf.py; CPU or GPU)
  openai        any OpenAI-compatible server (backends/openai.py: bounded concurrency, retries, reasoning)
  vllm-server   the openai back-end against a vLLM server it starts and always stops (backends/server.py)

What they share lives in backends/common.py, which imports no back-end; this module only opens one, and
imports each back-end when it is asked for it, so its dependencies load only then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from draftsmith.backends.common import ChatBackend

BACKENDS = ("transformers", "openai", "vllm-server")


def open_backend(
    settings: Any,
    target: str,
    render: Callable[[list[dict]], list[int]],
    fingerprint: str,
    server_log: str,
) -> ChatBackend:
    """The back-end `settings.backend` names, ready to run (model loaded, endpoint checked, server healthy).

    render: the target's chat template (messages -> prompt ids); fingerprint: its short hash, named when
    a server renders prompts differently; server_log: where a started server writes its log.
    Raises EndpointError / ServerError when the endpoint or server cannot be used."""
    if settings.backend == "transformers":
        from draftsmith.backends.hf import HfChatBackend

        return HfChatBackend.open(settings, target, render)
    if settings.backend == "openai":
        from draftsmith.backends.openai import OpenAIChatBackend

        return OpenAIChatBackend.open(settings, render, fingerprint)
    if settings.backend == "vllm-server":
        from draftsmith.backends.server import VllmServerBackend

        return VllmServerBackend.open(settings, target, render, fingerprint, server_log)
    raise ValueError(f"generate.backend: {settings.backend!r} is not one of {list(BACKENDS)}")
