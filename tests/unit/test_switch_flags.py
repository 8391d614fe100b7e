"""On/off flags are switches, as vLLM's and SGLang's are: `--enable-force-include-usage` alone
turns it on (what a vLLM command line says), `--no-worker-lane` turns one off, and a value
(`true`, `false`, `0`, `1`, `--flag=false`) still works, as do the env twins; the value given
last wins, and a bad value is a usage error, not a traceback."""

from __future__ import annotations

import pytest

from services.common.config import ROUTER_FLAGS, parse_args


def router_args(argv):
    return parse_args("router", "test", ROUTER_FLAGS, argv)


@pytest.mark.parametrize(("argv", "usage", "lane"), [
    ([], False, True),
    (["--enable-force-include-usage"], True, True),
    (["--enable-force-include-usage", "--no-worker-lane"], True, False),
    (["--enable-force-include-usage", "false"], False, True),
    (["--enable-force-include-usage=1", "--worker-lane", "0"], True, False),
    (["--no-worker-lane", "--worker-lane"], False, True),
    (["--enable-force-include-usage", "--port", "9000"], True, True),
])
def test_switches_alone_negated_or_with_a_value(argv, usage, lane):
    args = router_args(argv)
    assert (args.enable_force_include_usage, args.worker_lane) == (usage, lane)


def test_switches_keep_their_env_twins(monkeypatch):
    monkeypatch.setenv("PDMESH_ENABLE_FORCE_INCLUDE_USAGE", "true")
    monkeypatch.setenv("PDMESH_WORKER_LANE", "false")
    assert (router_args([]).enable_force_include_usage, router_args([]).worker_lane) == (True, False)
    assert router_args(["--no-enable-force-include-usage"]).enable_force_include_usage is False


def test_a_bad_switch_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stop:
        router_args(["--worker-lane", "maybe"])
    assert stop.value.code == 2 and "not a boolean" in capsys.readouterr().err
