"""schemathesis hooks for tests/integration/test_router_openapi.py (loaded via SCHEMATHESIS_HOOKS).

One bound, applied to every generated body before it is sent: at most 16 new tokens. The schema
rightly allows max_tokens up to the context (8192), and chat defaults to the rest of the context
when max_tokens is absent, so an unbounded case generates thousands of tokens and spends the time
budget on one request. Values of the wrong type stay as generated (they must be a 400).
"""

from __future__ import annotations

import schemathesis

# Imported once here rather than lazily from schemathesis' worker threads: a concurrent first
# import of anyio fails inside schemathesis 4.32 ("AST constructor recursion depth mismatch").
import schemathesis.transport.asgi  # noqa: F401

MAX_NEW_TOKENS = 16


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    body = case.body
    if not isinstance(body, dict):
        return
    if "input" in body and "messages" not in body and "prompt" not in body:  # /v1/responses
        value = body.get("max_output_tokens")
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > MAX_NEW_TOKENS):
            body["max_output_tokens"] = MAX_NEW_TOKENS
        return
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_NEW_TOKENS:
            body[name] = MAX_NEW_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_NEW_TOKENS
