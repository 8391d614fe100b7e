"""structlog JSON logs; the request's room id is bound through contextvars."""

from __future__ import annotations

import contextlib
import logging
import sys

import structlog


def configure_logging(level: str = "info", **static) -> None:
    """JSON lines on stderr, from structlog and from stdlib loggers alike (the transfer layer,
    NIXL's Python API, uvicorn), all carrying the bound room. `static` (service, worker) is
    added to every line."""
    numeric = getattr(logging, level.upper(), logging.INFO)
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            timestamper,
        ],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.JSONRenderer()],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(numeric)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            timestamper,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    if static:
        structlog.contextvars.bind_contextvars(**static)


def get_logger(name: str | None = None):
    return structlog.get_logger(name)


@contextlib.contextmanager
def bound_room(room: int):
    """Every log line inside carries room and request_id (the same 63-bit id)."""
    with structlog.contextvars.bound_contextvars(room=room, request_id=f"{room:x}"):
        yield
