"""On/off flags are switches, as vLLM's and SGLang's are: `--enable-force-include-usage` alone
turns it on (what a vLLM command line says), `--no-worker-lane` turns one off, and a value
(`true`, `false`, `0`, `1`, `--flag=false`) still works, as do the env twins; the value given
last wins, and a bad value is a usage error, not a traceback. The names a vLLM or SGLang command
line uses for the same settings are taken too (--disable-log-requests, --enable-prefix-caching,
--disable-radix-cache, --max-num-seqs, --block-size, --max-num-batched-tokens,
--h11-max-incomplete-event-size)."""

from __future__ import annotations

import pytest

from services.common.config import DECODE_FLAGS, PREFILL_FLAGS, ROUTER_FLAGS, parse_args


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


@pytest.mark.parametrize(("argv", "expected"), [
    (["--disable-log-requests"], False),
    (["--enable-log-requests"], True),
    (["--no-log-requests", "--enable-log-requests"], True),
])
def test_vllm_names_of_the_request_log_switch(argv, expected):
    assert router_args(argv).log_requests is expected


def test_vllm_and_sglang_names_of_worker_settings():
    decode = parse_args("decode", "test", DECODE_FLAGS, ["--max-num-seqs", "8", "--block-size", "32",
                                                         "--no-enable-prefix-caching"])
    assert (decode.max_running_requests, decode.page_size, decode.prefix_cache) == (8, 32, False)
    prefill = parse_args("prefill", "test", PREFILL_FLAGS, ["--disable-radix-cache"])
    assert prefill.prefix_cache is False
    assert parse_args("prefill", "test", PREFILL_FLAGS, ["--enable-prefix-caching"]).prefix_cache is True
    # vLLM's per-step token budget is the forward's chunk budget on either worker
    for role, flags in (("prefill", PREFILL_FLAGS), ("decode", DECODE_FLAGS)):
        assert parse_args(role, "test", flags, ["--max-num-batched-tokens", "2048"]).chunked_prefill_size == 2048
    assert router_args(["--h11-max-incomplete-event-size", "8192"]).max_header_bytes == 8192  # vLLM's name
