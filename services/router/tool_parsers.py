"""Tool calls in a model's output: one parser per chat-template family.

- `hermes` (Hermes 2 Pro, Qwen2.5, Qwen3): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number of them, with text
  around them that is the message's content.
- `llama3_json` (Llama 3.1/3.2/3.3 with JSON tool calling): the whole reply is
  `{"name": ..., "parameters": {...}}` (after an optional `<|python_tag|>`), several separated
  by `;`. A reply that does not start with `{` is plain content.

Each format parses a finished output (`parse`) and a growing one (`stream`). The streaming parser
turns text deltas into content deltas plus OpenAI tool-call deltas — `{"index", "id", "type",
"function": {"name", "arguments": ""}}` when a call's name is known, then `{"index", "function":
{"arguments": fragment}}` as the arguments' JSON arrives — which the openai SDK assembles by
index. Text that could be the start of a call marker is held back until the next delta decides.

A call's JSON is followed with a small incremental scanner (`_ObjectScan`), so a `</tool_call>`
inside an argument string does not end the call, and the arguments are streamed as the model's
own text (non-streamed replies carry exactly the same text). A call whose JSON is malformed stays
content in a non-streamed reply; a stream cannot take back a call it has announced, so there the
text after the fault goes on as content (docs/router.md, "Tool calls").
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

PYTHON_TAG = "<|python_tag|>"
_WS = " \t\r\n"
_SCALAR_START = "-0123456789tfn"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as the model wrote it
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# --- the scanner ------------------------------------------------------------------------------


class _ObjectScan:
    """Follows one JSON object as its text arrives: where each member's value starts and ends,
    and where the object closes. Structure only (strings, nesting); the finished object is
    checked with json.loads."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # text[:pos] is scanned
        self.phase = "start"
        self.members: dict[str, tuple[int, int]] = {}  # key -> (start, end) of its value in text
        self.key: str | None = None  # the member whose value is being read
        self.value_start = -1
        self.value_kind = ""  # "string" | "container" | "scalar"
        self.end = -1  # just past the closing brace, once done
        self.error = False
        self._mark = 0
        self._depth = 0
        self._in_string = False
        self._escape = False

    @property
    def done(self) -> bool:
        return self.phase == "done"

    def open_value(self) -> tuple[str, int, str] | None:
        """(key, start, kind) of a value being read, or None."""
        return (self.key, self.value_start, self.value_kind) if self.phase == "value" and self.key else None

    def feed(self, more: str) -> None:
        self.text += more
        if not self.error and not self.done:
            self._scan()

    def _fail(self, i: int) -> None:
        self.error = True
        self.pos = i

    def _close_value(self, end: int) -> None:
        assert self.key is not None
        self.members[self.key] = (self.value_start, end)
        self.phase = "after_value"

    def _scan(self) -> None:  # noqa: C901 - one state machine, clearer in one place
        t, i, n = self.text, self.pos, len(self.text)
        while i < n:
            c = t[i]
            ph = self.phase
            if ph == "value":
                kind = self.value_kind
                if kind == "scalar":
                    if c in _WS or c in ",}":
                        self._close_value(i)
                        continue
                elif self._escape:
                    self._escape = False
                elif kind == "string" or self._in_string:
                    if c == "\\":
                        self._escape = True
                    elif c == '"':
                        if kind == "string":
                            self._close_value(i + 1)
                        else:
                            self._in_string = False
                elif c == '"':
                    self._in_string = True
                elif c in "{[":
                    self._depth += 1
                elif c in "}]":
                    self._depth -= 1
                    if self._depth == 0:
                        self._close_value(i + 1)
                i += 1
                continue
            if ph == "in_key":
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    try:
                        key = json.loads(t[self._mark : i + 1])
                    except ValueError:
                        return self._fail(i)
                    if key in self.members:
                        return self._fail(i)  # a duplicate key: ambiguous, not a call
                    self.key = key
                    self.phase = "colon"
                i += 1
                continue
            if c in _WS:
                i += 1
                continue
            if ph == "start":
                if c != "{":
                    return self._fail(i)
                self.phase = "key_or_close"
            elif ph in ("key_or_close", "key"):
                if c == "}" and ph == "key_or_close":
                    self.phase, self.end = "done", i + 1
                    self.pos = i + 1
                    return
                if c != '"':
                    return self._fail(i)
                self.phase, self._mark, self._escape = "in_key", i, False
            elif ph == "colon":
                if c != ":":
                    return self._fail(i)
                self.phase = "value_start"
            elif ph == "value_start":
                self.value_start, self.phase, self._escape, self._in_string = i, "value", False, False
                if c == '"':
                    self.value_kind = "string"
                elif c in "{[":
                    self.value_kind, self._depth = "container", 1
                elif c in _SCALAR_START:
                    self.value_kind = "scalar"
                else:
                    return self._fail(i)
            elif ph == "after_value":
                if c == ",":
                    self.phase = "key"
                elif c == "}":
                    self.phase, self.end = "done", i + 1
                    self.pos = i + 1
                    return
                else:
                    return self._fail(i)
            i += 1
        self.pos = i


