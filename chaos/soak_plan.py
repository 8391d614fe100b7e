"""The chaos soak's fault schedule, drawn from a seed (pure: no processes, no clock).

Faults are spread over the middle of the run (the first and last stretch stay quiet so load
builds up before the first fault and the mesh can drain after the last), one at a time, each
given enough room to happen and recover before the next one starts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# The injection faults (services/common/faults.py) and the roles they apply to.
INJECTIONS = {
    "stall_transfer": ("prefill",),
    "drop_notification": ("prefill",),
    "fail_attach": ("prefill",),
    "delay_forward=0.3": ("prefill", "decode"),
    "fail_forward=0.2": ("prefill", "decode"),
    "hang_forward=6": ("prefill", "decode"),
    # wrong KV: the KV checksum fails the room before its first step and the router fails over
    "corrupt_kv=0.5": ("decode",),
    "misroute_kv=0.5": ("prefill",),
}
KINDS = ("kill", "freeze", "router_restart", "inject")
# Only in hosts mode (every service in its own network namespace, services/launch/netns.py):
# `partition` cuts prefill#index from decode#peer, both ways or one way, for `hold` seconds, then
# heals; `partial_partition` cuts that one pair both ways while every other pair stays up, and
# the soak checks that the router marks exactly that pair, that both workers keep serving
# through their other peers, and that the mark clears after the heal.
HOST_KINDS = (*KINDS, "partition", "partial_partition")
CUTS = ("partition", "partial_partition")
DIRECTIONS = ("both", "to_decode", "to_prefill")  # to_decode: prefill -> decode dropped only
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after load started
    kind: str  # one of KINDS
    role: str = ""  # "prefill" / "decode" ("router" for router_restart)
    index: int = 0  # which worker of that role
    spec: str = ""  # the --faults spec, for "inject"
    hold: float = 0.0  # seconds frozen / with the injected fault on / partitioned
    peer: int = 0  # partition: the decode cut from prefill#index (spec is one of DIRECTIONS)

    def describe(self) -> str:
        if self.kind == "partition":
            arrow = {"both": "<-x->", "to_decode": "-x->", "to_prefill": "<-x-"}[self.spec]
            return f"partition prefill#{self.index} {arrow} decode#{self.peer} {self.hold:g}s"
        if self.kind == "partial_partition":
            return f"partial partition prefill#{self.index} <-x-> decode#{self.peer} only {self.hold:g}s"
        what = {"kill": "SIGKILL + restart", "freeze": f"SIGSTOP {self.hold:g}s",
                "router_restart": "router restart", "inject": f"{self.spec} for {self.hold:g}s"}[self.kind]
        return f"{what} {self.role}#{self.index}" if self.kind != "router_restart" else what


def plan_faults(seed: int, duration: float, count: int, workers_per_role: int = 2,
                freeze_for: float = 8.0, inject_for: float = 10.0, kinds: tuple[str, ...] = KINDS,
                partition_for: float = 12.0, must: tuple[str, ...] | None = None) -> list[Fault]:
    """`count` faults at increasing times within [10 %, 80 %] of `duration`. Every kind in
    `must` (default: `kinds`; repeat a kind to have it at least that often) appears when count
    allows; the rest are drawn at random from `kinds`."""
    rng = random.Random(seed)
    must = kinds if must is None else must
    chosen = list(must[:count]) + [rng.choice(kinds) for _ in range(max(0, count - len(must)))]
    rng.shuffle(chosen)
    start, end = 0.1 * duration, 0.8 * duration
    step = (end - start) / max(1, count)
    faults = []
    for i, kind in enumerate(chosen):
        at = start + i * step + rng.uniform(0, 0.3 * step)
        role = rng.choice(ROLES)
        index = rng.randrange(workers_per_role)
        if kind == "kill":
            faults.append(Fault(at, kind, role, index))
        elif kind == "freeze":
            faults.append(Fault(at, kind, role, index, hold=freeze_for))
        elif kind == "router_restart":
            faults.append(Fault(at, kind, "router"))
        elif kind == "partition":
            faults.append(Fault(at, kind, "prefill", index, spec=rng.choice(DIRECTIONS), hold=partition_for,
                                peer=rng.randrange(workers_per_role)))
        elif kind == "partial_partition":
            faults.append(Fault(at, kind, "prefill", index, spec="both", hold=partition_for,
                                peer=rng.randrange(workers_per_role)))
        else:
            spec = rng.choice(sorted(INJECTIONS))
            faults.append(Fault(at, kind, rng.choice(INJECTIONS[spec]), index, spec=spec, hold=inject_for))
    return faults


def parse_schedule(text: str, freeze_for: float = 8.0, inject_for: float = 10.0,
                   partition_for: float = 12.0) -> list[Fault]:
    """Explicit faults, `kind:role:index[:spec][~hold]@seconds` separated by commas
    (router_restart takes no role), e.g.
    `kill:decode:0@8,inject:prefill:0:stall_transfer~20@15,freeze:decode:1:~12@25,router_restart@40`;
    a partition (hosts mode) is `partition:P:D[:direction][~hold]@seconds`: prefill#P cut from
    decode#D, direction both (default), to_decode or to_prefill, e.g. `partition:0:1~15@30`; a
    partial partition (only that pair cut, both ways) is `partial_partition:P:D[~hold]@seconds`."""
    faults = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        what, _, at = item.partition("@")
        kind, *rest = what.split(":")
        if kind not in HOST_KINDS or not at:
            raise ValueError(f"bad fault {item!r}: want kind:role:index[:spec]@seconds, kind in {HOST_KINDS}")
        if kind == "router_restart":
            faults.append(Fault(float(at), kind, "router"))
            continue
        if kind in CUTS:
            body, _, seconds = what.partition("~")
            _, p, d, *direction = body.split(":")
            spec = direction[0] if direction else "both"
            if kind == "partial_partition" and spec != "both":
                raise ValueError(f"bad partial partition {item!r}: it cuts both ways (no direction)")
            if spec not in DIRECTIONS:
                raise ValueError(f"bad partition {item!r}: direction in {DIRECTIONS}")
            faults.append(Fault(float(at), kind, "prefill", int(p), spec=spec,
                                hold=float(seconds) if seconds else partition_for, peer=int(d)))
            continue
        role, index, spec = rest[0], int(rest[1]), (rest[2] if len(rest) > 2 else "")
        hold = {"freeze": freeze_for, "inject": inject_for}.get(kind, 0.0)
        if "~" in spec:  # an explicit hold: freeze:decode:1:~12, inject:prefill:0:stall_transfer~20
            spec, _, seconds = spec.partition("~")
            hold = float(seconds)
        faults.append(Fault(float(at), kind, role, index, spec=spec, hold=hold))
    return sorted(faults, key=lambda f: f.at)
