"""Env twins that Kubernetes service links collide with: a flag always wins over its twin, a
`tcp://IP:PORT` service link is ignored (the default stands, and the service can say so), and any
other malformed twin stops the service with a message naming the variable, never a traceback."""

from __future__ import annotations

import pytest

from services.common import config
from services.common.config import (
    PREFILL_FLAGS,
    ROUTER_FLAGS,
    PrefillSettings,
    ignored_env_twins,
    parse_args,
    parse_command_line,
    parse_settings,
)


def router_args(argv):
    return parse_args("router", "test", ROUTER_FLAGS, argv)


@pytest.fixture(autouse=True)
def _fresh_notices(monkeypatch):
    monkeypatch.setattr(config, "_ignored_env", [])


def test_explicit_flag_wins_over_a_service_link_twin(monkeypatch):
    monkeypatch.setenv("PDMESH_PORT", "tcp://10.0.0.1:8000")
    assert router_args(["--port", "9000"]).port == 9000
    assert ignored_env_twins() == []  # the twin was never needed


def test_service_link_twin_without_the_flag_falls_back_to_the_default(monkeypatch):
    monkeypatch.setenv("PDMESH_PORT", "tcp://10.96.0.12:8000")
    assert router_args([]).port == 8000
    (notice,) = ignored_env_twins()
    assert "PDMESH_PORT" in notice and "service link" in notice and "enableServiceLinks" in notice


def test_a_command_line_parsed_twice_reports_a_service_link_once(monkeypatch):
    # each service's __main__ parses before its heavy imports, and its main() parses again
    monkeypatch.setenv("PDMESH_PORT", "tcp://10.96.0.12:8000")
    parse_command_line("router", [])
    parse_command_line("router", [])
    assert len(ignored_env_twins()) == 1


@pytest.mark.parametrize("name,value", [("PDMESH_GRPC_PORT", "udp://10.0.0.7:50051"),
                                        ("PDMESH_HTTP_PORT", "sctp://[fd00::1]:8081")])
def test_worker_port_twins_survive_service_links_too(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    s = parse_settings(PrefillSettings, "prefill", "test", [])
    assert (s.grpc_port, s.http_port) == (50051, 8081)


def test_explicit_flag_wins_over_any_malformed_twin(monkeypatch):
    monkeypatch.setenv("PDMESH_NUM_PAGES", "lots")
    monkeypatch.setenv("PDMESH_WORKER_LANE", "perhaps")
    s = parse_settings(PrefillSettings, "prefill", "test", ["--num-pages", "32"])
    assert s.num_pages == 32
    assert router_args(["--worker-lane", "false"]).worker_lane is False


def test_malformed_twin_without_its_flag_is_a_clear_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("PDMESH_NUM_PAGES", "lots")
    with pytest.raises(SystemExit) as e:
        parse_args("prefill", "test", PREFILL_FLAGS, [])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "PDMESH_NUM_PAGES='lots'" in err and "--num-pages" in err


def test_twin_outside_the_flags_choices_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("PDMESH_POLICY", "fastest")
    with pytest.raises(SystemExit):
        router_args([])
    assert "PDMESH_POLICY='fastest'" in capsys.readouterr().err
    assert router_args(["--policy", "least_loaded"]).policy == "least_loaded"


def test_repeatable_twin_still_splits_on_commas(monkeypatch):
    monkeypatch.setenv("PDMESH_PREFILL", "a:50051, b:50051")
    assert router_args([]).prefill == ["a:50051", "b:50051"]
    assert router_args(["--prefill", "c:1"]).prefill == ["c:1"]


def test_repeatable_flags_also_take_a_json_list_as_vllm_does(monkeypatch):
    # vLLM's --allowed-origins '["https://a", "https://b"]'; commas inside it are not separators
    args = router_args(["--allowed-origins", '["https://a", "https://b"]', "--allowed-origins", "https://c,https://d"])
    assert args.allowed_origins == ["https://a", "https://b", "https://c", "https://d"]
    monkeypatch.setenv("PDMESH_ALLOWED_ORIGINS", '["https://e"]')
    assert router_args([]).allowed_origins == ["https://e"]
    monkeypatch.setenv("PDMESH_ALLOWED_ORIGINS", "")
    assert router_args([]).allowed_origins == []  # an empty value: no origin
    monkeypatch.delenv("PDMESH_ALLOWED_ORIGINS")
    assert router_args([]).allowed_origins == ["*"] and router_args([]).allowed_methods == ["*"]
    # a bracketed address is one value, not a list
    assert router_args(["--prefill", "[::1]:50051", "--prefill", "[::1]"]).prefill == ["[::1]:50051", "[::1]"]
    assert router_args(["--prefill", '["[::1]:1", "h:2"]']).prefill == ["[::1]:1", "h:2"]


def test_make_run_ignores_a_service_link_in_its_port_settings(monkeypatch):
    from services.mesh import _port

    monkeypatch.setenv("PDMESH_ROUTER_PORT", "tcp://10.0.0.1:8000")
    assert _port("PDMESH_ROUTER_PORT", 8000) == 8000
    monkeypatch.setenv("PDMESH_ROUTER_PORT", "9100")
    assert _port("PDMESH_ROUTER_PORT", 8000) == 9100
    monkeypatch.setenv("PDMESH_ROUTER_PORT", "eighty")
    with pytest.raises(SystemExit, match="PDMESH_ROUTER_PORT='eighty' is not a port number"):
        _port("PDMESH_ROUTER_PORT", 8000)
