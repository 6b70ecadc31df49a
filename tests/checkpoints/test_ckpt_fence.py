"""The snapshot directory's fence: a stale round's commits and snapshots are refused, on a real filesystem."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from checkpoints import Fence, FenceToken, SnapshotFencedError, SnapshotStore
from ckpt_testutil import state_for

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
