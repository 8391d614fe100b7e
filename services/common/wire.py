"""Conversions between the worker protos and the engine's plain Python types."""

from __future__ import annotations

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.sampling_params import SamplingParams


def params_from_pb(p: wpb.SamplingParams) -> SamplingParams:
    """Raises ValueError on invalid values (the servicer maps it to INVALID_ARGUMENT)."""
    return SamplingParams(
        temperature=float(p.temperature),
        top_p=float(p.top_p) if p.top_p > 0 else 1.0,
        top_k=int(p.top_k),
        seed=int(p.seed) if p.HasField("seed") else None,
        max_tokens=int(p.max_tokens) if p.max_tokens else 16,
        stop_token_ids=tuple(int(t) for t in p.stop_token_ids),
        ignore_eos=bool(p.ignore_eos),
        presence_penalty=float(p.presence_penalty),
        frequency_penalty=float(p.frequency_penalty),
        repetition_penalty=float(p.repetition_penalty) if p.repetition_penalty > 0 else 1.0,
        logit_bias=tuple(sorted((int(k), float(v)) for k, v in p.logit_bias.items())),
        min_tokens=int(p.min_tokens),
        num_generated=int(p.num_generated),
        grammar=(p.grammar.kind, p.grammar.source) if p.grammar.kind else None,
        top_logprobs=int(p.top_logprobs),
        min_p=float(p.min_p),
        allowed_token_ids=tuple(int(t) for t in p.allowed_token_ids),
        bad_words=tuple(tuple(int(t) for t in seq.token_ids) for seq in p.bad_words),
        prompt_logprobs=int(p.prompt_logprobs) if p.HasField("prompt_logprobs") else None,
    )


def params_to_pb(p: SamplingParams) -> wpb.SamplingParams:
    msg = wpb.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        max_tokens=p.max_tokens,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logit_bias=dict(p.logit_bias),
        min_tokens=p.min_tokens,
        num_generated=p.num_generated,
        top_logprobs=p.top_logprobs,
        min_p=p.min_p,
        allowed_token_ids=list(p.allowed_token_ids),
        bad_words=[wpb.TokenSequence(token_ids=list(seq)) for seq in p.bad_words],
    )
    if p.grammar is not None:
        msg.grammar.kind, msg.grammar.source = p.grammar
    if p.seed is not None:
        msg.seed = p.seed
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    return msg


def top_logprobs_pb(tops) -> list[wpb.TopLogprobs]:
    """Per token [(id, logprob), ...] (or None: none asked for) as TopLogprobs messages."""
    if not tops:
        return []
    return [wpb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top]) for top in tops]


def validate_prompt(token_ids: list[int], params: SamplingParams, vocab_size: int, max_positions: int) -> str | None:
    """None if the request can run on this model, else a message for INVALID_ARGUMENT."""
    if not token_ids:
        return "empty prompt"
    bad = next((t for t in token_ids if t >= vocab_size), None)
    if bad is not None:
        return f"token id {bad} outside the vocabulary (size {vocab_size})"
    bad = next((t for t, _ in params.logit_bias if t >= vocab_size), None)
    if bad is not None:
        return f"logit_bias token id {bad} outside the vocabulary (size {vocab_size})"
    bad = next((t for t in params.allowed_token_ids if t >= vocab_size), None)
    if bad is not None:
        return f"allowed_token_ids: token id {bad} outside the vocabulary (size {vocab_size})"
    bad = next((t for seq in params.bad_words for t in seq if t >= vocab_size), None)
    if bad is not None:
        return f"bad_words: token id {bad} outside the vocabulary (size {vocab_size})"
    if params.num_generated >= len(token_ids):
        return f"num_generated ({params.num_generated}) must be less than the {len(token_ids)} token ids"
    if len(token_ids) + params.max_tokens > max_positions:
        return (
            f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"max model length {max_positions}"
        )
    return None


def parse_request(pb_params: wpb.SamplingParams, token_ids: list[int], config) -> SamplingParams:
    """Sampling params of a worker request, checked against the model (`config`: ModelConfig).
    Raises ValueError with a message for INVALID_ARGUMENT."""
    try:
        params = params_from_pb(pb_params)
    except ValueError as e:
        raise ValueError(f"invalid sampling params: {e}") from None
    why = validate_prompt(token_ids, params, config.vocab_size, config.max_model_len)
    if why:
        raise ValueError(why)
    return params
