"""The node-local channel between an agent and its in-place workers: files in one directory.

* ``round.json``: the agent's **offer**, the round its workers should reconfigure into.
  Written whole and renamed into place, so a reader sees an old offer or the new one.
* ``worker-{local_rank}.json``: each worker's **status**: its pid, whether it runs in
  place, the round it is in, and a request for a new round when one of its collectives
  failed while every lease still held.
* ``wake``: a FIFO. A worker writes one byte after a request, so that the agent, which
  waits on the FIFO between its monitor ticks, acts within milliseconds instead of at
  its next tick.

Files rather than sockets: both sides survive the other restarting, nothing blocks, a
worker blocked in a collective still has a thread that can read a file, and a human can
``cat`` the state. Workers poll the offer every few milliseconds with ``stat``, which
costs microseconds.

This module is the workers' end (:class:`WorkerChannel`) and the wire format both ends share;
the agent's end, which runs in the agent, is ``agent/node/channel.py`` (``AgentChannel``).
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from .. import contract, worker_env
from ..atomic_file import write_atomically




@dataclass(frozen=True)
class RoundOffer:
    """A closed rendezvous round, as one node's workers need it.

    ``rank_base + local_rank`` is a worker's global rank; ``store`` is the ``host:port``
    of the TCPStore the round's handles and gloo's rendezvous go through (hosted by the
    agent of the round's first node, so it lives as long as that node and no longer).
    """

    round: int
    participants: tuple[str, ...]
    node_rank: int
    rank_base: int
    world_size: int
    store: str
    nprocs: tuple[int, ...] = ()
    cause: str = "join"  # join: members only arrive; failure: the current world is broken

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "RoundOffer":
        data = json.loads(raw)
        return cls(round=int(data["round"]), participants=tuple(data["participants"]),
                   node_rank=int(data["node_rank"]), rank_base=int(data["rank_base"]),
                   world_size=int(data["world_size"]), store=str(data["store"]),
                   nprocs=tuple(int(n) for n in data.get("nprocs", ())), cause=str(data.get("cause", "join")))


def assign_ranks(participants: Sequence[str], node: str, nprocs: Mapping[str, int | None]) -> tuple[int, int] | None:
    """``(rank_base, world_size)`` for ``node``: global ranks run node by node in round
    order, each node contributing its own number of workers (so nodes may run different
    ``--nproc-per-node``). None if a participant's count is unknown."""
    counts = [nprocs.get(p) for p in participants]
    if node not in participants or any(c is None or c < 1 for c in counts):
        return None
    sizes = [int(c) for c in counts if c is not None]  # (none is: checked above)
    index = list(participants).index(node)
    return sum(sizes[:index]), sum(sizes)


def make_offer(round_number: int, participants: Sequence[str], node: str,
               nprocs: Mapping[str, int | None], stores: Mapping[str, str | None],
               cause: str = "join") -> RoundOffer | None:
    """The offer for ``node``'s workers, or None if a participant's registry record is
    missing what it needs (it died as the round closed: the next round will leave it out)."""
    ranks = assign_ranks(participants, node, nprocs)
    store = stores.get(participants[0]) if participants else None
    if ranks is None or not store:
        return None
    sizes = tuple(int(nprocs[p]) for p in participants)  # type: ignore[arg-type]  # not None: assign_ranks checked
    return RoundOffer(round=round_number, participants=tuple(participants), node_rank=list(participants).index(node),
                      rank_base=ranks[0], world_size=ranks[1], store=store, nprocs=sizes, cause=cause)


@dataclass(frozen=True)
class WorkerStatus:
    """What one worker says about itself (``want_round_after``: a request for a round
    newer than that one, because a collective failed)."""

    pid: int
    mode: str = contract.WorkerMode.RESTART  # a WorkerMode's value (a newer build's may be unknown here)
    round: int = -1
    state: str = contract.WorkerState.STARTING  # a WorkerState's value
    step: int = 0
    want_round_after: int | None = None
    reason: str = ""
    # the round is asked for because ranks stopped after an agreed SIGTERM, not because a
    # collective failed: a field, so the agent tells the two apart without reading ``reason``
    peers_stopped: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    stalled: int = 0  # the step after ``step``: 1 slow (ask the peers), 2 stuck (judge them); elastic.inplace.stall

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "WorkerStatus":
        data = json.loads(raw)
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


class WorkerChannel:
    """A worker's end: it polls the offer and reports its status."""

    def __init__(self, directory: Path, local_rank: int) -> None:
        self.directory, self.local_rank = directory, local_rank
        self._seen: tuple[int, int, int] | None = None
        self._offer: RoundOffer | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "WorkerChannel | None":
        parsed = worker_env.read(env)
        if not parsed.node.control_dir:
            return None
        return cls(Path(parsed.node.control_dir), parsed.me.local_rank)

    def offer(self) -> RoundOffer | None:
        """The agent's latest offer; re-read only when the file changed (one ``stat``)."""
        path = self.directory / contract.OFFER_FILE
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return self._offer
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._seen:
            try:
                self._offer = RoundOffer.from_json(path.read_bytes())
                self._seen = key
            except (OSError, ValueError, KeyError, TypeError):
                pass  # replaced under us: the next poll reads the new one
        return self._offer

    def report(self, status: WorkerStatus, wake: bool = False) -> None:
        write_atomically(self.directory / contract.worker_status_file(self.local_rank), status.to_json())
        if wake:
            self.wake_agent()

    def wake_agent(self) -> None:
        try:
            fd = os.open(self.directory / contract.WAKE_FIFO, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:  # no reader (the agent is gone) or no FIFO: the agent's tick still comes
            if exc.errno not in (errno.ENXIO, errno.ENOENT):
                raise
            return
        try:
            os.write(fd, b"w")
        except BlockingIOError:
            pass  # full: the agent has plenty of wake-ups queued
        finally:
            os.close(fd)
