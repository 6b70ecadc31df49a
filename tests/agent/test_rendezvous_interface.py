"""The agent's one interface to its rendezvous (agent/node/rendezvous_api.py), etcd-v3's side of it
(agent/rendezvous/agent_side.py) and the null parts (agent/node/nulls.py)."""

from __future__ import annotations

import inspect
import re
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

from agent.etcd import EmbeddedEtcd
from agent.node import nulls
from agent.node.commands import CommandWatch
from agent.node.fork_server import ForkServer
from agent.node.freeze import FreezeWatch
from agent.node.goodput import GoodputAccountant, NoGoodput
from agent.node.pace import PaceMonitor
from agent.node.policy import Action, Observation, Reason, decide
from agent.node.rendezvous_api import Round, TorchRendezvous
from agent.node.states import NodeState, RoundCause
from agent.rendezvous import create_handler
from agent.rendezvous.agent_side import agent_rendezvous
from agent.node.channel import AgentChannel
from tests.support.waiting import wait_until

AGENT = Path(__file__).resolve().parents[2] / "agent" / "node"


class _Static(RendezvousHandler):
    """A torch handler that always forms the same world of two, this node second."""

    def __init__(self) -> None:
        self.waiting = 0

    def get_backend(self) -> str:
        return "static"

    def next_rendezvous(self) -> RendezvousInfo:
        return RendezvousInfo(HashStore(), 1, 2, RendezvousStoreInfo("10.0.0.1", 29500))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return self.waiting

    def get_run_id(self) -> str:
        return "r"

    def shutdown(self) -> bool:
        return True


def test_any_torch_handler_gives_numbered_rounds_and_nothing_it_cannot_do() -> None:
    handler = _Static()
    rdzv = agent_rendezvous(handler, "b", nproc=4, in_place=True)
    assert isinstance(rdzv, TorchRendezvous) and not rdzv.in_place and not rdzv.can_keep_out
    first = rdzv.next_round(RoundCause.JOIN, Round(world_size=4))
    second = rdzv.next_round(RoundCause.FAILURE, first, offered=True)
    assert (first.number, second.number) == (0, 1)
    assert (second.group_rank, second.group_world, second.rank_base, second.world_size) == (1, 2, 4, 8)
    assert (second.master_addr, second.master_port, second.offer) == ("10.0.0.1", 29500, None)
    with pytest.raises(AttributeError):
        second.number = 5  # a frozen record
    assert rdzv.membership(second) == (None, [])
    handler.waiting = 1
    assert rdzv.membership(second) == (Reason.SCALE_UP, [])
    assert rdzv.peer_crashes(second) is None and rdzv.etcd_lost({"run": "r"}, "r") == ""
    assert rdzv.lease_health().due_in is None and rdzv.peers() == {}
    for absent in (rdzv.pace_monitor(None, None, None), rdzv.freeze_watch(None), rdzv.command_watch("")):
        assert type(absent).__module__ == "agent.node.nulls"
    assert isinstance(rdzv.goodput(Path("g"), Path("h"), CollectorRegistry()), NoGoodput)


@pytest.mark.parametrize("null, real", [(nulls.NoPace, PaceMonitor), (nulls.NoFreeze, FreezeWatch),
                                        (nulls.NoCommands, CommandWatch), (nulls.NoChannel, AgentChannel),
                                        (nulls.NoPool, ForkServer), (NoGoodput, GoodputAccountant)])
def test_every_null_part_answers_what_the_agent_asks_of_the_real_one(null: type, real: type) -> None:
    for name, method in vars(null).items():
        if name.startswith("_") or not callable(method):
            continue
        assert hasattr(real, name), f"{real.__name__} has no {name}: the null part answers a call nobody makes"
        ours = list(inspect.signature(method).parameters)
        theirs = list(inspect.signature(getattr(real, name)).parameters)
        assert ours == theirs[: len(ours)], f"{null.__name__}.{name}{ours} vs {real.__name__}.{name}{theirs}"


def test_the_agent_reaches_its_rendezvous_only_through_the_interface() -> None:
    """No field of a handler is read or written in the loop's modules (node_agent keeps the
    handler only for torch's WorkerSpec and the workers' TORCHELASTIC_USE_AGENT_STORE)."""
    for name in ("node_agent", "acts", "observer", "reporting", "spare_ahead", "preemption"):
        text = (AGENT / f"{name}.py").read_text()
        for line in text.splitlines():
            if re.search(r"\bhandler\.|\.ours\b|\.handler\.", line):
                assert name == "node_agent" and "use_agent_store" in line, f"{name}: {line.strip()}"
        assert " is None" not in re.sub(r"#.*", "", "\n".join(
            line for line in text.splitlines() if re.search(r"self\.(pace|freeze|commands|channel|pool|ours)\b", line)))


