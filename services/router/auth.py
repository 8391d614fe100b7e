"""The client API keys (--api-key): `Authorization: Bearer KEY` with one of them — or `x-api-key:
KEY`, the header Anthropic's clients send —, compared in constant time. Several keys (comma-separated, or a JSON list) let a rotation accept the old key
and the new one at once."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.requests import Request

from services.common.config import list_items
from services.router import errors


def api_keys(setting: str | Sequence[str]) -> list[str]:
    """The keys a setting holds: "a,b", '["a", "b"]', or already a list; empty: none."""
    if isinstance(setting, str):
        return list_items(setting)
    return [key for item in setting for key in list_items(item)]


def check_api_key(keys: Sequence[str], request: Request) -> None:
    """401 unless the request carries one of `keys` (api_keys(); none: every request passes)."""
    if not keys:
        return
    given: list[bytes] = []
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        given.append(token.strip().encode())
    if "x-api-key" in request.headers:
        given.append(request.headers["x-api-key"].strip().encode())
    # every key is compared, so the time taken says nothing of which one (or how much of it) matched
    matched = False
    for key in keys:
        for candidate in given:
            matched |= hmac.compare_digest(candidate, key.encode())
    if not matched:
        raise errors.unauthorized()
