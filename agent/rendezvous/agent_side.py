"""The etcd-v3 handler as the node agent sees it: :mod:`agent.node.rendezvous_api` implemented.

``agent/node`` holds the interface (:class:`~agent.node.rendezvous_api.AgentRendezvous` for the
agent's loop, :class:`~agent.node.rendezvous_api.HandlerSide` for the launcher) and never names
:class:`~agent.rendezvous.handler.EtcdV3RendezvousHandler`; this module is the one place that
reads and drives the handler for it, and the factories :func:`agent_rendezvous` and
:func:`handler_side` hand back ours over etcd-v3, torch's generic one over any other handler.
The watches get only its :class:`~agent.rendezvous.session.RendezvousSession`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from torch.distributed.elastic.rendezvous import RendezvousHandler

from elastic.inplace.channel import RoundOffer, assign_ranks, make_offer
from elastic.worker_env import joins_live_world
from agent.etcd import EtcdError
from agent.rendezvous.ended import SUCCEEDED, JobEnded
from agent.rendezvous.handler import LEASE_LOST, NEW_ROUND, PEER_LOST, EtcdV3RendezvousHandler
from agent.rendezvous.keepout import KeepOut
from agent.rendezvous.lease_clock import Verdict
from agent.rendezvous.registry import NodeRecord
from agent.rendezvous.rounds import JOIN
from agent.rendezvous.session import EtcdSession, RendezvousSession
from agent.rendezvous.states import NodeState, RoundCause

from agent.node.policy import JobEnd, Reason, etcd_lost
from agent.node.rendezvous_api import (AgentRendezvous, HandlerSide, JobFinishedError, LeaseHealth, Round,
                                       TorchRendezvous)
from agent.node.sdc import spares_waiting

log = logging.getLogger("elastic.agent")

_OFFER_TRIES = 5
_KEEP_OUT_SEEN_S = 5.0  # how long to wait for the rendezvous' mirror to show our keep-out key change
_MEMBERSHIP = {PEER_LOST: Reason.PEER_LOST, LEASE_LOST: Reason.LEASE_LOST, NEW_ROUND: Reason.SCALE_UP}


class EtcdRendezvous(AgentRendezvous):
    """``agent.rendezvous``'s etcd-v3 handler: registry, keep-outs, offers, spares, leases."""

    _handler: EtcdV3RendezvousHandler

    def __init__(self, handler: EtcdV3RendezvousHandler, node: str, nproc: int, in_place: bool) -> None:
        super().__init__(handler, node, nproc, in_place)
        self._session = EtcdSession(handler)  # all the watches get of the rendezvous

    @property
    def can_keep_out(self) -> bool:
        return True

    @property
    def min_nodes(self) -> int:
        return int(self._handler.timings.min_nodes)

    def attach(self, *, advertise_host: str | None, metrics_url: str | None, store_addr: str | None,
               on_etcd_error: Callable[[str], None], wake: Callable[[], None],
               on_keep_out: Callable[[KeepOut | None], None], while_spare: Callable[[], None]) -> None:
        h = self._handler
        if store_addr is not None:
            h.lease.update(store_addr=store_addr)
        h.lease.update(metrics_url=metrics_url, nproc=self.nproc)
        h.client.error_listeners.append(on_etcd_error)
        h.mirror.listeners.append(wake)
        h.narrow.listeners.append(wake)  # the round record: how a lost peer or a new round reaches a member
        h.reachability.listeners.append(on_keep_out)
        if self.in_place:
            h.while_spare.append(while_spare)
        h.serve_as(advertise_host, self._needs_bootstrap if self.in_place else None)  # where peers ask for its witness

    def next_round(self, cause: RoundCause, previous: Round, offered: bool = False) -> Round:
        if not offered:
            return self._one_round(cause, previous)
        # A round whose every member's record says where its store is (a member that died as
        # the round closed has none: the next round leaves it out). In-place workers need no
        # torchrun bootstrap (MASTER_ADDR), which could wait on a dead rank 0.
        current = previous
        for _ in range(_OFFER_TRIES):
            current = self._one_round(cause, current, master_addr_read=False)
            if current.offer is not None:
                break
        return current

    def _one_round(self, cause: RoundCause, previous: Round, master_addr_read: bool = True) -> Round:
        h = self._handler
        self._refuse_a_finished_job()
        info = h.next_rendezvous_for(cause.value, bootstrap=master_addr_read)
        bootstrap = info.bootstrap_store_info
        master_addr, master_port = ((bootstrap.master_addr, bootstrap.master_port) if bootstrap is not None
                                    else (previous.master_addr, previous.master_port))
        record = h.round
        number, participants = ((record.round, tuple(record.participants)) if record is not None
                                else (previous.number + 1, previous.participants))
        rank_base, world_size = info.rank * self.nproc, info.world_size * self.nproc
        records = h.node_records()
        offer = self._offer(number, participants, records, record.cause if record is not None else JOIN)
        if self.in_place and offer is None:
            # The mirror may not hold every member yet: a node that has just started reads
            # every peer's keys on demand, and its first read can lag or fail and be retried in
            # the background. Without an offer its in-place workers would wait for one that
            # never comes while the others wait for them (a chaos run wedged so for 150 s).
            records = h.node_records_now()
            offer = self._offer(number, participants, records, record.cause if record is not None else JOIN)
            if offer is None:
                log.warning("[%s] round %d cannot be handed to the workers: %s; the next round leaves "
                            "such a member out", self.node, number, _unoffered(participants, records))
        nprocs = {n: r.nproc for n, r in records.items()}
        ranks = assign_ranks(participants, self.node, nprocs)
        if ranks is not None:
            rank_base, world_size = ranks
        # decided by the round's closer for every member alike (RoundRecord.in_place)
        live = self.in_place and record is not None and record.forms_in_place
        return Round(number=number, participants=participants, group_rank=info.rank, group_world=info.world_size,
                     rank_base=rank_base, world_size=world_size, master_addr=master_addr, master_port=master_port,
                     offer=offer, live_world=live,
                     fresh_world=self.in_place and record is not None and not record.in_place)

    def _offer(self, number: int, participants: tuple[str, ...], records: Mapping[str, NodeRecord],
               cause: str) -> RoundOffer | None:
        """The offer for this node's in-place workers from ``records`` (None: not in place, or a
        member's record lacks its process count or, for the first member, its store address)."""
        if not self.in_place:
            return None
        return make_offer(number, participants, self.node, {n: r.nproc for n, r in records.items()},
                          {n: r.store_addr for n, r in records.items()}, cause)

    def _refuse_a_finished_job(self) -> None:
        """A node whose workers succeeded trained the job's last step (``ElasticRun``: every
        rank confirmed it), so there is no round left to form: a node back from a keep-out
        or a restart just then would otherwise pull the finished nodes into a round their
        workers never join, and hold them in their exit barrier until it times out."""
        done = sorted(n for n, r in self._handler.node_records().items()
                      if r.state == NodeState.SUCCEEDED and n != self.node)
        if done:
            raise JobFinishedError(f"the job finished (node {', '.join(done)}: workers succeeded) "
                                   "while this node was out")

    def _needs_bootstrap(self, record: Any) -> bool:
        """Whether this node's workers may read MASTER_ADDR in ``record``'s round: not when they
        join a world that already trains in place (they start in a set-up world of their own),
        so the rendezvous need not wait for rank 0 to publish it."""
        return not record.forms_in_place

    def live_world_ahead(self) -> bool:
        records = self._handler.node_records()
        return joins_live_world({n: bool(r.extra.get("in_place")) for n, r in records.items()}, self.node)

    def membership(self, current: Round) -> tuple[Reason | None, list[str]]:
        reason = _MEMBERSHIP.get(self._handler.restart_reason() or "")
        if reason is not None:
            return reason, []
        out = self._kept_out(current)
        return (Reason.PEER_LOST if out else None), out  # a member kept out takes part in no collective

    def _kept_out(self, current: Round) -> list[str]:
        """Members of this node's round that hold a keep-out key: one that went out after the
        round closed (a crash loop) keeps its lease, so nothing else says so."""
        h = self._handler
        out = h.reachability.keep_outs(h.narrow.entries()[0])  # keep-outs only, not every peer's keys
        if not out:
            return []  # the usual look: no work per peer
        return [n for n in current.others(self.node)
                if n in out and out[n].round >= current.number]  # older: put back, a replay

    def job_ended(self) -> JobEnd | None:
        ended = self._handler.job_end.seen()
        return JobEnd(failed=ended.failed, line=ended.line()) if ended is not None else None

    def publish(self, **fields: Any) -> None:
        lease = self._handler.lease
        state = fields.pop("state", None)
        if state is not None:
            lease.update(state=str(state))
        extra = lease.record.extra
        if any(extra.get(k, _EXTRA_DEFAULTS.get(k)) != v for k, v in fields.items()):
            lease.update(extra={**extra, **fields})

    def peers(self) -> Mapping[str, NodeRecord]:
        return self._handler.node_records()

    def peer_crashes(self, current: Round) -> dict[str, str] | None:
        # read from etcd, after this node's own report was written: of two nodes that crash
        # together, one at least reads the other's (a mirror begun on demand may lag behind)
        records = self._handler.node_records_now()
        return {n: str(records[n].extra.get("crash", "")) if n in records else "" for n in current.others(self.node)}

    def report_unreachable(self) -> None:
        self._handler.report_unreachable()

    def etcd_settings(self) -> Any:
        return self._handler.client.settings

    def hold_out(self, out: KeepOut | None) -> None:
        self._handler.start()  # the lease and mirror the keep-out key needs
        self.keep_out(out)

    def spares_waiting(self, current: Round) -> int:
        return spares_waiting(self._session, current.participants)

    def lease_health(self) -> LeaseHealth:
        h = self._handler
        watch = h.lease_watch
        return LeaseHealth(age=h.lease.clock().age(time.monotonic()), outage=watch.verdict_now is Verdict.OUTAGE,
                           cut_off=watch.detail if watch.verdict_now is Verdict.CUT_OFF else "",
                           due_in=watch.seconds_to_deadline())

    def etcd_lost(self, fence: Mapping[str, object] | None, run_id: str) -> str:
        now = self._handler.newest_round()
        return etcd_lost(fence, run_id, now) if fence is not None and now is not None else ""

    def keep_out(self, out: KeepOut | None) -> None:
        """Write (or, with None, clear) this node's keep-out key, as ``Reachability`` does for a
        node its peers cannot reach, and wait until the rendezvous' own mirror shows it: a
        stale key there would make the next round keep this node out again, as unreachable."""
        h = self._handler
        h.reachability.publish(out)  # the one writer of keep-out keys (agent/rendezvous/reachability.py)
        deadline = time.monotonic() + _KEEP_OUT_SEEN_S
        while time.monotonic() < deadline:
            entries, revision = h.narrow.entries()
            views = [entries] + ([h.mirror.entries()[0]] if h.mirror.begun else [])  # a steward closes from the latter
            if all((h.node in h.reachability.keep_outs(view)) == (out is not None) for view in views):
                return
            h.narrow.wait(revision, 0.1)

    def announce_finished(self) -> None:
        try:
            self._handler.set_closed(SUCCEEDED)
        except EtcdError as exc:  # the close at the agent's exit tries again
            log.warning("[%s] could not mark the job finished yet: %s", self.node, exc)

    def exit_barrier(self, current: Round, timeout: float) -> None:
        """A peer kept out (a crash loop) trains nothing and will not finish: not waited for."""
        h = self._handler
        deadline = time.monotonic() + timeout
        done = (NodeState.SUCCEEDED, NodeState.FAILED, NodeState.KEPT_OUT)
        while time.monotonic() < deadline:
            records = h.node_records()
            if not [n for n in current.participants if n in records and records[n].state not in done]:
                return
            _entries, revision = h.mirror.entries()
            h.mirror.wait(revision, 0.5)

    def session(self) -> RendezvousSession:
        return self._session


