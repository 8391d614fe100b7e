"""The client API keys (--api-key): `Authorization: Bearer KEY` with one of them, compared in
constant time. Several keys let a rotation accept the old key and the new one at once."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.requests import Request

from services.router import errors


def check_api_key(keys: Sequence[str] | str, request: Request) -> None:
    """401 unless the request carries one of `keys` (none set: every request passes)."""
    if isinstance(keys, str):  # one key, as settings made in code may give it
        keys = [keys] if keys else []
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    given_bytes = given.strip().encode()
    # every key is compared, so the time taken says nothing of which one (or how much of it) matched
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given_bytes, key.encode())
    if scheme.lower() != "bearer" or not matched:
        raise errors.unauthorized()
