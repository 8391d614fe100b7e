"""Typed, frozen per-service settings generated from the flag tables: every flag and its env twin
reach the settings object (flag over env twin over default)."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.config import (
    DECODE_FLAGS,
    PREFILL_FLAGS,
    ROUTER_FLAGS,
    DecodeSettings,
    PrefillSettings,
    RouterSettings,
    parse_args,
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


# --- every flag of every table reaches its settings field --------------------------------------
# For each flag, two values that differ from its default and from each other (where the type has
# two: a bool has one, so the flag's value is the default itself), written as the command line
# and the env twin would write them. A flag that the table declares but the settings object
# drops, renames or mistypes fails here by name.

TABLES = [
    ("prefill", PrefillSettings, PREFILL_FLAGS),
    ("decode", DecodeSettings, DECODE_FLAGS),
    ("router", RouterSettings, ROUTER_FLAGS),
]
FLAG_IDS = [pytest.param(cls, flag, id=f"{role}--{flag.name}") for role, cls, flags in TABLES for flag in flags]


def _two_values(flag):
    """(env value, flag value) as text, and the typed values a setting must then hold."""
    if flag.repeatable:
        return ("env-a,env-b", ["env-a", "env-b"]), ("flag-c", ["flag-c"])
    if flag.choices:
        others = [c for c in flag.choices if c != flag.default]
        first, second = others[0], (others[1] if len(others) > 1 else flag.default)
        return (str(first), first), (str(second), second)
    if flag.type is bool:
        return ("true" if not flag.default else "false", not flag.default), (str(flag.default).lower(), flag.default)
    if flag.type is int:
        return (str(flag.default + 7), flag.default + 7), (str(flag.default + 11), flag.default + 11)
    if flag.type is float:
        return (str(flag.default + 1.5), flag.default + 1.5), (str(flag.default + 2.25), flag.default + 2.25)
    if flag.type is str:
        return (f"env-{flag.name}", f"env-{flag.name}"), (f"flag-{flag.name}", f"flag-{flag.name}")
    raise AssertionError(f"--{flag.name}: no test values for type {flag.type!r}; add them here")


@pytest.fixture
def clean_env(monkeypatch):
    """No PDMESH_* twin of any table leaks in from the environment running the tests."""
    for _, _, flags in TABLES:
        for flag in flags:
            monkeypatch.delenv(flag.env, raising=False)
    return monkeypatch


def _setting(cls, flag, argv):
    value = getattr(parse_settings(cls, "test", "test", argv), flag.dest)
    if not flag.repeatable:
        assert type(value) is flag.type, f"--{flag.name}: {value!r} is not a {flag.type.__name__}"
    return value


@pytest.mark.parametrize("cls,flag", FLAG_IDS)
def test_flag_then_env_twin_then_default_reach_the_setting(clean_env, cls, flag):
    (env_text, env_value), (flag_text, flag_value) = _two_values(flag)
    assert env_value != flag.default, f"--{flag.name}: the env test value must differ from the default"
    assert env_value != flag_value

    assert _setting(cls, flag, []) == flag.default
    clean_env.setenv(flag.env, env_text)
    assert _setting(cls, flag, []) == env_value
    assert _setting(cls, flag, [f"--{flag.name}", flag_text]) == flag_value
    # the flag alone, without its twin
    clean_env.delenv(flag.env)
    assert _setting(cls, flag, [f"--{flag.name}", env_text]) == env_value


@pytest.mark.parametrize("cls,flags", [(c, f) for _, c, f in TABLES])
def test_settings_fields_are_exactly_the_table(cls, flags):
    extra = {"process_index", "shared_dir"} if cls is RouterSettings else set()
    names = [f.name for f in dataclasses.fields(cls)]
    assert names[: len(flags)] == [f.dest for f in flags]
    assert set(names[len(flags):]) == extra
    assert len({f.name for f in flags}) == len(flags), "a flag is declared twice in one table"


def test_router_settings_from_args_is_the_parsed_flags(clean_env):
    clean_env.setenv("PDMESH_MAX_MIGRATIONS", "5")
    args = parse_args("router", "test", ROUTER_FLAGS, ["--port", "9001"])
    s = RouterSettings.from_args(args)
    assert (s.port, s.max_migrations, s.process_index, s.shared_dir) == (9001, 5, 0, "")
