"""The round protocol: pure closing rules, and the handler on a real etcd when a lease is lost mid-join."""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from agent.etcd import EmbeddedEtcd
from agent.rendezvous import create_handler
from agent.rendezvous.keepout import ReachReport
from agent.rendezvous.rounds import (CLOSED, FAILURE, JOIN, OPEN, RoundRecord, Timings, lost_members, rank_order,
                                     should_close, waits_as_spare)
from tests.support.waiting import wait_until

T = Timings(min_nodes=1, max_nodes=3, last_call=1.0, rejoin=0.5, stop_grace=30.0)
LATER = RoundRecord(5, OPEN, previous=("a", "b", "c"), cause=FAILURE)
JOINING = RoundRecord(5, OPEN, previous=("a", "b", "c"), cause=JOIN)


def test_first_round_waits_the_last_call_after_min_nodes() -> None:
    first = RoundRecord(0, OPEN)
    assert not should_close(first, {"a": 1}, {"a": "rendezvous", "b": "starting"}, T, waited=0.5)
    assert should_close(first, {"a": 1}, {"a": "rendezvous", "b": "starting"}, T, waited=1.0)
    assert should_close(first, {"a": 1, "b": 2, "c": 3}, {}, T, waited=0.0)  # max is in


def test_later_round_closes_as_soon_as_every_live_member_is_back() -> None:
    live = {"a": "rendezvous", "b": "rendezvous"}  # c's lease is gone
    assert should_close(LATER, {"a": 1, "b": 2}, live, T, waited=0.0)


def test_a_member_still_running_may_be_dead_and_gets_only_the_rejoin_timeout() -> None:
    live = {"a": "rendezvous", "b": "running"}  # b: SIGKILLed, lease not yet expired?
    assert not should_close(LATER, {"a": 1}, live, T, waited=0.3)
    assert should_close(LATER, {"a": 1}, live, T, waited=0.5)


def test_a_round_opened_for_a_join_waits_for_running_members_that_are_not_proven_dead() -> None:
    live = {"a": "running", "b": "running", "c": "running"}  # c joins; a and b train, their watches late
    assert not should_close(JOINING, {"c": 1}, live, T, waited=5.0)
    assert should_close(JOINING, {"c": 1, "a": 2, "b": 3}, live, T, waited=0.0)
    assert should_close(JOINING, {"c": 1, "a": 2}, live, T, waited=0.0, dead={"b"})
    assert should_close(JOINING, {"c": 1}, live, T, waited=30.0)  # unless they are wedged


def test_after_a_failure_a_running_member_that_vouched_for_itself_is_waited_for() -> None:
    live = {"a": "rendezvous", "b": "running", "c": "running"}  # the etcd leader died: b's watch is late
    assert not should_close(LATER, {"a": 1, "c": 3}, live, T, waited=5.0, vouched={"b"})
    assert should_close(LATER, {"a": 1, "c": 3, "b": 4}, live, T, waited=0.0, vouched={"b"})
    assert should_close(LATER, {"a": 1, "c": 3}, live, T, waited=0.5, vouched={"c"})  # b did not answer
    assert should_close(LATER, {"a": 1, "c": 3}, live, T, waited=30.0, vouched={"b"})  # unless it is wedged


def test_a_member_proven_dead_is_not_waited_for_although_its_lease_holds() -> None:
    live = {"a": "rendezvous", "b": "running", "c": "running"}  # b's agent refused a connect: SIGKILLed
    assert should_close(LATER, {"a": 1, "c": 3}, live, T, waited=0.0, dead={"b"})
    assert not should_close(LATER, {"a": 1}, live, T, waited=0.0, dead={"b"})  # c is only slow


def test_a_member_on_its_way_is_waited_for() -> None:
    live = {"a": "rendezvous", "b": "stopping"}
    assert not should_close(LATER, {"a": 1}, live, T, waited=5.0)
    assert should_close(LATER, {"a": 1}, live, T, waited=30.0)  # unless it is wedged


def test_below_min_nodes_never_closes() -> None:
    two = Timings(min_nodes=2, max_nodes=3, last_call=1.0, rejoin=0.5)
    assert not should_close(LATER, {"a": 1}, {"a": "rendezvous"}, two, waited=100.0)


def test_ranks_are_stable_and_newcomers_follow_in_join_order() -> None:
    assert rank_order({"c": 9, "a": 7, "x": 3, "w": 4}, ("c", "b", "a"), 4) == ["c", "a", "x", "w"]
    assert rank_order({"c": 9, "a": 7, "x": 3}, ("c", "b", "a"), 2) == ["c", "a"]


