"""The agent's one interface to its rendezvous (agent/node/rendezvous_api.py) and its null parts (agent/node/nulls.py)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import RendezvousHandler
from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

from agent.node import nulls
from agent.node.commands import CommandWatch
from agent.node.fork_server import ForkServer
from agent.node.freeze import FreezeWatch
from agent.node.pace import PaceMonitor
from agent.node.policy import Reason
from agent.node.rendezvous_api import Round, TorchRendezvous, agent_rendezvous
from agent.node.states import RoundCause
from elastic.inplace.channel import AgentChannel

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
        second.number = 5  # type: ignore[misc]  # a frozen record
    assert rdzv.membership(second) == (None, [])
    handler.waiting = 1
    assert rdzv.membership(second) == (Reason.SCALE_UP, [])
    assert rdzv.peer_crashes(second) is None and rdzv.etcd_lost({"run": "r"}, "r") == ""
    assert rdzv.lease_health().due_in is None and rdzv.peers() == {}
    for absent in (rdzv.pace_monitor(None, None, None), rdzv.freeze_watch(None), rdzv.command_watch("")):
        assert type(absent).__module__ == "agent.node.nulls"


@pytest.mark.parametrize("null, real", [(nulls.NoPace, PaceMonitor), (nulls.NoFreeze, FreezeWatch),
                                        (nulls.NoCommands, CommandWatch), (nulls.NoChannel, AgentChannel),
                                        (nulls.NoPool, ForkServer)])
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
