"""KV transfer between real OS processes over the real NIXL (UCX).

One sender process (prefill side: KVSender + gRPC KVBootstrap, with the built-in model) serves
the whole module; receivers (decode side) are started per test. Helper process:
tests/integration/transfer_peer.py. After every scenario each process must be whole: no pages,
aux rows, NIXL transfer handles, rooms or parked attaches left.

Catching a transfer mid-flight: a posted NIXL WRITE only completes after the receiver's UCX
worker has progressed (see docs/transfer.md), so a receiver frozen with SIGSTOP keeps the
sender's WRITE in flight (state PROC) for as long as it is stopped. The SIGSTOP test relies on
exactly that; the SIGKILL test freezes the receiver the same way, checks the WRITE is in flight,
then SIGKILLs it. No fake transport and no fault hook is involved.
"""

from __future__ import annotations

import time

import pytest

from tests.integration.transfer_fixtures import PeerProc, Peers, module_peers, next_room, peers  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PAGE = 16


def pages_for(n_tokens: int) -> int:
    return -(-n_tokens // PAGE)


@pytest.fixture(scope="module")
def sender(module_peers: Peers) -> PeerProc:  # noqa: F811
    s = module_peers.start("sender", "--model", "--pages", "512", name="sender")
    yield s
    s.assert_whole()


def addr(sender: PeerProc) -> str:
    return f"127.0.0.1:{sender.ready['port']}"


def transfer_pattern(sender: PeerProc, rx: PeerProc, room: int, n_pages: int, attach_first: bool = True):
    """One room with pattern data; returns (sender terminal event, receiver terminal event)."""
    if attach_first:
        assert rx.call("recv", room=room, bootstrap=addr(sender), n_pages=n_pages)["attached"]
        sender.call("prefill", room=room, n_pages=n_pages)
    else:
        sender.call("prefill", room=room, n_pages=n_pages)
        assert rx.call("recv", room=room, bootstrap=addr(sender), n_pages=n_pages)["attached"]
    return sender.terminal(room), rx.terminal(room)


def assert_ok(ev_s: dict, ev_r: dict) -> None:
    assert ev_s["state"] == "Success", ev_s
    assert ev_r["state"] == "Success", ev_r
    assert ev_r["pattern_ok"], ev_r


# --- 1. real prefill: bit-exact pages and an identical greedy continuation -------------------


def test_real_prefill_pages_bit_exact_and_decode_continues_like_single_process(sender, peers):  # noqa: F811
    rx = peers.start("receiver", "--model", "--worker-id", "dec-model", name="rx-model")
    prompts = [
        [(i * 37 + 11) % 250 for i in range(37)],  # 3 pages, the last one partial
        [5, 17, 99, 3, 200, 42, 7],  # less than a page
        [(i * 13 + 1) % 256 for i in range(64)],  # exactly 4 pages
    ]
    max_tokens = 16
    ref = sender.call("reference", prompts=prompts, max_tokens=max_tokens, timeout=60)["tokens"]
    for i, prompt in enumerate(prompts):
        room = next_room()
        n_src = pages_for(len(prompt))
        n_dst = pages_for(len(prompt) + max_tokens)
        recv = dict(
            room=room, bootstrap=addr(sender), n_pages=n_dst, n_src=n_src, keep=True, check_pattern=False
        )
        if i % 2 == 0:  # decode attaches first (prefill's room waits in Bootstrapping)
            assert rx.call("recv", **recv)["attached"]
            p = sender.call("prefill", room=room, prompt=prompt)
        else:  # prefill first; here decode's attach may even beat the Prefill RPC's room creation
            p = sender.call("prefill", room=room, prompt=prompt)
            assert rx.call("recv", **recv)["attached"]
        ev_s, ev_r = sender.terminal(room), rx.terminal(room)
        assert ev_s["state"] == "Success" and ev_r["state"] == "Success", (ev_s, ev_r)
        assert ev_r["sha"] == p["src_sha"], "KV pages differ between prefill and decode"
        assert (ev_r["token"], ev_r["logprob"]) == (p["token"], p["logprob"])
        assert ev_s["ndescs"] == 2  # one coalesced KV run + the aux row
        out = rx.call("decode", room=room, prompt_len=len(prompt), max_tokens=max_tokens, timeout=60)[
            "tokens"
        ]
        assert out == ref[i], f"prompt {i}: disaggregated {out} != single-process {ref[i]}"
    rx.assert_whole()
    sender.assert_whole()


# --- 2. receiver SIGKILLed mid-transfer ------------------------------------------------------


def test_receiver_sigkill_mid_transfer_fails_room_fast_other_peer_unaffected(sender, peers):  # noqa: F811
    a, b = peers.start_receivers({"rx-a": "dec-kill-a", "rx-b": "dec-kill-b"})
    victim = next_room()
    assert a.call("recv", room=victim, bootstrap=addr(sender), n_pages=4)["attached"]
    sender.call("prefill", room=victim, n_pages=4, auto=False)
    sender.wait_room(victim, "WaitingForInput")
    # rooms on the healthy peer, attached before and in flight around the kill
    others = [next_room() for _ in range(6)]
    for room in others[:3]:
        assert b.call("recv", room=room, bootstrap=addr(sender), n_pages=3)["attached"]
    a.stop()
    sender.call("send", room=victim)
    for room in others[:3]:
        sender.call("prefill", room=room, n_pages=3)
    # the WRITE to the frozen receiver is posted and stays in flight
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        st = sender.call("room", room=victim)
        assert st["state"] == "Transferring" and st["xfer"] == "PROC", st
    t_kill = time.monotonic()
    a.kill()
    ev = sender.terminal(victim, timeout=10)
    elapsed = ev["t"] - t_kill  # CLOCK_MONOTONIC is system-wide: comparable across processes
    assert ev["state"] == "Failed", ev
    assert elapsed < 3.0, f"sender noticed the dead receiver after {elapsed:.2f}s"
    print(f"\nSIGKILL -> sender room Failed in {elapsed * 1e3:.0f} ms: {ev['reason']}")
    for room in others[:3]:
        assert_ok(sender.terminal(room), b.terminal(room))
    for room in others[3:]:  # and later rooms to the healthy peer still work
        assert_ok(*transfer_pattern(sender, b, room, 2))
    b.assert_whole()
    sender.assert_whole()
    assert not any(p.startswith(a.ready["agent"]) for p in sender.call("status")["peers"])


# --- 3. receiver SIGSTOPped mid-transfer -----------------------------------------------------


def test_receiver_sigstop_keeps_room_in_flight_and_completes_after_sigcont(sender, peers):  # noqa: F811
    a = peers.start("receiver", "--worker-id", "dec-stop", name="rx-stop")
    room = next_room()
    assert a.call("recv", room=room, bootstrap=addr(sender), n_pages=5)["attached"]
    sender.call("prefill", room=room, n_pages=5, auto=False)
    sender.wait_room(room, "WaitingForInput")
    a.stop()
    try:
        sender.call("send", room=room)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:  # observe: non-terminal, no NIXL error
            st = sender.call("room", room=room)
            assert st["state"] == "Transferring" and st["xfer"] == "PROC", st
        frozen_for = time.monotonic() - t0
    finally:
        a.cont()
    t_cont = time.monotonic()
    ev_s, ev_r = sender.terminal(room), a.terminal(room)
    assert_ok(ev_s, ev_r)
    print(
        f"\nfrozen {frozen_for:.2f}s in Transferring; Success {(ev_s['t'] - t_cont) * 1e3:.0f} ms after SIGCONT"
    )
    a.assert_whole()
    sender.assert_whole()


# --- 4. receiver restarted with a new epoch --------------------------------------------------


def test_receiver_restart_with_new_epoch_works_without_restarting_sender(sender, peers):  # noqa: F811
    a1 = peers.start("receiver", "--worker-id", "dec-restart", name="rx-gen1")
    assert_ok(*transfer_pattern(sender, a1, next_room(), 3))
    # a room attached by generation 1, whose KV is not sent yet when it dies
    orphan = next_room()
    assert a1.call("recv", room=orphan, bootstrap=addr(sender), n_pages=2)["attached"]
    sender.call("prefill", room=orphan, n_pages=2, auto=False)
    sender.wait_room(orphan, "WaitingForInput")
    a1.kill()
    replaced = sender.call("status")["stats"]["peers_replaced"]
    a2 = peers.start("receiver", "--worker-id", "dec-restart", name="rx-gen2")
    assert a2.ready["epoch"] > a1.ready["epoch"] and a2.ready["agent"] != a1.ready["agent"]
    t0 = time.monotonic()
    ev_s, ev_r = transfer_pattern(sender, a2, next_room(), 4)
    assert_ok(ev_s, ev_r)
    print(
        f"\nfirst transfer to the restarted receiver (register+attach+write): {(time.monotonic() - t0) * 1e3:.0f} ms"
    )
    orphan_ev = sender.terminal(orphan)
    assert orphan_ev["state"] == "Failed" and "restarted" in orphan_ev["reason"], orphan_ev
    st = sender.call("status")
    assert st["stats"]["peers_replaced"] == replaced + 1
    assert a2.ready["agent"] in st["peers"] and a1.ready["agent"] not in st["peers"]
    a2.assert_whole()
    sender.assert_whole()


# --- 5. many concurrent rooms, one sender, two receivers -------------------------------------


def test_many_concurrent_rooms_two_receivers_correct_and_no_leaks(sender, peers):  # noqa: F811
    a, b = peers.start_receivers({"rx-many-a": "dec-many-a", "rx-many-b": "dec-many-b"})
    n = 80
    rooms = [next_room() for _ in range(n)]
    plan = {room: ((a, b)[i % 2], 1 + (i * 7) % 6) for i, room in enumerate(rooms)}
    t0 = time.monotonic()
    # fire everything without waiting: attaches and prefills interleave in both orders
    pending = []
    for i, room in enumerate(rooms):
        rx, n_pages = plan[room]
        if i % 3 == 0:
            pending.append((sender, sender.send("prefill", room=room, n_pages=n_pages)))
            pending.append((rx, rx.send("recv", room=room, bootstrap=addr(sender), n_pages=n_pages)))
        else:
            pending.append((rx, rx.send("recv", room=room, bootstrap=addr(sender), n_pages=n_pages)))
            pending.append((sender, sender.send("prefill", room=room, n_pages=n_pages)))
    for proc, i in pending:
        r = proc.reply(i, timeout=60)
        assert r.get("attached", True), r
    for room in rooms:
        rx, _ = plan[room]
        assert_ok(sender.terminal(room, timeout=60), rx.terminal(room, timeout=60))
    elapsed = time.monotonic() - t0
    total_pages = sum(p for _, p in plan.values())
    print(f"\n{n} rooms / {total_pages} pages over 2 receivers in {elapsed:.2f}s")
    for p in (a, b, sender):
        p.assert_whole()
