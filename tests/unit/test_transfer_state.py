"""Room state machines, transition by transition (pure Python, fake clock)."""

import pytest

from services.transfer.state import DuplicateRoom, Room, RoomState, RoomTable

S = RoomState


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def clock():
    return FakeClock()


def test_initial_state_and_entry_time(clock):
    r = Room(1, clock())
    assert r.state == S.BOOTSTRAPPING and r.state_since == 100.0 and r.age(103.0) == 3.0


@pytest.mark.parametrize(
    "path",
    [
        [S.WAITING_FOR_INPUT, S.TRANSFERRING, S.SUCCESS],
        [S.WAITING_FOR_INPUT, S.SUCCESS],  # receiver: notification before "forward done"
        [S.TRANSFERRING, S.SUCCESS],
    ],
)
def test_forward_paths(path, clock):
    r = Room(1, clock())
    for s in path:
        clock.t += 1
        assert r.advance(s, clock())
        assert r.state == s and r.state_since == clock.t
    assert [h[0] for h in r.history] == [S.BOOTSTRAPPING, *path]


@pytest.mark.parametrize("start", [S.WAITING_FOR_INPUT, S.TRANSFERRING])
@pytest.mark.parametrize("back", [S.BOOTSTRAPPING, S.WAITING_FOR_INPUT])
def test_never_backwards_nor_same(start, back, clock):
    r = Room(1, clock())
    r.advance(start, clock())
    since = r.state_since
    clock.t += 5
    assert not r.advance(back, clock())
    assert r.state == start and r.state_since == since  # clock not reset by a no-op


@pytest.mark.parametrize("state", [S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING])
def test_failed_wins_from_every_non_terminal_state(state, clock):
    r = Room(1, clock())
    if state != S.BOOTSTRAPPING:
        r.advance(state, clock())
    clock.t += 2
    assert r.fail("boom", clock())
    assert r.state == S.FAILED and r.reason == "boom" and r.state_since == clock.t


@pytest.mark.parametrize("terminal", [S.SUCCESS, S.FAILED])
def test_terminal_is_final(terminal, clock):
    r = Room(1, clock())
    if terminal == S.SUCCESS:
        r.advance(S.SUCCESS, clock())
    else:
        r.fail("x", clock())
    for s in (S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING, S.SUCCESS):
        assert not r.advance(s, clock())
    assert not r.fail("again", clock())
    assert r.state == terminal


def test_advance_to_failed_must_use_fail(clock):
    with pytest.raises(ValueError):
        Room(1, clock()).advance(S.FAILED, clock())


def test_table_drops_events_for_unknown_rooms_and_never_recreates(clock):
    t = RoomTable(clock)
    assert not t.advance(7, S.TRANSFERRING)
    assert not t.fail(7, "late")
    assert 7 not in t and len(t) == 0 and t.dropped_events == 2


def test_table_remove_tombstones_and_refuses_reuse(clock):
    t = RoomTable(clock)
    t.add(Room(1, clock()))
    t.advance(1, S.SUCCESS)
    assert t.remove(1).state == S.SUCCESS
    assert t.outcome(1) == S.SUCCESS and t.is_known(1) and 1 not in t
    assert not t.advance(1, S.TRANSFERRING)  # late event dropped
    assert 1 not in t
    with pytest.raises(DuplicateRoom):
        t.add(Room(1, clock()))


def test_table_duplicate_live_room(clock):
    t = RoomTable(clock)
    t.add(Room(1, clock()))
    with pytest.raises(DuplicateRoom):
        t.add(Room(1, clock()))


def test_remove_non_terminal_fails_it_first(clock):
    t = RoomTable(clock)
    t.add(Room(1, clock()))
    r = t.remove(1)
    assert r.state == S.FAILED and t.outcome(1) == S.FAILED


def test_tombstones_are_bounded(clock):
    t = RoomTable(clock, tombstones=3)
    for i in range(5):
        t.add(Room(i, clock()))
        t.remove(i)
    assert [t.is_known(i) for i in range(5)] == [False, False, True, True, True]


def test_tombstone_without_live_room(clock):
    t = RoomTable(clock)
    t.tombstone(9, S.FAILED)
    assert t.outcome(9) == S.FAILED
    with pytest.raises(DuplicateRoom):
        t.add(Room(9, clock()))


def test_expired_uses_time_in_current_state(clock):
    t = RoomTable(clock)
    t.add(Room(1, clock()))  # bootstrapping since 100
    t.add(Room(2, clock()))
    clock.t = 150
    t.advance(2, S.TRANSFERRING)  # inflight since 150: its earlier 50 s do not count
    t.add(Room(3, clock()))
    t.advance(3, S.SUCCESS)  # terminal: never expires
    deadlines = {S.BOOTSTRAPPING: 30.0, S.TRANSFERRING: 10.0}
    clock.t = 155
    assert [e.room for e in t.expired(deadlines)] == [1]
    clock.t = 161
    got = {e.room: (e.state, e.age) for e in t.expired(deadlines)}
    assert got == {1: (S.BOOTSTRAPPING, 61.0), 2: (S.TRANSFERRING, 11.0)}
    assert t.expired({}) == []  # no deadline, no eviction (e.g. the waiting queue)


def test_labels_match_design_names():
    assert [s.label for s in S] == ["Bootstrapping", "WaitingForInput", "Transferring", "Success", "Failed"]
    assert [s.terminal for s in S] == [False, False, False, True, True]
