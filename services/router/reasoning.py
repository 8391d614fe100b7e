"""A reasoning model's thinking, told apart from its answer (vLLM's and SGLang's --reasoning-parser).

Models such as DeepSeek-R1 and Qwen3 write their reasoning between <think> and </think>, then the
answer. With a parser named, a chat reply is split: the text inside goes to the message's
`reasoning` (and `reasoning_content`, the older name that DeepSeek's API and many clients read),
the rest is the `content`, where tool calls are then looked for.

Where a reply starts:
- deepseek_r1: inside the reasoning. R1's templates open <think> in the prompt, or the model writes
  it first; a leading <think> is dropped. A reply with no </think> is all reasoning (cut by
  max_tokens, or a model that never stopped thinking).
- qwen3: inside the reasoning when the prompt ends with an open <think> (a thinking-only template,
  or an assistant turn continued mid-thought); otherwise as content, and a <think> at the very start
  of the reply opens the reasoning. Qwen3's hybrid templates with enable_thinking false close an
  empty <think></think> in the prompt, so the reply is all content.
- Under a grammar (structured output, a forced tool call), as content: the grammar holds from the
  reply's first token, so the model has no room to think before it (vLLM lets it reason first and
  applies the grammar after </think>; pdmesh does not).

A stream's text comes in pieces, and a tag may be cut between two: a piece's tail that could be the
start of a tag is held back until the next piece (or the end) says what it is.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
# parser name → whether a reply starts inside the reasoning whatever the prompt says
PARSERS = {"deepseek_r1": True, "qwen3": False}
ALIASES = {"deepseek-r1": "deepseek_r1"}  # SGLang's spelling
FLAG_CHOICES = ("", *PARSERS, *ALIASES)
REQUEST_FIELDS = frozenset({"include_reasoning"})  # vLLM's request fields a parser makes meaningful
PROMPT_TAIL_TOKENS = 16  # enough of the prompt's end to see whether it leaves a <think> open


def parser_name(flag: str) -> str | None:
    """The parser a --reasoning-parser value names; None for "" (no parser)."""
    if not flag:
        return None
    name = ALIASES.get(flag, flag)
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {flag!r} (known: {', '.join(FLAG_CHOICES[1:])})")
    return name


def prompt_leaves_open(prompt_tail: str) -> bool:
    """The prompt ends inside a <think> it opened (its last <think> comes after its last </think>)."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


def starts_inside(parser: str, prompt_tail: str, constrained: bool) -> bool:
    """Whether a reply to this prompt starts inside the reasoning (the module's rules)."""
    if constrained:
        return False
    return PARSERS[parser] or prompt_leaves_open(prompt_tail)


_LEAD_INSIDE, _LEAD_CONTENT, _INSIDE, _CONTENT = range(4)


class ReasoningSplit:
    """One reply's text, fed in pieces, split into (reasoning, content) pieces."""

    def __init__(self, inside: bool):
        self._state = _LEAD_INSIDE if inside else _LEAD_CONTENT
        self._held = ""
        self.opened = inside  # the reply has a reasoning part (possibly empty)

    def feed(self, text: str) -> tuple[str, str]:
        if not text:
            return "", ""
        text, self._held = self._held + text, ""
        if self._state == _CONTENT:
            return "", text
        if self._state in (_LEAD_INSIDE, _LEAD_CONTENT):
            lead = text.lstrip() if self._state == _LEAD_CONTENT else text
            if len(lead) < len(OPEN) and OPEN.startswith(lead):
                self._held = text  # still could be the opening tag
                return "", ""
            if lead.startswith(OPEN):
                text = lead[len(OPEN):]
                self.opened = True
            elif self._state == _LEAD_CONTENT:
                self._state = _CONTENT
                return "", text
            self._state = _INSIDE
        end = text.find(CLOSE)
        if end >= 0:
            self._state = _CONTENT
            return text[:end], text[end + len(CLOSE):]
        keep = _partial_tail(text, CLOSE)
        if keep:
            text, self._held = text[:-keep], text[-keep:]
        return text, ""

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the reply."""
        held, self._held = self._held, ""
        if self._state in (_LEAD_INSIDE, _INSIDE):
            return held, ""
        return "", held


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (0: none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_whole(text: str, inside: bool) -> tuple[str | None, str | None]:
    """A whole reply's (reasoning, content): reasoning None when the reply has no reasoning part;
    content None when a reply with one has nothing after it (as vLLM answers both)."""
    split = ReasoningSplit(inside)
    r1, c1 = split.feed(text)
    r2, c2 = split.finish()
    reasoning = r1 + r2 if split.opened else None
    content = c1 + c2
    return reasoning, (None if reasoning is not None and not content else content)
