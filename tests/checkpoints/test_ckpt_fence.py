"""The snapshot directory's fence: a stale round's commits and snapshots are refused, on a real filesystem."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from checkpoints import Fence, FenceToken, SnapshotFencedError, SnapshotStore
from checkpoints.fence import LOCK_NAME, LOCK_WAIT_S
from ckpt_testutil import state_for
from elastic.ledger import Ledger, check_ledger, read_ledger
from elastic.snapshots import last_ledger_step
from tests.support.waiting import wait_until

RUN = "job1"


def test_the_fence_only_rises_and_a_newer_round_refuses_the_older_ones_commits(tmp_path: Path) -> None:
    fence = Fence(tmp_path)
    assert fence.current() is None
    fence.raise_to(FenceToken(RUN, 3))
    with fence.holding(FenceToken(RUN, 3)):
        pass  # the current round commits
    fence.raise_to(FenceToken(RUN, 5))
    with pytest.raises(SnapshotFencedError, match="round 5 of this job now commits.*round 3 is stale"):
        with fence.holding(FenceToken(RUN, 3)):
            pass
    with pytest.raises(SnapshotFencedError):
        fence.raise_to(FenceToken(RUN, 4))  # a stale group forming late cannot lower it
    assert fence.current() == FenceToken(RUN, 5)


def test_another_run_takes_the_directory_over_and_the_old_run_is_stale(tmp_path: Path) -> None:
    fence = Fence(tmp_path)
    fence.raise_to(FenceToken(RUN, 40))
    fence.raise_to(FenceToken("job2", 0))  # a new job on an old directory starts its rounds at 0
    with pytest.raises(SnapshotFencedError, match="run 'job2' now writes"):
        with fence.holding(FenceToken(RUN, 40)):
            pass


def test_a_raise_waits_for_a_commit_in_progress(tmp_path: Path) -> None:
    fence = Fence(tmp_path)
    fence.raise_to(FenceToken(RUN, 1))
    raised = threading.Event()
    with fence.holding(FenceToken(RUN, 1)):
        thread = threading.Thread(target=lambda: (fence.raise_to(FenceToken(RUN, 2)), raised.set()))
        thread.start()
        assert not raised.wait(0.3), "the fence moved under a commit"
    thread.join(timeout=10)
    assert raised.is_set() and fence.current() == FenceToken(RUN, 2)


def test_a_stale_groups_snapshot_never_becomes_the_newest(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snaps")
    fence = Fence(store.root)
    fence.raise_to(FenceToken(RUN, 7))
    store.save(10, state_for(10), world_size=2, extra_meta={"fence": FenceToken(RUN, 7).to_meta()})
    fence.raise_to(FenceToken(RUN, 8))  # a new group formed; the old one still writes step 20
    with pytest.raises(SnapshotFencedError):
        store.save(20, state_for(20), world_size=3, extra_meta={"fence": FenceToken(RUN, 7).to_meta()})
    newest = store.newest_valid()
    assert newest is not None and newest.step == 10
    assert [p.name for p in store.root.iterdir() if p.name.startswith(".tmp")] == []  # no temp dir left
    store.save(30, state_for(30), world_size=2)  # a snapshot without a token (no rendezvous) is not fenced


FROZEN_COMMIT = textwrap.dedent("""
    import os, signal, sys
    from checkpoints import Fence, FenceToken, SnapshotFencedError
    fence = Fence(sys.argv[1])
    with fence.holding(FenceToken("job1", 1)):  # rank 0 appending a step's ledger line...
        print("holding", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # ...when its node is frozen
    try:
        with fence.holding(FenceToken("job1", 1)):
            print("committed after the raise", flush=True)
    except SnapshotFencedError:
        print("refused", flush=True)
""")
FROZEN_RAISE = textwrap.dedent("""
    import fcntl, os, signal, sys
    fd = os.open(os.path.join(sys.argv[1], sys.argv[2]), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what Fence.raise_to holds while it writes
    print("holding", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
""")


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _frozen_holder(script: str, *args: str) -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.stdout is not None and child.stdout.readline().strip() == "holding"
    wait_until(lambda: _stopped(child.pid), 10, "the lock holder to be stopped")
    return child


@pytest.mark.slow  # starts a process and SIGSTOPs it
def test_a_process_frozen_inside_a_commit_does_not_stall_the_next_rounds_raise(tmp_path: Path) -> None:
    """A frozen rank 0 inside its ledger commit held the lock the survivors' new rank 0 must
    take to raise the fence: the survivors waited for as long as it stayed frozen. The raise
    now waits the lock's bound, and the thawed holder's next commit is refused."""
    fence = Fence(tmp_path)
    fence.raise_to(FenceToken(RUN, 1))
    child = _frozen_holder(FROZEN_COMMIT, str(tmp_path))
    try:
        started = time.monotonic()
        fence.raise_to(FenceToken(RUN, 2))
        took = time.monotonic() - started
        assert LOCK_WAIT_S <= took < LOCK_WAIT_S + 5, took
        assert fence.current() == FenceToken(RUN, 2)
        with fence.holding(FenceToken(RUN, 2)):
            pass  # the new round commits while the old holder is still frozen
        os.kill(child.pid, signal.SIGCONT)
        out, _ = child.communicate(timeout=30)
        assert out.strip() == "refused", out
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


FROZEN_RANK0 = textwrap.dedent("""
    import os, signal, sys
    from checkpoints import Fence, FenceToken, SnapshotFencedError
    from elastic.ledger import Ledger
    fence, ledger, token = Fence(sys.argv[1]), Ledger(sys.argv[2], incarnation="old"), FenceToken("job", 1)
    for step in (1, 2, 3, 4):
        ids = [2 * step - 2, 2 * step - 1]  # a global batch of 2 (the test's new rank 0 takes the same)
        try:
            with fence.holding(token):  # what Snapshots._write_line does for each committed step
                if step == 3:
                    print("holding", flush=True)
                    os.kill(os.getpid(), signal.SIGSTOP)  # its node frozen inside step 3's commit
                ledger.record(epoch=0, step=step, world_size=2, samples=ids, resumed_from=0, round_number=1)
        except SnapshotFencedError:
            print(f"refused step {step}", flush=True)
            break
""")


@pytest.mark.slow  # starts a process and SIGSTOPs it
def test_a_rank_0_frozen_inside_its_ledger_commit_leaves_no_split_brain(tmp_path: Path) -> None:
    """The ledger's side of the frozen commit above. Seen under load in test_freeze_host:
    the frozen old rank 0 completed its admitted line of a step the new rank 0 had recorded
    meanwhile, and the checker called it a split brain. It is the one late commit the fence
    allows; its next one is refused."""
    root, path = tmp_path / "snapshots", tmp_path / "ledger.jsonl"
    root.mkdir()
    fence = Fence(root, key=None)
    fence.raise_to(FenceToken("job", 1))
    child = _frozen_holder(FROZEN_RANK0, str(root), str(path))
    try:
        fence.raise_to(FenceToken("job", 2))  # the survivors' round: goes on without the frozen holder's lock
        new = Ledger(path, incarnation="new")
        for step in range(1, 7):
            ids = [2 * step - 2, 2 * step - 1]
            if step > last_ledger_step(path):  # Snapshots.catch_up, then the steps the new round trains
                with fence.holding(FenceToken("job", 2)):
                    new.record(epoch=0, step=step, world_size=2, samples=ids, resumed_from=2, round_number=2)
            if step == 4:
                os.kill(child.pid, signal.SIGCONT)
                out, _ = child.communicate(timeout=30)
                assert out.strip() == "refused step 4", out
        new.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    steps = [(r["round"], r["step"]) for r in read_ledger(path)]
    assert steps[:4] == [(1, 1), (1, 2), (2, 3), (2, 4)] and (1, 3) in steps[4:], steps  # the late line is there
    report = check_ledger(path, 12, expect_epochs=1)
    assert report.ok, report.violations
    assert report.steps == 6


@pytest.mark.slow  # starts a process and SIGSTOPs it
def test_a_process_frozen_inside_a_raise_does_not_stall_the_commits(tmp_path: Path) -> None:
    fence = Fence(tmp_path)
    fence.raise_to(FenceToken(RUN, 3))
    child = _frozen_holder(FROZEN_RAISE, str(tmp_path), LOCK_NAME)
    try:
        started = time.monotonic()
        with fence.holding(FenceToken(RUN, 3)):
            took = time.monotonic() - started
        assert LOCK_WAIT_S <= took < LOCK_WAIT_S + 5, took
        with pytest.raises(SnapshotFencedError):
            with fence.holding(FenceToken(RUN, 2)):  # the check itself still stands without the lock
                pass
    finally:
        child.kill()
        child.wait()
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the killed holder's lock went with it
    finally:
        os.close(fd)
