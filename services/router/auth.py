"""The client API key (--api-key): `Authorization: Bearer KEY`, compared in constant time."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from services.router import errors


def check_api_key(key: str, request: Request) -> None:
    """401 unless the request carries `key` (no key set: every request passes)."""
    if not key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise errors.unauthorized()