_EXTRA_DEFAULTS: dict[str, object] = {"crash": "", "in_place": False}  # what a record without the key says


class EtcdHandlerSide(HandlerSide):
    """:class:`HandlerSide` of the etcd-v3 handler: the job's end travels with its close."""

    fences_rounds = True
    _handler: EtcdV3RendezvousHandler

    def closed_outcome(self) -> JobEnded | None:
        return self._handler.closed_outcome()

    def close_job(self, outcome: str, cause: str) -> None:
        self._handler.shutdown(outcome=outcome, cause=cause)

    def on_spare(self, callback: Callable[[bool], None]) -> None:
        self._handler.on_spare.append(callback)

    def start_rounds_above(self, fence_round: int) -> int | None:
        newest = self._handler.newest_round()
        if newest is None:
            self._handler.start_rounds_at(fence_round + 1)
            return None
        return newest if fence_round > newest else None


def handler_side(handler: RendezvousHandler) -> HandlerSide:
    """The launcher's side of ``handler``: ours over etcd-v3, else torch's (which does nothing more)."""
    return EtcdHandlerSide(handler) if isinstance(handler, EtcdV3RendezvousHandler) else HandlerSide(handler)


def agent_rendezvous(handler: RendezvousHandler, node: str, nproc: int, in_place: bool) -> AgentRendezvous:
    """The interface over ``handler``: ours over etcd-v3, else the generic one (in-place needs ours)."""
    if isinstance(handler, EtcdV3RendezvousHandler):
        return EtcdRendezvous(handler, node, nproc, in_place)
    return TorchRendezvous(handler, node, nproc, in_place=False)


def _unoffered(participants: tuple[str, ...], records: Mapping[str, NodeRecord]) -> str:
    """What keeps a round's offer from being made, in words (:func:`make_offer`'s needs)."""
    missing = [n for n in participants if n not in records]
    if missing:
        return f"no registry record of {', '.join(missing)}"
    no_count = [n for n in participants if not records[n].nproc]
    if no_count:
        return f"no process count in the record of {', '.join(no_count)}"
    return f"no store address in the record of {participants[0]}" if participants else "no members"


__all__ = ["EtcdHandlerSide", "EtcdRendezvous", "agent_rendezvous", "handler_side"]

