"""The snapshot writer process: serialise, hash, fsync and rename, away from the trainer.

Started by :class:`~checkpoints.procwriter.WriterProcess`, whose bootstrap has already set
the priority (before torch is imported, so every thread here inherits it), made this
process die with the trainer (``PR_SET_PDEATHSIG``: a write whose trainer is gone leaves
a temp dir, never a snapshot nobody asked for) and ignored SIGINT and SIGTERM (a Ctrl-C
or a signal to the trainer's process group must not kill a write the trainer is about to
flush). It reads the staged tensors from the shared arena and saves them with the same
:meth:`SnapshotStore.save` as a synchronous save, so the on-disk protocol and its crash
guarantees are one code path.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch

from . import wire
from .arena import map_arena
from .errors import SnapshotError
from .store import SnapshotStore
from .stores import open_store


def main(sock_fd: int) -> None:
    torch.set_num_threads(1)
    sock = socket.socket(fileno=sock_fd)
    try:
        wire.send(sock, {"op": "ready", "pid": os.getpid()})
        serve(sock)
    except (OSError, EOFError):
        pass  # the trainer closed the channel or is gone: nothing is waiting for us


def serve(sock: socket.socket) -> None:
    tensors: list[torch.Tensor] = []
    donor: list[torch.Tensor] = []  # a host copy taken as it is, for the next job only
    stores: dict[tuple[Any, ...], SnapshotStore] = {}
    while True:
        try:
            msg, fds = wire.recv(sock)
        except EOFError:
            return
        op = msg.get("op")
        if op == "arena":
            tensors = map_arena(fds[0], int(msg["size"]), msg["specs"])
        elif op == "donor":
            donor = map_arena(fds[0], int(msg["size"]), msg["specs"])
        elif op == "job":
            reply, store = _job(msg, tensors + donor, stores)
            donor = []  # its pages go with the host copy, not kept here until the next one
            wire.send(sock, reply)  # durable: the trainer need not wait for the pruning
            c0 = time.process_time()
            if store is not None:
                store.housekeep()
            wire.send(sock, {"op": "housekept", "cpu_s": time.process_time() - c0})
        elif op == "exit":
            return


def _job(msg: dict[str, Any], tensors: list[torch.Tensor],
         stores: dict[tuple[Any, ...], SnapshotStore]) -> tuple[dict[str, Any], SnapshotStore | None]:
    """The reply, and the store to housekeep once it is sent (None after a failure)."""
    t0, c0 = time.perf_counter(), time.process_time()
    step = msg["step"]
    try:
        cfg = msg["store"]
        key = tuple(sorted(cfg.items()))
        store = stores.get(key)
        if store is None:
            store = stores[key] = open_store(  # a directory or s3://
                cfg["root"], keep=cfg["keep"], if_exists=cfg["if_exists"], create=False,
                io_threads=cfg["io_threads"], stale_temp_grace_s=cfg["stale_temp_grace_s"], propagate_nice=False,
                recycle=cfg["recycle"], key=bytes.fromhex(cfg["key"]) if cfg.get("key") else None,
            )
        state = wire.decode(msg["state"], tensors)
        info = store.save(step, state, world_size=msg["world_size"], extra_meta=msg["extra_meta"], housekeeping=False)
    except SnapshotError as e:
        return {"op": "error", "kind": type(e).__name__, "message": str(e)}, None
    except Exception as e:  # noqa: BLE001 - reported to the trainer, which raises it at flush()
        return {"op": "error", "kind": "SnapshotError",
                "message": f"snapshot step {step} failed in the writer process: {type(e).__name__}: {e}"}, None
    return {
        "op": "done", "step": info.step, "path": str(info.path), "world_size": info.world_size,
        "written_at": info.written_at, "size_bytes": info.size_bytes, "torch_version": info.torch_version,
        "extra_meta": dict(info.extra_meta), "write_s": time.perf_counter() - t0,
        "cpu_s": time.process_time() - c0,
    }, store