def test_no_module_of_the_node_agent_knows_the_etcd_handler() -> None:
    """The watches get a narrow session (agent/rendezvous/session.py), the loop an
    ``AgentRendezvous`` and the launcher a ``HandlerSide`` (agent/node/rendezvous_api.py, the
    interface), both made by agent/rendezvous/agent_side.py: no module of ``agent/node``
    names the etcd-v3 handler class, and none but the interface reaches into a handler
    (``._handler``, ``handler.``)."""
    for path in sorted(AGENT.glob("*.py")):
        code = re.sub(r"#.*", "", path.read_text())
        assert "EtcdV3RendezvousHandler" not in code, f"{path.name} names the etcd-v3 handler"
        if path.stem == "rendezvous_api":
            continue  # the generic implementation drives torch's handler
        for line in code.splitlines():
            assert not re.search(r"\._handler\b|\bhandler\.\w|\.handler\.\w", line), f"{path.name}: {line.strip()}"


def _in_place_pair(etcd: EmbeddedEtcd, run_id: str, nprocs: dict[str, int]) -> tuple[list[Any], list[socket.socket]]:
    """Two in-place agents' rendezvous (``nprocs``: name -> its process count, in start order)
    over real etcd, each attached with a listening store port (a live agent's port answers
    its peers' probe); the caller closes the handlers and the sockets."""
    params = lambda name: RendezvousParameters(  # noqa: E731
        "etcd-v3", etcd.endpoint, run_id, 1, 2, node_name=name, lease_ttl="5", last_call_timeout="0.1")
    nodes = [agent_rendezvous(create_handler(params(n)), n, nproc=count, in_place=True) for n, count in nprocs.items()]
    stores = [socket.create_server(("127.0.0.1", 0)) for _ in nodes]
    for node, store in zip(nodes, stores):
        node.attach(advertise_host="127.0.0.1", metrics_url=None, store_addr=f"127.0.0.1:{store.getsockname()[1]}",
                    on_etcd_error=lambda kind: None, wake=lambda: None, on_keep_out=lambda out: None,
                    while_spare=lambda: None)
    return nodes, stores


def test_every_member_of_an_in_place_round_agrees_whether_it_joins_a_live_world(
        etcd_server: EmbeddedEtcd, run_id: str) -> None:
    """Node b formed the job alone; its workers had not yet said they run in place when
    node a arrived, and said so just after the round closed, before a read it. Both must
    read the round alike: it forms afresh (a starts its workers fresh, b starts its own
    again in it). The agents once read the registry each for itself, a moment apart, took
    the round for a fresh one on one side and an in-place one on the other, and each
    waited for the other's kind of start: every round failed after 30 s."""
    (b, a), stores = _in_place_pair(etcd_server, run_id, {"b": 1, "a": 1})
    try:
        first = b.next_round(RoundCause.JOIN, Round(world_size=1))
        assert first.participants == ("b",) and not first.live_world and first.fresh_world
        b.publish(in_place=False)  # its workers have not said they run in place yet

        def b_trains_now(record: Any) -> None:  # as round 1 closes: b's workers say they run in place
            b.publish(in_place=True)
            wait_until(lambda: a.peers()["b"].extra.get("in_place") is True, 10, "a to see b's new word")

        a._handler.on_round.append(b_trains_now)
        results: dict[str, Any] = {}
        joiner = threading.Thread(target=lambda: results.update(a=a.next_round(RoundCause.JOIN, Round())), daemon=True)
        joiner.start()
        joined = f"/elastic/{run_id}/rdzv/join/1/a"
        wait_until(lambda: joined in a._handler.mirror.entries()[0], 30, "a to open round 1")
        results["b"] = b.next_round(RoundCause.JOIN, first, offered=True)
        joiner.join(timeout=30)
        ra, rb = results["a"], results["b"]
        assert ra.number == rb.number == 1 and ra.participants == rb.participants == ("b", "a")
        assert rb.offer is not None and ra.offer is not None
        assert not ra.live_world and rb.fresh_world, (ra, rb)  # both: a fresh world, whatever was said after
        # once b's workers ran in place at a close, a later round forms in place, for both alike
        again = threading.Thread(target=lambda: results.update(a2=a.next_round(RoundCause.FAILURE, ra, offered=True)),
                                 daemon=True)
        a._handler.on_round.clear()
        again.start()
        results["b2"] = b.next_round(RoundCause.FAILURE, rb, offered=True)
        again.join(timeout=30)
        assert results["a2"].live_world and results["b2"].live_world and not results["b2"].fresh_world
    finally:
        for node in (a, b):
            node._handler.close()
        for store in stores:
            store.close()