# --- one call ---------------------------------------------------------------------------------


class _Call:
    """A call being read (streamed or whole): its scanner, and what of it has been announced."""

    def __init__(self, fmt: ToolFormat, lead: str = "") -> None:
        self.fmt = fmt
        self.scan = _ObjectScan()
        self.lead = lead  # text dropped before the call's marker (given back if it is no call)
        self.id: str | None = None  # set when announced
        self.name: str | None = None
        self.args_sent = 0  # characters of the arguments' text already sent

    @property
    def announced(self) -> bool:
        return self.id is not None

    def bad(self) -> bool:
        """Whether what has been read so far cannot be a call."""
        s = self.scan
        if s.error:
            return True
        keys = set(s.members)
        open_value = s.open_value()
        if open_value:
            keys.add(open_value[0])
        if not keys <= self.fmt.keys:
            return True
        name = s.members.get("name")
        if name is not None and s.text[name[0]] != '"':
            return True
        args = self._args()
        if args is None:
            return False
        return args[2] == "scalar" or (args[2] == "container" and s.text[args[0]] != "{")  # not an object

    def _args(self) -> tuple[int, int | None, str] | None:
        """(start, end or None while open, kind) of the arguments' value."""
        s = self.scan
        for key in self.fmt.args_keys:
            if key in s.members:
                start, end = s.members[key]
                return start, end, {'"': "string", "{": "container", "[": "container"}.get(s.text[start], "scalar")
        open_value = s.open_value()
        if open_value and open_value[0] in self.fmt.args_keys:
            return open_value[1], None, open_value[2]
        return None

    def finished_call(self) -> ToolCall | None:
        """The call, once the object is closed and valid JSON of the format's shape."""
        s = self.scan
        if not s.done or self.bad():
            return None
        try:
            obj = json.loads(s.text[: s.end])
        except ValueError:
            return None
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return None
        args = self._args()
        if args is None:
            text = "{}"
        elif args[2] == "string":  # some models write the arguments as a JSON string
            text = json.loads(s.text[args[0] : args[1]])
            try:
                if not isinstance(json.loads(text), dict):
                    return None
            except ValueError:
                return None
        else:
            text = s.text[args[0] : args[1]]
            if not text.startswith("{"):
                return None
        return ToolCall(name, text, id=self.id or new_call_id())

    def progress(self, index: int) -> list[dict]:
        """Deltas for what became known: the announcement once the name is, then argument text."""
        out: list[dict] = []
        s = self.scan
        if self.name is None and "name" in s.members:
            start, end = s.members["name"]
            try:
                self.name = json.loads(s.text[start:end])
            except ValueError:
                return out
        if self.name is None:
            return out
        if not self.announced:
            self.id = new_call_id()
            out.append({"index": index, "id": self.id, "type": "function",
                        "function": {"name": self.name, "arguments": ""}})
        args = self._args()
        if args is not None and args[2] == "container":
            start, end, _ = args
            upto = end if end is not None else s.pos
            fragment = s.text[start + self.args_sent : upto]
            if fragment:
                self.args_sent += len(fragment)
                out.append({"index": index, "function": {"arguments": fragment}})
        return out

    def complete(self, index: int, call: ToolCall) -> list[dict]:
        """The last deltas of a call found valid: whatever of its arguments was not sent yet."""
        out = self.progress(index)
        rest = call.arguments[self.args_sent:] if self.args_sent else call.arguments
        if rest:
            out.append({"index": index, "function": {"arguments": rest}})
        return out