def test_a_node_beside_a_full_world_waits_as_a_spare_until_a_member_is_lost() -> None:
    full = RoundRecord(4, CLOSED, ("a", "b"))
    live = {"a": "running", "b": "running", "c": "rendezvous"}
    assert waits_as_spare(full, "c", 2, live)
    assert not waits_as_spare(full, "a", 2, live)  # a member
    assert not waits_as_spare(full, "c", 3, live)  # room left: c opens a round and joins (a scale-up)
    assert not waits_as_spare(RoundRecord(5, OPEN, previous=("a", "b")), "c", 2, live)  # joins the open round
    assert not waits_as_spare(None, "c", 2, live)
    gone = {"a": "running", "c": "spare"}  # b's lease expired: c opens the next round itself
    assert lost_members(full, gone) == ["b"] and not waits_as_spare(full, "c", 2, gone)
    assert lost_members(RoundRecord(5, OPEN, previous=("a", "b")), gone) == []


def test_a_spare_takes_the_lost_members_place_and_the_survivors_keep_their_ranks() -> None:
    joined = {"c": 10, "b": 11, "d": 12}  # a lost; spares c and d both joined, c first
    assert rank_order(joined, ("a", "b"), 2) == ["b", "c"]
    timings = Timings(min_nodes=2, max_nodes=2, last_call=1.0, rejoin=0.5)
    assert should_close(RoundRecord(5, OPEN, previous=("a", "b"), cause=FAILURE), {"b": 11, "c": 10},
                        {"b": "rendezvous", "c": "spare"}, timings, waited=0.0)  # full at once: no rejoin wait


def test_round_record_round_trips_through_json() -> None:
    closed = LATER.closed_with(["b", "a"])
    again = RoundRecord.from_json(closed.to_json())
    assert (again.round, again.state, again.participants, again.previous) == (5, CLOSED, ("b", "a"), ("a", "b", "c"))
    assert again.next_open().previous == ("b", "a")


def test_a_round_records_who_ran_in_place_at_its_close_and_refuses_strangers_in_that_list() -> None:
    closed = LATER.closed_with(["b", "a"], in_place={"b", "c"})  # c is not a member: it holds no place in it
    again = RoundRecord.from_json(closed.to_json())
    assert again.in_place == ("b",) and again.forms_in_place  # a's new workers join through its offer
    assert not LATER.closed_with(["b", "a"]).forms_in_place  # nobody ran in place: it forms afresh
    assert RoundRecord.from_json(b'{"round": 1, "state": "closed", "participants": ["a"]}').in_place == ()
    with pytest.raises(ValueError, match="outside the round"):
        RoundRecord.from_json(b'{"round": 1, "state": "closed", "participants": ["a"], "in_place": ["z"]}')


def test_a_node_whose_lease_is_lost_while_joining_joins_again(etcd_server: EmbeddedEtcd, run_id: str) -> None:
    """min = max = 2: the round cannot close without the node that lost its join key."""
    params = lambda name: RendezvousParameters(  # noqa: E731
        "etcd-v3", etcd_server.endpoint, run_id, 2, 2, node_name=name, lease_ttl="2")
    first, second = create_handler(params("first")), create_handler(params("second"))
    results: dict[str, int] = {}
    try:
        joiner = threading.Thread(target=lambda: results.update(first=first.next_rendezvous().world_size),
                                  daemon=True)
        joiner.start()
        join_key = f"/elastic/{run_id}/rdzv/join/0/first"
        wait_until(lambda: join_key in first.mirror.entries()[0], 30, "first to join round 0")
        lost = first.lease.lease_id()
        first.client.call(lambda c: c.revoke_lease(lost))  # what etcd does to a frozen node's lease
        wait_until(lambda: first.lease.generation == 1, 10, "first to notice its lease is gone")
        results["second"] = second.next_rendezvous().world_size
        joiner.join(timeout=30)
        assert results == {"first": 2, "second": 2}
    finally:
        first.close()
        second.close()


def test_a_spare_outlives_the_join_timeout_and_replaces_a_world_whose_every_member_died(
        etcd_server: EmbeddedEtcd, run_id: str) -> None:
    """--nnodes 1:1: nobody survives to open the next round, so the spare opens it itself; and
    waiting beside a full world is not a rendezvous that failed to complete (join_timeout)."""
    params = lambda name: RendezvousParameters(  # noqa: E731
        "etcd-v3", etcd_server.endpoint, run_id, 1, 1, node_name=name, lease_ttl="2", join_timeout="2")
    member, spare = create_handler(params("member")), create_handler(params("spare"))
    seen: list[bool] = []
    spare.on_spare.append(seen.append)
    results: dict[str, object] = {}
    try:
        assert member.next_rendezvous().world_size == 1
        waiter = threading.Thread(target=lambda: results.update(info=_try(spare.next_rendezvous)), daemon=True)
        waiter.start()
        wait_until(lambda: spare.node_records().get("spare") is not None
                   and spare.node_records()["spare"].state == "spare", 30, "the spare to say so in the registry")
        assert seen == [True]
        waiter.join(timeout=3.0)  # past join_timeout (2 s): still waiting, not failed
        assert waiter.is_alive() and not results, results
        member.close()  # its lease revoked: the world of one is gone
        waiter.join(timeout=30)
        info = results["info"]
        assert not isinstance(info, BaseException), info
        assert (info.rank, info.world_size) == (0, 1)
        assert spare.round is not None and spare.round.participants == ("spare",) and spare.round.cause == FAILURE
        assert seen == [True, False] and spare.spare_since is None
        assert spare.node_records()["spare"].state == "running"
    finally:
        member.close()
        spare.close()


