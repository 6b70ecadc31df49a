"""torchrun's world: a process group that cannot lose a member.

The restart path. Every start (the job's first, and each restart the agent makes after a
fault) restores the newest snapshot on every rank; a lost peer ends the worker with exit
code 1, and its agent restarts every worker of the job in a new group.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from . import worker_env
from .distributed import DistInfo, ElasticRunError, all_gather_ints, init_distributed
from .grad_sync import CollectiveFailure
from .world import TrainingWorld

if TYPE_CHECKING:
    from .trainer import ElasticRun

log = logging.getLogger("elastic.trainer")  # the run's lines, whichever world says them

PEER_STOP_WAIT_S = 10.0  # how long a worker whose peers stopped waits for its own agent


class FixedWorld(TrainingWorld):
    restarts_from_disk = True

    def __init__(self, run: "ElasticRun", backend: str, timeout: float, owns_group: bool) -> None:
        super().__init__(run)
        self.backend, self.timeout = backend, timeout
        self.owns_group = owns_group  # a group the caller made is the caller's to destroy

    @property
    def round(self) -> int:
        return worker_env.read().me.place.round

    def connect(self) -> DistInfo:
        return init_distributed(self.backend, self.timeout)

    def start(self) -> None:
        """Every rank restores the newest snapshot, as every restart does."""
        run = self.run
        t0 = time.perf_counter()
        run.goodput.forming("start")
        run.snapshots.attach(run.dist)
        step, written_at = run._restore_newest()
        run.metrics.state_from("disk" if step >= 0 else "fresh")
        steps = all_gather_ints(run.state.step, run.dist)
        if len(set(steps)) != 1:
            raise ElasticRunError(
                f"ranks restored different steps {steps}; the snapshot directory changed under the job - "
                "make sure only this job writes to it"
            )
        run._holds_state()
        run.sync.build(run.dist, init_sync=True)
        run.metrics.restored(time.perf_counter() - t0, written_at)
        run.goodput.formed((), run.dist.rank)

    def control_value(self, agree_stop: bool) -> int | None:
        # No rounds to agree on: only a stop, and a world of one decides that alone.
        return 0 if agree_stop and self.run.dist.world_size > 1 else None

    def lost_peer(self, step: int, noticed: str, user_collective: str) -> None:
        """This worker leaves and its agent starts a new group. Exit code 1 as any failed
        worker (the agent restarts it, and refunds the restart once the next round shows a
        peer gone); the line also goes to torchrun's error file, where the agent reads why
        it failed."""
        exit_for_restart(self.run._where, step, noticed)

    def peers_stopped(self, step: int, said: str, leavers: list[int], broke: str) -> None:
        """This world cannot go on without the leavers. Its agent is about to stop this
        worker anyway (it restarts the world once the leavers' node is gone, or stops this
        group for a new round); exiting first would look like a failure of ours and spend
        one of its restarts. So wait for that, a while; then exit 1."""
        run = self.run
        log.warning("%s %s; this world cannot go on without them: waiting up to %.0f s for this node's agent to "
                    "stop this worker and start the world again", run._where, said, PEER_STOP_WAIT_S)
        run.close()
        deadline = time.monotonic() + PEER_STOP_WAIT_S
        while run._stop_signal is None and time.monotonic() < deadline:
            time.sleep(0.05)
        raise SystemExit(128 + run._stop_signal if run._stop_signal is not None else 1)

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def exit_for_restart(where: str, step: int, noticed: str) -> None:
    """One line, also in torchrun's error file, and exit code 1: the agent restarts the worker."""
    message = f"lost a peer in step {step} ({noticed}); the agent restarts this worker"
    log.warning("%s %s", where, message)
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(CollectiveFailure(message))
    except OSError as exc:
        log.debug("cannot write the error file: %s", exc)
    raise SystemExit(1)


__all__ = ["FixedWorld", "PEER_STOP_WAIT_S", "exit_for_restart"]
