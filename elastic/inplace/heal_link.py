"""The network a heal's shards cross: the collectives' own group, or an interface the operator names.

A heal moves a whole replica's state (a sharded model's shards) from a survivor to a joiner.
By default it goes over the world's process group, so over the interface the collectives
use (``GLOO_SOCKET_IFNAME``, else the host name's address). Where a node has a faster link
for bulk transfers than the one its collectives use (torchft #329: a heal took 948 s over
Ethernet and about 20 s once the InfiniBand address was advertised),
``ELASTIC_HEAL_IFNAME=ib0`` sends heals over that interface: the ranks of one heal (senders
and receivers, the same set on every rank since the plan is) open a gloo group of their own
whose device is bound to that interface, through the round's store, move the state, and
close it. The state travels through host memory on that path (gloo), so on GPUs it suits a
link NCCL does not already use; with NCCL and no setting, heals ride NCCL as the collectives
do.

The heal group's sockets are handed to the world's socket fence (:mod:`.fence`), so a peer
frozen during a heal gets the others out at once, as in a step.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Protocol

import torch
import torch.distributed as dist

from .. import contract
from . import gloo_private

log = logging.getLogger("elastic.trainer")
_warned = False  # the fallback's warning, once per process


class Wire(Protocol):
    """Point-to-point sends and receives between world ranks (:mod:`.transfer` uses them)."""

    device: torch.device
    over: str  # for the heal's log line: "over eth1", "over gloo (eth0)"

    def send(self, tensor: torch.Tensor, dst: int) -> None: ...
    def recv(self, tensor: torch.Tensor, src: int) -> None: ...
    def isend(self, tensor: torch.Tensor, dst: int) -> Any: ...
    def irecv(self, tensor: torch.Tensor, src: int) -> Any: ...
    def close(self) -> None: ...


def heal_interface(env: Mapping[str, str] | None = None) -> str:
    """The interface heals go over, or "" for the collectives' own group."""
    return (os.environ if env is None else env).get(contract.HEAL_IFNAME_ENV, "").strip()


def collectives_link(backend: str, env: Mapping[str, str] | None = None) -> str:
    """A few words for the collectives' own network, as the heal's log line shows it."""
    env = os.environ if env is None else env
    if backend == "nccl":
        return "over nccl"
    named = env.get("GLOO_SOCKET_IFNAME", "").strip()
    return f"over gloo ({named})" if named else "over gloo (the host name's address)"


@dataclass
class GroupWire:
    """The world's own process group (the default)."""

    device: torch.device
    over: str

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        dist.recv(tensor, src)

    def isend(self, tensor: torch.Tensor, dst: int) -> Any:
        return dist.isend(tensor, dst)

    def irecv(self, tensor: torch.Tensor, src: int) -> Any:
        return dist.irecv(tensor, src)

    def close(self) -> None:
        pass  # the world's group outlives the heal


class InterfaceWire:
    """A gloo group of the heal's ranks only, its device bound to ``interface``."""

    def __init__(self, store: dist.Store, members: list[int], rank: int, interface: str, timeout: timedelta) -> None:
        self.device = torch.device("cpu")
        self.over = f"over {interface}"
        self._index = {r: i for i, r in enumerate(members)}
        self._group = gloo_private.group_on(store, self._index[rank], len(members), interface, timeout)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.isend(tensor, dst).wait()

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self.irecv(tensor, src).wait()

    def isend(self, tensor: torch.Tensor, dst: int) -> Any:
        return self._group.send([tensor], self._index[dst], 0)

    def irecv(self, tensor: torch.Tensor, src: int) -> Any:
        return self._group.recv([tensor], self._index[src], 0)

    def close(self) -> None:
        del self._group  # its sockets close with it


def heal_members(sources: Mapping[int, int]) -> list[int]:
    """The world ranks of one heal: every receiver and every sender, in rank order."""
    return sorted(set(sources) | set(sources.values()))


def open_wire(sources: Mapping[int, int], rank: int, device: torch.device, backend: str,
              store: dist.Store | None, key: str, timeout: timedelta) -> GroupWire | InterfaceWire:
    """The wire for this rank's part in a heal (``sources``: receiver -> sender). ``store``:
    the round's store (None: no group of its own can be made, the world's group is used);
    ``key``: unique to this heal within it (the same on every member)."""
    interface = heal_interface()
    if not interface or store is None or rank not in heal_members(sources):
        return GroupWire(device, collectives_link(backend))
    why = gloo_private.unsupported_reason()
    if why is not None:
        global _warned
        if not _warned:
            _warned = True
            log.warning("%s=%s is not used: %s; heals go over the collectives' own link",
                        contract.HEAL_IFNAME_ENV, interface, why)
        return GroupWire(device, collectives_link(backend))
    return InterfaceWire(dist.PrefixStore(f"elastic/heal/{key}/", store), heal_members(sources), rank, interface,
                         timeout)
