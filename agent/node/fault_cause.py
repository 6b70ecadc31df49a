"""What ended a worker, named from its last words: a full disk, a CUDA or NCCL error, the OOM
killer, a lost etcd lease.

A worker's last line (its traceback's, from torchrun's error file, or the agent's words for
a death by a signal, :mod:`agent.node.oom`) says what happened in the words of whatever raised
it: ``OSError: [Errno 28] No space left on device``, ``torch.distributed.DistBackendError:
NCCL error in: ...``, ``RuntimeError: CUDA error: an illegal memory access``. An operator
reading the agent's line, ``elastic top``, ``elastic local``'s summary or the goodput
timeline wants the kind first. :func:`classify` names it from the text (pure, the same
function everywhere, so the words match); :func:`attribute` puts the name in front of the
line; :func:`timeline_reason` is the name the goodput timeline gives the fault.

The words avoid what :mod:`agent.node.policy` reads as a peer's doing (``nccl error``, ``timed
out``...): naming a fault never changes how the agent treats it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Cause:
    name: str  # the goodput timeline's reason (agent.node.goodput, elastic.goodput.account.LOCAL_REASONS)
    words: str  # what the line says first


DISK_FULL = Cause("disk_full", "disk full (ENOSPC)")
GPU_OOM = Cause("cuda_oom", "GPU out of memory (CUDA OOM)")
NCCL = Cause("nccl_error", "NCCL failure")
CUDA = Cause("cuda_error", "CUDA failure")
OOM = Cause("oom", "host out of memory")
LEASE = Cause("lease_lost", "etcd lease lost")
CAUSES = (DISK_FULL, GPU_OOM, NCCL, CUDA, OOM, LEASE)

# Most specific first: an NCCL error caused by CUDA is NCCL's (its text says both).
_PATTERNS: tuple[tuple[Cause, re.Pattern[str]], ...] = (
    (DISK_FULL, re.compile(r"\[Errno 28\]|\bENOSPC\b|No space left on device|\[Errno 122\]|Disk quota exceeded",
                           re.I)),
    (GPU_OOM, re.compile(r"CUDA out of memory|torch\.(cuda\.)?OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED"
                         r"|cudaErrorMemoryAllocation")),
    (NCCL, re.compile(r"\bNCCL error\b|\bnccl(UnhandledCuda|System|Internal|InvalidArgument|InvalidUsage|Remote)"
                      r"Error\b|ProcessGroupNCCL|NCCL communicator was aborted|NCCL WARN", re.I)),
    (CUDA, re.compile(r"\bCUDA error\b|\bcudaError\w*|CUBLAS_STATUS_\w+|CUDNN_STATUS_\w+|device-side assert"
                      r"|illegal memory access|CUDA driver|torch\.AcceleratorError|\bXid\b", re.I)),
    (OOM, re.compile(r"killed by the OOM killer|\bMemoryError\b")),
    (LEASE, re.compile(r"StaleGroupError|lost (its|this node's) (own )?etcd lease|etcd lease (was )?lost", re.I)),
)


def classify(text: str) -> Cause | None:
    """The kind of fault a worker's last line names, or None (an ordinary exception)."""
    for cause, pattern in _PATTERNS:
        if pattern.search(text):
            return cause
    return None


def attribute(text: str) -> str:
    """``disk full (ENOSPC): OSError: [Errno 28] No space left on device``; unchanged if no
    kind is known or the line already starts with its name."""
    cause = classify(text) if text else None
    if cause is None or text.startswith((cause.words, "killed by ")):  # agent.node.oom's words name it already
        return text
    return f"{cause.words}: {text}"


def timeline_reason(reason: str, messages: Iterable[str]) -> str:
    """The goodput timeline's name for a fault the agent acts on as ``reason``: a worker's
    failure by its kind where its words say one, else ``reason`` itself."""
    if reason != "worker_failed":
        return reason
    for message in messages:
        cause = classify(message)
        if cause is not None and cause is not LEASE:
            return cause.name
    return reason
