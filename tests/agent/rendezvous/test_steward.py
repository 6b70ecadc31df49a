"""What a member hears per round: the round record and its own keys, not every peer's (issue 53).

Real etcd, real handlers in one process (as bench/rendezvous_sim.py runs them, at a thousand).
"""

from __future__ import annotations

import threading

from torch.distributed.elastic.rendezvous import RendezvousParameters

from agent.etcd import EmbeddedEtcd
from agent.rendezvous import EtcdV3RendezvousHandler, create_handler
from agent.rendezvous.handler import NEW_ROUND, PEER_LOST
from agent.rendezvous.rounds import CLOSED, FAILURE, OPEN, RoundRecord
from tests.support.waiting import wait_until


def _form(handlers: list[EtcdV3RendezvousHandler]) -> dict[str, int]:
    worlds: dict[str, int] = {}
    errors: list[BaseException] = []

    def one(h: EtcdV3RendezvousHandler) -> None:
        try:
            worlds[h.node] = h.next_rendezvous().world_size
        except BaseException as exc:  # noqa: BLE001 - the test asserts on it
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return worlds


def _steward_of(handlers: list[EtcdV3RendezvousHandler]) -> list[EtcdV3RendezvousHandler]:
    return [h for h in handlers if h.steward.holding() is not None]


def test_a_member_hears_only_the_round_record_and_a_lost_peer_reaches_it_through_it(
        etcd_server: EmbeddedEtcd, run_id: str) -> None:
    """One steward slot, four nodes: the three others never read a peer's registry or join key,
    and hold the round anyway; a non-steward's loss reaches them as PEER_LOST (the steward opens
    the next round naming it), then the steward's own loss is survived (another takes its slot)."""
    params = lambda name: RendezvousParameters(  # noqa: E731
        "etcd-v3", etcd_server.endpoint, run_id, 2, 4, node_name=name, lease_ttl="2", stewards="1",
        last_call_timeout="0.5")
    handlers = [create_handler(params(f"n{i}")) for i in range(4)]
    try:
        assert _form(handlers) == {f"n{i}": 4 for i in range(4)}
        wait_until(lambda: len(_steward_of(handlers)) == 1, 10, "one steward")
        steward = _steward_of(handlers)[0]
        members = [h for h in handlers if h is not steward]
        for h in members:
            keys = set(h.narrow.entries()[0])
            peers = {k for k in keys if "/nodes/" in k and not k.endswith(f"/{h.node}")} | \
                {k for k in keys if "/rdzv/join/" in k}
            assert not peers, f"{h.node} hears its peers' keys: {sorted(peers)}"
            assert not h.mirror.begun, f"{h.node} read the whole run although it stewards nothing"
            assert h.round is not None and h.round.witnesses and all(h.round.witnesses)
        # a crash report (the agent's script-error judgement) is read as etcd holds it the moment
        # after it was written, by a member that watches no peer's key
        reporter, reader = members[0], members[1]
        reporter.lease.update(extra={**reporter.lease.record.extra, "crash": "NameError: x"})
        assert reader.node_records_now()[reporter.node].extra.get("crash") == "NameError: x"
        assert not reader.mirror.begun

        lost, survivors = members[0], [steward, *members[1:]]
        lost.close()  # its lease revoked: a peer gone
        wait_until(lambda: all(h.restart_reason() == PEER_LOST for h in survivors), 20,
                   "every survivor to read the loss from the round record")
        record = survivors[0].view.decode_round(survivors[0].narrow.entries()[0])
        assert record is not None and record.state == OPEN and record.cause == FAILURE and record.lost == (lost.node,)
        assert _form(survivors) == {h.node: 3 for h in survivors}

        steward.close()  # the steward itself: its slot frees with its lease
        rest = members[1:]
        wait_until(lambda: len(_steward_of(rest)) == 1, 20, "another node to take the free slot")
        wait_until(lambda: all(h.restart_reason() == PEER_LOST for h in rest), 20, "the steward's loss read")
        assert _form(rest) == {h.node: 2 for h in rest}
    finally:
        for h in handlers:
            h.close()


def test_a_newcomer_is_a_new_round_not_a_lost_peer(etcd_server: EmbeddedEtcd, run_id: str) -> None:
    params = lambda name: RendezvousParameters(  # noqa: E731
        "etcd-v3", etcd_server.endpoint, run_id, 2, 3, node_name=name, lease_ttl="2", last_call_timeout="0.3")
    a, b, c = (create_handler(params(n)) for n in "abc")
    try:
        assert _form([a, b]) == {"a": 2, "b": 2}
        joiner = threading.Thread(target=c.next_rendezvous, daemon=True)
        joiner.start()
        wait_until(lambda: a.restart_reason() == NEW_ROUND and b.restart_reason() == NEW_ROUND, 20,
                   "the members to see the newcomer's round")
        assert _form([a, b]) == {"a": 3, "b": 3}
        joiner.join(30)
    finally:
        for h in (a, b, c):
            h.close()


def test_the_round_record_carries_lost_members_and_witnesses_and_refuses_a_mismatch() -> None:
    closed = RoundRecord(4, OPEN, previous=("a", "b")).closed_with(["a", "b"], (), {"a": "h:1", "b": None})
    assert closed.state == CLOSED and closed.witness_of() == {"a": "h:1", "b": None}
    assert RoundRecord.from_json(closed.to_json()) == closed
    opened = closed.next_open(FAILURE, ["b"])
    assert RoundRecord.from_json(opened.to_json()).lost == ("b",)
    assert RoundRecord.from_json(b'{"round": 1, "state": "open"}').lost == ()  # written before either existed
    try:
        RoundRecord.from_json(b'{"round": 1, "state": "closed", "participants": ["a"], "witnesses": ["x", "y"]}')
    except ValueError as exc:
        assert "witnesses" in str(exc)
    else:
        raise AssertionError("two witnesses for one participant were accepted")
