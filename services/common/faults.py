"""Fault injection, off by default. Tests switch faults on to force each failure path.

Spec: comma-separated `name` or `name=value`, from --faults / PDMESH_FAULTS. Any active fault
is logged loudly at start so nobody runs a faulty worker by accident.

  stall_transfer          prefill never posts the KV WRITE (the room sits in inflight)
  drop_notification       prefill posts the WRITE without its notification
  fail_attach             prefill refuses every Attach
  fail_attach_from=NAME   prefill refuses the Attach of each decode whose worker id contains NAME
                          (one broken prefill-decode pair while both workers stay healthy)
  corrupt_kv[=P]          decode corrupts a room's first KV page after its WRITE landed (every
                          value negated), for every room or each with probability P (fault_seed)
  misroute_kv[=P]         prefill writes a room's first two KV pages into each other's destination
                          pages (its own pages, wrong order), every room or with probability P
  stall_kv_read           prefill never checks its READs of decode's held prefix: each runs into
                          --kv-read-timeout (as a READ from a frozen decode does)
  corrupt_kv_read         decode offers its held prefix pages with a wrong checksum for the last
                          one, so prefill's READ (which always takes the last) fails verification
  sigstop_after_attach    decode freezes itself (SIGSTOP) right after its first attach (when
                          the Attach reply is handled, or when the KV arrives if that is first)
  sigstop_after_held_attach
                          decode freezes itself right after its first attach that offers held
                          prefix pages for prefill to READ (a freeze between offer and READ)
  delay_forward=SECONDS   every forward sleeps this long first (engine thread, either worker)
  fail_forward[=P]        every forward raises (bare), or each with probability P, drawn from
                          a generator seeded with `fault_seed` (default 0) so runs repeat
  hang_forward=SECONDS    the FIRST forward after start blocks this long on the engine thread
                          (only the first, so a test sees the stuck forward, then recovery)
  crash_task=NAME         the named long-lived task (e.g. decode-loop, prefill-scheduler,
                          kv-heartbeat, watchdog, forward-watch, loop-lag, poller, http)
                          raises shortly after start; supervision must take the worker down
  fault_seed=N            seed of fail_forward's generator
  slow_load=SECONDS       loading the model takes this much longer (a big checkpoint's load, so
                          a test sees /health "loading" and /metrics answering meanwhile)

The forward faults and slow_load are applied by services/engine/worker_engine.py (both workers
alike), the task crash by services/common/worker_lifecycle.py.
"""

from __future__ import annotations

from dataclasses import dataclass

# name -> (type, value when given bare)
KNOWN: dict[str, tuple[type, object]] = {
    "stall_transfer": (bool, True),
    "drop_notification": (bool, True),
    "fail_attach": (bool, True),
    "fail_attach_from": (str, None),
    "corrupt_kv": (float, 1.0),
    "misroute_kv": (float, 1.0),
    "stall_kv_read": (bool, True),
    "corrupt_kv_read": (bool, True),
    "sigstop_after_attach": (bool, True),
    "sigstop_after_held_attach": (bool, True),
    "delay_forward": (float, None),
    "fail_forward": (float, 1.0),
    "hang_forward": (float, None),
    "crash_task": (str, None),
    "fault_seed": (int, None),
    "slow_load": (float, None),
}


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Faults:
    stall_transfer: bool = False
    drop_notification: bool = False
    fail_attach: bool = False
    fail_attach_from: str = ""
    corrupt_kv: float = 0.0  # probability that a room's KV is corrupted after it landed (decode)
    misroute_kv: float = 0.0  # probability that a room's pages land in the wrong order (prefill)
    stall_kv_read: bool = False  # prefill: READs of decode's held prefix run into their deadline
    corrupt_kv_read: bool = False  # decode: the last held page's checksum in Attach is wrong
    sigstop_after_attach: bool = False
    sigstop_after_held_attach: bool = False
    delay_forward: float = 0.0
    fail_forward: float = 0.0  # probability that one forward raises
    hang_forward: float = 0.0
    crash_task: str = ""
    fault_seed: int = 0
    slow_load: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> Faults:
        values: dict[str, object] = {}
        for item in (s.strip() for s in (spec or "").split(",")):
            if not item:
                continue
            name, eq, raw = item.partition("=")
            name, raw = name.strip(), raw.strip()
            if name not in KNOWN:
                raise FaultSpecError(f"unknown fault {name!r}; known: {sorted(KNOWN)}")
            kind, bare = KNOWN[name]
            if not eq:
                if bare is None:
                    raise FaultSpecError(f"fault {name} needs a value, e.g. {name}={_example(kind)}")
                values[name] = bare
                continue
            if kind is bool:
                raise FaultSpecError(f"fault {name} takes no value")
            try:
                values[name] = kind(raw)
            except ValueError:
                raise FaultSpecError(f"fault {name} needs a {kind.__name__}, e.g. {name}={_example(kind)}") from None
            if kind is str and not raw:
                raise FaultSpecError(f"fault {name} needs a name")
        for name in ("fail_forward", "corrupt_kv", "misroute_kv"):
            p = values.get(name, 0.0)
            if not 0.0 <= p <= 1.0:  # type: ignore[operator]
                raise FaultSpecError(f"{name} is a probability in [0, 1], got {p}")
        return cls(**values)  # type: ignore[arg-type]

    def active(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if v}


def _example(kind: type) -> str:
    return {float: "5", int: "1", str: "decode-loop"}.get(kind, "1")
