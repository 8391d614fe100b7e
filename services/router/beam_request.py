"""vLLM's `use_beam_search` and `length_penalty`, read from a request body.

Beam search ranks continuations by the model's own log-probabilities (services/router/beam_search.py),
so the fields that change how a token is sampled cannot act on it. vLLM ignores them there; this
router refuses a non-default value with a 400 naming the field (temperature 0 and 1 are accepted:
greedy is what beam search widens, and 1 is the distribution it ranks by), and refuses
structured output, whose grammar the search does not follow. `seed` is accepted and changes
nothing: the search draws no random numbers.
"""

from __future__ import annotations

from typing import Any

from services.common.sampling_params import api_fields
from services.router.beam_search import MAX_WIDTH
from services.router.errors import bad_request
from services.router.getters import get_bool, get_float

# the scalar fields that shape which token is sampled (min_tokens and ignore_eos the search honours)
_SHAPING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
# field -> values that leave sampling as beam search ranks it (None: absent or null): each scalar's
# declared default, greedy (temperature 0) and vLLM's "off" for top_k (-1); the token masks empty
SAMPLING_DEFAULTS: dict[str, tuple[Any, ...]] = {
    **{name: (None, default, *{"temperature": (0,), "top_k": (-1,)}.get(name, ()))
       for name, default, _ in api_fields() if name in _SHAPING},
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
}
MAX_LENGTH_PENALTY = 100.0  # |length_penalty|: beyond it the length alone decides


def beam_fields(body: dict) -> dict[str, Any]:
    """GenerateSpec keywords (`beam_search`, `length_penalty`) from the client's own body (before
    the model's sampling defaults are filled in: those are not the client's asking)."""
    on = get_bool(body, "use_beam_search", False)
    length_penalty = get_float(body, "length_penalty", 1.0, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY)
    if not on:
        if length_penalty != 1.0:
            raise bad_request("'length_penalty' applies to beam search: set 'use_beam_search' to true.",
                              param="length_penalty", code="invalid_value")
        return {}
    for name, defaults in SAMPLING_DEFAULTS.items():
        value = body.get(name)
        if not any(value == d and type(value) is not bool for d in defaults):
            raise bad_request(f"'{name}' cannot be combined with 'use_beam_search': beam search ranks tokens by "
                              "the model's own log-probabilities, which this field would not change.",
                              param=name, code="unsupported_value")
    return {"beam_search": True, "length_penalty": length_penalty}


def check_beam_spec(n: int, grammar_param: str, grammar: object) -> None:
    """What beam search cannot serve, known once the whole body is read: more beams than the workers
    give alternatives for, and a grammar."""
    if n > MAX_WIDTH:
        raise bad_request(f"With 'use_beam_search', 'n' (the beam width) must be at most {MAX_WIDTH}, got {n}.",
                          param="n", code="invalid_value")
    if grammar is not None:
        raise bad_request(f"'{grammar_param}' cannot be combined with 'use_beam_search': the search does not "
                          "follow a grammar.", param=grammar_param or None, code="unsupported_value")
