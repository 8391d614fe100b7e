"""SamplingParams is the one declaration of a sampling field: every field round-trips through
the worker wire (services/common/wire.py) and the serialized proto, its declared range is what
the engine enforces, the API fields a client sets reach the workers, and a field declared on one
side only (SamplingParams or worker.proto) stops the import with a message naming it."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.builtin_tokenizer import BuiltinTokenizer
from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.sampling_params import (
    FIELDS,
    GRAMMAR,
    MAP,
    OPTIONAL,
    RANGED,
    REPEATED,
    SCALAR,
    SEQUENCES,
    SamplingParams,
    Wire,
    api_fields,
    param,
)
from services.common.wire import check_declaration, params_from_pb, params_to_pb
from services.router.errors import APIError
from services.router.json_codec import loads
from services.router.orchestrator import sampling_params
from services.router.protocol import ModelInfo, parse_completion

TOK = BuiltinTokenizer()
INFO = ModelInfo(name="m", tokenizer=TOK, context_length=64)


def _value(f: dataclasses.Field):
    """A valid value other than the default, exact in float32 (the proto's float fields)."""
    shape = f.metadata["wire"].shape
    if shape == SCALAR:
        kind = type(f.default)
        return {bool: True, int: 3, float: 0.5, str: "salt"}[kind]
    return {
        OPTIONAL: 3,
        REPEATED: (1, 2),
        MAP: ((3, 1.5), (7, -2.0)),
        SEQUENCES: ((1, 2), (4,)),
        GRAMMAR: ("regex", "a+"),
    }[shape]


@pytest.mark.parametrize("f", FIELDS, ids=[f.name for f in FIELDS])
def test_every_field_round_trips_through_the_wire_and_the_proto(f):
    params = SamplingParams(**{f.name: _value(f)})
    assert getattr(params, f.name) != getattr(SamplingParams(), f.name)
    msg = params_to_pb(params)
    again = wpb.SamplingParams.FromString(msg.SerializeToString())
    assert params_from_pb(again) == params


def test_all_fields_at_once_and_the_defaults_round_trip():
    params = SamplingParams(**{f.name: _value(f) for f in FIELDS})
    assert params_from_pb(params_to_pb(params)) == params
    assert params_from_pb(params_to_pb(SamplingParams())) == SamplingParams()


@pytest.mark.parametrize("f", RANGED, ids=[f.name for f in RANGED])
def test_declared_range_is_enforced(f):
    r = f.metadata["range"]
    outside = [r.lo] if r.lo_open else [r.lo - 1]
    if r.hi is not None:
        outside.append(r.hi + 1)
    if isinstance(f.default, float) or f.default is None and isinstance(r.lo, float):
        outside.append(float("nan"))
    for bad in outside:
        with pytest.raises(ValueError, match=f.name):
            SamplingParams(**{f.name: bad})


@pytest.mark.parametrize("name,default,api", api_fields(), ids=[n for n, _, _ in api_fields()])
def test_api_fields_reach_the_workers(name, default, api):
    value = _value(next(f for f in FIELDS if f.name == name))
    spec = parse_completion({"model": "m", "prompt": "hello", "max_tokens": 8, name: value}, INFO)
    assert getattr(sampling_params(spec, TOK.eos_token_ids), name) == value
    bad = ["text", *([api.lo - 1] if api.lo is not None else []), *([api.hi + 1] if api.hi is not None else [])]
    for value in bad:
        with pytest.raises(APIError) as e:
            parse_completion({"model": "m", "prompt": "hello", name: value}, INFO)
        assert (e.value.status, e.value.param) == (400, name), value


@pytest.mark.parametrize("raw, shown", [("NaN", "NaN"), ("Infinity", "Infinity"), ("-Infinity", "-Infinity"),
                                        ("1e999", "Infinity")])
def test_a_number_json_cannot_hold_is_named_as_sent(raw, shown):
    # Python's JSON parser takes NaN and Infinity (and 1e999 overflows to it); no field takes them
    body = loads(b'{"model": "m", "prompt": "hello", "temperature": ' + raw.encode() + b"}")
    with pytest.raises(APIError) as e:
        parse_completion(body, INFO)
    assert (e.value.status, e.value.param) == (400, "temperature")
    assert e.value.message == f"Invalid type for 'temperature': expected a number, but got {shown} instead."


def test_the_declaration_and_the_proto_agree():
    check_declaration()  # what every service does at import


def test_a_field_without_a_proto_field_fails_loudly():
    Extended = dataclasses.make_dataclass(
        "Extended", [("new_knob", float, param(0.0))], bases=(SamplingParams,), frozen=True)
    with pytest.raises(TypeError, match="new_knob.*no field in worker.proto"):
        check_declaration(dataclasses.fields(Extended))


def test_a_proto_field_not_declared_fails_loudly():
    with pytest.raises(TypeError, match="prompt_logprobs.*not declared"):
        check_declaration([f for f in FIELDS if f.name != "prompt_logprobs"])


def test_a_field_declared_without_wire_or_with_the_wrong_shape_fails_loudly():
    Plain = dataclasses.make_dataclass("Plain", [("top_k", int, dataclasses.field(default=0))], frozen=True)
    with pytest.raises(TypeError, match="top_k declares no Wire"):
        check_declaration(dataclasses.fields(Plain))
    Wrong = dataclasses.make_dataclass("Wrong", [("top_p", float, param(1.0, wire=Wire(REPEATED)))], frozen=True)
    with pytest.raises(TypeError, match="top_p: declared repeated"):
        check_declaration(dataclasses.fields(Wrong))
