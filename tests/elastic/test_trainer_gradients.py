"""The gradient is the mean over the global batch at any world size, uneven splits included.

These runs use ranks started as ``torch.multiprocessing.spawn`` would (forked from a
pre-imported zygote: :func:`tests.support.spawn.ranks`) with gloo over a FileStore instead of
torchrun: the property is about the training step, not about rendezvous, and this keeps
the test to a few seconds. ``ElasticRun`` reuses the process group it finds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from elastic.jobs.mlp import SyntheticClassification, as_batch
from elastic.distributed import ElasticRunError
from elastic.run_config import DataConfig, SnapshotConfig
from elastic.trainer import ElasticRun, StepInfo
from tests.support.spawn import ranks

DATASET, GLOBAL_BATCH = 11, 10  # step 1: 10 samples (4/3/3 over 3 ranks); step 2: the 1-sample tail
PER_RANK = 3  # fixed-per-rank at world 2: global batch 6, so lr x 6/10


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))


# (world, batch policy, metrics). With metrics the comm hook sums and the loss carries 1/world;
# without them DDP averages and the loss does not: both must give the same update.
CONFIGS = [(1, "fixed-global", True), (2, "fixed-global", True), (3, "fixed-global", True),
           (2, "fixed-per-rank", True), (3, "fixed-global", False)]


def _tag(world: int, policy: str, metrics: bool = True) -> str:
    return f"{world}-{policy}" + ("" if metrics else "-no-metrics")


def _train_one(rank: int, world: int, tmp: str, policy: str, metrics: bool) -> None:
    tag = _tag(world, policy, metrics)
    store = dist.FileStore(f"{tmp}/store-{tag}", world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    params: list[list[torch.Tensor]] = []

    def keep(_info: StepInfo) -> None:
        params.append([p.detach().clone() for p in model.parameters()])

    run = ElasticRun(
        model, optimizer, SyntheticClassification(DATASET, seed=1), global_batch_size=GLOBAL_BATCH,
        steps=2, snapshot_dir=f"{tmp}/snap-{tag}", snapshots=SnapshotConfig(every_steps=None), metrics=metrics,
        on_step_end=keep, handle_sigterm=False,
        data=DataConfig(collate_fn=as_batch, batch_policy=policy,
                        per_rank_batch_size=PER_RANK if policy == "fixed-per-rank" else None),
    )
    for x, y in run:
        run.step(F.cross_entropy(run.model(x), y))
    assert dist.is_initialized(), "ElasticRun must leave a process group it did not create"
    dist.destroy_process_group()
    if rank == 0:
        torch.save(params, f"{tmp}/params-{tag}.pt")


def _unshared_dir(rank: int, world: int, tmp: str) -> None:
    """Each rank sees its own directory at "the same path": the start must refuse, on every rank."""
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store-unshared", world), rank=rank, world_size=world)
    try:
        ElasticRun(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), SyntheticClassification(4, seed=1),
                   global_batch_size=2, steps=1, snapshot_dir=f"{tmp}/node-local-{rank}", handle_sigterm=False)
    except ElasticRunError as e:
        Path(f"{tmp}/unshared-{rank}.txt").write_text(str(e))
    dist.destroy_process_group()


def _worker(rank: int, tmp: str) -> None:
    """One spawn serves every configuration (process start dominates the cost)."""
    torch.set_num_threads(1)
    for world, policy, metrics in CONFIGS:
        if rank < world:
            _train_one(rank, world, tmp, policy, metrics)
    _unshared_dir(rank, 3, tmp)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("grads")
    ranks(_worker, (str(tmp),), max(w for w, _, _ in CONFIGS), tmp / "logs")
    return tmp


def _params(tmp: Path, world: int, policy: str = "fixed-global", metrics: bool = True) -> list[list[torch.Tensor]]:
    return torch.load(tmp / f"params-{_tag(world, policy, metrics)}.pt")


def _reference(batch: int = GLOBAL_BATCH, lr: float = 0.5) -> list[list[torch.Tensor]]:
    """The single-process definition: SGD on the mean loss over each global batch."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data = SyntheticClassification(DATASET, seed=1)
    from elastic.sampler import ElasticSampler

    sampler, out = ElasticSampler(DATASET, seed=0), []
    for _ in range(2):
        ids = sampler.global_batch(batch)
        x, y = data.__getitems__(ids)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        sampler.advance(len(ids))
        out.append([p.detach().clone() for p in model.parameters()])
    return out


@pytest.fixture(scope="module")
def reference() -> list[list[torch.Tensor]]:
    return _reference()


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize(("world", "metrics"), [(1, True), (2, True), (3, True), (3, False)])
def test_update_equals_the_global_batch_mean_at_any_world_size(
    trained: Path, world: int, metrics: bool, reference: list[list[torch.Tensor]]
) -> None:
    """Step 1 splits 10 samples 4/3/3 at world 3; step 2 is the 1-sample tail (two ranks empty).

    ``metrics=False`` has no comm hook: DDP averages and the loss is scaled differently."""
    got = _params(trained, world, metrics=metrics)
    assert len(got) == 2
    for step, (want, have) in enumerate(zip(reference, got), start=1):
        for w, h in zip(want, have):
            # float summation order differs across world sizes; 1e-6 is far below one update
            torch.testing.assert_close(h, w, rtol=0, atol=1e-6, msg=f"world {world}, step {step}")


@pytest.mark.slow  # starts processes
def test_fixed_per_rank_scales_the_learning_rate_with_the_global_batch(trained: Path) -> None:
    """3 per rank at world 2 is a global batch of 6: the update of lr 0.5 x 6/10 on 6 samples."""
    got = _params(trained, 2, "fixed-per-rank")
    want = _reference(batch=2 * PER_RANK, lr=0.5 * 2 * PER_RANK / GLOBAL_BATCH)
    for step in range(2):
        for w, h in zip(want[step], got[step]):
            torch.testing.assert_close(h, w, rtol=0, atol=1e-6)


@pytest.mark.slow  # starts processes
def test_a_snapshot_dir_not_shared_by_all_ranks_is_refused_on_every_rank(trained: Path) -> None:
    for rank in range(3):
        message = (trained / f"unshared-{rank}.txt").read_text()
        assert "is not shared: rank(s) [1, 2] cannot see files rank 0 writes there" in message, message
