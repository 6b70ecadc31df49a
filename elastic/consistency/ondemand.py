"""A replica check on demand (``elastic check``): asked of one worker, agreed by all.

A check is a collective, so every rank must run it at the same step boundary; one rank
learns of the request (its agent leaves a file for local rank 0). That rank sets a bit in
the step's control all-reduce (MAX), which every rank reads after the step, so all of them
check at its boundary. The rank that asked writes the outcome (the check's one line) for
its agent, which puts it in etcd for the command to print. The request stays open until a
check answers it: a step abandoned to a lost peer, or a world switch at that boundary,
carries the bit into the next step.

A bit above every round number and below the stop bit: a rank that asks sends
``round | CHECK_BIT``, so MAX may hide a newer round another rank offers for that one step
(it is offered again at the next one), and a stop hides the request (the job stops).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from .. import contract, worker_env

log = logging.getLogger(__name__)

CHECK_BIT = 1 << 61  # in the step's control value (elastic.trainer's _STOP_BIT is 1 << 62)
OFF = ("the replica check is off in this run (check_every_steps=0, ELASTIC_CHECK_EVERY_STEPS=0, "
       "or a model sharded across every node, FSDP2 without a replicate dimension): nothing to compare")
NO_CONTROL = ("this run agrees on nothing per step (handle_sigterm=False): its ranks cannot agree on a step to "
              "check at; the periodic check still runs")


def _path(template: str, where: str | os.PathLike[str], local_rank: int | str) -> Path:
    return Path(where) / template.format(local_rank=local_rank)


def _write(path: Path, body: dict[str, Any]) -> Path:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)  # whole, or not at all
    return path


def request_check(heartbeat_dir: str | os.PathLike[str], request_id: float, local_rank: int = 0) -> Path:
    """The agent's side: ask local rank ``local_rank`` to have the world check its replicas."""
    return _write(_path(contract.CHECK_REQUEST_FILE, heartbeat_dir, local_rank), {"id": request_id})


def take_result(heartbeat_dir: str | os.PathLike[str], local_rank: int = 0) -> dict[str, Any] | None:
    """The agent's side: the outcome a worker left, taken once (None: none yet, or unreadable)."""
    return take_once(_path(contract.CHECK_RESULT_FILE, heartbeat_dir, local_rank))


def take_once(path: Path) -> dict[str, Any] | None:
    """A worker's JSON answer at ``path``, read and removed (None: none yet, or unreadable)."""
    try:
        result = json.loads(path.read_text())
        path.unlink()
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) else None


class CheckRequests:
    """The worker's side: one ``stat`` per step boundary while no request is open."""

    def __init__(self) -> None:
        env = worker_env.read()
        where, local_rank = env.node.heartbeat_dir, env.me.local_rank
        self.path = _path(contract.CHECK_REQUEST_FILE, where, local_rank) if where else None
        self.result = _path(contract.CHECK_RESULT_FILE, where, local_rank) if where else None
        self.pending: float | None = None  # the open request's id

    def poll(self, check_on: bool, step: int) -> bool:
        """Take a new request; True while one is open (this rank then sets :data:`CHECK_BIT`)."""
        if self.pending is None and self.path is not None and os.path.exists(self.path):
            try:
                request = json.loads(self.path.read_text())
                self.path.unlink()
                self.pending = float(request["id"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("a replica check request was not understood: %s", exc)
                return False
            if not check_on:
                self.answer(step, False, OFF)
        return self.pending is not None

    def answer(self, step: int, agreed: bool, line: str) -> None:
        """The outcome of the first check since the request (or why none can run)."""
        if self.pending is None or self.result is None:
            return
        try:
            _write(self.result, {"id": self.pending, "step": step, "agreed": agreed, "line": line})
        except OSError as exc:
            log.warning("could not leave the replica check's outcome for the agent: %s", exc)
        self.pending = None


__all__ = ["CHECK_BIT", "CheckRequests", "NO_CONTROL", "OFF", "request_check", "take_result"]
