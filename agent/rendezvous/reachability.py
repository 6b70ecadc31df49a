"""Keeping a node out while its peers cannot reach it: the etcd and network I/O around :mod:`.keepout`.

* ``{run}/reach/{node}``: after a round failed with every lease held, what ``node`` could
  not reach (:meth:`Reachability.report`, a bounded connect to each member's round store),
  or whose agent did not answer while a step waited on it (``agent/node/freeze.py``: frozen).
* ``{run}/keepout/{node}``: written by a node while it stays out, under its own lease, so
  it vanishes with the node; it says why, for how long, and which strike this is.

Every closer of a round leaves out the nodes :func:`.keepout.choose_kept_out` picks from
the reports of the round before, and the nodes holding a keep-out key
(:meth:`Reachability.excluded`), so the decision is the same whoever closes. A node that
finds itself left out stays out (:meth:`Reachability.stay_out`): it waits its back-off,
then rejoins only once a connect to every member of the round that trains succeeds.
"""

from __future__ import annotations

import logging
import time
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Mapping, Protocol, TypeVar

from agent.etcd import EtcdClient, EtcdError

from agent.rendezvous.freshness import lease_stale
from agent.rendezvous.keepout import KeepOut, ReachReport, backoff, choose_kept_out, next_strikes
from agent.rendezvous.probe import UNREACHABLE, reach
from agent.rendezvous.registry import NodeLease, NodeRecord
from agent.rendezvous.rounds import CLOSED, RoundRecord
from agent.rendezvous.signing import SignatureError, StateSigner
from agent.rendezvous.states import NodeState

log = logging.getLogger(__name__)


class _Leased(Protocol):
    """A signed value that names the lease it was written under (KeepOut, ReachReport)."""

    @property
    def lease(self) -> int: ...


_Signed = TypeVar("_Signed", bound=_Leased)

PROBE_TIMEOUT_S = 1.0
_PROBE_THREADS = 32
_RECHECK_S = 1.0


