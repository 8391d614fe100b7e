"""structlog logs: JSON lines, or human-readable lines in a terminal; the request's room id is
bound through contextvars."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import TextIO

import structlog

LOG_FORMATS = ("auto", "console", "json")
LOG_FORMAT_ENV = "PDMESH_LOG_FORMAT"


def resolve_log_format(fmt: str | None, stream: TextIO) -> str:
    """'console' or 'json'. auto: console when the log stream is a terminal (a person reads it),
    JSON otherwise (a file, a pipe, docker/kubectl logs: a machine reads it). None: $PDMESH_LOG_FORMAT, else auto."""
    fmt = (fmt or os.environ.get(LOG_FORMAT_ENV) or "auto").lower()
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(LOG_FORMATS)}")
    if fmt == "auto":
        try:
            return "console" if stream.isatty() else "json"
        except (AttributeError, ValueError):  # a closed or unusual stream
            return "json"
    return fmt


def configure_logging(level: str = "info", fmt: str | None = None, **static) -> None:
    """Log lines on stderr, from structlog and from stdlib loggers alike (the transfer layer,
    NIXL's Python API, uvicorn), all carrying the bound room. `fmt` is auto, console or json
    (see resolve_log_format). `static` (service, worker) is added to every line."""
    numeric = getattr(logging, level.upper(), logging.INFO)
    stream = sys.stderr
    console = resolve_log_format(fmt, stream) == "console"
    if console:
        timestamper = structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False)
        renderer = structlog.dev.ConsoleRenderer(colors=_colors(stream))
        exc_processors = []  # the console renderer prints tracebacks itself
    else:
        timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
        renderer = structlog.processors.JSONRenderer()
        exc_processors = [structlog.processors.format_exc_info]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            timestamper,
        ],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(numeric)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            timestamper,
            *exc_processors,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    if static:
        structlog.contextvars.bind_contextvars(**static)


def _colors(stream: TextIO) -> bool:
    # https://no-color.org; colours only into a terminal.
    try:
        return stream.isatty() and not os.environ.get("NO_COLOR")
    except (AttributeError, ValueError):
        return False


def get_logger(name: str | None = None):
    return structlog.get_logger(name)


@contextlib.contextmanager
def bound_room(room: int):
    """Every log line inside carries room and request_id (the same 63-bit id)."""
    with structlog.contextvars.bound_contextvars(room=room, request_id=f"{room:x}"):
        yield
