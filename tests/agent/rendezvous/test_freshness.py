"""Freshness rules: a signed value put back later (a replay) is stale, never a decision."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agent.etcd.mirror import Entry
from agent.rendezvous.freshness import NO_LEASE, lease_stale, round_order, round_stale
from agent.rendezvous.keepout import KeepOut, ReachReport
from agent.rendezvous.reachability import Reachability
from agent.rendezvous.signing import StateSigner

KEY = b"k" * 32
RUN = "/elastic/fresh"
LEASE = 0x6A3B1C2D


def test_a_value_held_by_no_lease_is_stale() -> None:
    assert lease_stale(NO_LEASE) is not None
    assert lease_stale(NO_LEASE, LEASE) is not None
    assert "replay" in (lease_stale(NO_LEASE) or "")


def test_a_value_under_another_lease_than_it_names_is_stale() -> None:
    assert lease_stale(LEASE + 1, LEASE) is not None
    assert lease_stale(LEASE, LEASE) is None
    assert lease_stale(LEASE) is None, "a key that names no lease is current while any lease holds it"


def test_round_records_only_move_forward() -> None:
    assert round_order(3, False) < round_order(3, True) < round_order(4, False)
    assert not round_stale(None, round_order(0, False))
    assert not round_stale(round_order(3, True), round_order(3, True)), "the same record again is current"
    assert not round_stale(round_order(3, True), round_order(4, False))
    assert round_stale(round_order(3, True), round_order(3, False)), "open after closed: put back"
    assert round_stale(round_order(4, False), round_order(3, True))


@pytest.mark.parametrize("record", [KeepOut("a", 2, 10.0, ("b",), lease=LEASE), ReachReport("a", 3, ("b",), lease=LEASE)])
def test_the_lease_is_part_of_the_signed_record(record: KeepOut | ReachReport) -> None:
    assert type(record).from_json(record.to_json()) == record
    assert type(record).from_json(replace(record, lease=0).to_json()).lease == 0


@pytest.mark.parametrize("bad", ["1", -1, True, 2**64, 1.5])
def test_a_lease_that_is_not_an_id_is_refused(bad: object) -> None:
    raw = KeepOut("a", 1, 5.0).to_json().replace(b'"lease": 0', f'"lease": {__import__("json").dumps(bad)}'.encode())
    with pytest.raises(ValueError):
        KeepOut.from_json(raw)


def _reach(node: str = "me") -> Reachability:
    return Reachability(node, None, StateSigner(KEY), None, RUN) # reading only


def _entry(reach: Reachability, key: str, record: KeepOut | ReachReport, lease: int, revision: int = 7) -> Entry:
    return Entry(reach.signer.seal(key.encode(), record.to_json()), revision, revision, lease)


def test_a_keep_out_counts_only_under_the_lease_its_writer_signed(caplog: pytest.LogCaptureFixture) -> None:
    reach, key = _reach(), f"{RUN}/keepout/b"
    out = KeepOut("b", 1, 5.0, ("a",), lease=LEASE)
    assert set(reach.keep_outs({key: _entry(reach, key, out, LEASE)})) == {"b"}
    assert reach.keep_outs({key: _entry(reach, key, out, NO_LEASE, 8)}) == {}, "the same bytes put back without a lease"
    assert reach.keep_outs({key: _entry(reach, key, out, LEASE + 1, 9)}) == {}, "put back under the replayer's lease"
    assert reach.keep_outs({key: _entry(reach, key, replace(out, lease=0), NO_LEASE, 10)}) == {}, "an old format"
    assert sum("stale" in r.getMessage() and key in r.getMessage() for r in caplog.records) == 3


def test_a_stale_value_is_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    reach, key = _reach(), f"{RUN}/keepout/b"
    entry = _entry(reach, key, KeepOut("b", 1, 5.0, lease=LEASE), NO_LEASE)
    for _ in range(5):
        reach.keep_outs({key: entry})
    assert sum("stale" in r.getMessage() for r in caplog.records) == 1


def test_a_reach_report_counts_only_for_its_round_and_under_its_lease() -> None:
    reach, key = _reach(), f"{RUN}/reach/b"
    report = ReachReport("b", 3, ("c",), lease=LEASE)
    assert reach.reports({key: _entry(reach, key, report, LEASE)}, 3) == [report]
    assert reach.reports({key: _entry(reach, key, report, LEASE)}, 4) == [], "another round's"
    assert reach.reports({key: _entry(reach, key, report, NO_LEASE)}, 3) == []


def test_a_keep_out_names_the_round_it_went_out_of() -> None:
    out = KeepOut("b", 1, 5.0, round=12, lease=LEASE)
    assert KeepOut.from_json(out.to_json()).round == 12
    assert KeepOut.from_json(KeepOut("b", 1, 5.0).to_json()).round == -1, "unknown: no member stops for it"
    with pytest.raises(ValueError):
        KeepOut.from_json(out.to_json().replace(b'"round": 12', b'"round": "12"'))


def test_a_node_tells_its_own_last_record_from_an_older_one_put_back() -> None:
    from agent.rendezvous.registry import NodeLease

    lease = NodeLease.__new__(NodeLease)  # only its memory of its writes is under test
    lease._last_write, lease._writing = (10, b"latest"), b""
    assert lease.ours(10, b"latest") and lease.ours(9, b"older"), "a mirror behind its own write"
    assert lease.ours(12, b"latest"), "the same bytes again change nothing"
    assert not lease.ours(12, b"older"), "an older record of its own, put back after its last write"
    lease._writing = b"next"
    assert lease.ours(13, b"next"), "its write in flight"
