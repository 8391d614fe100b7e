"""Conditional disaggregation, pure logic: when a request skips prefill and its decode computes
the prompt's uncached part itself (the colocated path, services/decode/local_prefill.py).

A prefill + KV transfer pays when there is much to compute; when the decode the routing rule
picked already holds the conversation (as far as the router's index knows) and only a short
tail is new, sending that tail through a prefill costs a second hop, a transfer handshake and a
page of KV over the network for less work than one of decode's own prefill chunks. The rule
(router --local-prefill-max-tokens, docs/router.md "Conditional disaggregation"):

- only in PD mode under the cache_aware policy (the only one that keeps the index), and only
  for a request that allows it: not a choice of n > 1 sharing one prefill (the choices would
  each compute the prompt on their decodes instead of once), not one asking for prompt
  logprobs (decode would compute the whole prompt to give them), not any attempt after one
  that failed (those go through prefill, the path fail-over and migration were built on);
- the chosen decode holds at least one full page of the prompt, and
- the prompt's tokens beyond what it holds are at most the threshold (0 turns the rule off).
"""

from __future__ import annotations


def goes_local(prompt_tokens: int, held_tokens: int, page_size: int, max_tokens: int) -> bool:
    """True: the decode holding `held_tokens` leading tokens of a `prompt_tokens`-token prompt
    (in pages of `page_size`; 0: it keeps no prefix cache) computes the rest itself."""
    if max_tokens <= 0 or page_size <= 0 or held_tokens < page_size:
        return False
    return prompt_tokens - held_tokens <= max_tokens
