"""A reasoning model's thinking, told apart from its answer (vLLM's and SGLang's --reasoning-parser).

Models such as DeepSeek-R1 and Qwen3 write their reasoning between <think> and </think>, then the
answer. With a parser named, a chat reply is split: the text inside goes to the message's
`reasoning` (and `reasoning_content`, the older name that DeepSeek's API and many clients read),
the rest is the `content`, where tool calls are then looked for.

Where a reply starts:
- deepseek_r1: inside the reasoning. R1's templates open <think> in the prompt, or the model writes
  it first; a leading <think> is dropped. A reply with no </think> is all reasoning (cut by
  max_tokens, or a model that never stopped thinking).
- qwen3 (and deepseek_v3, glm45): inside the reasoning when the prompt ends with an open <think>
  (a thinking-only template, DeepSeek-V3.1's with `thinking` on, an assistant turn continued
  mid-thought); otherwise as content, and a <think> at the very start of the reply opens the
  reasoning. A prompt that ends with a closed thought (Qwen3's and GLM-4.5's hybrid templates with
  enable_thinking false, DeepSeek-V3.1's without `thinking`) has thinking off: the reply is content.

A request's grammar (structured output, a forced tool call) holds after the thinking, as vLLM
applies it: `think_first` makes one llguidance grammar of a free thought (required when the reply
starts inside one, optional when the model may open one) up to </think>, then the request's own.

A stream's text comes in pieces, and a tag may be cut between two: a piece's tail that could be the
start of a tag is held back until the next piece (or the end) says what it is.
"""

from __future__ import annotations

import json

from services.common.grammar_spec import to_llguidance
from services.common.tokenizer import Tokenizer
from services.router.tools import marker_term

OPEN, CLOSE = "<think>", "</think>"
# parser name → whether a reply starts inside the reasoning whatever the prompt says. The others
# read the prompt: DeepSeek-V3.1's template ends with <think> when `thinking` is on and with
# </think> when off; GLM-4.5's, as Qwen3's, closes an empty thought when thinking is off.
PARSERS = {"deepseek_r1": True, "qwen3": False, "deepseek_v3": False, "glm45": False}
ALIASES = {"deepseek-r1": "deepseek_r1", "deepseek-v3": "deepseek_v3"}  # SGLang's spellings
FLAG_CHOICES = ("", *PARSERS, *ALIASES)
# vLLM's request fields a parser makes meaningful
REQUEST_FIELDS = frozenset({"include_reasoning", "thinking_token_budget"})
MAX_THINKING_BUDGET = 1 << 20
PROMPT_TAIL_TOKENS = 16  # enough of the prompt's end to see whether it leaves a <think> open


def parser_name(flag: str) -> str | None:
    """The parser a --reasoning-parser value names; None for "" (no parser)."""
    if not flag:
        return None
    name = ALIASES.get(flag, flag)
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {flag!r} (known: {', '.join(FLAG_CHOICES[1:])})")
    return name


# how a reply to a prompt may think (the module's rules)
INSIDE, MAY_OPEN, OFF = "inside", "may_open", "off"


def prompt_leaves_open(prompt_tail: str) -> bool:
    """The prompt ends inside a <think> it opened (its last <think> comes after its last </think>)."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


def thinking_mode(parser: str, prompt_tail: str) -> str:
    """INSIDE: the reply starts thinking; MAY_OPEN: it may open a thought first; OFF: the prompt
    ends with a closed thought (thinking turned off), so the reply is the answer."""
    if PARSERS[parser] or prompt_leaves_open(prompt_tail):
        return INSIDE
    return OFF if prompt_tail.rstrip().endswith(CLOSE) else MAY_OPEN


ANSWER = "pdmesh_answer"  # the request's own grammar, referred to from the thinking one
FREE_ANSWER = ("lark", "start: /(.|\\n)*/")  # a thinking budget without a grammar: any answer


def think_first(grammar: tuple[str, str] | None, mode: str, tokenizer: Tokenizer,
                budget: int | None = None) -> tuple[str, str] | None:
    """The request's grammar after a free thought, as one llguidance grammar; with `budget` (vLLM's
    thinking_token_budget), the thought ends after that many tokens at the latest — </think> is
    then forced — and a request without a grammar gets one that lets any answer follow. A tag the
    tokenizer has as one token is named by its id (services/router/tools.marker_term): free text
    can never write it, so the thought ends where it comes; a tag that is plain text ends the thought
    at its first occurrence (lazily), its own tokens counted in the budget. Up to two blanks may
    follow (Qwen3 writes "</think>\n\n"). OFF leaves the grammar as it is."""
    if mode == OFF or (grammar is None and budget is None):
        return grammar
    answer = _grammars(*(grammar or FREE_ANSWER))
    marker = marker_term(tokenizer)
    open_tag, close_tag = marker(OPEN), marker(CLOSE)
    if budget == 0:
        thought = f"pdmesh_thought: {close_tag}\n"
    elif close_tag.startswith("<["):
        limit = f"[max_tokens={budget}]" if budget is not None else ""
        thought = f"pdmesh_thought: pdmesh_text {close_tag}\npdmesh_text{limit}: /(.|\\n)*/\n"
    elif budget is None:
        thought = f"pdmesh_thought[suffix={close_tag}]: /(.|\\n)*/\n"
    else:
        # the lexeme's budget counts the tag's own tokens: a tag begun within the budget is finished
        limit = budget + len(tokenizer.encode(CLOSE, add_special_tokens=False))
        thought = f"pdmesh_thought: pdmesh_text {close_tag}\npdmesh_text[stop={close_tag}, max_tokens={limit}]: /(.|\\n)*/\n"
    if mode == INSIDE:
        start = f"start: {open_tag}? pdmesh_thought PDMESH_GAP? @{ANSWER}\n"
    else:
        start = f"start: ({open_tag} pdmesh_thought PDMESH_GAP?)? @{ANSWER}\n"
    lark = start + thought + "PDMESH_GAP: /[ \\n]{1,2}/\n"
    return "llguidance", json.dumps({"grammars": [{"lark_grammar": lark}, {**answer[0], "name": ANSWER}, *answer[1:]]})


def _grammars(kind: str, source: str) -> list[dict]:
    """A grammar as llguidance's list of grammars (its start one first): llguidance writes a JSON
    schema or a regex as that JSON already, a Lark grammar as Lark text."""
    text = to_llguidance(kind, source)
    try:
        grammars = json.loads(text)["grammars"]
    except (ValueError, TypeError, KeyError):
        return [{"lark_grammar": text}]
    return [{k: v for k, v in g.items() if v is not None} for g in grammars]


_LEAD_INSIDE, _LEAD_CONTENT, _INSIDE, _CONTENT = range(4)


class ReasoningSplit:
    """One reply's text, fed in pieces, split into (reasoning, content) pieces."""

    def __init__(self, inside: bool):
        self._state = _LEAD_INSIDE if inside else _LEAD_CONTENT
        self._held = ""
        self.opened = inside  # the reply has a reasoning part (possibly empty)

    def reply(self, reasoning: str, content: str) -> tuple[str | None, str | None]:
        """A whole reply's (reasoning, content), from all the pieces this split gave: reasoning None
        when the reply has no reasoning part; content None when a reply with one has nothing after
        it (as vLLM answers both)."""
        reasoning = reasoning if self.opened else None
        return reasoning, (None if reasoning is not None and not content else content)

    @property
    def thinking(self) -> bool:
        """Inside the thought (or at a reply's start that is)."""
        return self._state in (_LEAD_INSIDE, _INSIDE)

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