class Reachability:
    def __init__(self, node: str, client: EtcdClient, signer: StateSigner, lease: NodeLease, run_prefix: str) -> None:
        self.node, self.client, self.signer, self.lease = node, client, signer, lease
        self.reach_prefix = f"{run_prefix}/reach/"
        self.keepout_prefix = f"{run_prefix}/keepout/"
        self.strikes = 0
        self._served = -1  # the newest round whose exclusion of this node it has sat out
        self._back_at: float | None = None  # when this node last came back from a keep-out
        self.listeners: list[Callable[[KeepOut | None], None]] = []  # told when this node goes out / comes back
        self._out: KeepOut | None = None  # what this node last published about itself (None: it is not out)
        self._stale_seen: set[tuple[str, int]] = set()  # (key, mod revision) of replays already reported

    # ------------------------------------------------------------------ after a failed round

    def probe(self, addrs: Mapping[str, str | None]) -> list[str]:
        """The nodes of ``addrs`` (node -> store address) a connect cannot reach now."""
        todo = {n: a for n, a in addrs.items() if a and n != self.node}
        if not todo:
            return []
        with ThreadPoolExecutor(max_workers=min(_PROBE_THREADS, len(todo))) as pool:
            verdicts = dict(zip(todo, pool.map(lambda a: reach(a, PROBE_TIMEOUT_S), todo.values())))
        return sorted(n for n, v in verdicts.items() if v == UNREACHABLE)

    def report(self, round_number: int, participants: tuple[str, ...], records: Mapping[str, NodeRecord]) -> list[str]:
        """Probe the round's other members and, if some are unreachable, say so in etcd."""
        addrs = {n: records[n].store_addr for n in participants if n in records}
        unreachable = self.probe(addrs)
        if not unreachable:
            return []
        log.warning("[%s] round %d failed and this node cannot reach %s (connects time out or find no route)",
                    self.node, round_number, ", ".join(unreachable))
        self.record(ReachReport(self.node, round_number, tuple(unreachable)))
        return unreachable

    def record(self, report: ReachReport) -> bool:
        """Put this node's report in etcd, under its lease; False if etcd refused it."""
        key = self.reach_prefix + self.node

        def put(lease_id: int) -> object:
            value = self.signer.seal(key.encode(), replace(report, lease=lease_id).to_json())
            return self.client.call(lambda c: c.put(key, value, lease=lease_id))

        try:
            with self.client.deadline(1.0):
                self.lease.write(put)
        except EtcdError as exc:
            log.warning("[%s] could not record the unreachable peers: %s", self.node, exc)
            return False
        return True

    # ------------------------------------------------------------------ reading the mirror

    def _decoded(self, entries: Mapping[str, object], prefix: str, parse: Callable[[bytes], _Signed]) -> list[_Signed]:
        """The values under ``prefix`` that verify and are current: held by the lease their
        writer signed (a replay of older bytes is stale: one WARNING per value, never a decision)."""
        found: list[_Signed] = []
        for key, entry in entries.items():
            if key.startswith(prefix):
                try:
                    value = parse(self.signer.open(key.encode(), entry.value))  # type: ignore[attr-defined]  # a mirror entry (duck-typed)
                except (SignatureError, ValueError, KeyError, TypeError):
                    continue
                stale = lease_stale(getattr(entry, "lease", 0), value.lease)
                if stale is not None:
                    self._report_stale(key, getattr(entry, "mod_revision", 0), stale)
                    continue
                found.append(value)
        return found

    def _report_stale(self, key: str, mod_revision: int, why: str) -> None:
        if (key, mod_revision) in self._stale_seen:
            return
        self._stale_seen.add((key, mod_revision))
        log.warning("[%s] ignoring %s: it verifies but is stale, %s; nobody is kept out on its word",
                    self.node, key, why)

    def keep_outs(self, entries: Mapping[str, object]) -> dict[str, KeepOut]:
        found = {k.node: k for k in self._decoded(entries, self.keepout_prefix, KeepOut.from_json)}
        mine = found.get(self.node)
        if mine is not None and self._out is None and self.lease is not None:
            self._clear_replay(mine)
            del found[self.node]
        return found

    def _clear_replay(self, found: KeepOut) -> None:
        """A keep-out for this node while it is not out, under its live lease: not this node's
        word (it was put back); say so and delete it, in the background (callers read a mirror)."""
        key = self.keepout_prefix + self.node
        if (key, -found.lease) in self._stale_seen:
            return
        self._stale_seen.add((key, -found.lease))
        log.warning("[%s] ignoring %s: this node is not kept out (an older keep-out put back); deleting it",
                    self.node, key)

        def clear() -> None:
            try:
                if self._out is None:
                    self.client.call(lambda c: c.delete(key), deadline=1.0)
            except EtcdError as exc:
                log.warning("[%s] could not delete the replayed %s: %s", self.node, key, exc)
            finally:
                self._stale_seen.discard((key, -found.lease))

        threading.Thread(target=clear, name="elastic-keepout-replay", daemon=True).start()

    def reports(self, entries: Mapping[str, object], round_number: int) -> list[ReachReport]:
        found = self._decoded(entries, self.reach_prefix, ReachReport.from_json)
        return [r for r in found if r.round == round_number]

    def excluded(self, record: RoundRecord, entries: Mapping[str, object]) -> set[str]:
        """Nodes no closer of ``record`` may take in: staying out, or picked by the reports
        of the round before (whose members are ``record.previous``)."""
        out = set(self.keep_outs(entries))
        if record.previous and record.round >= 1:
            out |= choose_kept_out(record.previous, self.reports(entries, record.round - 1))
        return out

    def must_stay_out(self, record: RoundRecord, entries: Mapping[str, object]) -> bool:
        if record.state == CLOSED and self.node in record.participants:
            return False
        return record.round > self._served and self.node in self.excluded(record, entries)

    # ------------------------------------------------------------------ staying out

    def _why(self, record: RoundRecord, entries: Mapping[str, object]) -> tuple[str, ...]:
        cut: set[str] = set()
        for report in self.reports(entries, record.round - 1):
            if report.node == self.node:
                cut |= set(report.unreachable)
            elif self.node in report.unreachable:
                cut.add(report.node)
        return tuple(sorted(cut))

    def stay_out(self, record: RoundRecord, entries: Mapping[str, object],
                 records: Callable[[], Mapping[str, NodeRecord]], closed: Callable[[], bool]) -> None:
        """Sit out the back-off, then wait until every member that trains is reachable; each
        time they are still not, the back-off doubles. Returns once this node may rejoin."""
        self._served = record.round
        back_for = None if self._back_at is None else time.monotonic() - self._back_at
        self.strikes = next_strikes(self.strikes, back_for)
        cut = self._why(record, entries)
        since = time.monotonic()
        log.warning("[%s] kept out of round %d: its peers cannot reach it%s; it stays out %.0f s (strike %d), "
                    "then rejoins once it can reach them", self.node, record.round,
                    f" ({', '.join(cut)})" if cut else "", backoff(self.strikes), self.strikes)
        while True:
            out = KeepOut(self.node, self.strikes, backoff(self.strikes), cut, round=record.round)
            self.publish(out)
            if self._sleep(out.backoff, closed):
                return
            training = record.participants if record.state == CLOSED else record.previous
            current = records()
            cut = tuple(self.probe({n: current[n].store_addr for n in training if n in current}))
            if not cut:
                break
            self.strikes += 1
            log.warning("[%s] still cannot reach %s after %.0f s out: staying out %.0f s more (strike %d)",
                        self.node, ", ".join(cut), time.monotonic() - since, backoff(self.strikes), self.strikes)
        log.info("[%s] reaches its peers again after %.0f s kept out; rejoining", self.node, time.monotonic() - since)
        self._back_at = time.monotonic()
        self.publish(None)

    def _sleep(self, seconds: float, closed: Callable[[], bool]) -> bool:
        """True if the job closed meanwhile."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if closed():
                return True
            time.sleep(min(_RECHECK_S, max(0.0, end - time.monotonic())))
        return closed()

    def publish(self, out: KeepOut | None) -> None:
        """Write (or, with None, clear) this node's keep-out key, and its state with it: the one
        writer of keep-out keys (a node its peers cannot reach, or one the agent keeps out)."""
        key = self.keepout_prefix + self.node
        self._out = out

        def put(lease_id: int) -> object:
            assert out is not None
            value = self.signer.seal(key.encode(), replace(out, lease=lease_id).to_json())
            return self.client.call(lambda c: c.put(key, value, lease=lease_id))

        try:
            with self.client.deadline(1.0):
                if out is None:
                    self.client.call(lambda c: c.delete(key))
                else:
                    self.lease.write(put)
        except EtcdError as exc:
            log.warning("[%s] could not %s its keep-out record: %s", self.node,
                        "clear" if out is None else "write", exc)
        self.lease.update(state=NodeState.KEPT_OUT.value if out is not None else NodeState.RENDEZVOUS.value,
                          extra={"kept_out": out.describe()} if out is not None else {})
        for listener in list(self.listeners):
            listener(out)
