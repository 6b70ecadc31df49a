"""The goodput account's rules, one fold at a time (no clock, no files, no etcd)."""

from __future__ import annotations

import pytest

from elastic.goodput.account import (GAP_ABSORBED_S, LOST_CAUSES, MAX_FAULTS, Account, Fault, Interval, added,
                                     extend, name_faults)


def iv(start: float | None, end: float, cause: str, step: int | None = None, reason: str = "",
       nodes: tuple[str, ...] = ()) -> Interval:
    return Interval(end=end, cause=cause, start=start, step=step, reason=reason, nodes=nodes)


def parts_add_up(a: Account) -> bool:
    return a.productive + sum(a.lost.values()) == pytest.approx(a.wall)


def test_the_clock_starts_with_the_first_step_and_set_up_before_it_is_not_counted() -> None:
    a = extend(Account(), [iv(0, 5, "worker_start"), iv(5, 7, "restore"), iv(7, 8, "productive", step=1),
                           iv(8, 9, "productive", step=2)])
    assert (a.started_at, a.to, a.productive, a.lost_total) == (7, 9, 2, 0)
    assert a.goodput == 1.0 and a.high_water == 2 and a.faults == ()


def test_a_restart_is_a_fault_with_its_phases_and_its_recomputation_and_the_parts_add_up() -> None:
    a = extend(Account(), [iv(0, 10, "productive", step=10)])
    # the agent: detection to when it acted, then the rendezvous; the new worker: start, restore, redo
    a = extend(a, [iv(None, 11.5, "detection", reason="peer_lost", nodes=("b",)),
                   iv(11.5, 12.0, "rendezvous", reason="peer_lost", nodes=("b",)),
                   iv(12.0, 13.0, "worker_start"), iv(13.0, 13.5, "restore"),
                   iv(13.5, 15.5, "recompute", step=10), iv(15.5, 16.0, "snapshot"),
                   iv(16.0, 20.0, "productive", step=14)])
    assert parts_add_up(a) and a.wall == 20
    assert a.productive == 14 and a.lost["recompute"] == 2 and a.lost["snapshot"] == 0.5
    (fault,) = a.faults
    assert (fault.at, fault.reason, fault.nodes) == (10, "peer_lost", ("b",))
    assert fault.phases == {"detection": 1.5, "rendezvous": 0.5, "worker_start": 1.0, "restore": 0.5,
                            "recompute": 2.0}
    assert a.goodput == pytest.approx(14 / 20)


def test_time_already_counted_is_never_counted_again_whoever_reports_it() -> None:
    a = extend(Account(), [iv(0, 10, "productive", step=10)])
    again = extend(a, [iv(2, 9, "productive", step=9), iv(9, 11, "productive", step=11)])  # a survivor's overlap
    assert again.to == 11 and again.productive == 11 and parts_add_up(again)
    assert extend(a, [iv(3, 8, "detection")]) == a  # wholly counted: nothing changes, no fault opens


def test_a_short_gap_belongs_to_the_next_interval_and_a_long_one_is_unknown() -> None:
    a = extend(Account(), [iv(0, 10, "productive", step=1)])
    slack = extend(a, [iv(10 + GAP_ABSORBED_S / 2, 12, "productive", step=2)])
    assert slack.productive == 12 and slack.lost["unknown"] == 0
    hole = extend(a, [iv(15, 16, "productive", step=2)])
    assert hole.lost["unknown"] == 5 and hole.productive == 11 and parts_add_up(hole)
    assert hole.faults == ()  # nobody said what it was: lost, but no fault to name


def test_an_in_place_join_is_one_fault_of_its_own_cause() -> None:
    a = extend(Account(), [iv(0, 10, "productive", step=5)])
    a = extend(a, [iv(10, 10.2, "join", reason="scale_up", nodes=("c",)),
                   iv(10.2, 10.4, "join", reason="scale_up", nodes=("c",)), iv(10.4, 12, "productive", step=6)])
    (fault,) = a.faults
    assert fault.reason == "scale_up" and fault.phases == pytest.approx({"join": 0.4})
    assert a.lost["join"] == pytest.approx(0.4) and parts_add_up(a)


def test_snapshot_stalls_neither_open_nor_close_a_fault() -> None:
    a = extend(Account(), [iv(0, 1, "productive", step=1), iv(1, 1.1, "snapshot"), iv(1.1, 2, "productive", step=2)])
    assert a.faults == () and a.lost["snapshot"] == pytest.approx(0.1)
    a = extend(a, [iv(None, 3, "detection"), iv(3, 4, "restore"), iv(4, 5, "recompute", step=2),
                   iv(5, 5.2, "snapshot"), iv(5.2, 6, "recompute", step=2), iv(6, 7, "productive", step=3)])
    (fault,) = a.faults
    assert fault.phases["recompute"] == pytest.approx(1.8)  # both sides of the stall