def test_a_joiner_whose_mirror_has_not_read_its_peers_yet_still_hands_its_workers_the_round(
        etcd_server: EmbeddedEtcd, run_id: str) -> None:
    """A node that has just started reads every peer's registry key on demand, and that first
    read can lag behind the round it joins (or fail and be retried in the background). Its
    in-place workers need the round's offer (every member's process count, the first
    member's store address): without one they waited for an offer that never came, while the
    others waited for them (a chaos run's returning node, wedged 150 s). The lag is made by
    emptying the joiner's mirror-fed view of the records (a timing that cannot be forced
    otherwise); the records in etcd are real."""
    (b, a), stores = _in_place_pair(etcd_server, run_id, {"b": 2, "a": 1})
    try:
        first = b.next_round(RoundCause.JOIN, Round(world_size=2))
        b.publish(in_place=True)
        a._handler.node_records = lambda: {}  # its mirror has read nothing yet
        results: dict[str, Any] = {}
        joiner = threading.Thread(target=lambda: results.update(a=a.next_round(RoundCause.JOIN, Round())), daemon=True)
        joiner.start()
        wait_until(lambda: f"/elastic/{run_id}/rdzv/join/1/a" in b._handler.mirror.entries()[0], 30, "a to open round 1")
        results["b"] = b.next_round(RoundCause.JOIN, first, offered=True)
        joiner.join(timeout=30)
        offer = results["a"].offer
        assert offer is not None, "the joiner's workers got no offer: they would wait for ever"
        assert (offer.round, offer.participants, offer.nprocs) == (1, ("b", "a"), (2, 1))
        assert (offer.rank_base, offer.world_size) == (2, 3) == (results["a"].rank_base, results["a"].world_size)
        assert offer.store == f"127.0.0.1:{stores[0].getsockname()[1]}"  # b's: the round's first member hosts it
    finally:
        for node in (a, b):
            node._handler.close()
        for store in stores:
            store.close()


def test_a_node_whose_workers_finished_says_so_before_its_exit_barrier_and_a_joiner_stops_at_once(
        etcd_server: EmbeddedEtcd, run_id: str) -> None:
    """Node b's workers trained the last step just as node a came back and joined a round with
    it. b waits in its exit barrier for a, whose workers wait for a world b's workers will
    never form: a's agent must hear the job's end from its mirror then, not when b leaves the
    barrier (30 s later: every ``elastic local`` run whose killed node came back at the end
    waited out the round's store timeout)."""
    params = lambda name: RendezvousParameters(  # noqa: E731
        "etcd-v3", etcd_server.endpoint, run_id, 1, 2, node_name=name, lease_ttl="5", last_call_timeout="0.1")
    b, a = (agent_rendezvous(create_handler(params(n)), n, nproc=1, in_place=True) for n in ("b", "a"))
    stores = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    for node, store in zip((b, a), stores):
        node.attach(advertise_host="127.0.0.1", metrics_url=None, store_addr=f"127.0.0.1:{store.getsockname()[1]}",
                    on_etcd_error=lambda kind: None, wake=lambda: None, on_keep_out=lambda out: None,
                    while_spare=lambda: None)
    barrier: threading.Thread | None = None
    try:
        first = b.next_round(RoundCause.JOIN, Round(world_size=1))
        results: dict[str, Any] = {}
        joiner = threading.Thread(target=lambda: results.update(a=a.next_round(RoundCause.JOIN, Round())), daemon=True)
        joiner.start()
        wait_until(lambda: f"/elastic/{run_id}/rdzv/join/1/a" in a._handler.mirror.entries()[0], 30,
                   "a to open round 1")
        results["b"] = b.next_round(RoundCause.JOIN, first, offered=True)
        joiner.join(timeout=30)
        joined = results["b"]
        assert a.job_ended() is None  # nothing ended yet
        b.publish(state=NodeState.SUCCEEDED)  # as Acts.succeed does, in its order
        b.announce_finished()
        barrier = threading.Thread(target=b.exit_barrier, args=(joined, 30.0), daemon=True)
        barrier.start()
        wait_until(lambda: a.job_ended() is not None, 10, "a's mirror to show the job's end while b is in its barrier")
        ended = a.job_ended()
        assert ended is not None and not ended.failed and "node b" in ended.line and barrier.is_alive(), ended
        joining = Observation(exits={0: None}, in_place=True, restarts_left=3, job_ended=ended, in_world=False)
        assert decide(joining).action is Action.END  # a's workers, still joining, stop now
    finally:
        for node in (a, b):
            node._handler.close()
        for store in stores:
            store.close()
        if barrier is not None:
            barrier.join(timeout=35)


def test_a_round_counts_the_other_members_as_its_list_of_them_does() -> None:
    current = Round(participants=("a", "b", "c"))
    assert [current.count_others(n) for n in ("a", "z")] == [len(current.others("a")), len(current.others("z"))] == [2, 3]


def test_the_states_the_rendezvous_writes_are_the_agents_enums_as_plain_strings() -> None:
    """One spelling (agent.rendezvous.states, re-exported by agent.node.states), written as its
    value: an enum member hashes by its name and would miss a set of strings."""
    from agent.node import states
    from agent.rendezvous.registry import NodeRecord
    from agent.rendezvous.rounds import FAILURE, JOIN, ON_THEIR_WAY

    assert states.NodeState is NodeState and states.RoundCause is RoundCause
    assert type(NodeRecord(node="a", host="h", pid=1).state) is str and all(type(s) is str for s in ON_THEIR_WAY)
    assert ON_THEIR_WAY == {NodeState.STOPPING.value, NodeState.RENDEZVOUS.value}
    assert (JOIN, FAILURE) == (RoundCause.JOIN.value, RoundCause.FAILURE.value)
