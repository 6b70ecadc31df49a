"""Process group, device and the few collectives the trainer needs to agree on a restart.

Everything comes from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``). Run without torchrun, a process is a world of one, so the
same script works on a laptop. The collective timeout is short by default (30 s): a hung
peer should fail the step quickly so torchrun can re-form the world, not after torch's
10-30 minute default.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from . import worker_env

log = logging.getLogger(__name__)

DEFAULT_COLLECTIVE_TIMEOUT_S = 30.0
_PROBE_PREFIX = ".elastic-probe-"


class ElasticRunError(RuntimeError):
    """A problem the user can fix (shared dir, mismatched snapshot, bad option); one line."""


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    node: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def node_name() -> str:
    return worker_env.read().node.node_name or socket.gethostname()


def pick_backend(requested: str = "auto") -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested not in ("gloo", "nccl"):
        raise ElasticRunError(f"unknown backend {requested!r}; use auto, gloo or nccl")
    if requested == "nccl" and not torch.cuda.is_available():
        raise ElasticRunError("backend nccl needs CUDA, which is not available here; use --backend gloo")
    return requested


def init_distributed(backend: str = "auto", collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> DistInfo:
    """Join (or reuse) the default process group; pick the device from LOCAL_RANK."""
    local_rank = worker_env.read().me.local_rank
    if dist.is_initialized():
        chosen = str(dist.get_backend())
    else:
        chosen = pick_backend(backend)
        if not worker_env.under_torchrun():  # a world of one
            worker_env.be_world_of_one(_free_port())
        if chosen == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(chosen, timeout=timedelta(seconds=collective_timeout))
    if torch.cuda.is_available():  # gloo can drive CUDA tensors too; the backend only moves bytes
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, chosen, node_name())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def collective_device(info: DistInfo) -> torch.device:
    return info.device if info.backend == "nccl" else torch.device("cpu")


def broadcast_int(value: int, info: DistInfo, src: int = 0) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=collective_device(info))
    dist.broadcast(t, src)
    return int(t.item())


def all_gather_ints(value: int, info: DistInfo) -> list[int]:
    t = torch.tensor([value], dtype=torch.int64, device=collective_device(info))
    out = [torch.zeros_like(t) for _ in range(info.world_size)]
    dist.all_gather(out, t)
    return [int(x.item()) for x in out]


def check_shared_dir(root: Path, info: DistInfo) -> None:
    """Every rank must see rank 0's snapshots, or ranks would resume from different steps.

    Rank 0 writes a probe file holding a fresh nonce; every rank reads it back; the
    verdict is all-gathered so that every rank fails with the same one line.
    """
    nonce = secrets.randbits(62) if info.is_main else 0
    probe: Path | None = None
    if info.is_main:
        _remove_stale_probes(root)
        probe = root / f"{_PROBE_PREFIX}{nonce:x}"
        probe.write_text(f"{nonce:x}\n")
    nonce = broadcast_int(nonce, info)
    try:
        seen = (root / f"{_PROBE_PREFIX}{nonce:x}").read_text().strip() == f"{nonce:x}"
    except OSError:
        seen = False
    verdicts = all_gather_ints(int(seen), info)
    if probe is not None:
        probe.unlink(missing_ok=True)
    blind = [r for r, ok in enumerate(verdicts) if not ok]
    if blind:
        if not seen:
            log.error("[%s rank %d] cannot see rank 0's probe file in %s", info.node, info.rank, root)
        raise ElasticRunError(
            f"snapshot directory {root} is not shared: rank(s) {blind} cannot see files rank 0 writes there; "
            "put snapshots on a filesystem every node mounts at the same path"
        )


def _remove_stale_probes(root: Path, older_than_s: float = 60.0) -> None:
    now = time.time()
    for p in root.glob(f"{_PROBE_PREFIX}*"):
        try:
            if now - p.stat().st_mtime > older_than_s:
                p.unlink()
        except OSError:
            pass