def test_a_second_fault_during_the_redo_of_the_first_is_a_fault_of_its_own() -> None:
    a = extend(Account(), [iv(0, 10, "productive", step=10), iv(None, 11, "detection"), iv(11, 12, "restore"),
                           iv(12, 13, "recompute", step=9), iv(13, 14, "detection", reason="hang", nodes=("a",)),
                           iv(14, 15, "restore"), iv(15, 17, "recompute", step=10), iv(17, 18, "productive", step=11)])
    assert [f.at for f in a.faults] == [10, 13]
    assert a.faults[1].reason == "hang" and a.faults[1].phases["recompute"] == 2


def test_unknown_steps_of_a_plain_script_are_lost_but_are_no_fault() -> None:
    a = extend(Account(), [iv(0, 10, "productive"), iv(10, 20, "unknown", step=3)])
    assert a.lost["unknown"] == 10 and a.faults == ()
    # after a restart they end the fault, as productive steps would: the next one is its own
    a = extend(a, [iv(None, 21, "detection", reason="peer_lost", nodes=("b",)), iv(21, 22, "worker_start"),
                   iv(22, 25, "unknown", step=2), iv(None, 26, "detection", reason="peer_lost", nodes=("c",))])
    assert [(f.nodes, f.phases) for f in a.faults] == [(("b",), {"detection": 1, "worker_start": 1}),
                                                       (("c",), {"detection": 1})]
    assert a.high_water == -1  # a process's own step count is no job step


def test_only_the_newest_faults_are_kept_and_the_totals_keep_every_second() -> None:
    intervals = [iv(0, 1, "productive", step=1)]
    for i in range(MAX_FAULTS + 5):
        t = 1 + 2 * i
        intervals += [iv(t, t + 1, "detection"), iv(t + 1, t + 2, "productive", step=i + 2)]
    a = extend(Account(), intervals)
    assert len(a.faults) == MAX_FAULTS and a.faults[-1].at == 1 + 2 * (MAX_FAULTS + 4)
    assert a.lost["detection"] == MAX_FAULTS + 5 and parts_add_up(a)


def test_what_a_write_added_is_never_negative() -> None:
    old = extend(Account(), [iv(0, 10, "productive", step=1)])
    new = extend(old, [iv(10, 11, "detection"), iv(11, 12, "productive", step=2)])
    productive, lost = added(new, old)
    assert productive == 1 and lost["detection"] == 1 and set(lost) == set(LOST_CAUSES)
    assert added(old, new) == (0.0, {c: 0.0 for c in LOST_CAUSES})  # a record handed in backwards


def test_the_record_round_trips_through_json_and_refuses_what_is_not_one() -> None:
    a = extend(Account(), [iv(0, 10, "productive", step=4), iv(None, 11, "detection", reason="peer_lost",
                                                               nodes=("b",)), iv(11, 12, "productive", step=5)])
    assert Account.from_json(a.to_json()) == a
    for bad in (b"{}", b'{"v": 2}', b"[]", b"not json"):
        with pytest.raises(ValueError):
            Account.from_json(bad)
    with pytest.raises(ValueError):
        Interval.from_row([0, 1, "holiday", None, "", []])


def test_faults_nobody_named_are_named_from_another_agents_note() -> None:
    a = extend(Account(), [iv(0, 10, "productive", step=1), iv(None, 11, "detection", reason="reform"),
                           iv(11, 12, "restore"), iv(12, 13, "productive", step=2)])
    notes = {"b": ("worker_failed", 10.3), "c": ("worker_failed", 100.0), "d": ("peer_lost", 10.1)}
    named = name_faults(a, notes, since=0)
    assert (named.faults[0].reason, named.faults[0].nodes) == ("worker_failed", ("b",))
    peer = extend(Account(), [iv(0, 10, "productive"), iv(None, 11, "detection", reason="peer_lost", nodes=("x",))])
    assert name_faults(peer, notes, since=0) == peer  # already named by what the worker saw


def test_a_fault_keeps_the_first_name_it_is_given() -> None:
    f = extend(Account(), [iv(0, 1, "productive"), iv(None, 2, "worker_start"),
                           iv(2, 3, "restore", reason="scale_up", nodes=("c",)),
                           iv(3, 4, "restore", reason="peer_lost", nodes=("d",))]).faults[0]
    assert f == Fault(at=1, reason="scale_up", nodes=("c",), phases={"worker_start": 1, "restore": 2})
