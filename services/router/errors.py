"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Every failure the router reports to a client is an `APIError`; the app turns it into a JSON body
(before the first byte) or into an SSE `data: {"error": ...}` event (after it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

# OpenAI's `type` per status; clients (the openai SDK included) key on the status, the type is for humans.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,  # noqa: A002 - OpenAI's field name
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported_content_encoding(encoding: str) -> APIError:
    return APIError(415, f"Request bodies with Content-Encoding '{encoding[:64]}' are not supported; send the "
                         "JSON uncompressed.", code="unsupported_content_encoding")


def invalid_type(param: str, expected: str, value: Any) -> APIError:
    return bad_request(
        f"Invalid type for '{param}': expected {expected}, but got {json_type(value)} instead.",
        param=param,
        code="invalid_type",
    )


def each_object(items: list, where: str, expected: str = "an object") -> Iterator[tuple[str, dict[str, Any]]]:
    """(its path, e.g. `messages[2]`, and the item) for each item of a request's array `where`, in
    order; an item that is not a JSON object fails the request (invalid_type) when the walk
    reaches it."""
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise invalid_type(at, expected, item)
        yield at, item


# the JSON type names of OpenAI's invalid_type message; bool before int, of which it is a subclass
_JSON_TYPE_NAMES = (
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a decimal"),
    (str, "a string"),
    (list, "an array"),
    (dict, "an object"),
)


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, float) and not math.isfinite(value):
        # NaN and Infinity are not JSON, though Python's parser takes them: name them as written
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    for kind, name in _JSON_TYPE_NAMES:
        if isinstance(value, kind):
            return name
    return type(value).__name__


def unauthorized() -> APIError:
    return APIError(
        401,
        "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>').",
        code="invalid_api_key",
    )


def model_not_found(name: str, served: str, adapters: list[str] | None = None) -> APIError:
    also = f" and the LoRA adapters {', '.join(repr(a) for a in adapters)}" if adapters else ""
    return APIError(
        404,
        f"The model '{name}' does not exist. This server serves '{served}'{also}.",
        param="model",
        code="model_not_found",
    )


def route_not_found(method: str, path: str) -> APIError:
    return APIError(404, f"Unknown request URL: {method} {path}.", code="unknown_url")


def method_not_allowed(method: str, path: str) -> APIError:
    return APIError(405, f"Method {method} is not allowed for {path}.", code="method_not_allowed")


def body_too_large(limit: int) -> APIError:
    return APIError(
        413, f"Request body is larger than the limit of {limit} bytes.", code="request_too_large"
    )


def _rate_limited(message: str) -> APIError:
    """A 429 the client may retry after a second: the router is at one of its limits."""
    return APIError(429, message, code="rate_limit_exceeded", headers={"Retry-After": "1"})


def too_many_requests(limit: int) -> APIError:
    return _rate_limited(f"The router is at its limit of {limit} concurrent choices (n counts each); retry shortly.")


def choices_over_budget(n: int, limit: int) -> APIError:
    return bad_request(
        f"n = {n} is more choices than this router ever serves at once ({limit}); ask for at most {limit}.",
        param="n", code="n_over_budget",
    )


def too_many_body_reads(limit: int) -> APIError:
    return _rate_limited(f"The router is reading its limit of {limit} request bodies; retry shortly.")


def shutting_down() -> APIError:
    return APIError(
        503,
        "The router is shutting down; retry (another router replica takes the request).",
        code="shutting_down",
        headers={"Retry-After": "1"},
    )


def body_timeout(timeout: float) -> APIError:
    return APIError(408, f"The request body did not arrive within {timeout:g} s.", code="request_timeout")


def nested_too_deeply() -> APIError:
    return bad_request("The JSON body is nested too deeply.", code="invalid_json")


def no_healthy_workers(what: str) -> APIError:
    return APIError(503, f"No healthy {what} worker is available.", code="no_healthy_workers")


def upstream_failed(detail: str) -> APIError:
    return APIError(503, f"The request failed on the workers: {detail}", code="worker_failure")


def deadline_exceeded(timeout: float) -> APIError:
    return APIError(504, f"The request did not finish within the deadline of {timeout:g} s.", code="timeout")
