"""A refusal code survives both transports: an RPC's trailing metadata and the lane's LaneEnd."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.lane_server import LaneAbort, LaneContext, _end
from services.common.refusal import (
    REFUSAL_KEY,
    Refusal,
    length_refusal,
    refusal_from_metadata,
    refusal_of,
    refuse,
)
from services.router.lane import rpc_error


@pytest.mark.parametrize("refusal", list(Refusal), ids=lambda r: r.name)
def test_the_lane_carries_the_code_the_servicer_refused_with(refusal):
    async def servicer() -> None:
        await refuse(LaneContext(), grpc.StatusCode.INVALID_ARGUMENT, refusal, "no")

    with pytest.raises(LaneAbort) as aborted:
        asyncio.run(servicer())
    end = _end(1, aborted.value.code, aborted.value.details, aborted.value.refusal).end
    assert end.refusal == refusal
    # the router's end of the lane rebuilds the RPC's error, trailing metadata included
    error = rpc_error(grpc.StatusCode.INVALID_ARGUMENT, end.details, end.refusal)
    assert refusal_of(error) is refusal and error.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_unknown_or_missing_codes_are_no_refusal():
    assert refusal_from_metadata(()) is Refusal.UNSPECIFIED
    assert refusal_from_metadata(((REFUSAL_KEY, "999"),)) is Refusal.UNSPECIFIED  # a newer worker's reason
    assert refusal_from_metadata((("other", "1"), (REFUSAL_KEY, "1"))) is Refusal.KV_CAPACITY
    assert refusal_of(ValueError("not an RPC error")) is Refusal.UNSPECIFIED


def test_length_refusal():
    assert length_refusal(10, 5, 15) == ""
    assert "max model length 15" in length_refusal(10, 6, 15)
