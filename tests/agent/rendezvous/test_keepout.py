"""Which nodes a failed round's reachability reports keep out, and for how long. Pure."""

from __future__ import annotations

import pytest

from agent.rendezvous.keepout import (
    BACKOFF_CAP_S, KeepOut, ReachReport, backoff, broken_pairs, choose_kept_out, next_strikes,
)

ABC = ("a", "b", "c")


def r(node: str, *unreachable: str, round_number: int = 4) -> ReachReport:
    return ReachReport(node, round_number, unreachable)


def test_a_node_cut_from_both_peers_is_kept_out_whoever_reported() -> None:
    everyone = [r("a", "c"), r("b", "c"), r("c", "a", "b")]
    assert choose_kept_out(ABC, everyone) == {"c"}
    assert choose_kept_out(ABC, [r("c", "a", "b")]) == {"c"}  # its own report alone says enough
    assert choose_kept_out(ABC, [r("a", "c"), r("b", "c")]) == {"c"}


def test_the_reported_node_is_more_suspect_than_its_reporter() -> None:
    # only a has reported so far, and c is rank 0: c still goes, not a
    assert choose_kept_out(("c", "a", "b"), [r("a", "c")]) == {"c"}


def test_two_nodes_cut_from_each_other_keep_the_earlier_one_in_round_order() -> None:
    assert choose_kept_out(("a", "b"), [r("a", "b"), r("b", "a")]) == {"b"}
    assert choose_kept_out(("b", "a"), [r("a", "b"), r("b", "a")]) == {"a"}  # rank 0 stays


def test_a_cut_between_two_of_three_removes_one_of_the_pair_only() -> None:
    assert choose_kept_out(ABC, [r("a", "c"), r("c", "a")]) == {"c"}


def test_everyone_cut_from_everyone_leaves_rank_0_alone() -> None:
    reports = [r("a", "b", "c"), r("b", "a", "c"), r("c", "a", "b")]
    assert choose_kept_out(ABC, reports) == {"b", "c"}


def test_reports_about_or_from_strangers_and_empty_reports_change_nothing() -> None:
    assert choose_kept_out(ABC, [r("a"), r("b"), r("c")]) == set()
    assert choose_kept_out(ABC, [r("x", "a"), r("a", "x")]) == set()
    assert broken_pairs(ABC, [r("a", "a")]) == set()


def test_the_backoff_doubles_up_to_its_cap_and_strikes_are_forgotten_after_a_long_stay() -> None:
    assert [backoff(s, base=5.0) for s in (1, 2, 3)] == [5.0, 10.0, 20.0]
    assert backoff(40) == BACKOFF_CAP_S
    assert next_strikes(0, None) == 1
    assert next_strikes(2, back_for=30.0) == 3
    assert next_strikes(2, back_for=3600.0) == 1


def test_records_round_trip_and_describe_themselves() -> None:
    report = r("c", "a", "b")
    assert ReachReport.from_json(report.to_json()) == report
    out = KeepOut("c", 2, 10.0, ("a", "b"))
    assert KeepOut.from_json(out.to_json()) == out
    assert out.describe() == "kept out: back-off 10 s (strike 2); cannot reach a, b"


def test_a_keep_out_for_a_crash_loop_says_its_cause_and_older_records_still_read() -> None:
    out = KeepOut("c", 1, 5.0, cause="local rank(s) [0] failed right after each of the last 3 starts: ValueError: x")
    assert KeepOut.from_json(out.to_json()) == out
    assert out.describe() == ("kept out: back-off 5 s (strike 1); local rank(s) [0] failed right after each of the "
                              "last 3 starts: ValueError: x")
    assert KeepOut.from_json(b'{"node": "c", "strikes": 1, "backoff": 5.0, "unreachable": []}').cause == ""
    with pytest.raises(ValueError):
        KeepOut.from_json(b'{"node": "c", "strikes": 1, "backoff": 5.0, "unreachable": [], "cause": 3}')
