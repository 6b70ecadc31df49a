"""The account in a few words, the same in ``elastic top``, ``elastic local`` and the chaos soak."""

from __future__ import annotations

from .account import LOST_CAUSES, Account, Fault

PHASE_ORDER = ("detection", "rendezvous", "worker_start", "restore", "join", "unknown", "recompute")


def seconds(value: float, fine: bool = False) -> str:
    """A duration in the unit a reader takes in at a glance: ``3.0 s``, ``12.5 min``, ``2.1 h``.
    The one formatter for goodput lines and ``elastic top``; ``fine`` (top's columns of step
    times) goes down to ``ms``/``µs`` and keeps two decimals in seconds."""
    if fine and value < 1e-3:
        return f"{value * 1e6:.0f} µs"
    if fine and value < 1:
        return f"{value * 1e3:.1f} ms"
    if value < 1 or (fine and value < 120):
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
    lost = ", ".join(f"{c.replace('_', ' ')} {seconds(account.lost[c])}" for c in LOST_CAUSES
                     if account.lost.get(c, 0.0) >= 0.05)
    return (f"goodput {100 * account.goodput:.1f} % of {seconds(account.wall)} since the first step "
            f"(productive {seconds(account.productive)}; lost: {lost or 'nothing'})")


def describe_fault(fault: Fault) -> str:
    """``peer_lost b: detection 1.2 s, rendezvous 0.3 s, restore 0.1 s (1.6 s)``."""
    name = fault.reason or "unnamed"
    if fault.nodes:
        name += " " + ",".join(fault.nodes)
    if fault.detail:
        name += f" ({fault.detail})"
    phases = ", ".join(f"{p.replace('_', ' ')} {seconds(fault.phases[p])}" for p in PHASE_ORDER
                       if p in fault.phases)
    return f"{name}: {phases or 'no phases'} ({seconds(fault.seconds)})"
