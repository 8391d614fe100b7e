"""Bounds for rendering a chat template that a client sent (vLLM's per-request `chat_template`).

A model's own template is trusted; one in a request is not. Jinja's sandbox already refuses
attribute tricks and caps `range()` at 100,000 items, but a template can still nest loops or
multiply or double strings until the router is out of time or memory. So a request's template
renders in `LimitedSandbox` (`*`, `+` and `**` capped) under `run_with_deadline`, which stops the
render once it has run longer than its budget or the process's peak memory grew by more than
MAX_RENDER_GROWTH_KB (what `~` concatenation, which Jinja does not let a sandbox intercept, can
build), and its output is capped in length.
"""

from __future__ import annotations

import operator
import resource
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_REPEAT_ITEMS = 1 << 20  # the largest string or list a `*` may build
MAX_POWER_BITS = 4096  # the largest integer a `**` may build, in bits
MAX_RENDERED_CHARS = 4 << 20  # a rendered prompt beyond this is refused before tokenization
MAX_RENDER_GROWTH_KB = 256 << 10  # peak resident memory a render may add (ru_maxrss is in KiB)

T = TypeVar("T")


class TemplateLimitError(ValueError):
    """The template went past a bound (time, size)."""


class LimitedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "+", "**"])

    def call_binop(self, context: Any, operator_name: str, left: Any, right: Any) -> Any:
        if operator_name == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                if len(left) + len(right) > MAX_REPEAT_ITEMS:
                    raise TemplateLimitError("the template builds a sequence that is too long")
            return operator.add(left, right)
        if operator_name == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                    if len(seq) * max(count, 0) > MAX_REPEAT_ITEMS:
                        raise TemplateLimitError("the template builds a sequence that is too long")
            return operator.mul(left, right)
        if isinstance(left, int) and isinstance(right, int) and right > 0:
            if abs(left) > 1 and right * max(abs(left).bit_length(), 1) > MAX_POWER_BITS:
                raise TemplateLimitError("the template computes a number that is too large")
        return operator.pow(left, right)


def run_with_deadline(fn: Callable[[], T], seconds: float) -> T:
    """fn() in this thread, stopped with TemplateLimitError once it ran for `seconds`.

    A trace function checks the clock on every line Jinja's compiled template (filename
    "<template>") executes; other code runs untraced, so the cost is confined to the render.
    """
    deadline = time.monotonic() + seconds
    rss_limit = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss + MAX_RENDER_GROWTH_KB

    def local(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateLimitError(f"the template took longer than {seconds:g} s to render")
        if resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > rss_limit:
            raise TemplateLimitError("the template uses too much memory")
        return local

    def calls(frame, event, arg):
        if frame.f_code.co_filename == "<template>":
            return local
        return None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        return fn()
    finally:
        sys.settrace(previous)
