"""The agent's view of its workers' replica checks: who named this node, and when.

A worker that a replica vote names (:mod:`elastic.consistency.report`) appends a JSON
line to ``$ELASTIC_HEARTBEAT_DIR/sdc-{local_rank}.jsonl``. The agent reads what is new
at each look (a file's size first: nothing to read costs one ``stat``), remembers when
this node was the outlier, and hands those facts to the policy, which decides whether that
makes it suspect hardware (:func:`agent.node.policy.sdc_keep_out`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, cast

from elastic import contract

from agent.node.policy import SDC_WINDOW_S, SdcFacts

if TYPE_CHECKING:
    from agent.rendezvous.session import RendezvousSession

log = logging.getLogger(__name__)


def window_from_env() -> float:
    raw = os.environ.get(contract.SDC_WINDOW_ENV, "").strip()
    try:
        value = float(raw) if raw else SDC_WINDOW_S
    except ValueError:
        value = -1.0
    if not value > 0:
        log.warning("%s=%r is not seconds above 0; using %g", contract.SDC_WINDOW_ENV, raw, SDC_WINDOW_S)
        return SDC_WINDOW_S
    return value


class SdcWatch:
    """Reads the workers' SDC events; :meth:`look` returns a keep-out detail or None."""

    def __init__(self, node: str, heartbeat_dir: Path, window_s: float | None = None) -> None:
        self.node, self.dir = node, Path(heartbeat_dir)
        self.window_s = window_from_env() if window_s is None else window_s
        self._offsets: dict[Path, int] = {}
        self.outlier_at: list[float] = []

    def look(self, now: float | None = None) -> SdcFacts:
        """When replica votes named this node the outlier within the window (the policy weighs
        them: :attr:`agent.node.policy.SdcFacts.suspect`)."""
        now = time.time() if now is None else now
        for event in self._new_events():
            step, role = event.get("step"), event.get("role")
            log.error("[%s] the replica check named this node %s at step %s (differs in %s)", self.node,
                      "the outlier" if role == "outlier" else "a suspect", step,
                      # a list: the cast names what the worker writes, it checks nothing
                      ", ".join(str(n) for n in cast("list[object]", event.get("differing", []))[:4]) or "?")
            at = event.get("time")
            if role == "outlier" and isinstance(at, (int, float)):
                self.outlier_at.append(float(at))
        self.outlier_at = [t for t in self.outlier_at if now - t <= self.window_s]
        return SdcFacts(tuple(self.outlier_at), now, self.window_s)

    def forget(self) -> None:
        """Kept out: the strikes are spent (a second keep-out needs two new ones)."""
        self.outlier_at.clear()

    def _new_events(self) -> list[dict[str, object]]:
        events: list[dict[str, object]] = []
        for path in sorted(self.dir.glob(contract.SDC_EVENTS_FILE.format(local_rank="*"))):
            try:
                size = path.stat().st_size
                start = self._offsets.get(path, 0)
                if size < start:  # the file was removed and written anew
                    start = 0
                if size <= start:
                    continue
                with open(path, "rb") as f:
                    f.seek(start)
                    chunk = f.read(size - start)
            except OSError:
                continue
            whole = chunk[: chunk.rfind(b"\n") + 1]  # a half-written last line waits for the next look
            self._offsets[path] = start + len(whole)
            for line in whole.splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    events.append(event)
        return events


def spares_waiting(session: "RendezvousSession", participants: Iterable[str]) -> int:
    """Live nodes of the run outside the round: warm spares, one of which takes the place of
    a node kept out (so a job at its minimum size can still keep a suspect node out). Read
    from etcd on this rare path only; 0 if etcd does not answer."""
    try:
        live = session.live_nodes()
    except Exception:  # noqa: BLE001 - no answer: count no spare, keep the node in
        return 0
    return len(set(live) - set(participants))


__all__ = ["SdcWatch", "spares_waiting", "window_from_env"]
