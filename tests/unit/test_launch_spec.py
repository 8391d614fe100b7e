"""services/launch/spec.py and the placements' choices, without starting anything."""

from __future__ import annotations

import pytest

from services.launch.local import Local
from services.launch.spec import MeshSpec, Service


def test_pd_lists_prefills_then_decodes_then_the_router():
    spec = MeshSpec.pd(prefills=2, decodes=1, prefill_flags=("--a",), router_flags=("--b", "1"), model="m")
    assert [s.role for s in spec.services] == ["prefill", "prefill", "decode", "router"]
    assert spec.of_role("prefill")[0].flags == ("--a",)
    assert spec.of_role("router")[0].flags == ("--b", "1")
    assert spec.model == "m"
    assert [s.role for s in MeshSpec.pd(router=False).services] == ["prefill", "decode"]


def test_unknown_role_is_refused():
    with pytest.raises(ValueError, match="unknown role"):
        Service("colocated")


def test_local_ports_are_free_unless_named():
    local = Local()
    grpc, http = local.ports("prefill", "")
    assert grpc and http and grpc != http
    assert local.ports("decode", "", 50052, 8082) == (50052, 8082)
    assert local.ports("router", "", 0, 8000) == (None, 8000)
    assert local.service_args("router", "") == []
    assert Local(bind="127.0.0.1").service_args("prefill", "") == ["--host", "127.0.0.1"]
