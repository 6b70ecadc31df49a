"""AsyncSnapshotWriter: consistent captures, overlap policy, flush/close, SIGTERM, errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from checkpoints import AsyncSnapshotWriter, SnapshotDiskFullError, SnapshotError, SnapshotStore
from ckpt_testutil import (REPO_ROOT, LineReader, assert_equal_state, assert_pending_flushed, child_env, pruning_held,
                           start_child, state_for, stop_child)
from tests.support.waiting import wait_until


def _big_state(n_tensors: int = 16, numel: int = 1 << 20) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"p{i}": torch.randn(numel, generator=g) for i in range(n_tensors)}  # 64 MB


MODES = pytest.mark.parametrize("mode", ["process", "thread"])


@pytest.mark.slow  # starts processes
@MODES
def test_mutation_after_wait_capture_does_not_reach_the_snapshot(tmp_path: Path, mode: str) -> None:
    params = _big_state()
    expected = {k: v.clone() for k, v in params.items()}
    small = torch.zeros(3)  # copied synchronously in submit: may be mutated right away
    with AsyncSnapshotWriter(SnapshotStore(tmp_path), mode=mode) as writer:
        assert writer.submit(1, {"model": params, "bn": {"running_mean": small}}, world_size=1)
        small.add_(1)  # like BatchNorm in the next forward
        writer.wait_capture()
        for p in params.values():  # like optimizer.step()
            p.add_(1)
        writer.flush()
    got = SnapshotStore(tmp_path).load(1)
    assert_equal_state(got["model"], expected)
    assert torch.equal(got["bn"]["running_mean"], torch.zeros(3))


@pytest.mark.slow  # starts processes
@MODES
def test_optimizer_step_waits_for_the_capture(tmp_path: Path, mode: str) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # 32 MB of weights
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(2, 1024)).sum().backward()
        opt.step()
    expected = {"model": OrderedDict((k, v.clone()) for k, v in model.state_dict().items())}
    with AsyncSnapshotWriter(SnapshotStore(tmp_path), mode=mode) as writer:
        writer.attach_optimizer(opt)
        writer.submit(2, {"model": model.state_dict(), "opt": opt.state_dict()}, world_size=1)
        opt.step()  # same grads again: every weight changes, but only after the copy
        writer.flush()
    assert_equal_state(SnapshotStore(tmp_path).load(2)["model"], expected["model"])


@pytest.mark.slow  # starts processes
@MODES
@pytest.mark.parametrize("policy", ["skip", "wait"])
def test_overlap_policy_is_applied_and_counted(tmp_path: Path, policy: str, mode: str) -> None:
    store = SnapshotStore(tmp_path, keep=10)
    state = _big_state(8)
    with AsyncSnapshotWriter(store, overlap_policy=policy, mode=mode) as writer:
        results = [writer.submit(s, state, world_size=1) for s in (1, 2, 3)]
        writer.flush()
        stats = writer.stats
    steps = [i.step for i in store.list()]
    if policy == "skip":
        # 2 and 3 arrive while 1 is still being written (64 MB to disk takes far longer than a submit).
        assert results == [True, False, False] and steps == [1]
        assert (stats.snapshots_written, stats.snapshots_skipped, stats.snapshots_waited) == (1, 2, 0)
    else:
        assert results == [True, True, True] and steps == [1, 2, 3]
        assert (stats.snapshots_written, stats.snapshots_skipped, stats.snapshots_waited) == (3, 0, 2)
    assert stats.last_durable_step == steps[-1] and stats.errors == 0
    assert stats.last_bytes == store.list()[-1].size_bytes
    assert stats.last_durable_time is not None and abs(stats.last_durable_time - time.time()) < 60
    assert stats.last_write_s > 0 and stats.last_stall_s > 0


@pytest.mark.slow  # starts processes
def test_close_flushes_and_callback_sees_durable_stats(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    seen = []
    writer = AsyncSnapshotWriter(store, on_durable=lambda s: seen.append((s.last_durable_step, store.verify(s.last_durable_step))))
    writer.submit(5, state_for(5), world_size=3)
    writer.close()
    writer.close()  # idempotent
    assert seen == [(5, [])]
    assert_equal_state(store.load(5), state_for(5))
    assert store.list()[0].world_size == 3
    with pytest.raises(SnapshotError, match="closed"):
        writer.submit(6, state_for(6), world_size=1)


@pytest.mark.slow  # starts processes
@MODES
def test_a_snapshot_is_reported_durable_before_the_old_one_is_pruned(tmp_path: Path, mode: str) -> None:
    """Pruning checks snapshots and may delete a 300 MB snapshot (~0.1 s of waiting for
    the disk); the durable report (stats, on_durable, metrics) must not wait for it, and
    flush() must."""
    store = SnapshotStore(tmp_path, keep=1)
    with AsyncSnapshotWriter(store, mode=mode) as writer:
        writer.wait_writer_process()
        writer.submit(1, state_for(1), world_size=1)
        writer.flush()
        with pruning_held(tmp_path / "step-000000000099") as release:
            writer.submit(2, state_for(2), world_size=1)
            wait_until(lambda: writer.stats.last_durable_step == 2, 60, "step 2 to be reported durable")
            assert writer.pending_step == 2  # still pruning: a snapshot due now meets the overlap policy
            assert sorted(os.listdir(tmp_path)) == ["step-000000000001", "step-000000000002", "step-000000000099"]
            release()
        writer.flush()
        assert [i.step for i in store.list()] == [2]  # flush() returned after the pruning
    assert writer.stats.snapshots_written == 2 and writer.stats.errors == 0


@pytest.mark.slow  # starts processes
@MODES
def test_background_disk_full_surfaces_at_flush(tiny_fs: Path, mode: str) -> None:
    store = SnapshotStore(tiny_fs)
    with AsyncSnapshotWriter(store, mode=mode) as writer:
        writer.submit(1, {"x": torch.zeros(1000)}, world_size=1)
        writer.flush()
        writer.submit(2, {"x": torch.zeros(1 << 20)}, world_size=1)  # 4 MB > 2 MiB filesystem
        with pytest.raises(SnapshotDiskFullError, match="disk full writing snapshot step 2"):
            writer.flush()
        assert writer.stats.errors == 1 and writer.stats.last_durable_step == 1
        writer.flush()  # the error was reported once
    assert [i.step for i in store.list()] == [1]
    assert [p.name for p in tiny_fs.iterdir()] == ["step-000000000001"]


# The timer below owns SIGALRM, which pytest-timeout's default method uses: the thread
# method fails a hang here (it dumps every stack) instead of stalling the suite.
@pytest.mark.timeout(120, method="thread")
def test_flush_from_a_signal_handler_never_waits_on_the_thread_it_interrupted(tmp_path: Path) -> None:
    """A SIGTERM handler that flushes runs on the training thread wherever it was
    interrupted, in the middle of submit included (inside ``Event.wait`` or a logging
    call among others). The writer thread must never need anything that thread holds, or
    the handler waits for ever (seen in loaded CI runs, and once on an idle machine: the
    writer thread blocked in ``Event.set`` on the condition lock the interrupted
    ``prev.done.wait()`` held). A timer interrupts a loop of submits every millisecond with
    a handler that flushes, until both have happened many times."""
    writer = AsyncSnapshotWriter(SnapshotStore(tmp_path, keep=2), overlap_policy="wait", mode="thread")
    flushes = []

    def on_alarm(signum: int, frame: object) -> None:
        writer.flush(timeout=20)  # a SnapshotError here fails the test: the write never became durable
        flushes.append(writer.pending_step)
        signal.setitimer(signal.ITIMER_REAL, 0.001)  # once this handler is done: handlers do not nest

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.001)
    try:
        step, deadline = 0, time.monotonic() + 60.0  # counts, not a time window: a loaded machine is slow
        while (len(flushes) <= 50 or step <= 50) and time.monotonic() < deadline:
            step += 1
            writer.submit(step, {"w": torch.full((64,), float(step)), "step": step}, world_size=1)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, previous)
        writer.close()
    assert len(flushes) > 50 and step > 50, (len(flushes), step)  # the handler ran, mid-submit among others
    assert SnapshotStore(tmp_path).newest_valid(full=True).step == step


def test_the_training_thread_never_takes_the_writers_lock(tmp_path: Path) -> None:
    """Why the handler above cannot hang: nothing the training thread calls (submit, the
    optimizer's capture wait, stats, flush) takes the lock the writer thread needs."""
    import threading

    class Recording:
        def __init__(self) -> None:
            self.lock, self.takers = threading.Lock(), set[int]()

        def __enter__(self) -> None:
            self.takers.add(threading.get_ident())
            self.lock.acquire()

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

    writer = AsyncSnapshotWriter(SnapshotStore(tmp_path, keep=2), overlap_policy="wait", mode="thread")
    writer._lock = recording = Recording()  # type: ignore[assignment]  # a lock that records its takers
    try:
        for step in range(1, 6):
            writer.submit(step, state_for(step), world_size=1)
            writer.wait_capture()
            assert writer.stats.snapshots_written <= step
        writer.flush(timeout=30)
    finally:
        writer.close()
    assert recording.takers and threading.get_ident() not in recording.takers


@pytest.mark.slow  # starts processes
def test_sigterm_mid_write_flushes_before_exit(tmp_path: Path) -> None:
    proc = start_child("_ckpt_writer_child.py", str(tmp_path))
    try:
        out = LineReader(proc)
        out.wait_for("submitted 2", timeout=60)
        proc.send_signal(signal.SIGTERM)
        line = out.wait_for("flushed", timeout=60)
        assert proc.wait(timeout=30) == 0
    finally:
        stop_child(proc)
    pending = assert_pending_flushed(tmp_path, line)
    store = SnapshotStore(tmp_path)
    newest = store.newest_valid(full=True)
    assert newest is not None and newest.step >= pending
    assert all(s.valid for s in store.status(full=True))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.slow  # starts processes
def test_normal_exit_with_a_pending_snapshot_makes_it_durable(tmp_path: Path) -> None:
    """No close(), no flush(): the atexit hook must still finish the write."""
    code = (
        "import sys, torch\n"
        "from checkpoints import AsyncSnapshotWriter, SnapshotStore\n"
        "w = AsyncSnapshotWriter(SnapshotStore(sys.argv[1]))\n"
        "assert w.submit(9, {'w': torch.arange(4 << 20, dtype=torch.float32), 'step': 9}, world_size=1)\n"
        "print('pending', w.pending_step, flush=True)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True, text=True, env=child_env(), cwd=str(REPO_ROOT), timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "pending 9", "the write finished before exit; the test proved nothing"
    got = SnapshotStore(tmp_path).load(9)
    assert torch.equal(got["w"], torch.arange(4 << 20, dtype=torch.float32)) and got["step"] == 9