def _try(call: Callable[[], object]) -> object:
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        return exc


def test_a_node_back_from_its_keep_out_waits_for_the_next_round_without_rewriting_its_join(
        etcd_server: EmbeddedEtcd, run_id: str, caplog: pytest.LogCaptureFixture) -> None:
    """Round 0 (a, b) failed and a could not reach b, so round 1 leaves b out. b sits out its
    back-off, reaches a again, and joins round 1, which still leaves it out (it waits for a
    third node). Its join key is there, only left out: it must wait for the next round, not
    take the key for lost and write it again (it once did, 2095 times in 13 s)."""
    params = lambda name: RendezvousParameters(  # noqa: E731
        "etcd-v3", etcd_server.endpoint, run_id, 2, 3, node_name=name, lease_ttl="5", last_call_timeout="0.1")
    a, b = create_handler(params("a")), create_handler(params("b"))
    stores = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]  # each agent's port answers probes
    for handler, store in zip((a, b), stores):
        handler.lease.update(store_addr=f"127.0.0.1:{store.getsockname()[1]}")
    results: dict[str, object] = {}
    try:
        first = threading.Thread(target=lambda: results.update(a0=a.next_rendezvous().world_size), daemon=True)
        first.start()
        results["b0"] = b.next_rendezvous().world_size
        first.join(30)
        assert results == {"a0": 2, "b0": 2}
        assert a.reachability.record(ReachReport("a", 0, ("b",))) is not False  # round 0 failed; a could not reach b
        threading.Thread(target=lambda: results.update(a1=_try(a.next_rendezvous)), daemon=True).start()
        wait_until(lambda: f"/elastic/{run_id}/rdzv/join/1/a" in a.mirror.entries()[0], 30, "a to open round 1")
        with caplog.at_level("INFO", logger="agent.rendezvous"):
            threading.Thread(target=lambda: results.update(b1=_try(b.next_rendezvous)), daemon=True).start()
            key = f"/elastic/{run_id}/rdzv/join/1/b"
            wait_until(lambda: key in b.mirror.entries()[0], 30, "b to sit out its back-off and join round 1")
            written = b.mirror.entries()[0][key].mod_revision
            # a spin writes the key again within milliseconds; a second shows it, or that it waits
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                assert b.mirror.entries()[0][key].mod_revision == written, "b wrote its join of round 1 again"
                time.sleep(0.01)
        assert "kept out of round 1" in caplog.text and "vanished" not in caplog.text, caplog.text
        assert "a1" not in results and "b1" not in results  # round 1 still waits for a second node it may take
    finally:
        a.close()
        b.close()
        for store in stores:
            store.close()


def test_a_round_that_lost_a_member_waits_a_moment_for_a_spare_on_its_way() -> None:
    """The survivors of a write-off joined at once (0.03 s); the spare had not seen the round
    yet, and the world shrank for a round (a whole suite under load). Below --nnodes MAX the
    round waits up to ``spare_join`` for a spare or newcomer that is not yet in."""
    live = {"a": "rendezvous", "b": "rendezvous", "d": "spare"}  # c lost: d waits as a spare
    assert not should_close(LATER, {"a": 1, "b": 2}, live, T, waited=0.1)
    assert should_close(LATER, {"a": 1, "b": 2, "d": 3}, live, T, waited=0.1)  # it took the place
    assert should_close(LATER, {"a": 1, "b": 2}, live, T, waited=T.spare_join)  # a wedged spare costs a moment
    assert should_close(LATER, {"a": 1, "b": 2}, live, T, waited=0.1, dead={"d"})
    assert should_close(LATER, {"a": 1, "b": 2}, {"a": "rendezvous", "b": "rendezvous"}, T, waited=0.0)  # none
    assert should_close(LATER, {"a": 1, "b": 2}, {**live, "d": "kept_out"}, T, waited=0.1)  # not on its way
