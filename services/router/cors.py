"""Cross-origin requests from browsers (CORS), configured as vLLM's: `--allowed-origins`,
`--allowed-methods`, `--allowed-headers` (each `*` by default) and `--allow-credentials` (off).

A web page served from another origin (a chat UI on localhost:3000, a notebook's front end) can
call the API only if the router answers its preflight (`OPTIONS` with `Origin` and
`Access-Control-Request-Method`) and marks its responses with `Access-Control-Allow-Origin`;
without it the browser blocks the call, whatever the router answered. vLLM and SGLang allow
every origin by default, and so does the router: a page still needs the API key where one is
set, as any other client.

Starlette's CORS middleware applies the rules, in front of everything the router serves (the
generation routes' fast path included, services/router/fastpath.py). Only a request that carries
an `Origin` header goes through it: the SDKs and benchmark tools never send one, so their
requests cost one scan of the header names more. A preflight the rules refuse is answered 400
with an OpenAI error body naming what was not allowed (the browser reads only the status and the
headers; a person debugging reads the body).
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp

from services.router.errors import APIError
from services.router.http_errors import error_json


def has_origin(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """Whether a request's headers (ASGI's: lower-case names) carry `Origin`."""
    for name, _ in headers:
        if name == b"origin":
            return True
    return False


class Cors(CORSMiddleware):
    """Starlette's CORS rules, with a refused preflight answered as every other 400 of the router."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        # "Disallowed CORS origin, method": what the middleware found, kept as the message
        what = response.body.decode().removeprefix("Disallowed CORS ")
        error = APIError(response.status_code,
                         f"Cross-origin request refused: its {what} is not allowed by this server's CORS "
                         "settings (--allowed-origins, --allowed-methods, --allowed-headers).",
                         code="cors_not_allowed")
        refused = error_json(error)
        for name, value in response.headers.items():
            if name.lower().startswith(("access-control-", "vary")):
                refused.headers[name] = value
        return refused


def cors(app: ASGIApp, origins: Sequence[str], methods: Sequence[str], headers: Sequence[str],
         credentials: bool) -> Cors:
    return Cors(app, allow_origins=list(origins), allow_methods=[m.upper() for m in methods],
                allow_headers=list(headers), allow_credentials=credentials)
