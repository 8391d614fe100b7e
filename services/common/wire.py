"""Conversions between the worker protos and the engine's plain Python types. The sampling
parameters' conversions are derived from their declaration (services/common/sampling_params.py)."""

from __future__ import annotations

from operator import attrgetter

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.sampling_params import (
    FIELDS,
    GRAMMAR,
    MAP,
    OPTIONAL,
    REPEATED,
    SCALAR,
    SEQUENCES,
    SamplingParams,
)


def check_declaration(fields=None, descriptor=None) -> None:
    """Every declared sampling field has a proto field of its name and shape, and every proto
    field is declared: raises TypeError naming the first that is not (at import, so a field added
    on one side only stops every service at start, not a request at run time)."""
    fields = FIELDS if fields is None else fields
    descriptor = wpb.SamplingParams.DESCRIPTOR if descriptor is None else descriptor
    by_name = descriptor.fields_by_name
    for f in fields:
        wire = f.metadata.get("wire")
        if wire is None:
            raise TypeError(f"SamplingParams.{f.name} declares no Wire (use sampling_params.param)")
        pf = by_name.get(f.name)
        if pf is None:
            raise TypeError(f"SamplingParams.{f.name} has no field in worker.proto's SamplingParams")
        repeated = pf.is_repeated
        ok = {
            SCALAR: not repeated and pf.message_type is None,
            OPTIONAL: not repeated and pf.has_presence and pf.message_type is None,
            REPEATED: repeated and pf.message_type is None,
            MAP: repeated and pf.message_type is not None and pf.message_type.GetOptions().map_entry,
            SEQUENCES: repeated and pf.message_type is not None and "token_ids" in pf.message_type.fields_by_name,
            GRAMMAR: not repeated and pf.message_type is not None and "kind" in pf.message_type.fields_by_name,
        }.get(wire.shape, False)
        if not ok:
            raise TypeError(f"SamplingParams.{f.name}: declared {wire.shape}, proto field {pf.name} does not match")
    missing = set(by_name) - {f.name for f in fields}
    if missing:
        raise TypeError(f"worker.proto's SamplingParams fields {sorted(missing)} are not declared in SamplingParams")


check_declaration()


def _reader(f):
    """A function reading one field's value from the proto, as the engine's plain Python type."""
    name, wire, default = f.name, f.metadata["wire"], f.default
    if wire.shape == SCALAR:
        kind = type(default)
        if wire.zero_is_default:
            return lambda p: kind(getattr(p, name)) or default
        return lambda p: kind(getattr(p, name))
    if wire.shape == OPTIONAL:
        return lambda p: int(getattr(p, name)) if p.HasField(name) else None
    if wire.shape == REPEATED:
        return lambda p: tuple(int(t) for t in getattr(p, name))
    if wire.shape == MAP:
        return lambda p: tuple(sorted((int(k), float(x)) for k, x in getattr(p, name).items()))
    if wire.shape == SEQUENCES:
        return lambda p: tuple(tuple(int(t) for t in seq.token_ids) for seq in getattr(p, name))
    return lambda p: (lambda g: (g.kind, g.source) if g.kind else None)(getattr(p, name))  # GRAMMAR


# Built once from the declaration: a request's conversion is then a loop over plain tuples.
_READERS = tuple((f.name, _reader(f)) for f in FIELDS)
_BY_SHAPE = {shape: tuple(f.name for f in FIELDS if f.metadata["wire"].shape == shape)
             for shape in (SCALAR, OPTIONAL, REPEATED, MAP, SEQUENCES, GRAMMAR)}
_SCALARS = _BY_SHAPE[SCALAR]
_scalar_values = attrgetter(*_SCALARS)


def params_from_pb(p: wpb.SamplingParams) -> SamplingParams:
    """Raises ValueError on invalid values (the servicer maps it to INVALID_ARGUMENT)."""
    return SamplingParams(**{name: read(p) for name, read in _READERS})


def params_to_pb(p: SamplingParams) -> wpb.SamplingParams:
    plain = dict(zip(_SCALARS, _scalar_values(p), strict=True))
    # empty containers and None are left out: the proto's empty default, and passing them costs
    for name in _BY_SHAPE[REPEATED]:
        if v := getattr(p, name):
            plain[name] = v
    for name in _BY_SHAPE[MAP]:
        if v := getattr(p, name):
            plain[name] = dict(v)
    for name in _BY_SHAPE[SEQUENCES]:
        if v := getattr(p, name):
            plain[name] = [wpb.TokenSequence(token_ids=seq) for seq in v]
    for name in _BY_SHAPE[OPTIONAL]:
        if (v := getattr(p, name)) is not None:
            plain[name] = v
    for name in _BY_SHAPE[GRAMMAR]:
        if (v := getattr(p, name)) is not None:
            plain[name] = wpb.Grammar(kind=v[0], source=v[1])
    return wpb.SamplingParams(**plain)


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
