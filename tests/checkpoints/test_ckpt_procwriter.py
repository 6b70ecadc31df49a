"""The writer process: what crosses to it, and what happens when it or its trainer dies."""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from checkpoints import AsyncSnapshotWriter, Fence, FenceToken, SnapshotError, SnapshotFencedError, SnapshotStore, WriterStats
from checkpoints.wire import decode, encode
from ckpt_testutil import LineReader, assert_equal_state, assert_pending_flushed, pruning_held, start_child, stop_child
from tests.support.waiting import wait_until


def first_snapshot_by_the_writer_process(writer: AsyncSnapshotWriter) -> int:
    """Step 1 made durable by the writer process (not the start-up thread); its pid."""
    assert writer.wait_writer_process()
    assert writer.submit(1, {"model": {"w": torch.ones(4)}}, world_size=1)
    writer.flush()
    pid = writer.writer_pid
    assert pid is not None
    return pid


def _pid_gone(pid: int, timeout: float) -> bool:
    """True once ``pid`` and all its threads have exited (unreaped counts as gone).

    A killed multi-threaded process shows its leader as a zombie while its other threads
    still exit; only when they are gone are its sockets closed and can it be reaped.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state in ("Z", "X") and os.listdir(f"/proc/{pid}/task") == [str(pid)]:
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


def test_wire_round_trips_every_kind_of_value_a_state_dict_holds() -> None:
    t = [torch.zeros(2), torch.ones(3, dtype=torch.int64)]
    state = {
        "od": OrderedDict([("b", 1), ("a", 2)]),
        "opt": {"state": {0: {"step": t[1]}}, "param_groups": [{"params": [0, 1], "betas": (0.9, 0.999)}]},
        "misc": [None, True, 3, -0.0, math.inf, 1 + 2j, "s\u00e9", b"\x00\xff", torch.float16, torch.device("cpu"),
                 torch.Size([2, 3]), t[0]],
        7: "int key",
    }
    index = {id(x): i for i, x in enumerate(t)}
    got = decode(encode(state, lambda x: index[id(x)]), t)
    assert_equal_state(got, state)
    assert type(got["od"]) is OrderedDict and type(got["opt"]["param_groups"][0]["betas"]) is tuple
    assert got["misc"][-1] is t[0] and math.copysign(1, got["misc"][3]) == -1


@pytest.mark.slow  # starts processes
def test_writer_process_killed_mid_write_loses_only_that_snapshot(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=5)
    big = {"w": torch.randn(16 << 20)}  # 64 MB: the write takes far longer than the kill
    with AsyncSnapshotWriter(store) as writer:
        pid = first_snapshot_by_the_writer_process(writer)
        assert writer.submit(2, {"model": big}, world_size=1)
        writer.wait_capture()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(SnapshotError, match=r"writer process was killed by SIGKILL while writing step 2") as e:
            writer.flush()
        assert "\n" not in str(e.value) and writer.stats.errors == 1
        assert writer.submit(3, {"model": {"w": torch.full((4,), 3.0)}}, world_size=1)  # a new writer process
        writer.flush()
        assert writer.writer_pid not in (None, pid)
        assert writer.stats.last_write_cpu_s is None, "the new process cannot be up yet: a thread wrote step 3"
    assert [i.step for i in store.list()] == [1, 3]
    assert all(s.valid for s in store.status(full=True))
    assert torch.equal(store.load(3)["model"]["w"], torch.full((4,), 3.0))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")], "the killed write's temp dir stayed"


@pytest.mark.slow  # starts processes
def test_trainer_killed_mid_write_takes_its_writer_process_along(tmp_path: Path) -> None:
    proc = start_child("_ckpt_writer_child.py", str(tmp_path), "--writer-process")
    try:
        out = LineReader(proc)
        writer_pid = int(out.wait_for("writer ", timeout=60).split()[1])
        out.wait_for("submitted 3", timeout=60)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        stop_child(proc)
    assert _pid_gone(writer_pid, timeout=30), "the writer process outlived its trainer"
    store = SnapshotStore(tmp_path)
    assert store.newest_valid(full=True) is not None
    assert all(s.valid for s in store.status(full=True))
    store.clean_stale_temps()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.slow  # starts processes
def test_sigterm_to_the_whole_process_group_still_flushes(tmp_path: Path) -> None:
    """torchrun or a Ctrl-C may signal the group: the writer process must not die of it."""
    from ckpt_testutil import HERE, REPO_ROOT, child_env

    proc = subprocess.Popen([sys.executable, str(HERE / "_ckpt_writer_child.py"), str(tmp_path), "--writer-process"],
                            stdout=subprocess.PIPE,
                            text=True, env=child_env(), cwd=str(REPO_ROOT), start_new_session=True)
    try:
        out = LineReader(proc)
        writer_pid = int(out.wait_for("writer ", timeout=60).split()[1])
        out.wait_for("submitted 2", timeout=60)
        os.killpg(proc.pid, signal.SIGTERM)
        line = out.wait_for("flushed", timeout=60)
        assert proc.wait(timeout=30) == 0
    finally:
        stop_child(proc)
    assert_pending_flushed(tmp_path, line)
    assert _pid_gone(writer_pid, timeout=30)


@pytest.mark.slow  # starts processes
def test_an_urged_idle_write_is_raised_and_then_put_back_to_idle(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    with AsyncSnapshotWriter(store, priority="idle") as writer:
        assert writer.wait_writer_process()
        assert writer.submit(1, {"model": {"w": torch.randn(8 << 20)}}, world_size=1)
        writer.flush()  # someone waits: the write must not stay at idle priority
        stats = writer.stats
        pid = writer.writer_pid
        assert pid is not None
        policies = {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}
    assert stats.boosted == 1 and stats.snapshots_written == 1
    if os.geteuid() == 0:
        assert policies == {os.SCHED_IDLE}, "the writer process stayed raised after the urgent write"


@pytest.mark.slow  # starts processes
def test_writer_process_killed_between_snapshots_is_replaced_without_losing_one(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    with AsyncSnapshotWriter(store) as writer:
        pid = first_snapshot_by_the_writer_process(writer)
        os.kill(pid, signal.SIGKILL)
        assert _pid_gone(pid, timeout=30)
        assert writer.submit(2, {"model": {"w": torch.full((4,), 2.0)}}, world_size=1)
        writer.flush()  # no error: the dead child was noticed before the job was sent
        assert writer.writer_pid != pid and writer.stats.errors == 0
    assert [i.step for i in store.list()] == [1, 2]


@pytest.mark.slow  # starts processes
def test_writer_process_killed_while_pruning_keeps_the_durable_snapshot(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The child reports a snapshot durable, then prunes. Dying in between loses nothing:
    the snapshot counts as written, no error reaches flush(), the next one gets a new child."""
    store = SnapshotStore(tmp_path)
    pids: list[int] = []

    def kill_child_once_durable(stats: WriterStats) -> None:
        if len(pids) == 1 and stats.last_durable_step == 2:
            os.kill(pids[0], signal.SIGKILL)

    with AsyncSnapshotWriter(store, on_durable=kill_child_once_durable) as writer:
        pids.append(first_snapshot_by_the_writer_process(writer))
        stuck = tmp_path / "step-000000000099"
        with pruning_held(stuck):  # the child stays in its pruning until on_durable kills it
            assert writer.submit(2, {"model": {"w": torch.full((4,), 2.0)}}, world_size=1)
            writer.flush()  # no error: step 2 was durable before the child died
            assert writer.stats.snapshots_written == 2 and writer.stats.errors == 0
            # The writer thread's lines reach the handlers through its log pump, a thread of
            # its own (checkpoints/oneshot.py), so the line may follow flush() by a moment.
            wait_until(lambda: "while pruning after step 2" in caplog.text, 10, "the pruning child's death logged")
        stuck.rmdir()
        assert writer.wait_writer_process()  # a new child
        assert writer.submit(3, {"model": {"w": torch.full((4,), 3.0)}}, world_size=1)
        writer.flush()
        assert writer.writer_pid not in (None, pids[0]) and writer.stats.last_write_cpu_s is not None
    assert [i.step for i in store.list()] == [1, 2, 3]
    assert torch.equal(store.load(2)["model"]["w"], torch.full((4,), 2.0))


