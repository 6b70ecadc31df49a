"""``ElasticRun``: a plain training loop that survives node loss and world-size changes.

    run = ElasticRun(model, optimizer, dataset, global_batch_size=64, epochs=10,
                     snapshot_dir="/shared/ckpt/job1")
    for x, y in run:                       # this rank's share of the next global batch
        loss = loss_fn(run.model(x), y)    # mean over the local batch, as usual
        if run.step(loss):                 # backward, all-reduce, commit, optimizer step: trained
            ...                            # per-step side effects, registered state (run.register)

The run is a small state machine, read top to bottom in this file, with two parts of it
in modules of their own, objects the run holds (each with its own state and a stated
contract with the run): forming a world and losing one (1 and 3, ``run._worlds``,
:mod:`elastic.restore`) and stopping on SIGTERM (5, ``run._stop``, :mod:`elastic.stopping`).
The file stays near 800 lines on purpose: what is left is one step, whose order of
collectives, commit and optimizer step is the exactly-once contract, and it reads best as
one sequence.

1. **Form a world.** The run trains in one of two worlds (:mod:`elastic.world`), chosen
   once and asked at every moment where the recovery paths differ. Under ``elastic agent``
   with a torch that can reconfigure a process group, :mod:`elastic.inplace.in_place_world`:
   the process joins the round its agent offers, the ranks agree on the step to go on from
   (the highest step any rank holding state completed) and every rank that stands
   elsewhere is healed from one that holds it; only when no rank holds state (the job's
   start, or every replica lost) is the newest snapshot read from disk. Otherwise (plain
   torchrun, ``--no-in-place``, an older torch) :mod:`elastic.fixed_world`: torchrun's
   process group, and every rank restores the newest snapshot, as a restart always does.
   Either world only says what to do (:mod:`elastic.formation`: the group, and restore
   from disk, heal from a peer or start fresh); the run does it, in one restore sequence.
2. **Train.** Each step: this rank's share of the next global batch (:mod:`elastic.plan`),
   the user's forward and loss, then in :meth:`step` every collective of the step
   (:mod:`elastic.grad_sync`), the commit of the previous step (ledger line, snapshot:
   :mod:`elastic.snapshots`), and only then the optimizer step. RNGs are reseeded from
   ``(seed, step, rank)`` so dropout and augmentation do not depend on restarts. With
   :mod:`elastic.prepare` (``user_backward``) the script runs the backward itself, its
   gradient all-reduce records a failure instead of raising, and its ``optimizer.step()``
   calls :meth:`step_after_backward`, the same step from there on.
3. **A collective fails.** The step is abandoned whole (no optimizer step was taken, so no
   state is half-applied) and the world answers (``lost_peer``): in place it forms again
   (1) and the same batch is re-split over the new ranks; torchrun's world ends the worker
   and its agent restarts it.
4. **A node joins.** Every step's tiny control all-reduce carries the newest round whose
   members are all ready; all ranks see it in the same step and switch to it (1) at the
   top of the loop, after the loop's code for that step, so that what the loop registered
   (:mod:`elastic.user_state`) stands at that step too; then they heal the joiner from a
   live replica. Survivors stand still only for that. A joiner's own set-up (its script
   before the loop) runs in a world of its own (:mod:`elastic.worker_env`), and it joins
   at its loop's first batch, so its set-up collectives never meet the survivors' steps.
   The script's own collectives in the loop body fail the step, as the run's do
   (:mod:`elastic.inplace.user_collectives`); ``run.on_new_world(fn)`` runs per-world
   set-up on every rank after each formation.
5. **End.** After the last step a final all-reduce confirms every rank finished it; rank 0
   commits it and writes the final snapshot. **SIGTERM** (a pre-emption: Kubernetes, a spot
   VM, the agent passing its own on) is agreed on through the step's control all-reduce, so
   every rank stops after the same step: they finish it, confirm it with one more
   all-reduce, rank 0 commits it and writes its snapshot synchronously, and the ranks that
   got the signal exit with 128 + 15. Ranks that did not (another node was pre-empted) go
   on: in place they re-form without the leavers; otherwise they exit so that their agent
   restarts the world. A resume then retrains nothing.

A **usage error** (:class:`ElasticRunError`, a snapshot from another model) raised while the
run is built ends the process with one ``error:`` line and exit code 2 (rank 0 speaks for
errors every rank hits), so that an agent never restarts what would fail again.

The loss passed to ``step`` must be the *mean* over the local batch (the default of
torch's losses). It is rescaled by ``local_n / global_n`` so that the sum over ranks is the
mean over the global batch, uneven splits included; a rank whose share is empty (the
epoch's tail) trains on one stand-in sample with its loss scaled by zero.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import logging
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from checkpoints import SnapshotMismatchError
from checkpoints.location import LocationError
from checkpoints.stores import location_of

from . import contract, worker_env
from .consistency.check import ReplicaCheck
from .consistency.inject import FlipRequests
from .consistency.nonfinite import Do, grads_finite, skip_setting
from .consistency.unreplicated import step_without_replica
from .consistency.ondemand import CHECK_BIT, NO_CONTROL, CheckRequests
from .consistency.report import check_interval, report_mismatch
from .distributed import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DistInfo,
    ElasticRunError,
    broadcast_int,
    collective_device,
    node_name,
)
from .fixed_world import FixedWorld
from .goodput.recorder import GoodputLog
from .collectives import first_line
from .grad_sync import CollectiveFailure, GradSync, is_collective_failure
from .heartbeat import Heartbeat
from .host_shards import host_shards
from .inplace import node_verdict
from .inplace.memory_copies import MemoryCopies, World as CopyWorld
from .inplace.peer_copies import PeerCopies, copy_for_snapshot, peer_copies_asked, peer_copy_setting
from .inplace.user_collectives import Guard, owned
from .log import Noticed, show_library_lines
from . import sharded
from .own_group import taken_over_line, unwrap_ddp
from .plan import DataPlan
from .progress import take_over as take_over_progress
from .restore import WorldForming
from .run_config import DataConfig, SnapshotConfig, checked, refuse_flat_keywords
from .seeding import seed_everything, step_seed
from .snapshots import FinalSnapshotLost, Snapshots
from .step_result import StepResult
from .stopping import STOP_BIT, SignalStop
from .train_state import TrainState
from .world import TrainingWorld, choose_world

log = logging.getLogger(__name__)



class UsageExit(SystemExit, ElasticRunError):
    """A usage error out of ``ElasticRun``: uncaught, the process exits 2 without a traceback
    (its one line is already out, and an agent never restarts it); a caller that catches
    :class:`ElasticRunError` around the constructor still can."""

    def __init__(self, message: str) -> None:
        SystemExit.__init__(self, contract.USAGE_ERROR_EXIT)
        self.message = message

    def __str__(self) -> str:
        return self.message
_USAGE_ERRORS = (ElasticRunError, SnapshotMismatchError)  # every rank hits these alike


def _snapshot_root(snapshot_dir: str | Path) -> str | Path:
    """The store's location for ``snapshot_dir``; a misspelt ``s3://`` (``s3:/x``) is a usage
    error: as a directory, the job would snapshot into ``./s3:/x/`` and end with exit 0."""
    try:
        return location_of(snapshot_dir)
    except LocationError as e:
        raise ElasticRunError(str(e)) from None
_NO_LOSS = torch.tensor(float("nan"))  # metrics and hooks of a step whose loss the run never saw
_T = TypeVar("_T")


@dataclass(frozen=True)
class StepInfo:
    """What ``on_step_end`` receives after every completed step, on every rank.

    ``loss`` is this rank's unscaled loss, detached; ``float(info.loss)`` synchronises
    with the GPU, so a metrics hook should do it only when it actually exports.
    """

    step: int
    epoch: int
    samples: int  # in this step's global batch
    total_samples: int  # since the job began, across restarts and re-formations
    local_samples: int
    loss: torch.Tensor
    step_seconds: float
    data_wait_seconds: float
    world_size: int
    rank: int
    node: str
    round: int = -1  # the rendezvous round this step was trained in (-1: not under elastic agent)


@dataclass
class _Pending:
    """Between yielding a batch and ``step(loss)``."""

    ids: list[int]
    local_n: int
    started: float
    data_wait: float
    tokens: int | None
    control: Any = None
    failure: CollectiveFailure | None = None


class ElasticRun:
    """Fault-tolerant DDP loop over ``dataset``; iterate it and call ``step(loss)`` per batch.

    ``global_batch_size`` stays the same at every world size by default (each rank gets
    ``global / world``, uneven splits allowed). ``data=DataConfig(batch_policy=
    "fixed-per-rank", per_rank_batch_size=...)`` instead keeps the per-rank batch and scales
    the learning rate linearly with the resulting global batch (``lr * per_rank * world /
    global_batch_size``); ``DataConfig`` also holds the loader's ``num_workers`` and
    ``collate_fn``. ``snapshots=SnapshotConfig(...)`` says when rank 0 snapshots, how many
    it keeps, and its ledger (:mod:`elastic.run_config`; a flat keyword of earlier releases,
    ``snapshot_every_steps=`` and the like, is a ``TypeError`` naming its grouped form).

    ``run.model`` is the DDP-wrapped model of the current world; use it each step (it is
    built again when the world changes in place). BatchNorm buffers are rank 0's, as with
    DDP's default. ``metrics=False`` records no metrics and installs no comm hook.
    ``count_tokens(batch) -> int`` feeds ``elastic_tokens_total``. ``in_place=False`` keeps
    the restart path even where in-place recovery is possible (the default, None, uses it
    whenever the agent and torch allow). ``device`` is where the run trains: None, this
    rank's GPU (``LOCAL_RANK``) when CUDA is available, else the CPU; the prepare API
    passes the model's own, so a script that trains on the CPU keeps doing so on a GPU node.

    ``run.register(name, obj)`` adds the loop's own state to what is healed and snapshotted;
    ``run.rank``, ``run.world_size``, ``run.is_main`` and ``run.epoch`` are always current.
    A ``DistributedDataParallel`` passed as ``model``, and a default group the script made
    itself, are taken over (:mod:`elastic.own_group`), so in-place recovery stays on.
    """

    # Set in __init__, typed here: its parts (run._stop, run._worlds) take the run as their
    # contract says before these are assigned, and a type checker then needs them declared.
    metrics: Any
    goodput: GoodputLog
    _dist: DistInfo
    _guards_nonfinite: bool  # set through the guards_nonfinite property, which also sets the check's and GradSync's

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Dataset[Any],
        *,
        global_batch_size: int,
        snapshot_dir: str | Path,
        steps: int | None = None,
        epochs: int | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        seed: int = 0,
        snapshots: SnapshotConfig | None = None,
        data: DataConfig | None = None,
        backend: str = "auto",
        collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        on_step_end: Callable[[StepInfo], None] | None = None,
        max_grad_norm: float | None = None,
        handle_sigterm: bool = True,
        metrics: bool = True,
        count_tokens: Callable[[Any], int] | None = None,
        in_place: bool | None = None,
        user_backward: bool = False,
        device: str | torch.device | None = None,
        check_every_steps: int | None = None,
        peer_copy_every: int | None = None,
        **flat_keywords: Any,
    ) -> None:
        refuse_flat_keywords(flat_keywords)  # before anything starts: the grouped form is the one way (0.1.0)
        show_library_lines()  # the lines below reach the user even if their script set up no logging
        self._stop = SignalStop(self)  # 6., stopping on SIGTERM after an agreed step (elastic.stopping)
        self._worlds = WorldForming(self)  # 1. and 3., forming a world and losing one (elastic.restore)
        self._closed = False
        self.snapshots: Any = None
        self._device = torch.device(device) if device is not None else None
        owns_group = not dist.is_initialized()  # a caller's group is the caller's to destroy
        # Until a world is chosen, closing the run is closing torchrun's (a usage error on the way in).
        self.world: TrainingWorld = FixedWorld(backend, collective_timeout, owns_group)
        self._batch_epoch: int | None = None  # the epoch of the batch the loop holds (run.epoch)
        self._between_steps: Callable[[], None] | None = None  # agreed in run.step, done after the loop's code
        self._agree_stop = False  # a stop is agreed through the control all-reduce (off: handle_sigterm=False)
        self._guard = Guard()  # the script's own collectives: a lost peer fails the step (user_collectives)
        self._world_hooks: list[Callable[["ElasticRun"], None]] = []
        self._world_hook_due = True  # a world formed since the hooks last ran
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._stop.on_sigterm)
            self._agree_stop = True
        try:
            if steps is None and epochs is None:
                raise ElasticRunError("give steps= or epochs= (or both; the run stops at whichever comes first)")
            if global_batch_size < 1:
                raise ElasticRunError(f"global batch size must be >= 1, got {global_batch_size}")
            root = _snapshot_root(snapshot_dir)  # a misspelt s3:// is refused before a world forms
            snapshot_config, data_config = checked(snapshots, data)
            self.steps_target, self.epochs_target = steps, epochs
            self.seed, self.max_grad_norm, self.on_step_end = seed, max_grad_norm, on_step_end
            self.count_tokens = count_tokens
            self._check = ReplicaCheck(check_interval(check_every_steps),
                                       on_mismatch=lambda m, d: report_mismatch(m, d, self.metrics, self.goodput),
                                       snapshot_every_steps=snapshot_config.every_steps)
            self._flips = FlipRequests()  # `elastic inject-sdc`: a bit flipped on request, to rehearse
            self._asks = CheckRequests()  # `elastic check`: a replica check at the next step, on request
            self._check_due = False  # set by a step every rank of the world applied: all check, or none
            try:
                self._skip_nonfinite = skip_setting()  # a batch whose gradients stay non-finite: skipped, or the end
            except ValueError as exc:
                raise ElasticRunError(str(exc)) from None
            self._recomputed = -1  # the step last computed again for non-finite gradients (once per step)
            self._stop_uncommitted = False  # the job stops with a non-finite shard: nothing of it is committed

            self.plan = DataPlan(dataset, global_batch_size=global_batch_size, seed=seed, config=data_config)
            self.mesh = sharded.check(model, optimizer, _local_world_size())  # FSDP2: never wrapped in DDP
            self.hsdp: Any = None  # HSDP in place: the takeover of the script's mesh (elastic.inplace.hsdp)
            self.fsdp: Any = None  # FSDP across every node, in place from peer memory (set below)
            if self.mesh is not None and tuple(self.mesh.kinds) == ("replicate", "shard"):
                self._check.shard_ranks = self.mesh.shape[1]  # HSDP: each shard's replicas vote among themselves
            elif self.mesh is not None:  # FSDP across every node: no replica of any shard to compare with
                self._check.every_steps = 0
            self._replicated = self.mesh is None or bool(self._check.shard_ranks)  # a replica to vote with
            model, took_ddp = unwrap_ddp(model, self)  # the script's DDP: the run builds its own per world
            self.state = TrainState(model, optimizer, self.plan.sampler, scheduler, scaler)
            self.state.sharded = self.mesh is not None
            if self.mesh is not None:
                sharded.check_snapshots(snapshot_config.every_seconds)
            self.world = choose_world(backend, collective_timeout, in_place, owns_group,
                                      off_reason=sharded.restart_reason(model, self.mesh,
                                                                        peer_copies_asked(peer_copy_every)))
            self.dist = self.world.connect()
            if (took_ddp or self.world.took_group) and self.dist.is_main and not self.world.in_setup_world:
                log.info("%s %s", self._where, taken_over_line(took_ddp, self.world.took_group))
            self.metrics = self._start_metrics(metrics)
            self.state.module.to(self.dist.device)
            self.sync = GradSync(self.state.module, self.metrics, user_backward, sharded=self.mesh is not None)
            # Each step's all-reduced gradients are looked at before they are applied (consistency.nonfinite):
            # DDP's sum is every rank's alike; a sharded model's flags meet in one tiny all-reduce after its
            # backward (GradSync.agree_on_failure). Not under a GradScaler (non-finite gradients are its to skip).
            self.guards_nonfinite = not (scaler is not None and scaler.is_enabled())
            self.hsdp = sharded.take_over(self.state.module, self.mesh, self.world, self.sync)  # HSDP in place
            if self.hsdp is not None:  # its all-reduce across replicas, timed like DDP's
                self.hsdp.timer = getattr(self.metrics, "replicate_timer", lambda: None)()
                self.sync.agree_each_step = True  # ... and on disjoint groups: the ranks agree on each step
            # HSDP in place: a node applies each step on all of its ranks or on none
            self._node_verdict = node_verdict.for_this_node(self.hsdp.shard_size) if self.hsdp is not None else None
            self.snapshots = Snapshots(root, snapshot_config, metrics=self.metrics,
                                       round_of=lambda: self.round)  # the fence token: a stale group commits nothing
            self.snapshots.collective = self.mesh is not None  # every rank takes part in a sharded snapshot
            # in place, the sharded snapshots' own group joins the world's socket fence
            self.snapshots.socket_fence = getattr(getattr(self.world, "membership", None), "fence", None)
            self.state.shards_in_snapshots = self.snapshots.per_rank  # ... each writing its own shards
            # each rank's state in the host memory of a buddy on another node (elastic.inplace.peer_copies)
            self.copies = PeerCopies(peer_copy_setting(peer_copy_every, self.mesh, self.dist, self._where),
                                     self.metrics)
            # ... and the own copy in the node agent's shared memory: a restarted worker loads it (memory_copies)
            self.copies.memory = MemoryCopies.from_env() if self.copies.on else None
            self.copies.world_of = self._memory_world
            # FSDP across every node, in place: a lost node's shards from the buddies' copies (elastic.inplace.fsdp_in_place)
            self.fsdp = sharded.take_over_fsdp(self.state.module, self.state.optimizer, self.mesh, self.world, self.sync,
                                               self.copies)
            self._pending: _Pending | None = None
            self._generation = 0  # bumped at every change of world: the loader is built again
            self._has_state = False  # a fresh process holds nothing until restored or healed
            self._committed = -1  # the last step whose ledger line and snapshot turn are done
            self.resumed_from = 0
            take_over_progress()  # committed steps, not optimizer calls, are this job's progress
            self._heartbeat = Heartbeat.from_env()  # the agent's hang watchdog reads it
            self.goodput = GoodputLog.from_env()  # where this process's time went, for the job's goodput
            if self._heartbeat is not None and threading.current_thread() is threading.main_thread():
                faulthandler.register(signal.SIGUSR1, all_threads=True)  # the watchdog's stack dump
            if self.world.in_setup_world:  # a joiner: run.model for set-up code; built again when it joins
                self.sync.build(self.dist)
            else:
                self._worlds.form("start")
            self._guard.install()
            if self.mesh is not None and user_backward and self.world.restarts_from_disk:
                # kept to the process's end: the failure surfaces after the loop's generator is gone
                sharded.quiet_lost_peer(lambda: self._where, lambda: self.state.step + 1)
        except _USAGE_ERRORS as exc:
            self._usage_error(exc)
        finally:
            self._stop.forming = False

    # ------------------------------------------------------------------ public views

    @property
    def model(self) -> DistributedDataParallel:
        """DDP of the current world around the script's module (a sharded model: the model itself)."""
        assert self.sync.model is not None
        return self.sync.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    @property
    def sampler(self) -> Any:
        return self.plan.sampler

    @property
    def writer(self) -> Any:
        return self.snapshots.writer

    @property
    def step_count(self) -> int:
        return self.state.step

    @property
    def total_samples(self) -> int:
        return self.state.samples

    @property
    def round(self) -> int:
        return self.world.round

    # Always the current world's (in place they change at a re-formation, in the same process;
    # os.environ's RANK, WORLD_SIZE, GROUP_RANK and LOCAL_WORLD_SIZE are rewritten to match).

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def dist(self) -> DistInfo:
        """The current world as this rank sees it, on the device the run trains on."""
        return self._dist

    @dist.setter
    def dist(self, info: DistInfo) -> None:
        if self._device is not None and self._device != info.device:
            if info.backend == "nccl" and self._device.type != "cuda":
                raise ElasticRunError(f"the model is on {self._device} but the backend is nccl, which needs it on a "
                                      "GPU: move it with model.to(local_rank) before prepare, or use backend gloo")
            info = replace(info, device=self._device)
        self._dist = info

    @property
    def local_rank(self) -> int:
        return self.dist.local_rank

    @property
    def world_size(self) -> int:
        return self.dist.world_size

    @property
    def is_main(self) -> bool:
        """Rank 0 now: the rank that should print, save and time for the job."""
        return self.dist.is_main

    @property
    def epoch(self) -> int:
        """The epoch of the batch in hand (in the loop body); before the loop, the next one's."""
        return self._batch_epoch if self._batch_epoch is not None else self.plan.sampler.epoch

    def register(self, name: str, obj: _T) -> _T:
        """Make ``obj`` (a dict, a list, a tensor, or anything with ``state_dict``/``load_state_dict``)
        part of the run's state: healed into a joiner and saved in snapshots with the model,
        as of the last committed step (:mod:`elastic.user_state`). Returns ``obj``; register
        before the loop, and change it only after ``run.step(loss)`` returned true."""
        try:
            return self.state.user.register(name, obj)
        except ElasticRunError as exc:
            self._usage_error(exc)
            raise  # not reached: _usage_error raises

    def on_new_world(self, fn: Callable[["ElasticRun"], None]) -> Callable[["ElasticRun"], None]:
        """Run ``fn(run)`` on every rank whenever a world has formed: before the first step, and
        after every re-formation (a node lost or joined), at the step boundary, with the new
        world in place and before the next step. The one place for set-up that must agree
        across the current world's ranks, survivors and joiners alike (a subgroup, a config
        broadcast, a barrier). A collective in it that fails because a peer was lost fails
        the next step, which is re-formed in place: ``fn`` then runs again. Returns ``fn``,
        so it can be used as a decorator."""
        self._world_hooks.append(fn)
        return fn

    @property
    def replica_check(self) -> ReplicaCheck:
        """The run's replica consistency check (:class:`elastic.consistency.check.ReplicaCheck`).
        The loop drives it by itself (``check_every_steps``); public so that a benchmark can
        call it by hand to time it alone (``bench/replica_check.py``), and a test can reach
        the state it keeps, without reading the run's private members."""
        return self._check

    @property
    def guards_nonfinite(self) -> bool:
        """Whether each step's all-reduced gradients are looked at for a NaN or an Inf before
        they are applied (:mod:`elastic.consistency.nonfinite`; on unless a GradScaler is
        enabled, whose own job that is). Settable so that a benchmark can time the look
        against the plain step in the same processes (``bench/nonfinite_guard.py``): setting
        it leaves the run as if it had been built so. A script has no reason to."""
        return self._guards_nonfinite

    @guards_nonfinite.setter
    def guards_nonfinite(self, on: bool) -> None:
        self._guards_nonfinite = self._check.guarded = on
        self.sync.guard_nonfinite = on and self.mesh is not None

    @property
    def step_in_hand(self) -> bool:
        """A batch was yielded and its step is not taken yet (:meth:`step` or
        :meth:`step_after_backward`). Public for :mod:`elastic.prepare`, whose ``optimizer.step()``
        tells a missed or a doubled call apart by it."""
        return self._pending is not None

    @property
    def done(self) -> bool:
        return (self.steps_target is not None and self.state.step >= self.steps_target) or (
            self.epochs_target is not None and self.plan.sampler.epoch >= self.epochs_target
        )

    @property
    def _where(self) -> str:
        return f"[{self.dist.node} rank {self.dist.rank}]"

    # ------------------------------------------------------------------ 1. forming a world (the sequence: restore.py)

    def _start_metrics(self, wanted: bool) -> Any:
        from .metrics.training import NoMetrics

        if not wanted:
            return NoMetrics()
        from .metrics.export import MetricsConfigError
        from .metrics.training import TrainingMetrics

        try:
            return TrainingMetrics(self.dist)
        except MetricsConfigError as e:
            raise _OwnUsageError(str(e)) from None

    def _new_world(self) -> None:
        """A world formed anew: the loader is built again and the per-world hooks run again."""
        self._generation += 1
        self._world_hook_due = True
        self._guard.take()  # a user collective that failed in the old world: that world is gone
        self._check.forget()  # every rank of the new world keeps a baseline at its first batch
        if self.fsdp is None:  # (FSDP in place: done as the world formed, _seed_copies)
            self.copies.world_formed(self.round)  # the buddies are assigned again at the next copy

    # ------------------------------------------------------------------ 2. training

    def __iter__(self) -> Iterator[Any]:
        try:
            with owned():
                if self.world.enter_loop(self.dist.local_rank, self._stop.between_worlds):  # a joiner's set-up is done
                    self._guard.take()  # a failure in the set-up world was that world's
                    self._worlds.form("join")
            self._t0 = time.perf_counter()
            while True:
                while not self.done:
                    generation, epoch = self._generation, self.plan.sampler.epoch
                    on_cuda = self.dist.device.type == "cuda"
                    for batch, ids, local_n in self.plan.batches(self.dist.rank, self.dist.world_size, on_cuda):
                        self._begin(batch, ids, local_n)
                        if self.sync.user_backward:
                            self._before_user_backward()
                        self._batch_epoch = epoch
                        yield self._to_device(batch)
                        if self._pending is not None:
                            raise ElasticRunError("call run.step(loss) exactly once for every batch the run yields")
                        self._at_step_boundary()
                        if self._stop.leaving:
                            self._stop.leave()
                        if self.done or self.plan.sampler.epoch != epoch or self._generation != generation:
                            break
                        self._t0 = time.perf_counter()
                if self._finish():
                    return
        finally:
            self.close()

    def _begin(self, batch: Any, ids: list[int], local_n: int) -> None:
        if self._world_hook_due:
            self._world_hook_due = False
            for hook in self._world_hooks:
                hook(self)
            self._check.baseline(self)  # every replica just restored or healed the same state
        now = time.perf_counter()
        started = getattr(self, "_t0", now)
        seed_everything(step_seed(self.seed, self.state.step, self.dist.rank))
        tokens = self.count_tokens(batch) if self.count_tokens is not None else None
        self._pending = _Pending(ids, local_n, started, now - started, tokens)
        failure = self._guard.take()  # the script's own collective (set-up, the hook) lost a peer
        if failure is not None:
            self._pending.failure = failure
            return
        replaced_by = self.world.replaced_by()
        if replaced_by is not None:  # a world of one has no collective to fail: give way here
            self._pending.failure = CollectiveFailure(f"round {replaced_by} replaces this world",
                                                       noticed=Noticed.BY_THE_AGENTS)
            return
        # What the world agrees on each step (the newest round every rank could switch to) and
        # whether this rank was told to stop: one tiny all-reduce (MAX) that overlaps forward
        # and backward. None: nothing to agree on.
        value = self.world.control_value(self._agree_stop, self.dist.world_size)
        if value is None:
            if self._asks.pending is not None and self.dist.world_size > 1:
                self._asks.answer(self.state.step, False, NO_CONTROL)
            return
        if self._asks.pending is not None:
            value += CHECK_BIT  # every rank checks at this step's boundary (elastic.consistency.ondemand)
        if self._stop.signal is not None:
            value += STOP_BIT
        try:
            with owned():
                self._pending.control = self.sync.start_control(value)
        except CollectiveFailure as exc:
            self._pending.failure = exc

    def _to_device(self, batch: Any) -> Any:
        if self.dist.device.type == "cpu":
            return batch
        if isinstance(batch, torch.Tensor):
            return batch.to(self.dist.device, non_blocking=True)
        if isinstance(batch, (list, tuple)):
            return type(batch)(self._to_device(b) for b in batch)
        if isinstance(batch, dict):
            return {k: self._to_device(v) for k, v in batch.items()}
        return batch

    def step(self, loss: torch.Tensor) -> StepResult:
        """Every collective, then the commit of the previous step, then the optimizer step.

        Returns a :class:`StepResult`, true when the batch was trained and false when the
        step was abandoned (a peer was lost; the world formed again in place): per-step side
        effects go under ``if run.step(loss):``."""
        if self._pending is None:
            raise ElasticRunError("run.step(loss) called without a batch; call it once per batch of the loop")
        if self.sync.user_backward:
            raise ElasticRunError("this run was prepared (elastic.Elastic): call loss.backward() and optimizer.step()")
        pending, self._pending = self._pending, None
        d, ids = self.dist, pending.ids
        scale = self.plan.loss_scale(pending.local_n, len(ids), d.world_size, self.sync.averages)
        failure = pending.failure or self._guard.take()  # the script's own collective in the loop body
        with owned():
            try:
                if failure is not None:
                    raise failure
                self.sync.backward(loss if scale == 1.0 else loss * scale, self.state.scaler)
                ready = self._after_backward(pending)
            except CollectiveFailure as exc:
                return self._abandon(exc)
        return self._apply(pending, loss, ready)

    def _before_user_backward(self) -> None:
        """``user_backward`` (:mod:`elastic.prepare`): the script runs the backward itself, so
        the step's loss scale goes into the comm hook, and a world already known broken
        makes the hook skip its all-reduces (the step is abandoned at the commit point)."""
        pending = self._pending
        assert pending is not None
        self.sync.failure = None
        self.sync.grad_scale = self.plan.loss_scale(pending.local_n, len(pending.ids), self.dist.world_size, False)
        if pending.failure is not None:
            self.sync.failure = str(pending.failure)

    def step_after_backward(self) -> StepResult:
        """The rest of :meth:`step` when the script ran ``loss.backward()`` itself (``user_backward``):
        the commit point of :mod:`elastic.prepare`'s optimizer. A gradient all-reduce that failed
        in that backward was recorded by the comm hook; the step is then abandoned here."""
        if self._pending is None:
            raise ElasticRunError("optimizer.step() called twice for one batch, or outside the loader's loop; "
                                  "call it once per batch the prepared loader yields")
        pending, self._pending = self._pending, None
        recorded = self.sync.take_failure()
        failure = pending.failure or self._guard.take()
        with owned():
            try:
                if failure is not None:
                    raise failure
                if self.sync.agrees_after_backward:  # HSDP in place, a sharded look: every rank's verdict
                    recorded = self.sync.agree_on_failure(recorded)
                if recorded is not None:
                    raise CollectiveFailure(recorded)
                self.sync.settle_buckets()
                self.sync.scale_sharded_grads(self.dist.world_size)
                ready = self._after_backward(pending)
            except CollectiveFailure as exc:
                return self._abandon(exc)
        return self._apply(pending, None, ready)

    def _abandon(self, exc: CollectiveFailure) -> StepResult:
        """A collective of the step failed: nothing of it is applied, the world re-forms, and
        the result says the step was not trained (``step`` is the one that would have been)."""
        abandoned = StepResult(False, self.state.step + 1, self.epoch)
        if self._node_verdict is not None:
            self._node_verdict.abandon(self.round, self.state.step + 1)
        with owned():  # re-entrant: the callers in backward already hold it
            self._worlds.recover(exc)
        self._guard.after_abandoned = True  # the loop body's own collectives, until the next batch
        return abandoned

    def _after_backward(self, pending: _Pending) -> int:
        """The step's collectives after the gradient all-reduce: buffers, then the control value."""
        self.sync.sync_buffers()
        return self.sync.finish_control(pending.control) if pending.control is not None else -1

    def _apply(self, pending: _Pending, loss: torch.Tensor | None, ready: int) -> StepResult:
        """Every collective of the step succeeded: commit the previous step, then apply this one."""
        d, ids = self.dist, pending.ids
        seen_loss = loss  # None: the script's own backward, the run never saw the loss
        skip_update = False
        if self._guards_nonfinite and self._grads_nonfinite():
            answer = self._nonfinite_step(seen_loss)  # before the commit: a NaN replica's state is never committed
            if answer is not None:
                return answer
            skip_update = True  # the user asked to skip a batch whose gradients stay non-finite
        if loss is None:
            loss = _NO_LOSS  # for the hooks, which take a tensor
        asked = 0 <= ready < STOP_BIT and bool(ready & CHECK_BIT)
        if asked:
            ready -= CHECK_BIT
        stop = ready >= STOP_BIT or (d.world_size == 1 and self._stop.signal is not None)
        if ready >= STOP_BIT:
            ready = -1  # the world changes anyway: a ready round waits for the next formation
        committing = time.perf_counter()
        try:
            self._commit_previous()
        except CollectiveFailure as exc:  # a sharded capture gathers over the mesh: a peer lost there
            return self._abandon(exc)
        self.metrics.commit_took(time.perf_counter() - committing)
        if self._node_verdict is not None:  # the step's last collective: its node's others completed it too?
            why = self._node_verdict.agree(self.round, self.state.step + 1)
            if why is not None:
                return self._abandon(CollectiveFailure(why, noticed=Noticed.NODE_ABANDONED))
        if self.max_grad_norm is not None and not skip_update:
            if self.state.scaler is not None:
                self.state.scaler.unscale_(self.state.optimizer)
            torch.nn.utils.clip_grad_norm_(self.state.module.parameters(), self.max_grad_norm)
        self.snapshots.wait_capture()  # the snapshot's copy of the parameters must predate this update
        if not skip_update:
            self._optimizer_step()
        self.state.optimizer.zero_grad(set_to_none=True)
        if self.state.scheduler is not None:
            self.state.scheduler.step()
        epoch = self.plan.sampler.epoch
        self.state.step += 1
        self.state.samples += len(ids)
        self.plan.commit(self.state.step, ids, d.world_size)
        if self._heartbeat is not None:
            self._heartbeat.beat(self.state.step)
        self.world.stepped(self.state.step)
        if not self._copy_to_peer(now_s=time.perf_counter() - pending.started):  # copies incomplete: not committed
            return self._abandon_applied(epoch)
        self._check_due = self._check.due(self.state.step) or (asked and self._check.every_steps > 0)
        self.goodput.stepped(self.state.step, self.snapshots.take_stall())
        now = time.perf_counter()
        self.metrics.step_done(pending.local_n, now - pending.started, pending.data_wait, seen_loss, pending.tokens)
        if self.on_step_end is not None:
            self.on_step_end(StepInfo(
                step=self.state.step, epoch=epoch, samples=len(ids), total_samples=self.state.samples,
                local_samples=pending.local_n, loss=loss.detach(), step_seconds=now - pending.started,
                data_wait_seconds=pending.data_wait, world_size=d.world_size, rank=d.rank, node=d.node,
                round=self.round,
            ))
        # A change of world waits for the top of the loop, after the loop's code for this step:
        # then every rank's registered state stands at this step (elastic.user_state).
        if stop and not self.done:  # the last step ends the run as usual, signal or not
            self._between_steps = self._stop.after_step
        elif self.world.offers(ready) and not self.done:
            self._between_steps = lambda: self._worlds.form("join", min_round=ready)  # every rank saw it
        return StepResult(True, self.state.step, epoch, self.plan.sampler.epoch != epoch)

    def _grads_nonfinite(self) -> bool:
        """Whether the step's gradients hold a NaN or an Inf on any rank: DDP's all-reduced sum
        looked at here, every rank's alike; a sharded model's flags already met after the backward."""
        if self.mesh is None:
            return not grads_finite(self.state.module.parameters())
        seen, self.sync.grads_nonfinite = self.sync.grads_nonfinite, False
        return seen

    def _nonfinite_step(self, loss: torch.Tensor | None) -> StepResult | None:
        """The step's all-reduced gradients hold a NaN or an Inf, on every rank alike: nothing of
        it is applied, the replicas vote at once, and :func:`.consistency.nonfinite.decide` says
        what happens: a NaN replica healed from the majority, or a recompute, and the same batch
        trained again (False); a skip (None: the step goes on without its update); or the end
        of the run at the last finite agreed state (one line, exit 2)."""
        self.state.optimizer.zero_grad(set_to_none=True)
        step = self.state.step + 1
        loss_finite = None if loss is None else bool(torch.isfinite(loss.detach()).all())
        try:
            with owned():
                if self._replicated:  # the replicas vote (DDP, HSDP)
                    do = self._check.vote_step(self, loss_finite, self._recomputed == step, self._skip_nonfinite)
                else:  # 1-D FSDP: no replica of any shard
                    answer = step_without_replica(self, loss_finite, self._recomputed == step, self._skip_nonfinite)
                    do, self._check.stop_line = answer.do, answer.line
                    self._stop_uncommitted = answer.state_nonfinite
        except RuntimeError as exc:
            if not is_collective_failure(exc):
                raise
            return self._abandon(CollectiveFailure(first_line(exc)))
        if do is Do.SKIP:
            return None
        if do is Do.STOP:
            self._stop_diverged()
        if do is Do.RECOMPUTE:
            self._recomputed = step
        if do is not Do.ROLLBACK:  # (a rollback built the loader anew itself)
            self._generation += 1  # the same batch again: the loader is built anew from the uncommitted cursor
        return StepResult(False, step, self.epoch)

    def _stop_diverged(self) -> NoReturn:
        """The training diverged (:attr:`ReplicaCheck.stop_line`): every replica stands at the
        last finite agreed state; it is committed and snapshotted (a snapshot of non-finite
        state is never written), and the run ends with one line and exit 2, which an agent
        never restarts: the same steps would diverge again."""
        line = self._check.stop_line or "training diverged"
        if self._stop_uncommitted:  # a shard holds a NaN: nothing is committed, the newest snapshot is finite
            self._usage_error(TrainingDiverged(line))
        with owned():
            try:
                self._commit_previous()
                self.snapshots.final(self.state.step, self.state.capture(), self.dist.world_size,
                                     {"epoch": self.plan.sampler.epoch, "cursor": self.plan.sampler.cursor,
                                      "samples": self.state.samples})
            except FinalSnapshotLost as exc:
                log.error("%s %s", self._where, exc)
        self._usage_error(TrainingDiverged(line))
        raise AssertionError("not reached: _usage_error raises")

    def _copy_to_peer(self, now_s: float, force: bool = False) -> bool:
        """The applied step's state to this rank's buddy, when due (:mod:`elastic.inplace.peer_copies`).
        False: the exchange failed, and the step is not committed."""
        if not self.copies.on:
            return True
        d = self.dist
        feed, shared = self.snapshots.host_copy_wanted(self.state.step)
        with owned():
            return self.copies.after_step(self.state.step, d.rank, d.world_size, d.node, _local_world_size(),
                                          lambda: {"state": self.state.capture(local=True),
                                                   "recent": self.plan.recent_state()},
                                          collective_device(d), step_seconds=now_s, force=force,
                                          feed=feed, shared=shared, tag=self.state.loads)

    def _host_copy_of(self, step: int) -> Any:
        """This rank's complete host copy of ``step`` for its snapshot, if it has one of the
        state as it stands (None: the snapshot captures its own). A copy is of step ``step``
        only if no state was loaded since it was made (a rollback to an older step trains
        ``step`` again, and a copy of the first try is not of that state). A sharded model's:
        this rank's shards of it, paired with the live ones (:func:`elastic.host_shards.host_shards`)."""
        if self.state.sharded:
            if not self.snapshots.takes_sharded_host_copies:
                return None
            from .inplace.hsdp import capture_local

            return host_shards(self.copies.fed, step, self.state.loads,
                               lambda: capture_local(self.state.module, self.state.optimizer))
        if not self.snapshots.takes_host_copies:
            return None
        return copy_for_snapshot(self.copies.fed, step, self.state.loads)

    def _memory_world(self) -> CopyWorld:
        """The run and world this rank's state is of now: a memory copy loads only into the same."""
        return CopyWorld(worker_env.read().me.run_id or "", self.dist.world_size, self.dist.rank, _local_world_size(),
                         tuple(self.mesh.shape) if self.mesh is not None else None)

    def _seed_copies(self) -> None:
        """FSDP across every node, in place, as a world forms: this rank's position from now on,
        FSDP2's collectives guarded, and a copy of the step every rank now stands on, whatever
        ``K``. The copies of the world before were of its positions and cut, so they are
        dropped; without this copy a second loss before the new world's first due one would
        find a lost node's shards nowhere in memory. A peer lost during it: the world forms again."""
        if self.hsdp is not None:
            self.hsdp.guard()  # HSDP in place: its shard group is on the fence too, so FSDP2's collectives are guarded
        if self.fsdp is None:
            return
        self.copies.world_formed(self.round)
        self.fsdp.formed(self.dist)
        self.fsdp.guard()
        if not self._copy_to_peer(0.0, force=True):
            failure, self.copies.failure = self.copies.failure, None
            raise CollectiveFailure(failure or "a peer copy's exchange failed")

    def _abandon_applied(self, epoch: int) -> StepResult:
        """The step was applied here but its peer copies are not complete on every rank: it is
        reported as not trained, and the world re-forms (it then stands every rank on one step
        whose state exists for every rank, this one or the one before)."""
        failure, self.copies.failure = self.copies.failure, None
        abandoned = StepResult(False, self.state.step, epoch)
        with owned():
            self._worlds.recover(CollectiveFailure(failure or "a peer copy's exchange failed"), failed_step=self.state.step)
        self._guard.after_abandoned = True
        return abandoned

    def _at_step_boundary(self) -> None:
        """The loop's code for the step has run: do what the ranks agreed on in its run.step."""
        action, self._between_steps = self._between_steps, None
        self._guard.after_abandoned = False  # the abandoned step's loop body is over
        failure = self._guard.take()  # the script's own collective after run.step lost a peer
        with owned():
            if failure is not None and action != self._stop.after_step:
                self._worlds.recover(failure)  # an agreed join waits: the world is broken, it forms again
            elif action is not None:
                action()
            if action is None and failure is None:
                self._flips.poll(self.state.module, self.state.optimizer, self.state.step, self._where)
                if self._asks.poll(self._check.every_steps > 0, self.state.step) and self.dist.world_size == 1:
                    self._check_due = True  # a world of one: no control value to carry the request
            check, self._check_due = self._check_due, False
            if check and action is None and failure is None:
                step = self.state.step
                self._check_replicas()
                if self._check.outcome is not None:
                    self._asks.answer(step, *self._check.outcome)

    def _check_replicas(self) -> bool:
        """The replica consistency check (:mod:`elastic.consistency`). True: the loop cannot go
        on as it was (the run went back to the last agreed state, or a peer was lost in the
        check's all-gather and the world answered)."""
        try:
            went_back = self._check.run(self)
        except RuntimeError as exc:
            if not is_collective_failure(exc):
                raise
            self._worlds.recover(CollectiveFailure(first_line(exc)))
            return True
        if self._check.stop_line is not None:  # every replica non-finite: back to the last finite agreed state
            if self._check.outcome is not None:
                self._asks.answer(self.state.step, *self._check.outcome)
            self._stop_diverged()
        return went_back

    def returned_to(self, step: int) -> None:
        """Every replica loaded the last agreed state, of ``step``: the steps since are trained
        again (their ledger lines written again), from a loader built anew. Public because the
        replica check (:mod:`elastic.consistency.check`) loads that state and then tells the run."""
        self._committed = step
        self._generation += 1
        self.world.stepped(step)  # in place: a re-formation agrees on this step, not the abandoned ones

    def _optimizer_step(self) -> None:
        saved: list[float] = []
        lr_scale = self.plan.lr_scale(self.dist.world_size)
        if lr_scale != 1.0:  # linear scaling rule (nominal batch), around the step only
            for group in self.state.optimizer.param_groups:
                saved.append(group["lr"])
                group["lr"] = group["lr"] * lr_scale
        if self.state.scaler is not None:
            self.state.scaler.step(self.state.optimizer)
            self.state.scaler.update()
        else:
            self.state.optimizer.step()
        for group, lr in zip(self.state.optimizer.param_groups, saved):
            group["lr"] = lr  # exact restore: schedulers and snapshots see the unscaled value

    def _commit_previous(self, force_snapshot: bool = False) -> None:
        """Every rank has finished ``state.step`` (the all-reduces of the next one completed):
        rank 0 writes its ledger line and, when one is due, submits its snapshot."""
        step = self.state.step
        if step <= self._committed:
            return
        self._committed = step
        record = self.plan.recent[-1] if self.plan.recent and self.plan.recent[-1].step == step else None
        self.snapshots.commit(step, record, self.state.capture, self.dist.world_size, self.plan.sampler.epoch,
                              self.plan.sampler.cursor, self.state.samples, force=force_snapshot,
                              finite=self._check.finite_at == step, host=self._host_copy_of(step))
        self.copies.fed = None  # taken or not, its memory goes once no one else holds it

    # ------------------------------------------------------------------ 5. the end

    def _finish(self) -> bool:
        """Commit the last step once every rank has finished it; False if the world broke first."""
        with owned():
            return self._finish_owned()

    def _finish_owned(self) -> bool:
        if self._check.pending(self.state.step) and self._check_replicas():
            return False  # trained again since the last agreed state, or the world broke
        try:
            broadcast_int(0, self.dist)  # returns once every rank has reached the end
        except RuntimeError as exc:
            if not is_collective_failure(exc):
                raise
            self._worlds.recover(CollectiveFailure(first_line(exc)))
            return False
        self._commit_previous()
        try:
            self.snapshots.final(self.state.step, self.state.capture(), self.dist.world_size,
                                 {"epoch": self.plan.sampler.epoch, "cursor": self.plan.sampler.cursor,
                                  "samples": self.state.samples})
        except FinalSnapshotLost as exc:  # no restart frees a disk: one line, and an exit code that says so
            log.error("%s %s", self._where, exc)
            with contextlib.suppress(Exception):
                self.close()
            raise SystemExit(contract.FINAL_SNAPSHOT_LOST_EXIT) from None
        if self.dist.is_main and self.snapshots.writer is not None:
            log.info("%s finished at step %d (epoch %d); final snapshot durable in %s", self._where,
                     self.state.step, self.plan.sampler.epoch, self.snapshots.root)
        return True

    # ------------------------------------------------------------------ 7. usage errors

    def _usage_error(self, exc: Exception) -> None:
        """One ``error:`` line and exit code 2, which an agent never restarts: the same error
        would come back at every start. Rank 0 speaks for errors every rank hits alike."""
        rank = self.dist.rank if hasattr(self, "dist") else worker_env.read().me.place.rank
        if isinstance(exc, _OwnUsageError):
            print(f"error: [{node_name()} rank {rank}] {exc}", file=sys.stderr, flush=True)
        elif rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        try:
            self.close()  # the writer process and the process group go now, not at exit
        except Exception:  # the usage error is what the user must see
            log.debug("closing after a usage error", exc_info=True)
        raise UsageExit(str(exc)) from exc

    def close(self) -> None:
        """Flush the pending snapshot, close the ledger, leave the process group if we joined it."""
        if self._closed:
            return
        self._closed = True
        self._guard.uninstall()  # after the loop, the script's collectives are torch's again
        if hasattr(self, "goodput"):
            self.goodput.close()
        try:
            if self.snapshots is not None:
                self.snapshots.close()
        finally:
            self.world.close()
            if self.world.keeps_group_until_exit:  # left at exit: this run's DDP must go first
                atexit.register(_release_ddp_at_exit, weakref.ref(self))

    def __enter__(self) -> "ElasticRun":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ kept for callers

    def state_dict(self) -> dict[str, Any]:
        """Everything a restart needs, as tensors and plain numbers (what a snapshot holds)."""
        return self.state.capture()


class TrainingDiverged(ElasticRunError):
    """Non-finite values on every replica, or gradients non-finite again after a recompute:
    the job ends (exit 2, never restarted) at the last finite agreed state."""


class _OwnUsageError(ElasticRunError):
    """A usage error of this rank's own (its metrics port, say): it says so itself, whatever its rank."""


def _local_world_size() -> int:
    """This node's rank count, as torchrun (or elastic agent) says; a world of one without it."""
    try:
        return worker_env.read().me.place.local_world_size or (dist.get_world_size() if dist.is_initialized() else 1)
    except ValueError:
        return 1


def _release_ddp_at_exit(ref: "weakref.ref[ElasticRun]") -> None:
    """Drop the run's DDP before the process group is left at exit: a DDP that outlives its
    destroyed group frees it in C++ teardown, where gloo aborts the process (SIGABRT,
    "terminate called without an active exception"; 2 to 3 exits in 12 of a 2-process
    script, 0 in 14 with this), and the agent would take a finished worker for a failed one."""
    run = ref()
    if run is not None and getattr(run, "sync", None) is not None:
        run.sync.model = None
    gc.collect()


__all__ = ["ElasticRun", "StepInfo"]
