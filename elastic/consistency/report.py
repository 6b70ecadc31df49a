"""What a failed replica check leaves behind: one line, a metric, an event for the agent.

Rank 0 speaks for the job (the line naming the node, the tensors and the step, and
``elastic_sdc_mismatches_total{node}`` for each node named); each named rank also says it
in a line of its own and appends an event to its agent's directory
(:data:`elastic.contract.SDC_EVENTS_FILE`), from which the agent decides whether its node
is suspect hardware and keeps it out (``agent.node.policy.sdc_keep_out``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from .. import contract, worker_env
from ..distributed import DistInfo, ElasticRunError
from .check import DEFAULT_EVERY_STEPS, Mismatch, describe

log = logging.getLogger(__name__)


def check_interval(given: int | None) -> int:
    """The interval: the keyword, else ``$ELASTIC_CHECK_EVERY_STEPS``, else the default; 0 is off."""
    source = "check_every_steps"
    if given is None:
        raw = os.environ.get(contract.CHECK_EVERY_STEPS_ENV, "").strip()
        if not raw:
            return DEFAULT_EVERY_STEPS
        source = contract.CHECK_EVERY_STEPS_ENV
        try:
            given = int(raw)
        except ValueError:
            raise ElasticRunError(f"{source}={raw!r} is not a whole number of steps (0 turns the check off)") from None
    if isinstance(given, bool) or not isinstance(given, int) or given < 0:
        raise ElasticRunError(f"{source} must be a whole number of steps >= 0 (0 turns the check off), got {given!r}")
    return given


def timeline_detail(m: Mismatch) -> str:
    """The fault timeline's words for a mismatch: the step, what differs, the rollback."""
    names: list[str] = []
    for r in m.verdict.suspects:
        names += [n for n in m.nonfinite.get(r) or m.differing.get(r, []) if n not in names]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    what = "non-finite" if m.verdict.suspects and all(r in m.nonfinite for r in m.verdict.suspects) else "differs"
    return (f"step {m.step}, {what}: {shown or '?'}; back to step {m.back_to}, "
            f"{m.step - m.back_to} step(s) retrained")


def report_mismatch(m: Mismatch, d: DistInfo, metrics: Any, goodput: Any = None) -> None:
    line = describe(m)
    if goodput is not None:  # the fault timeline (elastic top, elastic local): an `sdc` fault, its nodes, its detail
        goodput.corrupted([m.nodes[r] for r in m.verdict.suspects], timeline_detail(m))
    if d.is_main:
        log.error("[%s rank %d] %s", d.node, d.rank, line)
        for r in m.verdict.suspects:
            metrics.sdc_mismatch(m.nodes[r])
    if d.rank in m.verdict.suspects:
        role = "outlier" if m.verdict.has_majority else "suspect"
        if not d.is_main:
            log.error("[%s rank %d] this replica is named as %s: its state differs at step %d in %s", d.node, d.rank,
                      "the outlier" if role == "outlier" else "a suspect", m.step,
                      ", ".join(m.differing.get(d.rank, [])[:4]) or "?")
        _tell_agent(role, m, d)


def _tell_agent(role: str, m: Mismatch, d: DistInfo) -> None:
    """One JSON line for this node's agent (under ``elastic agent`` only)."""
    where = worker_env.read().node.heartbeat_dir
    if not where:
        return
    event = {"time": time.time(), "role": role, "step": m.step, "back_to": m.back_to, "rank": d.rank,
             "differing": m.differing.get(d.rank, [])[:16], "replicas": len(m.nodes),
             "nonfinite": m.nonfinite.get(d.rank, [])[:16]}
    try:
        with open(Path(where) / contract.sdc_events_file(d.local_rank), "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")
    except OSError as exc:
        log.warning("[%s rank %d] could not tell the agent of the mismatch: %s", d.node, d.rank, exc)


__all__ = ["check_interval", "report_mismatch", "timeline_detail"]
