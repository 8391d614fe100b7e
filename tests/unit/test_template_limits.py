"""A request's own chat template renders under bounds; the model's template is untouched by them."""

from __future__ import annotations

import time

import pytest

from services.common.tokenizer import ChatTemplateError, load_tokenizer
from services.router.errors import APIError
from services.router.protocol import ModelInfo, parse_chat

TOK = load_tokenizer("builtin")
MSGS = [{"role": "user", "content": "hi"}]
INFO = ModelInfo(name="m", tokenizer=TOK, context_length=2048)


def _render(template: str) -> str:
    return TOK.apply_chat_template(MSGS, chat_template=template, untrusted_template=True)


def test_a_plain_template_renders():
    assert _render("{% for m in messages %}<{{ m.content }}>{% endfor %}") == "<hi>"


@pytest.mark.parametrize("template,why", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer than"),
    ("{{ 'x' * 10000000000 }}", "too long"),
    ("{{ [1] * 10000000000 }}", "too long"),
    ("{{ 10 ** 100000000 }}", "too large"),
    ("{% set ns = namespace(x='ab') %}{% for i in range(40) %}{% set ns.x = ns.x + ns.x %}{% endfor %}", "too long"),
    # the memory bound, or on a loaded machine the time bound if it comes first (copying ~1 GB)
    ("{% set ns = namespace(x='ab') %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}",
     ("memory", "longer than")),
    ("{{ '' ~ messages.__class__.__mro__ }}", None),
])
def test_a_hostile_template_is_stopped(template, why):
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError) as err:
        x = _render(template)
        assert "__mro__" not in x
        raise ChatTemplateError("rendered")  # the sandbox rendered it harmlessly
    if why:
        assert any(w in str(err.value) for w in ((why,) if isinstance(why, str) else why)), err.value
    assert time.monotonic() - t0 < 10


def test_the_request_gets_a_400_naming_chat_template():
    with pytest.raises(APIError) as err:
        parse_chat({"model": "m", "messages": MSGS, "chat_template": "{{ 10 ** 100000000 }}"}, INFO)
    assert err.value.status == 400 and err.value.param == "chat_template"
    with pytest.raises(APIError) as err:
        parse_chat({"model": "m", "messages": MSGS, "chat_template": "x" * 70000}, INFO)
    assert err.value.param == "chat_template"


def test_a_template_name_selects_the_models_own():
    assert TOK.apply_chat_template(MSGS, chat_template="default", untrusted_template=True) == \
        TOK.apply_chat_template(MSGS)
