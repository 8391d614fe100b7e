"""structlog logs: JSON lines, or human-readable lines in a terminal; the request's room id is
bound through contextvars."""

from __future__ import annotations

import contextvars
import logging
import os
import sys
from typing import Any, TextIO

import structlog

from services.common import log_processors

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
        # TimeStamper(fmt="iso", utc=True) and JSONRenderer(), line for line, for less CPU
        timestamper = log_processors.iso_utc_timestamp
        renderer = log_processors.JSONLineRenderer()
        exc_processors = [structlog.processors.format_exc_info]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            log_processors.merge_contextvars,
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
            log_processors.merge_contextvars,
            structlog.processors.add_log_level,
            timestamper,
            *exc_processors,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # PrintLogger's lines (print(line, flush=True)) with one write instead of two
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    global _generation
    _generation += 1  # every Logger rebuilds its bound logger from this configuration
    structlog.contextvars.clear_contextvars()
    if static:
        structlog.contextvars.bind_contextvars(**static)


def _colors(stream: TextIO) -> bool:
    # https://no-color.org; colours only into a terminal.
    try:
        return stream.isatty() and not os.environ.get("NO_COLOR")
    except (AttributeError, ValueError):
        return False


# configure_logging() calls so far: a Logger whose bound logger is from an older one rebuilds it
_generation = 0


class Logger:
    """structlog's logger, assembled once per configuration. structlog.get_logger()'s lazy proxy
    (with cache_logger_on_first_use off, so that reconfiguring still reaches module-level loggers)
    assembles a new bound logger — logger factory, wrapper, context — for every call (about a
    tenth of a log call's CPU, measured). This one keeps it until configure_logging() runs again."""

    __slots__ = ("_name", "_bound", "_generation")

    def __init__(self, name: str | None = None):
        self._name = name
        self._bound: Any = None
        self._generation = -1

    def __getattr__(self, attr: str) -> Any:
        # only for what the slots do not have: the logging methods, bind(), ...
        if self._generation != _generation:
            self._bound = structlog.get_logger(self._name).bind()
            self._generation = _generation
        return getattr(self._bound, attr)


def get_logger(name: str | None = None) -> Logger:
    return Logger(name)


class bound_contextvars:  # noqa: N801 - a drop-in for structlog's function of the same name
    """structlog.contextvars.bound_contextvars, without reading the whole context (it copies all of
    it to save the values it overrides): binds the keys, then puts back exactly what they were —
    their earlier value, or unset — from the tokens binding returned."""

    __slots__ = ("_values", "_tokens")

    def __init__(self, **values: Any):
        self._values = values
        self._tokens: Any = ()

    def __enter__(self) -> None:
        self._tokens = structlog.contextvars.bind_contextvars(**self._values).values()

    def __exit__(self, *exc: object) -> None:
        for token in self._tokens:
            # set, not reset: the same outcome even when the context is no longer the one bound in
            old = token.old_value
            token.var.set(... if old is contextvars.Token.MISSING else old)  # ...: structlog's "unset"
        self._tokens = ()


def bound_room(room: int) -> bound_contextvars:
    """Every log line inside carries room and request_id (the same 63-bit id)."""
    return bound_contextvars(room=room, request_id=f"{room:x}")
