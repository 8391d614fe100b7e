"""Refusal reasons as codes: a worker says why it refuses a call, the router acts on the code.

`Refusal` is worker.proto's `RefusalReason`, as a Python enum built from the generated one (the
proto is the only declaration). A worker refuses with `refuse(context, code, refusal, details)`:
the gRPC status and details as before (for logs and for clients that read them), plus the code
in the trailing metadata `pdmesh-refusal`; the lane carries it in `LaneEnd.refusal` and the
router's lane end rebuilds the same metadata, so `refusal_of(error)` reads it from any call.
"""

from __future__ import annotations

import enum

import grpc

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb

REFUSAL_KEY = "pdmesh-refusal"

Refusal = enum.IntEnum(  # type: ignore[misc]
    "Refusal", {name.removeprefix("REFUSAL_REASON_"): value for name, value in wpb.RefusalReason.items()},
    module=__name__,
)
Refusal.__doc__ = "Why a worker refused a call (worker.proto RefusalReason); UNSPECIFIED: not a refusal."


def refusal_metadata(refusal: int) -> tuple[tuple[str, str], ...]:
    return ((REFUSAL_KEY, str(int(refusal))),) if refusal else ()


async def refuse(context, code: grpc.StatusCode, refusal: Refusal, details: str) -> None:
    """End the call with `code` and `details`, saying why by code (raises, as context.abort does)."""
    await context.abort(code, details, trailing_metadata=refusal_metadata(refusal))


def length_refusal(prompt_tokens: int, max_tokens: int, max_model_len: int) -> str:
    """Why a call's prompt + max_tokens do not fit this worker's --max-model-len ("" when they do)."""
    if prompt_tokens + max_tokens <= max_model_len:
        return ""
    return (f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds this worker's max model "
            f"length {max_model_len}")


def refusal_from_metadata(metadata) -> Refusal:
    """The refusal in a call's trailing metadata; UNSPECIFIED when there is none (or one this side
    does not know: a newer worker's reason is treated as a plain failure)."""
    for key, value in metadata or ():
        if key == REFUSAL_KEY:
            try:
                return Refusal(int(value))
            except ValueError:
                return Refusal.UNSPECIFIED
    return Refusal.UNSPECIFIED


def refusal_of(error: BaseException) -> Refusal:
    if isinstance(error, grpc.aio.AioRpcError):
        return refusal_from_metadata(error.trailing_metadata())
    return Refusal.UNSPECIFIED
