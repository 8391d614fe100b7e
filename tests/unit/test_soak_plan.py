from chaos.soak_plan import (
    DIRECTIONS,
    HOST_KINDS,
    INJECTIONS,
    KINDS,
    Fault,
    parse_schedule,
    plan_faults,
)


def test_same_seed_same_plan_and_other_seed_other_plan():
    assert plan_faults(1, 120, 10) == plan_faults(1, 120, 10)
    assert plan_faults(1, 120, 10) != plan_faults(2, 120, 10)


def test_faults_are_ordered_inside_the_quiet_margins_and_cover_every_kind():
    faults = plan_faults(7, 120, 10)
    times = [f.at for f in faults]
    assert times == sorted(times) and 12 <= times[0] and times[-1] <= 0.8 * 120
    assert {f.kind for f in faults} == set(KINDS)
    for f in faults:
        if f.kind == "inject":
            assert f.role in INJECTIONS[f.spec] and f.hold > 0
        if f.kind in ("kill", "freeze", "inject"):
            assert f.role in ("prefill", "decode") and f.index in (0, 1)


def test_kinds_can_be_restricted():
    assert {f.kind for f in plan_faults(3, 60, 4, kinds=("kill", "freeze"))} <= {"kill", "freeze"}


def test_an_explicit_schedule_parses_in_time_order():
    faults = parse_schedule("inject:prefill:1:stall_transfer@15, kill:decode:0@8,router_restart@30")
    assert faults == [Fault(8.0, "kill", "decode", 0), Fault(15.0, "inject", "prefill", 1, "stall_transfer", 10.0),
                      Fault(30.0, "router_restart", "router")]
    assert parse_schedule("freeze:decode:1:~12@25,inject:prefill:0:stall_transfer~20@9") == [
        Fault(9.0, "inject", "prefill", 0, "stall_transfer", 20.0), Fault(25.0, "freeze", "decode", 1, "", 12.0)]


def test_partitions_parse_with_direction_and_hold():
    assert parse_schedule("partition:0:1~15@30,partition:1:0:to_decode@40,partition:1:1:to_prefill~9@50") == [
        Fault(30.0, "partition", "prefill", 0, "both", 15.0, peer=1),
        Fault(40.0, "partition", "prefill", 1, "to_decode", 12.0, peer=0),
        Fault(50.0, "partition", "prefill", 1, "to_prefill", 9.0, peer=1)]
    assert parse_schedule("partition:0:1~15@30")[0].describe() == "partition prefill#0 <-x-> decode#1 15s"
    import pytest
    with pytest.raises(ValueError):
        parse_schedule("partition:0:1:sideways@5")


def test_partitions_are_drawn_only_when_asked_and_as_often_as_must_says():
    assert all(f.kind != "partition" for s in range(1, 6) for f in plan_faults(s, 120, 10))
    faults = plan_faults(1, 90, 10, kinds=HOST_KINDS, must=(*HOST_KINDS, "partition"))
    parts = [f for f in faults if f.kind == "partition"]
    assert len(parts) >= 2 and {f.kind for f in faults} == set(HOST_KINDS)
    for f in parts:
        assert f.role == "prefill" and f.index in (0, 1) and f.peer in (0, 1) and f.spec in DIRECTIONS
        assert f.hold > 10  # longer than the soak's longest deadline (prealloc/bootstrap 10 s)


def test_partial_partitions_parse_cut_both_ways_and_are_drawn_in_hosts_mode_from_the_seed():
    assert parse_schedule("partial_partition:0:0~10@12") == [
        Fault(12.0, "partial_partition", "prefill", 0, "both", 10.0, peer=0)]
    assert parse_schedule("partial_partition:1:0@5")[0].describe() == \
        "partial partition prefill#1 <-x-> decode#0 only 12s"
    import pytest
    with pytest.raises(ValueError):
        parse_schedule("partial_partition:0:1:to_decode@5")  # one pair, both ways: no direction
    assert all(f.kind != "partial_partition" for s in range(1, 6) for f in plan_faults(s, 120, 10))
    drawn = [plan_faults(s, 90, 10, kinds=HOST_KINDS) for s in (1, 2)]
    assert drawn[0] == plan_faults(1, 90, 10, kinds=HOST_KINDS)  # seeded: the same plan again
    for faults in drawn:
        cuts = [f for f in faults if f.kind == "partial_partition"]
        assert cuts and all(f.spec == "both" and f.index in (0, 1) and f.peer in (0, 1) and f.hold > 10
                            for f in cuts)
