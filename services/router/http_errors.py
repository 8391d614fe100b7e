"""An `APIError` as the HTTP response a client gets before any byte of a reply was sent."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from services.router.errors import APIError

CLIENT_CLOSED = 499  # nginx's "client closed request", for metrics and logs only


def error_json(error: APIError, request_id: int | str | None = None) -> JSONResponse:
    headers = dict(error.headers)
    if request_id is not None:
        headers["X-Request-Id"] = request_id if isinstance(request_id, str) else f"{request_id:016x}"
    return JSONResponse(error.body(), status_code=error.status, headers=headers)
