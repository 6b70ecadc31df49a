"""What ended a worker, named by its kind: a full disk, a CUDA or NCCL error, the OOM killer,
a lost etcd lease.

The worker names it by its error's type where it fails (:func:`elastic.failure_record.fault_cause`,
into torchrun's error file beside the error's line), and the agent by its own findings (the
OOM killer: :mod:`agent.node.oom`); both as a :class:`elastic.contract.FaultCause`. An operator
reading the agent's line, ``elastic top``, ``elastic local``'s summary or the goodput timeline
wants the kind first: :func:`attribute` puts its words in front of the line;
:func:`timeline_reason` is the name the goodput timeline gives the fault. Nothing here reads
the line's words: naming a fault never changes how the agent treats it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from elastic.contract import FaultCause


@dataclass(frozen=True)
class Cause:
    name: str  # the goodput timeline's reason (agent.node.goodput, elastic.goodput.account.LOCAL_REASONS)
    words: str  # what the line says first


DISK_FULL = Cause(FaultCause.DISK_FULL.value, "disk full (ENOSPC)")
GPU_OOM = Cause(FaultCause.GPU_OOM.value, "GPU out of memory (CUDA OOM)")
NCCL = Cause(FaultCause.NCCL.value, "NCCL failure")
CUDA = Cause(FaultCause.CUDA.value, "CUDA failure")
OOM = Cause(FaultCause.OOM.value, "host out of memory")
LEASE = Cause(FaultCause.LEASE_LOST.value, "etcd lease lost")
CAUSES = (DISK_FULL, GPU_OOM, NCCL, CUDA, OOM, LEASE)
_BY_KIND = {FaultCause(c.name): c for c in CAUSES}


def cause_of(kind: FaultCause | None) -> Cause | None:
    return _BY_KIND.get(kind) if kind is not None else None


def attribute(text: str, kind: FaultCause | None) -> str:
    """``disk full (ENOSPC): OSError: [Errno 28] No space left on device``; unchanged if no
    kind is known or the line already starts with its name (the agent's words for an OOM kill)."""
    cause = cause_of(kind)
    if cause is None or not text or text.startswith((cause.words, "killed by ")):
        return text
    return f"{cause.words}: {text}"


def timeline_reason(reason: str, kinds: Iterable[FaultCause | None]) -> str:
    """The goodput timeline's name for a fault the agent acts on as ``reason``: a worker's
    failure by its kind where one was named, else ``reason`` itself."""
    if reason != "worker_failed":
        return reason
    for kind in kinds:
        if kind is not None and kind is not FaultCause.LEASE_LOST:
            return kind.value
    return reason
