"""What one request may send the workers: a request's size must never hurt another request.

Every choice of a request is one Prefill call and one Decode call, each carrying the prompt's ids
and the grammar; the lane batches calls to one worker into one message (services/router/lane.py).
So the router bounds, before anything is compiled or sent:

- a grammar (structured output, or the grammar of a forced tool call): `--max-grammar-bytes`;
- the request's whole load on the workers, n × (prompt ids + grammar): `--max-request-worker-bytes`.

Both refusals are a 400 naming the limit and its flag. What comes back is bounded too: a reply
with prompt logprobs grows with prompt length x alternatives and must fit one gRPC message.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.lane_batches import LANE_MESSAGE_BYTES
from services.router.errors import bad_request

# A token id travels as a varint: at most 5 bytes for ids below 2**35. Counted at that bound so the
# limit does not depend on the vocabulary.
BYTES_PER_TOKEN_ID = 5
# The rest of a call (room, addresses, sampling fields, stop strings): a generous constant
PER_CALL_OVERHEAD_BYTES = 4096


@dataclass(frozen=True)
class RequestLimits:
    max_grammar_bytes: int = 1024 * 1024
    max_request_worker_bytes: int = 16 * 1024 * 1024


DEFAULT_LIMITS = RequestLimits()


def check_grammar_size(source: str, param: str, limits: RequestLimits) -> None:
    size = len(source.encode("utf-8", errors="replace"))
    if size > limits.max_grammar_bytes:
        raise bad_request(
            f"The grammar of '{param}' is {size} bytes; at most {limits.max_grammar_bytes} are allowed "
            "(the router's --max-grammar-bytes).", param=param, code="grammar_too_large")


def call_bytes(prompt_ids: int, grammar: tuple[str, str] | None) -> int:
    """An upper bound of the bytes one call of a choice carries."""
    return PER_CALL_OVERHEAD_BYTES + BYTES_PER_TOKEN_ID * prompt_ids + (len(grammar[1].encode()) if grammar else 0)


def check_request_size(n: int, prompt_ids: int, grammar: tuple[str, str] | None, param: str,
                       limits: RequestLimits) -> None:
    total = n * call_bytes(prompt_ids, grammar)
    if total > limits.max_request_worker_bytes:
        raise bad_request(
            f"The request would send the workers {total} bytes (n = {n} × a prompt of {prompt_ids} tokens"
            f"{' and a grammar' if grammar else ''}); at most {limits.max_request_worker_bytes} are allowed "
            "(the router's --max-request-worker-bytes). Send a smaller n, prompt or schema.",
            param=param, code="request_too_large")


# Per prompt position of a reply's prompt logprobs: a logprob (9 bytes) and a rank (<= 6), plus per
# alternative an id (<= 6) and a logprob (9): an upper bound, packed repeated fields
PROMPT_LOGPROB_BYTES, PROMPT_ALTERNATIVE_BYTES = 15, 15


def check_prompt_logprobs_size(prompt_ids: int, k: int | None, param: str) -> None:
    """A reply carrying a prompt's logprobs must fit one lane message (else the worker would have
    to refuse it after computing the prompt)."""
    if k is None:
        return
    size = PER_CALL_OVERHEAD_BYTES + prompt_ids * (PROMPT_LOGPROB_BYTES + k * PROMPT_ALTERNATIVE_BYTES)
    if size > LANE_MESSAGE_BYTES:
        raise bad_request(
            f"Prompt logprobs with {k} alternatives for a prompt of {prompt_ids} tokens would be {size} bytes; "
            f"at most {LANE_MESSAGE_BYTES} fit in one reply. Ask for fewer alternatives or send a shorter prompt.",
            param=param, code="request_too_large")
