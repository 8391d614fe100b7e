"""Fault injection, off by default. Tests switch faults on to force each failure path.

Spec: comma-separated `name` or `name=value`, from --faults / PDMESH_FAULTS. Any active fault
is logged loudly at start so nobody runs a faulty worker by accident.

  stall_transfer          prefill never posts the KV WRITE (the room sits in inflight)
  drop_notification       prefill posts the WRITE without its notification
  fail_attach             prefill refuses every Attach
  delay_forward=SECONDS   prefill sleeps this long inside each forward (engine thread)
  sigstop_after_attach    decode freezes itself (SIGSTOP) right after its first attach
"""

from __future__ import annotations

from dataclasses import dataclass

KNOWN = {
    "stall_transfer": bool,
    "drop_notification": bool,
    "fail_attach": bool,
    "delay_forward": float,
    "sigstop_after_attach": bool,
}


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Faults:
    stall_transfer: bool = False
    drop_notification: bool = False
    fail_attach: bool = False
    delay_forward: float = 0.0
    sigstop_after_attach: bool = False

    @classmethod
    def parse(cls, spec: str) -> Faults:
        values: dict[str, object] = {}
        for item in (s.strip() for s in (spec or "").split(",")):
            if not item:
                continue
            name, _, raw = item.partition("=")
            name = name.strip()
            if name not in KNOWN:
                raise FaultSpecError(f"unknown fault {name!r}; known: {sorted(KNOWN)}")
            if KNOWN[name] is bool:
                values[name] = True
            else:
                try:
                    values[name] = float(raw)
                except ValueError:
                    raise FaultSpecError(f"fault {name} needs a number, e.g. {name}=5") from None
        return cls(**values)

    def active(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if v}
