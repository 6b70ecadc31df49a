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
    snapshots = Snapshots(root, SnapshotConfig(every_steps=None, keep=5, writer=mode), metrics=NoMetrics(),  # type: ignore[arg-type]
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


def _equal(a: Any, b: Any, where: str = "state") -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


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
    _equal(fed, own)  # every tensor, and the run state: progress, sampler, RNG, metadata
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


def test_the_host_copy_is_fed_only_once_complete_and_only_its_own_step(world_of_one: DistInfo) -> None:
    """PeerCopies.fed: set when a copy is complete (a world of one: written to the node's memory)."""
    from elastic.inplace.peer_copies import PeerCopies

    class Memory:  # the node's memory copies, reduced to what a world of one calls (no /dev/shm here)
        def write(self, *_: Any) -> None:
            pass

    copies = PeerCopies(2)
    copies.memory = Memory()  # type: ignore[assignment]
    copies.world_of = lambda: None  # type: ignore[assignment,return-value]
    live = {"w": torch.ones(4)}
    assert copies.after_step(1, 0, 1, "n", 1, lambda: live, torch.device("cpu"), tag=0)  # not due: no copy
    assert copies.fed is None
    assert copies.after_step(2, 0, 1, "n", 1, lambda: live, torch.device("cpu"), shared=True, tag=0)
    assert copies.fed is not None and copies.fed.step == 2 and copies.fed.arena is not None
    live["w"].add_(1)  # the next step changes the live tensors; the copy stays the step's
    assert torch.equal(copies.fed.payload["w"], torch.ones(4))

    def torn() -> Any:
        raise ValueError("the capture failed")  # a copy that never completes

    with pytest.raises(ValueError):
        copies.after_step(4, 0, 1, "n", 1, torn, torch.device("cpu"), tag=0)
    assert copies.fed.step == 2  # still the last complete one, never step 4's
    assert copy_for_snapshot(copies.fed, 4, 0) is None
