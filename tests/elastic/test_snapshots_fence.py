"""Rank 0's asynchronous writer and the fence across rounds formed in place (a world of one).

The writer renames a snapshot into place some time after it was submitted. In place, a
new round can form meanwhile, and rank 0 stands the fence at that round: the snapshot
submitted in the earlier round is then refused. That refusal is the fence at work, not a
stale group, and the world that formed the newer round must go on and finish (the demo
once stopped at its very end with "this group of round 1 is stale"). A world whose round
is older than the fence, though, is stale, and must stop.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from checkpoints import Fence, FenceToken, SnapshotStore
from checkpoints.fence import FENCE_NAME, LOCK_NAME
from elastic.distributed import DistInfo
from elastic.metrics.training import NoMetrics
from elastic.run_config import SnapshotConfig
from elastic.snapshots import Snapshots, StaleGroupError

RUN = "fence-test"


@pytest.fixture
def world_of_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[DistInfo]:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", RUN)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo", node="n")
    finally:
        dist.destroy_process_group()


class Rounds:
    """The round the world stands in, as Membership reports it to the trainer."""

    def __init__(self) -> None:
        self.now = 1

    def __call__(self) -> int:
        return self.now


def opened(root: Path, rounds: Rounds, info: DistInfo) -> Snapshots:
    config = SnapshotConfig(every_steps=None, keep=5, writer="thread")
    snapshots = Snapshots(root, config, metrics=NoMetrics(), round_of=rounds)
    snapshots.attach(info, check_dir=False)
    return snapshots


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(step))}


def stand_fence_while_writer_waits(root: Path, snapshots: Snapshots, step: int, at: FenceToken) -> None:
    """Submit ``step``, and move the fence to ``at`` before its rename can happen: the test
    holds the fence's lock, so the writer blocks right before the rename."""
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        snapshots.commit(step, None, lambda: state(step), world_size=1, epoch=0, cursor=0, samples=0, force=True)
        (root / FENCE_NAME).write_text(json.dumps(at.to_meta()))
    finally:
        os.close(fd)


def test_a_snapshot_fenced_off_by_this_worlds_own_newer_round_is_dropped_and_the_job_finishes(
    tmp_path: Path, world_of_one: DistInfo
) -> None:
    root, rounds = tmp_path / "snapshots", Rounds()
    snapshots = opened(root, rounds, world_of_one)
    assert Fence(root).current() == FenceToken(RUN, 1)

    stand_fence_while_writer_waits(root, snapshots, 5, FenceToken(RUN, 2))
    rounds.now = 2  # the same world, re-formed in place as round 2 (rank 0 stood the fence there)
    snapshots.attach(world_of_one, check_dir=False)
    snapshots.final(6, state(6), world_size=1, meta={})
    snapshots.close()

    store = SnapshotStore(root, keep=5, create=False)
    assert [info.step for info in store.list()] == [6], "step 5 was fenced off; the final snapshot must be durable"
    assert store.list()[0].extra_meta["fence"] == {"run": RUN, "round": 2}
    assert Fence(root).current() == FenceToken(RUN, 2)


def test_a_world_whose_round_the_fence_has_passed_is_stale_and_commits_nothing(
    tmp_path: Path, world_of_one: DistInfo
) -> None:
    root, rounds = tmp_path / "snapshots", Rounds()
    snapshots = opened(root, rounds, world_of_one)

    stand_fence_while_writer_waits(root, snapshots, 5, FenceToken(RUN, 3))  # another group formed round 3
    with pytest.raises(StaleGroupError, match="round 3 of this job now commits"):
        snapshots.final(6, state(6), world_size=1, meta={})
    snapshots.close()
    assert SnapshotStore(root, keep=5, create=False).list() == []
    assert Fence(root).current() == FenceToken(RUN, 3)
