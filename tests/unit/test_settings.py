"""Typed, frozen per-service settings generated from the flag table."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.config import (
    DECODE_FLAGS,
    PREFILL_FLAGS,
    DecodeSettings,
    PrefillSettings,
    parse_settings,
)


@pytest.mark.parametrize("cls,flags", [(PrefillSettings, PREFILL_FLAGS), (DecodeSettings, DECODE_FLAGS)])
def test_every_flag_is_one_typed_field(cls, flags):
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    assert list(fields) == [f.dest for f in flags]
    assert all(fields[f.dest] is f.type for f in flags if not f.repeatable)


def test_settings_come_from_flags_then_env_then_defaults_and_are_frozen(monkeypatch):
    monkeypatch.setenv("PDMESH_TRANSFER_TIMEOUT", "7.5")
    s = parse_settings(DecodeSettings, "decode", "test", ["--num-pages", "12"])
    assert (s.num_pages, s.transfer_timeout, s.page_size) == (12, 7.5, 16)
    assert isinstance(s.transfer_timeout, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_pages = 3
    with pytest.raises(SystemExit):
        parse_settings(PrefillSettings, "prefill", "test", ["--num-pages", "many"])
