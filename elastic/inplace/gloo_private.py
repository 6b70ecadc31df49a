"""torch's private gloo options, behind one small module: a gloo group on one network interface.

A heal on the operator's interface (``ELASTIC_HEAL_IFNAME``, :mod:`.heal_link`) needs a gloo
group of its own ranks whose device is bound to that interface. torch's public ways to make
a group (``init_process_group``, ``new_group``) read the interface from
``GLOO_SOCKET_IFNAME`` for the whole process, and ``new_group`` is a collective of every
rank of the world, while a heal involves only its senders and receivers. What this touches
instead (torch 2.14.1): ``ProcessGroupGloo._Options`` with its ``_devices`` and ``_timeout``,
and ``ProcessGroupGloo.create_device(interface=...)``.

:func:`unsupported_reason` says in one line when this torch lacks any of it; the heal then
goes over the collectives' own group, with one warning. ``tests/elastic/inplace/
test_gloo_private.py`` fails loudly if a torch upgrade changes it.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from datetime import timedelta
from typing import Any, Iterable

import torch.distributed as dist


def unsupported_reason() -> str | None:
    """None if this torch can bind a gloo group to an interface as :func:`group_on` does."""
    gloo = getattr(dist, "ProcessGroupGloo", None)
    if gloo is None:
        return "this torch has no gloo backend"
    options = getattr(gloo, "_Options", None)
    if options is None or not callable(getattr(gloo, "create_device", None)):
        return "this torch's ProcessGroupGloo has no _Options or create_device"
    try:
        made = options()
        missing = [name for name in ("_devices", "_timeout") if not hasattr(made, name)]
    except Exception as exc:  # noqa: BLE001 - any failure means: not as this module knows it
        return f"this torch's ProcessGroupGloo._Options() failed ({exc})"
    return f"this torch's ProcessGroupGloo._Options has no {', '.join(missing)}" if missing else None


def group_on(store: dist.Store, rank: int, size: int, interface: str, timeout: timedelta) -> Any:
    """A gloo process group of ``size`` ranks (this one ``rank``) through ``store``, its
    sockets on ``interface`` only. Raises RuntimeError when the interface does not exist."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(interface=interface)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, options)


def release_pending_connect(listeners: Iterable[tuple[str, int]], ranks: Iterable[int], timeout: float = 0.5) -> int:
    """Complete, as a closed connection, the wait of this process's pairs for ``ranks`` on each
    of its gloo ``listeners`` (address, port); returns how many connections were made. A rank
    whose pair is not waiting leaves a socket gloo keeps unused until a later round's pair with
    that rank takes it, reads it closed, and that round is given up for the next."""
    made = 0
    for host, port in listeners:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        for rank in ranks:
            with contextlib.suppress(OSError):
                with socket.create_connection((host, port), timeout=timeout) as conn:
                    conn.sendall(struct.pack("<Q", rank))
                made += 1
    return made


__all__ = ["group_on", "release_pending_connect", "unsupported_reason"]
