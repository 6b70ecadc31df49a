"""torchrun's world: a process group that cannot lose a member.

The restart path. Every start (the job's first, and each restart the agent makes after a
fault) restores the newest snapshot on every rank; a lost peer ends the worker with exit
code 1, and its agent restarts every worker of the job in a new group.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, NoReturn

import torch.distributed as dist

from . import failure_record, worker_env
from .contract import FailureKind
from .distributed import DistInfo, init_distributed
from .formation import Holding, Joined, Source, StatePlan, TrainingWorld
from .collectives import CollectiveFailure

log = logging.getLogger("elastic.trainer")  # the run's lines, whichever world says them

PEER_STOP_WAIT_S = 10.0  # how long a worker whose peers stopped waits for its own agent


class FixedWorld(TrainingWorld):
    restarts_from_disk = True

    def __init__(self, backend: str, timeout: float, owns_group: bool) -> None:
        self.backend, self.timeout = backend, timeout
        self.owns_group = owns_group  # a group the caller made is the caller's to destroy
        self._info: DistInfo | None = None

    @property
    def round(self) -> int:
        return worker_env.read().me.place.round

    def connect(self) -> DistInfo:
        self._info = init_distributed(self.backend, self.timeout)
        return self._info

    def join(self, min_round: int) -> Joined:
        """torchrun's group, as connected: there is no other."""
        assert self._info is not None, "connect() first"
        return Joined(self._info, round=self.round)

    def plan(self, mine: Holding, info: DistInfo) -> StatePlan:
        """Every rank restores the newest snapshot, as every restart does, and the ranks
        confirm they restored the same step; none on disk: each builds the same fresh
        state from the seed, and DDP's first broadcast aligns it."""
        return StatePlan(Source.DISK, check_same_step=True, init_sync=True)

    def incomplete(self, noticed: str) -> int:
        """torchrun's world forms once per process: a peer lost meanwhile ends the worker, as
        any failed collective of its start always did (its agent restarts it)."""
        raise CollectiveFailure(f"a peer was lost while torchrun's world formed ({noticed})")

    def control_value(self, agree_stop: bool, world_size: int) -> int | None:
        # No rounds to agree on: only a stop, and a world of one decides that alone.
        return 0 if agree_stop and world_size > 1 else None

    def lost_peer(self, step: int, noticed: str, user_collective: str, where: str) -> int:
        """This worker leaves and its agent starts a new group. Exit code 1 as any failed
        worker (the agent restarts it, and refunds the restart once the next round shows a
        peer gone); the line also goes to torchrun's error file, where the agent reads why
        it failed."""
        exit_for_restart(where, step, noticed)

    def peers_stopped(self, step: int, said: str, leavers: list[int], broke: str, where: str, is_main: bool,
                      close: Callable[[], None], stop_signal: Callable[[], int | None]) -> int:
        """This world cannot go on without the leavers. Its agent is about to stop this
        worker anyway (it restarts the world once the leavers' node is gone, or stops this
        group for a new round); exiting first would look like a failure of ours and spend
        one of its restarts. So wait for that, a while; then exit 1."""
        log.warning("%s %s; this world cannot go on without them: waiting up to %.0f s for this node's agent to "
                    "stop this worker and start the world again", where, said, PEER_STOP_WAIT_S)
        close()
        deadline = time.monotonic() + PEER_STOP_WAIT_S
        while stop_signal() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        signum = stop_signal()
        raise SystemExit(128 + signum if signum is not None else 1)

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def exit_for_restart(where: str, step: int, noticed: str) -> NoReturn:
    """One line, also in torchrun's error file with its kind (a peer lost), and exit code 1: the
    agent restarts the worker and never counts it towards a crash loop."""
    message = f"lost a peer in step {step} ({noticed}); the agent restarts this worker"
    log.warning("%s %s", where, message)
    failure_record.record(CollectiveFailure(message), kind=FailureKind.PEER_LOST)  # the agent reads the kind
    raise SystemExit(1)


__all__ = ["FixedWorld", "PEER_STOP_WAIT_S", "exit_for_restart"]
