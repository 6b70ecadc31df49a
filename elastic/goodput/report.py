"""The account in a few words, the same in ``elastic top``, ``elastic local`` and the chaos soak."""

from __future__ import annotations

from .account import LOST_CAUSES, Account, Fault

PHASE_ORDER = ("detection", "rendezvous", "worker_start", "restore", "join", "unknown", "recompute")


def _seconds(value: float) -> str:
    if value < 1:
        return f"{value:.2f} s"
    if value < 120:
        return f"{value:.1f} s"
    if value < 7200:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.1f} h"


def describe(account: Account | None) -> str:
    """``goodput 91.2 % of 10.3 min (lost: detection 12.0 s, ...)``, or why there is none."""
    if account is None or account.goodput is None:
        return "goodput: no steps accounted yet"
    lost = ", ".join(f"{c.replace('_', ' ')} {_seconds(account.lost[c])}" for c in LOST_CAUSES
                     if account.lost.get(c, 0.0) >= 0.05)
    return (f"goodput {100 * account.goodput:.1f} % of {_seconds(account.wall)} since the first step "
            f"(productive {_seconds(account.productive)}; lost: {lost or 'nothing'})")


def describe_fault(fault: Fault) -> str:
    """``peer_lost b: detection 1.2 s, rendezvous 0.3 s, restore 0.1 s (1.6 s)``."""
    name = fault.reason or "unnamed"
    if fault.nodes:
        name += " " + ",".join(fault.nodes)
    if fault.detail:
        name += f" ({fault.detail})"
    phases = ", ".join(f"{p.replace('_', ' ')} {_seconds(fault.phases[p])}" for p in PHASE_ORDER
                       if p in fault.phases)
    return f"{name}: {phases or 'no phases'} ({_seconds(fault.seconds)})"
