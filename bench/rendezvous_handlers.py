"""What the rendezvous benches ask of a handler, ours or torch's c10d one, in one place.

``bench/rendezvous_scale.py`` (a process per node) and ``bench/rendezvous_sim.py`` (many
participants per process) both report the round each node holds and its size; torch's
``DynamicRendezvousHandler`` keeps it in a private state holder, read here only.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousHandler

from agent.rendezvous import EtcdV3RendezvousHandler


def held_round(handler: RendezvousHandler) -> tuple[int, int]:
    """(round, world size) this node holds, after its ``next_rendezvous`` returned."""
    if isinstance(handler, EtcdV3RendezvousHandler):
        assert handler.round is not None
        return handler.round.round, len(handler.round.participants)
    state = handler._state_holder.state  # type: ignore[attr-defined]  # torch's dynamic handler
    return state.round, len(state.participants)
