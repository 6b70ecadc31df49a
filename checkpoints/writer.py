"""Background snapshot writer: training stalls for the capture, not for the disk.

``submit`` takes references, copies the small tensors and returns; a writer thread copies
the large tensors into reusable staging buffers while the next forward/backward runs.
Parameters and optimizer state only change in ``optimizer.step``, so that is where the
trainer waits (``wait_capture``, wired up by ``attach_optimizer``) - usually not at all,
because the copy finished during backward.

Serialising, hashing, fsyncing and renaming then happen in a writer process (the default,
``mode="process"``) that reads the staging buffers from shared memory and runs at idle
CPU priority, so it neither takes the trainer's GIL nor competes for its cores; or, with
``mode="thread"``, on a niced thread of the trainer (see docs/checkpoints.md for the
measured difference).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import os
import queue
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

import torch

from . import layout, sched
from .arena import Arena
from .capture import Capture, Stager
from .errors import SnapshotError
from .fence import SnapshotFencedError
from .oneshot import LogPump, OneShot
from .procwriter import WriterProcess
from .store import SnapshotInfo, SnapshotStore
from .workers import DaemonPool

log = logging.getLogger(__name__)


_BOOST_AFTER = 0.5  # fraction of the last submit interval a write may take at idle priority
_FIRST_BOOST_AFTER_S = 1.0  # the same for the first snapshot, which has no interval to go by


def _process_mode_supported() -> bool:
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and hasattr(os, "SCHED_IDLE")


@dataclass
class WriterStats:
    """Plain counters for metrics; read a consistent copy through ``writer.stats``."""

    snapshots_written: int = 0
    snapshots_skipped: int = 0  # due while the previous one was in flight, policy "skip"
    snapshots_waited: int = 0  # due while the previous one was in flight, policy "wait"
    last_stall_s: float = 0.0  # time training was blocked for the last snapshot
    total_stall_s: float = 0.0
    last_capture_s: float = 0.0  # background copy into staging buffers
    last_write_s: float = 0.0  # serialise + hash + fsync + rename, after the capture; pruning follows
    last_write_cpu_s: float | None = None  # writer process CPU for it, pruning included (None: thread mode)
    total_write_cpu_s: float = 0.0
    boosted: int = 0  # writes raised from idle to normal priority because they were late or awaited
    last_bytes: int = 0
    last_durable_step: int | None = None
    last_durable_time: float | None = None  # time.time() when it became durable
    errors: int = 0
    last_error: str | None = None


@dataclass(eq=False)
class _Probe:
    """Queued by ``wait_writer_process``: the writer thread owns the channel, so it answers."""

    timeout: float
    done: OneShot = dataclasses.field(default_factory=OneShot)
    ready: bool = False


@dataclass(eq=False)
class _Job:
    step: int
    world_size: int
    extra_meta: dict[str, Any] | None
    capture: Capture
    captured: OneShot = dataclasses.field(default_factory=OneShot)  # set by the writer thread, which must never
    done: OneShot = dataclasses.field(default_factory=OneShot)  # block on a lock a waiter holds (.oneshot)
    stall_s: float = 0.0
    device_waited: bool = False
    boost_at: float | None = None  # time.monotonic() after which an idle-priority write is raised


class AsyncSnapshotWriter:
    """Write snapshots in the background, one at a time.

    ``overlap_policy`` decides what happens when a snapshot is due while the previous one
    is still being written: ``"skip"`` (default) drops the new one and counts it in
    ``stats.snapshots_skipped`` - training never waits for the disk; ``"wait"`` blocks
    until the previous one is durable (counted in ``snapshots_waited``, and the wait is
    part of the stall).

    ``mode="process"`` (default on Linux) writes from a long-lived child process at
    ``priority`` (``"idle"``: SCHED_IDLE, or a nice value). A write still running halfway
    to the next expected snapshot (half the shortest of the last four intervals between
    ``submit`` calls), or one that somebody waits for (``flush``, a due snapshot, exit), is raised to
    ``boost_nice`` until it is durable, so idle priority cannot make snapshots fall behind
    (raising needs CAP_SYS_NICE or RLIMIT_NICE; without it the overlap policy counts what
    a starved write costs). ``mode="thread"`` writes from a thread of this process at nice
    ``priority`` (10 for ``"idle"``: a thread that holds the GIL must not be starved).

    Call ``flush()`` from the trainer's SIGTERM handler; ``close()`` (or leaving the
    ``with`` block, or interpreter exit) flushes too.
    """

    def __init__(
        self,
        store: SnapshotStore,
        overlap_policy: Literal["skip", "wait"] = "skip",
        *,
        sync_copy_max_bytes: int = 1 << 20,
        on_durable: Callable[[WriterStats], None] | None = None,
        mode: Literal["process", "thread"] = "process",
        priority: sched.Priority = "idle",
        boost_nice: int = 0,
    ) -> None:
        if overlap_policy not in ("skip", "wait"):
            raise ValueError(f"overlap_policy must be 'skip' or 'wait', got {overlap_policy!r}")
        if mode not in ("process", "thread"):
            raise ValueError(f"mode must be 'process' or 'thread', got {mode!r}")
        self.store = store
        self.overlap_policy = overlap_policy
        self.on_durable = on_durable
        self.priority = sched.check_priority(priority)
        if mode == "process" and not _process_mode_supported():
            log.info("snapshot writer: no memfd/SCM_RIGHTS/SCHED_IDLE on this platform; writing from a thread")
            mode = "thread"
        self.mode = mode
        self._stager = Stager(sync_copy_max_bytes, shared=mode == "process")
        self._stats = WriterStats()
        # Taken by the writer thread only. flush() works from a signal handler, which runs on
        # the training thread wherever it was interrupted: had that thread held this lock, the
        # writer thread would block on it and the handler would wait on the writer for ever.
        # So the training thread only does single stores to its own stats fields (atomic under
        # the GIL), reads stats without it, and takes errors from a deque (atomic appends/pops).
        self._lock = threading.Lock()
        self._job: _Job | None = None
        self._errors: collections.deque[BaseException] = collections.deque()
        self._closed = False
        self._last_submit: float | None = None
        self._intervals: collections.deque[float] = collections.deque(maxlen=4)
        self._queue: queue.SimpleQueue[_Job | _Probe | OneShot | None] = queue.SimpleQueue()
        self._logs = LogPump(log, "snapshot-writer-log")  # the writer thread's lines (.oneshot)
        self._fenced_said: str | None = None  # the last fence refusal logged (each fence is said once)
        # The newest round whose fence this process raised (-1: none). Rank 0 that goes on into
        # a new round in place raises it while its writer may still hold the old round's
        # snapshot: that one is then refused, which is the fence at work on our own behalf.
        self.own_round = -1
        self._proc: WriterProcess | None = None
        self._io: DaemonPool | None = None
        if mode == "process":
            self._proc = WriterProcess(store, self.priority, boost_nice)
        else:
            # The capture copy runs on the writer thread at normal priority: training waits for
            # it in optimizer.step, so deprioritising it would be a priority inversion.
            # Serialising, hashing and fsyncing run on the io thread, niced.
            self._io = DaemonPool(1, "snapshot-io", initializer=self._io_thread_setup)
        self._thread = threading.Thread(target=self._run, name="snapshot-writer", daemon=True)
        self._thread.start()
        atexit.register(self._atexit)

    # ---------------------------------------------------------------- training thread

    def submit(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        world_size: int,
        extra_meta: dict[str, Any] | None = None,
        frozen: Sequence[torch.Tensor] = (),
        donor: Arena | None = None,
    ) -> bool:
        """Start snapshot ``step``; returns False if skipped by the overlap policy.

        ``frozen``: tensors of ``state`` that nothing will write to again (a complete host
        copy of this step), written as they are instead of copied (in process mode only
        those that are views of ``donor``, a host copy made in shared memory):
        :meth:`checkpoints.capture.Stager.stage`."""
        t0 = time.perf_counter()
        if self._closed:
            raise SnapshotError("snapshot writer is closed; create a new AsyncSnapshotWriter")
        layout.check_step(step)
        now = time.monotonic()
        if self._last_submit is not None:
            self._intervals.append(now - self._last_submit)
        self._last_submit = now
        prev = self._job
        waited = 0.0
        if prev is not None and not prev.done.is_set():
            self._urge()  # it is late: the next snapshot is already due
            if self.overlap_policy == "skip":
                self._stats.snapshots_skipped += 1
                log.info("snapshot step %d skipped: step %d is still being written (policy 'skip')", step, prev.step)
                return False
            prev.done.wait()
            waited = time.perf_counter() - t0
            self._stats.snapshots_waited += 1
        # The previous job is done, so the staging buffers are free to overwrite.
        capture = self._stager.stage(state, frozen, donor)
        job = _Job(step=step, world_size=world_size, extra_meta=extra_meta, capture=capture)
        # the shortest recent interval: irregular snapshots are raised early, not late. The
        # first one has no interval yet; left at idle priority on busy cores it could take
        # minutes, and every later snapshot would be skipped behind it.
        job.boost_at = now + (_BOOST_AFTER * min(self._intervals) if self._intervals else _FIRST_BOOST_AFTER_S)
        self._job = job
        self._queue.put(job)
        job.stall_s = time.perf_counter() - t0
        self._stats.last_stall_s = job.stall_s
        self._stats.total_stall_s += job.stall_s
        if waited:
            log.info("snapshot step %d waited %.3fs for step %d to become durable", step, waited, prev.step if prev else -1)
        return True

    def wait_capture(self) -> None:
        """Block until the in-flight capture is copied; call before mutating saved tensors."""
        job = self._job
        if job is None:
            return
        if not job.captured.is_set():
            t0 = time.perf_counter()
            job.captured.wait()
            dt = time.perf_counter() - t0
            job.stall_s += dt
            self._stats.last_stall_s = job.stall_s
            self._stats.total_stall_s += dt
        if job.capture.cuda_event is not None and not job.device_waited:
            # GPU-side wait: the optimizer's kernels queue behind the copy; the CPU does not block.
            torch.cuda.current_stream().wait_event(job.capture.cuda_event)
            job.device_waited = True

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait for the capture; returns the hook handle."""
        return optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: self.wait_capture())

    @property
    def pending_step(self) -> int | None:
        """Step being written right now, or None."""
        job = self._job
        return job.step if job is not None and not job.done.is_set() else None

    def wait_writer_process(self, timeout: float = 60.0) -> bool:
        """Wait until the writer process can take snapshots; until then they are written from
        a thread, so nothing waits for its start. Its start is raised to normal priority while
        this waits (as a due snapshot raises it). False in thread mode or on timeout."""
        if self._proc is None or self._closed:
            return False
        probe = _Probe(timeout)
        self._queue.put(probe)
        probe.done.wait()
        return probe.ready

    @property
    def writer_pid(self) -> int | None:
        """pid of the writer process (mode "process", once started), e.g. to find it in ``ps``."""
        return self._proc.pid if self._proc is not None else None

    @property
    def stats(self) -> WriterStats:
        return dataclasses.replace(self._stats)  # no lock: see __init__; a copy mid-update is a metric a tick old

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything submitted is durable; re-raise a background failure.

        Works from a signal handler: it queues a barrier behind whatever was submitted
        (SimpleQueue.put is reentrant) instead of trusting state the interrupted
        ``submit`` may have been halfway through updating.
        """
        if not self._closed:
            barrier = OneShot()
            self._queue.put(barrier)
            self._urge()
            if not barrier.wait(timeout):
                raise SnapshotError(
                    f"snapshot step {self.pending_step} is still not durable after {timeout:.1f}s; "
                    f"the filesystem under {self.store.root} is very slow or hung"
                )
        errors = []
        while True:
            try:
                errors.append(self._errors.popleft())
            except IndexError:
                break
        err = errors[-1] if errors else None  # the newest failure says most; the others were logged
        if err is not None:
            if isinstance(err, SnapshotError):
                raise err
            raise SnapshotError(f"background snapshot write failed: {type(err).__name__}: {err}") from err

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._queue.put(None)  # FIFO: anything still queued is written before the thread exits
            self._thread.join()
            self._logs.close()
            if self._proc is not None:
                self._proc.close()
            self._stager.release()
            atexit.unregister(self._atexit)

    def __enter__(self) -> "AsyncSnapshotWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _atexit(self) -> None:
        if self.pending_step is not None:
            log.info("waiting for snapshot step %d to become durable before exit", self.pending_step)
        try:
            self.close()
        except SnapshotError as e:
            log.error("%s", e)

    def _urge(self) -> None:
        if self._proc is not None and self.pending_step is not None:
            self._proc.urge()

    # ---------------------------------------------------------------- writer thread

    def _run(self) -> None:
        self._logs.adopt()  # procwriter's lines too: nothing on this thread waits on a handler
        if self._proc is not None:
            try:  # from this long-lived thread: the child's PR_SET_PDEATHSIG follows the thread that spawned it
                self._proc.start()
            except SnapshotError as e:
                self._logs.log(logging.WARNING, "%s", e)
        while (job := self._queue.get()) is not None:
            if isinstance(job, OneShot):  # flush barrier
                job.set()
                continue
            if isinstance(job, _Probe):
                if self._proc is not None:  # someone waits for its start: at idle priority on a
                    self._proc.hurry()     # machine others keep busy it would never get the CPU
                job.ready = self._proc is not None and self._proc.wait_ready(job.timeout)
                job.done.set()
                continue
            try:
                self._write(job)
            except BaseException as e:  # noqa: BLE001 - reported through flush() and stats
                # a fenced write is the round protocol at work, not a disk fault; said once per fence
                fenced = isinstance(e, SnapshotFencedError)
                taken_in = round_taken_in(job.extra_meta)
                if fenced and 0 <= taken_in < self.own_round:  # our own newer round's fence: no failure
                    self._logs.log(logging.INFO, "snapshot step %d not committed: it was taken in round %d, and "
                                   "this rank went on into round %d in place, whose fence it raised; the next "
                                   "snapshot is that round's", job.step, taken_in, self.own_round)
                    continue
                self._errors.append(e)
                with self._lock:
                    self._stats.errors += 1
                    self._stats.last_error = str(e)
                again = fenced and str(e) == self._fenced_said
                self._fenced_said = str(e) if fenced else self._fenced_said
                self._logs.log(logging.DEBUG if again else logging.WARNING if fenced else logging.ERROR,
                               "snapshot step %d failed: %s%s", job.step, e,
                               " (later snapshots refused by this fence are not logged again)" if fenced and not again
                               else "")
            finally:
                job.captured.set()
                job.done.set()
                # staging stays in the Stager; a host copy's memory goes with the host copy
                job.capture = dataclasses.replace(job.capture, staged={}, donor=None)

    def _write(self, job: _Job) -> None:
        t0 = time.perf_counter()
        try:
            job.capture.finish_copies()
        finally:
            job.captured.set()
        t1 = time.perf_counter()
        if self._proc is not None and self._proc.is_ready():
            try:
                info, timings = self._proc.write(job.step, job.capture, job.world_size, job.extra_meta, job.boost_at)
                self._durable(job, info, t1 - t0, t1, timings["cpu_s"])
            finally:  # the child prunes after replying; the job is done when it has
                prune_cpu_s = self._proc.finish_housekeeping(job.step, job.boost_at)
                with self._lock:
                    s = self._stats
                    s.total_write_cpu_s += prune_cpu_s
                    if s.last_write_cpu_s is not None:
                        s.last_write_cpu_s += prune_cpu_s
                    s.boosted = self._proc.boosts
            return
        if self._proc is not None:
            self._proc.hurry()  # its torch import must not starve at idle priority while snapshots fall due
        if self._io is None:  # the writer process is still starting (or cannot start): no snapshot waits for it
            self._logs.log(logging.INFO, "snapshot step %d: the writer process is not up yet; writing it from a thread",
                           job.step)
            self._io = DaemonPool(1, "snapshot-io", initializer=self._io_thread_setup)
        info = self._io.submit(
            self.store.save, job.step, job.capture.staged, world_size=job.world_size, extra_meta=job.extra_meta,
            housekeeping=False,
        ).result()
        self._durable(job, info, t1 - t0, t1, None)
        self._io.submit(self.store.housekeep).result()

    def _io_thread_setup(self) -> None:
        layout.set_thread_nice(10 if self.priority == "idle" or self._proc is not None else int(self.priority))
        self._logs.adopt()  # the store's prune and fence lines: the writer waits on this thread

    def _durable(self, job: _Job, info: SnapshotInfo, capture_s: float, t1: float, cpu_s: float | None) -> None:
        """Record snapshot ``info`` as durable (stats, log line, ``on_durable``), before pruning."""
        t2 = time.perf_counter()
        with self._lock:
            s = self._stats
            s.snapshots_written += 1
            s.last_capture_s = capture_s
            s.last_write_s = t2 - t1
            s.last_write_cpu_s = cpu_s
            s.total_write_cpu_s += cpu_s or 0.0
            s.boosted = self._proc.boosts if self._proc is not None else 0
            s.last_bytes = info.size_bytes
            s.last_durable_step = info.step
            s.last_durable_time = time.time()
            snapshot = dataclasses.replace(s)
        self._logs.log(
            logging.INFO,
            "snapshot step %d durable: %.1f MB in %.2fs (%.2f GB/s), training stalled %.1f ms",
            info.step,
            info.size_bytes / 1e6,
            t2 - t1,
            info.size_bytes / max(t2 - t1, 1e-9) / 1e9,
            job.stall_s * 1e3,
        )
        if self.on_durable is not None:
            try:
                self.on_durable(snapshot)
            except Exception:  # noqa: BLE001 - a metrics bug must not fail snapshots
                self._logs.log(logging.ERROR, "on_durable callback failed:\n%s", traceback.format_exc())


def round_taken_in(extra_meta: Mapping[str, Any] | None) -> int:
    """The fence round a snapshot job was taken in (-1: not fenced)."""
    fence = (extra_meta or {}).get("fence")
    try:
        return int(fence["round"]) if isinstance(fence, Mapping) else -1
    except (KeyError, TypeError, ValueError):
        return -1
