"""A snapshot written from a peer copy's host copy is the snapshot a capture of its own writes.

Issue 52: "the persistent snapshots keep being written in the background from the host copy".
When the step a snapshot is of already has a complete host copy (:mod:`elastic.inplace.peer_copies`),
:meth:`elastic.snapshots.Snapshots.commit` writes its model and optimizer from it, as they
are (in shared memory for the writer process), and captures only the small run state.
Here, in process: a real gloo world of one, a real writer (its child process, and a thread),
a real directory; the two snapshots of one step are read back and compared, whole. The
one capture mock is the node's shared-memory directory in the last test (a dummy writer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from checkpoints import SnapshotStore
from elastic.distributed import DistInfo
from elastic.inplace.peer_copies import Copy, copy_for_snapshot, host_copy, host_copy_shared
from elastic.metrics.training import NoMetrics
from elastic.run_config import SnapshotConfig
from elastic.sampler import ElasticSampler
from elastic.snapshots import Snapshots
from elastic.train_state import TrainState
from tests.support.trees import assert_same_tree

STEP = 3


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[DistInfo]:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo", node="n")
    finally:
        dist.destroy_process_group()


def _trained() -> TrainState:
    """A model and AdamW after STEP steps (moments and step counters), a sampler mid-epoch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(STEP):
        model(torch.randn(8, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    state = TrainState(model, optimizer, ElasticSampler(100, seed=1))
    state.sampler.cursor = 24
    state.step, state.samples = STEP, 24
    return state


def _write(root: Path, info: DistInfo, mode: str, state: TrainState, host: Any) -> tuple[dict[str, Any], int]:
    snapshots = Snapshots(root, SnapshotConfig(every_steps=None, keep=5, writer=mode), metrics=NoMetrics(),
                          round_of=lambda: -1)
    snapshots.attach(info, check_dir=False)
    writer = snapshots.writer
    assert writer is not None
    if mode == "process":
        assert writer.wait_writer_process(60.0), "the writer process did not start"
    torch.manual_seed(7)  # the RNG as both captures find it
    snapshots.commit(STEP, None, state.capture, world_size=1, epoch=0, cursor=24, samples=24, force=True, host=host)
    writer.flush()
    fed = snapshots.fed_from_host
    snapshots.close()
    return SnapshotStore(root, create=False).load(STEP), fed


# the writer process: its child imports torch (seconds under load), so with the slow tests
@pytest.mark.parametrize("mode", [pytest.param("process", marks=pytest.mark.slow), "thread"])
def test_a_snapshot_from_the_host_copy_equals_one_from_its_own_capture(
        world_of_one: DistInfo, tmp_path: Path, mode: str) -> None:
    state = _trained()
    tree = {"state": state.capture(local=True), "recent": []}
    if mode == "process":  # the writer process reads shared memory: the copy is made there
        payload, nbytes, arena = host_copy_shared(tree)
    else:
        (payload, nbytes), arena = host_copy(tree), None
    copy = Copy(STEP, 0, -1, payload, nbytes, arena, tag=state.loads)
    own, fed_own = _write(tmp_path / "own", world_of_one, "thread", state, None)  # the files are alike either way
    fed, fed_host = _write(tmp_path / "host", world_of_one, mode, state, copy)
    assert (fed_own, fed_host) == (0, 1)
    assert_same_tree(fed, own)  # every tensor, and the run state: progress, sampler, RNG, metadata
    for key in ("model", "optimizer", "sampler", "progress", "rng"):
        assert key in own
    assert own["progress"] == {"step": STEP, "samples": 24} and own["sampler"]["cursor"] == 24


def test_a_host_copy_of_another_step_or_of_a_state_since_reloaded_is_never_taken() -> None:
    copy = Copy(5, 0, 1, {}, 0, None, tag=2)
    assert copy_for_snapshot(copy, 5, 2) is copy
    assert copy_for_snapshot(copy, 4, 2) is None  # another step
    assert copy_for_snapshot(copy, 6, 2) is None
    assert copy_for_snapshot(copy, 5, 3) is None  # a state loaded since (a rollback trains step 5 again)
    assert copy_for_snapshot(None, 5, 2) is None


def test_the_host_copy_is_fed_only_once_complete_and_only_its_own_step(world_of_one: DistInfo,
                                                                       tmp_path: Path) -> None:
    """PeerCopies.fed: set when a copy is complete (a world of one: written to the node's memory,
    here a directory of the test's own, read back from the shared-memory copy's bytes)."""
    from elastic.inplace.memory_copies import MemoryCopies, World
    from elastic.inplace.peer_copies import PeerCopies

    copies = PeerCopies(2)
    copies.memory = MemoryCopies(tmp_path, 0)
    copies.world_of = lambda: World("run", 1, 0, 1, None)
    live = {"w": torch.ones(4)}
    cpu = torch.device("cpu")
    assert copies.after_step(1, 0, 1, "n", 1, lambda: live, cpu, feed=True, tag=0)  # not due: no copy
    assert copies.fed is None
    assert copies.after_step(2, 0, 1, "n", 1, lambda: live, cpu, tag=0)  # no snapshot due: not kept for one
    assert copies.fed is None and copies.memory.steps() == [2]
    assert copies.after_step(2, 0, 1, "n", 1, lambda: live, cpu, feed=True, shared=True, tag=0)
    assert copies.fed is not None and copies.fed.step == 2 and copies.fed.arena is not None
    live["w"].add_(1)  # the next step changes the live tensors; the copy stays the step's
    assert torch.equal(copies.fed.payload["w"], torch.ones(4))
    assert torch.equal(copies.memory.read(2)["w"], torch.ones(4))

    def torn() -> Any:
        raise ValueError("the capture failed")  # a copy that never completes

    with pytest.raises(ValueError):
        copies.after_step(4, 0, 1, "n", 1, torn, cpu, feed=True, tag=0)
    assert copies.fed is None  # never step 4's: it is not complete (nor step 2's, of another step)


RUN_STEPS, EVERY = 6, 2


def _run_twice(rank: int, tmp: str) -> None:
    """A real ElasticRun, a world of one: with memory copies after every step (the node's
    directory here, as the agent gives one), then without; snapshots every 2 steps, each
    written by the writer process. Each run's result is left in ``tmp``."""
    import os

    from torch.nn import functional as F

    from elastic.jobs.mlp import IN_FEATURES, SyntheticClassification, as_batch
    from elastic.run_config import DataConfig
    from elastic.trainer import ElasticRun

    torch.set_num_threads(1)
    for name, copies in (("copies", 1), ("plain", 0)):
        if copies:
            os.makedirs(f"{tmp}/shm", exist_ok=True)
            os.environ["ELASTIC_MEMORY_COPY_DIR"] = f"{tmp}/shm"
        else:
            os.environ.pop("ELASTIC_MEMORY_COPY_DIR", None)
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store-{name}", 1), rank=0, world_size=1)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(IN_FEATURES, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 4))
        run = ElasticRun(model, torch.optim.AdamW(model.parameters(), lr=1e-3), SyntheticClassification(64, seed=0),
                         global_batch_size=4, steps=RUN_STEPS, snapshot_dir=f"{tmp}/snap-{name}",
                         snapshots=SnapshotConfig(every_steps=EVERY, keep=10), data=DataConfig(collate_fn=as_batch),
                         handle_sigterm=False, peer_copy_every=copies)
        assert run.writer is not None and run.writer.wait_writer_process(60.0)
        for x, y in run:
            run.step(F.cross_entropy(run.model(x), y))
        torch.save({"fed": run.snapshots.fed_from_host}, f"{tmp}/result-{name}.pt")
        run.close()
        dist.destroy_process_group()


@pytest.mark.slow  # starts a process (a real run, its writer process)
def test_a_run_with_copies_writes_its_snapshots_from_them_and_they_equal_a_run_without(tmp_path: Path) -> None:
    from tests.support.spawn import ranks

    ranks(_run_twice, (str(tmp_path),), 1, tmp_path / "logs")
    # step 2's at least (the first: nothing in flight to skip it for); later ones as the disk allows
    assert torch.load(tmp_path / "result-copies.pt")["fed"] >= 1, "no snapshot was written from a host copy"
    assert torch.load(tmp_path / "result-plain.pt")["fed"] == 0
    with_copies, without = SnapshotStore(tmp_path / "snap-copies", create=False), \
        SnapshotStore(tmp_path / "snap-plain", create=False)
    # (a snapshot due while the one before is still being written is skipped, in either run)
    steps = {info.step for info in with_copies.list()} & {info.step for info in without.list()}
    assert {EVERY, RUN_STEPS} <= steps
    for step in sorted(steps):  # the same snapshots, tensor by tensor, run state (progress, sampler, RNG) included
        assert_same_tree(with_copies.load(step), without.load(step), f"step {step}")