# --- formats ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # the text outside calls (None when calls leave no text)
    calls: list[ToolCall]


class ToolFormat:
    name = ""
    keys: frozenset[str] = frozenset()  # the members a call object may have
    args_keys: tuple[str, ...] = ()  # the member holding the arguments (first found wins)

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def stream(self) -> ToolStream:
        raise NotImplementedError

    def call_text(self, name: str, args_rule: str, marker: Callable[[str], str] = json.dumps) -> str:
        """A Lark expression for one call of `name` whose arguments are the rule `args_rule`;
        `marker` spells a marker such as <tool_call> in Lark (a token reference when the
        tokenizer has it as one token: llguidance matches added tokens only as tokens)."""
        raise NotImplementedError

    def calls_rule(self, call_rule: str, parallel: bool) -> str:
        """A Lark expression for the reply: one call, or (parallel) one or more."""
        raise NotImplementedError


class ToolStream:
    """Streaming side of a format: feed() text deltas, finish() at the end; each returns
    (content text, tool-call deltas)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.calls: list[ToolCall] = []  # calls ended so far
        self.call: _Call | None = None  # the call being read
        self.pending = ""  # text not yet released as content or given to the call

    @property
    def has_calls(self) -> bool:
        """Whether a call was announced to the client."""
        return bool(self.calls) or (self.call is not None and self.call.announced)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        return self._run(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, list[dict]]:
        raise NotImplementedError

    def _end_announced(self, call: _Call) -> None:
        """An announced call that goes no further: it keeps the arguments already sent."""
        args = call._args()
        sent = call.scan.text[args[0] : args[0] + call.args_sent] if args and args[2] == "container" else ""
        self.calls.append(ToolCall(call.name or "", sent, id=call.id or new_call_id()))

    def _complete(self, call: _Call, finished: ToolCall, deltas: list[dict]) -> None:
        deltas += call.complete(len(self.calls), finished)
        finished.id = call.id or finished.id
        self.calls.append(finished)
        self.call = None


def _lark(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: JSON's escapes are Lark's


def _holdback(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class HermesFormat(ToolFormat):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    keys = frozenset({"name", "arguments"})
    args_keys = ("arguments",)

    def parse(self, text: str) -> ParsedOutput:
        parts: list[str] = []
        calls: list[ToolCall] = []
        pos = search = 0
        while (i := text.find(self.START, search)) >= 0:
            body = i + len(self.START)
            found = self._call_at(text, body)
            if found is None:
                search = body  # not a call: the marker stays content
                continue
            call, after = found
            parts.append(text[pos:i])
            calls.append(call)
            pos = search = after
        if not calls:
            return ParsedOutput(text, [])
        parts.append(text[pos:])
        # whitespace next to a call belongs to the call's layout, not to the content
        trimmed = [p.lstrip(_WS) if k else p for k, p in enumerate(parts)]
        trimmed = [p.rstrip(_WS) if k < len(trimmed) - 1 else p for k, p in enumerate(trimmed)]
        content = "".join(trimmed)
        return ParsedOutput(content or None, calls)

    def _call_at(self, text: str, body: int) -> tuple[ToolCall, int] | None:
        c = _Call(self)
        c.scan.feed(text[body:])
        call = c.finished_call()
        if call is None:
            return None
        tail = c.scan.text[c.scan.end :]
        rest = tail.lstrip(_WS)
        if rest.startswith(self.END):
            return call, body + c.scan.end + (len(tail) - len(rest)) + len(self.END)
        if self.END.startswith(rest):
            return call, len(text)  # the text ends after the object (a stop string cut the marker)
        return None

    def stream(self) -> ToolStream:
        return HermesStream(self)

    def call_text(self, name: str, args_rule: str, marker: Callable[[str], str] = json.dumps) -> str:
        head = "\n" + json.dumps({"name": name})[:-1] + ', "arguments": '
        return f"{marker(self.START)} {_lark(head)} {args_rule} {_lark('}' + chr(10))} {marker(self.END)}"

    def calls_rule(self, call_rule: str, parallel: bool) -> str:
        return f'{call_rule} ("\\n" {call_rule})*' if parallel else call_rule


class HermesStream(ToolStream):
    fmt: HermesFormat

    def __init__(self, fmt: HermesFormat) -> None:
        super().__init__(fmt)
        self.after_call = False  # whitespace right after a call is dropped

    def _run(self, final: bool) -> tuple[str, list[dict]]:  # noqa: C901 - one state machine
        fmt = self.fmt
        content: list[str] = []
        deltas: list[dict] = []
        while True:
            call = self.call
            if call is None:
                buf = self.pending
                if self.after_call:
                    buf = buf.lstrip(_WS)
                    if not buf:
                        self.pending = ""
                        break
                    self.after_call = False
                i = buf.find(fmt.START)
                if i >= 0:
                    before = buf[:i]
                    kept = before.rstrip(_WS)
                    content.append(kept)
                    self.call = _Call(fmt, lead=before[len(kept):])
                    self.pending = buf[i + len(fmt.START):]
                    continue
                if final:
                    content.append(buf)
                    self.pending = ""
                    break
                hold = _holdback(buf, fmt.START)
                head = buf[: len(buf) - hold]
                hold += len(head) - len(head.rstrip(_WS))  # whitespace before a possible call
                content.append(buf[: len(buf) - hold])
                self.pending = buf[len(buf) - hold:]
                break
            call.scan.feed(self.pending)
            self.pending = ""
            if call.bad():
                self._abandon(call, content, at=call.scan.pos)
                continue
            if call.scan.done:
                finished = call.finished_call()
                rest = call.scan.text[call.scan.end:].lstrip(_WS)
                if rest.startswith(fmt.END) and (finished is not None or call.announced):
                    if finished is not None:
                        self._complete(call, finished, deltas)
                    else:  # announced, then the JSON proved invalid: it keeps what was sent
                        self.call = None
                        self._end_announced(call)
                    self.after_call, self.pending = True, rest[len(fmt.END):]
                    continue
                if fmt.END.startswith(rest) and not final:  # the marker may still come
                    deltas += call.progress(len(self.calls)) if finished is not None else []
                    break
                if finished is not None and fmt.END.startswith(rest):
                    self._complete(call, finished, deltas)  # a stop string or the token limit cut the marker
                    continue
                self._abandon(call, content, at=call.scan.end)
                continue
            if final:  # cut short inside the call
                if call.announced:
                    deltas += call.progress(len(self.calls))
                    self._end_announced(call)
                    self.call = None
                    break
                self._abandon(call, content, at=0)
                continue
            deltas += call.progress(len(self.calls))
            break
        return "".join(content), deltas

    def _abandon(self, call: _Call, content: list[str], at: int) -> None:
        """Not a call after all: unannounced, its text is content again; announced, it ends
        with what was sent and the text from the fault on is content."""
        self.call = None
        if not call.announced:
            content.append(call.lead + self.fmt.START)
            self.pending = call.scan.text
            return
        self._end_announced(call)
        self.pending = call.scan.text[at:]


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    keys = frozenset({"name", "parameters", "arguments"})
    args_keys = ("parameters", "arguments")

    @staticmethod
    def _skip_tag(text: str) -> str:
        s = text.lstrip(_WS)
        if s.startswith(PYTHON_TAG):
            s = s[len(PYTHON_TAG):].lstrip(_WS)
        return s

    def parse(self, text: str) -> ParsedOutput:
        rest = self._skip_tag(text)
        if not rest.startswith("{"):
            return ParsedOutput(text, [])
        calls = []
        while rest:
            c = _Call(self)
            c.scan.feed(rest)
            call = c.finished_call()
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
            tail = rest[c.scan.end:].lstrip(_WS)
            if tail and tail[0] != ";":
                return ParsedOutput(text, [])
            rest = tail[1:].lstrip(_WS)
        return ParsedOutput(None, calls)

    def stream(self) -> ToolStream:
        return Llama3JsonStream(self)

    def call_text(self, name: str, args_rule: str, marker: Callable[[str], str] = json.dumps) -> str:
        head = json.dumps({"name": name})[:-1] + ', "parameters": '
        return f"{_lark(head)} {args_rule} \"}}\""

    def calls_rule(self, call_rule: str, parallel: bool) -> str:
        return f'{call_rule} ("; " {call_rule})*' if parallel else call_rule


class Llama3JsonStream(ToolStream):
    """Undecided until the first non-blank character (after <|python_tag|>): `{` starts calls,
    anything else makes the whole reply content."""

    fmt: Llama3JsonFormat

    def __init__(self, fmt: Llama3JsonFormat) -> None:
        super().__init__(fmt)
        self.mode = "undecided"  # | "call" | "between" (after a call) | "text"
        self.raw = ""  # everything fed: the reply is all content when its first call fails

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.raw += text
        return super().feed(text)

    def _run(self, final: bool) -> tuple[str, list[dict]]:  # noqa: C901 - one state machine
        content: list[str] = []
        deltas: list[dict] = []
        while True:
            if self.mode == "text":
                content.append(self.pending)
                self.pending = ""
                break
            if self.mode in ("undecided", "between"):
                undecided = self.mode == "undecided"
                s = self.fmt._skip_tag(self.pending) if undecided else self.pending.lstrip(_WS)
                if not s or (undecided and PYTHON_TAG.startswith(s)):
                    if not final:
                        break
                    if undecided:
                        self.mode, self.pending = "text", self.raw
                        continue
                    self.pending = ""
                    break
                if s.startswith("{"):
                    self.mode, self.call, self.pending = "call", _Call(self.fmt), s
                    continue
                self.mode, self.pending = "text", (s if self.calls else self.raw)
                continue
            call = self.call
            assert call is not None
            call.scan.feed(self.pending)
            self.pending = ""
            at = call.scan.pos
            if not call.bad():
                if call.scan.done:
                    finished = call.finished_call()
                    rest = call.scan.text[call.scan.end:].lstrip(_WS)
                    if finished is not None and (rest.startswith(";") or (not rest and final)):
                        self._complete(call, finished, deltas)
                        self.mode, self.pending = "between", rest[1:]
                        continue
                    if finished is not None and not rest:
                        deltas += call.progress(len(self.calls))
                        break
                    at = call.scan.end
                elif not final:
                    deltas += call.progress(len(self.calls))
                    break
                else:  # cut short inside the call
                    at = len(call.scan.text)
                    if call.announced:
                        deltas += call.progress(len(self.calls))
            # not a call after all
            self.call = None
            if not call.announced:
                self.mode, self.pending = "text", (call.scan.text if self.calls else self.raw)
                continue
            self._end_announced(call)
            self.mode, self.pending = "text", call.scan.text[at:]
        return "".join(content), deltas


# --- selection --------------------------------------------------------------------------------

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat())}
PARSER_CHOICES = ("auto", "none", *FORMATS)


def detect_tool_parser(templates: Iterable[str | None]) -> str | None:
    """The format a chat template teaches the model, from the template's text (the tool_use
    template first when there is one); None when no known format shows."""
    for template in templates:
        if not template:
            continue
        if HermesFormat.START in template:
            return "hermes"
        if PYTHON_TAG in template or ('"parameters"' in template and "<|start_header_id|>" in template):
            return "llama3_json"
    return None


def get_format(name: str) -> ToolFormat:
    return FORMATS[name]