@pytest.mark.slow  # starts processes
def test_snapshots_do_not_wait_for_the_writer_process_to_start(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    with AsyncSnapshotWriter(store, overlap_policy="wait") as writer:
        t0 = time.monotonic()
        assert writer.submit(1, {"model": {"w": torch.ones(4)}}, world_size=1)
        writer.flush()
        first = time.monotonic() - t0
        assert writer.stats.last_write_cpu_s is None  # written from a thread: the process imports torch meanwhile
        assert writer.wait_writer_process()
        assert writer.submit(2, {"model": {"w": torch.ones(4)}}, world_size=1)
        writer.flush()
        assert writer.stats.last_write_cpu_s is not None  # now the process writes
    assert first < 30 and [i.step for i in store.list()] == [1, 2]


@pytest.mark.slow  # starts the writer process
def test_a_fenced_write_stays_a_fence_refusal_and_our_own_newer_round_is_no_failure(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 0 that goes on into round 8 in place raises its fence while its writer still holds
    round 7's snapshot: that one is refused, and said as what it is (INFO, no failure). A
    refusal by a round raised elsewhere is the stale-group error, of its own type, from the
    writer process too (it came back as a plain SnapshotError: an ERROR line at every join)."""
    store = SnapshotStore(tmp_path, keep=5)
    fence = Fence(tmp_path)
    fence.raise_to(FenceToken("job", 7))
    taken_in_7 = {"fence": FenceToken("job", 7).to_meta()}
    with AsyncSnapshotWriter(store) as writer:
        first_snapshot_by_the_writer_process(writer)
        fence.raise_to(FenceToken("job", 8))
        writer.own_round = 8
        with caplog.at_level(logging.INFO, logger="checkpoints.writer"):
            assert writer.submit(2, {"model": {"w": torch.ones(4)}}, world_size=1, extra_meta=taken_in_7)
            writer.flush()  # no failure
            # the writer's lines go through its log pump, a thread of its own: a moment later
            said = wait_until(lambda: [r for r in caplog.records if "snapshot step 2" in r.getMessage()], 10,
                              "the writer's line on step 2")
        assert [r.levelno for r in said] == [logging.INFO], [r.getMessage() for r in said]
        assert "taken in round 7, and this rank went on into round 8 in place" in said[0].getMessage()
        assert writer.stats.errors == 0

        writer.own_round = -1  # round 8 is someone else's: this writer's group is stale
        assert writer.submit(3, {"model": {"w": torch.ones(4)}}, world_size=1, extra_meta=taken_in_7)
        with pytest.raises(SnapshotFencedError):
            writer.flush()
    assert [i.step for i in store.list()] == [1]


STUB_CHILD = """\
import os, sys
from checkpoints import procstub
assert procstub.prefork()  # as a warm worker does before its script runs (agent/worker/warm_worker.py)
stub_pid = procstub._stub[0]
print("stub", stub_pid, flush=True)
if sys.argv[2] == "die":
    sys.stdin.readline()  # the test kills us here
import torch
from checkpoints import AsyncSnapshotWriter, SnapshotStore
with AsyncSnapshotWriter(SnapshotStore(sys.argv[1]), priority="idle") as writer:
    assert writer.wait_writer_process()
    assert writer.submit(1, {"model": {"w": torch.ones(4)}}, world_size=1)
    writer.flush()
    print("writer", writer.writer_pid, flush=True)
"""


@pytest.mark.slow  # starts processes
def test_a_writer_forked_ahead_is_the_writer_process_and_writes_a_valid_snapshot(tmp_path: Path) -> None:
    from ckpt_testutil import REPO_ROOT, child_env

    done = subprocess.run([sys.executable, "-c", STUB_CHILD, str(tmp_path), "write"], capture_output=True, text=True,
                          env=child_env(), cwd=str(REPO_ROOT), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    said = dict(line.split() for line in done.stdout.splitlines())
    assert said["writer"] == said["stub"], "the writer process was started by exec, not taken from the stub"
    info = SnapshotStore(tmp_path).newest_valid(full=True)
    assert info is not None and info.step == 1


@pytest.mark.slow  # starts processes
def test_a_writer_stub_never_taken_dies_with_its_worker(tmp_path: Path) -> None:
    from ckpt_testutil import REPO_ROOT, child_env

    proc = subprocess.Popen([sys.executable, "-c", STUB_CHILD, str(tmp_path), "die"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=child_env(), cwd=str(REPO_ROOT))
    try:
        out = LineReader(proc)
        stub = int(out.wait_for("stub ", timeout=60).split()[1])
        wait_until(lambda: b"snapshot writer" in Path(f"/proc/{stub}/cmdline").read_bytes(), 30,
                   "the stub to show itself as the snapshot writer, not as its worker")
        proc.kill()
        proc.wait(timeout=30)
    finally:
        stop_child(proc)
    assert _pid_gone(stub, timeout=30), "the writer stub outlived its worker"
