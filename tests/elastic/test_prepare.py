"""``elastic.Elastic`` (the prepare API) in a world of one, in this process: a plain loop
changed only by the added lines trains each sample once per epoch, equals ``ElasticRun``
bit for bit, resumes exactly, and refuses what it cannot do with one line and exit 2.
The comm hook that records a lost peer instead of raising is tested on its own."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import elastic
from elastic.grad_sync import GradSync, _recording_hook
from elastic.ledger import check_ledger

N = 40
SNAPSHOTS = elastic.SnapshotConfig(every_steps=4, writer="thread")
RUN = {"metrics": False, "handle_sigterm": False, "snapshots": SNAPSHOTS}


def _with_ledger(path: Path) -> dict[str, Any]:
    return {**RUN, "snapshots": replace(SNAPSHOTS, ledger=path)}


def _parts(batch: int = 8, scheduler: bool = False) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader[Any], Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5) if scheduler else None
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g))
    return model, optimizer, DataLoader(data, batch_size=batch, shuffle=True), steps


def _plain_loop(tmp: Path, epochs: int, seen: list[tuple[int, int]] | None = None) -> tuple[nn.Module, Any]:
    model, optimizer, loader, scheduler = _parts(scheduler=True)
    ft = elastic.Elastic(snapshot_dir=tmp, **_with_ledger(tmp / "ledger.jsonl"))                # added
    model, optimizer, loader, scheduler = ft.prepare(model, optimizer, loader, scheduler)       # added
    for epoch in ft.epochs(epochs):                                                             # changed
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            scheduler.step()
            if seen is not None:
                seen.append((epoch, len(x)))
    return model, scheduler


def test_a_plain_loop_trains_each_sample_once_per_epoch(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    _, scheduler = _plain_loop(tmp_path, 3, seen)
    assert seen == [(e, 8) for e in range(3) for _ in range(5)]
    assert scheduler.get_last_lr() == [pytest.approx(0.1 * 0.5 ** 5)]  # 15 committed steps
    report = check_ledger(tmp_path / "ledger.jsonl", dataset_size=N, expect_epochs=3)
    assert report.ok, report.violations


def test_it_trains_exactly_what_elastic_run_trains(tmp_path: Path) -> None:
    prepared, _ = _plain_loop(tmp_path / "a", 2)
    model, optimizer, loader, _ = _parts()
    run = elastic.ElasticRun(model, optimizer, loader.dataset, global_batch_size=8, epochs=2,
                             snapshot_dir=tmp_path / "b", **RUN)
    for x, y in run:
        run.step(F.cross_entropy(run.model(x), y))
    # no clipping and no scheduler there: compare against a prepared loop without them
    mine = _without_extras(tmp_path / "c", 2)
    for a, b in zip(mine.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(prepared.parameters(), model.parameters()))


def _without_extras(tmp: Path, epochs: int) -> nn.Module:
    model, optimizer, loader, _ = _parts()
    ft = elastic.Elastic(snapshot_dir=tmp, **RUN)
    model, optimizer, loader = ft.prepare(model, optimizer, loader)
    for _ in ft.epochs(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert optimizer.step()
    return model


def test_amp_with_a_prepared_grad_scaler_trains_what_elastic_run_with_scaler_trains(tmp_path: Path) -> None:
    model, optimizer, loader, _ = _parts()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    ft = elastic.Elastic(snapshot_dir=tmp_path / "a", **RUN)
    model, optimizer, loader, scaler = ft.prepare(model, optimizer, loader, scaler)
    for _ in ft.epochs(2):
        for x, y in loader:
            optimizer.zero_grad()
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            assert scaler.step(optimizer)
            scaler.update()
    ref_model, ref_optimizer, ref_loader, _ = _parts()
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    run = elastic.ElasticRun(ref_model, ref_optimizer, ref_loader.dataset, global_batch_size=8, epochs=2,
                             scaler=ref_scaler, max_grad_norm=1.0, snapshot_dir=tmp_path / "b", **RUN)
    for x, y in run:
        run.step(F.cross_entropy(run.model(x), y))
    assert scaler.get_scale() == ref_scaler.get_scale()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_a_restart_resumes_from_the_snapshot_and_trains_only_the_rest(tmp_path: Path) -> None:
    _plain_loop(tmp_path, 2)
    seen: list[tuple[int, int]] = []
    _, scheduler = _plain_loop(tmp_path, 3, seen)
    assert seen == [(2, 8)] * 5, "only the third epoch is trained again"
    assert scheduler.get_last_lr() == [pytest.approx(0.1 * 0.5 ** 5)], "the scheduler's state was restored"
    report = check_ledger(tmp_path / "ledger.jsonl", dataset_size=N, expect_epochs=3)
    assert report.ok, report.violations


def test_a_kept_set_epoch_works_and_a_wrong_one_says_how_to_fix_it(tmp_path: Path, capsys: Any) -> None:
    model, optimizer, loader, _ = _parts()
    ft = elastic.Elastic(snapshot_dir=tmp_path, **RUN)
    model, optimizer, loader = ft.prepare(model, optimizer, loader)
    epochs = ft.epochs(2)
    epoch = next(epochs)
    loader.sampler.set_epoch(epoch)
    with pytest.raises(SystemExit) as exc:
        loader.sampler.set_epoch(epoch + 1)
    assert exc.value.code == 2 and "ft.epochs(N)" in capsys.readouterr().err
    ft.run.close()


@pytest.mark.parametrize("mistake", ["loader outside epochs", "no optimizer.step", "no_sync", "iterable dataset",
                                     "closure", "scheduler not prepared", "scheduler built after prepare",
                                     "step twice", "no_sync with accumulation", "step every K-th micro-batch",
                                     "accumulation and global batch"])
def test_what_prepare_cannot_do_ends_in_one_line_and_exit_2(tmp_path: Path, capsys: Any, mistake: str) -> None:
    model, optimizer, loader, _ = _parts()
    accumulate = 4 if mistake in ("no_sync with accumulation", "step every K-th micro-batch") else 1
    if mistake == "accumulation and global batch":
        with pytest.raises(SystemExit) as exc:
            elastic.Elastic(snapshot_dir=tmp_path, gradient_accumulation_steps=2, global_batch_size=16, **RUN)
        assert exc.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
        return
    ft = elastic.Elastic(snapshot_dir=tmp_path, gradient_accumulation_steps=accumulate, **RUN)
    with pytest.raises(SystemExit) as exc:
        if mistake == "iterable dataset":
            ft.prepare(model, optimizer, DataLoader(_Stream(), batch_size=4))
        if mistake == "scheduler not prepared":
            torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
        model, optimizer, loader = ft.prepare(model, optimizer, loader)
        if mistake == "scheduler built after prepare":
            torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
        if mistake == "loader outside epochs":
            next(iter(loader))
        for _ in ft.epochs(2):
            for i, (x, y) in enumerate(loader):
                if mistake == "step every K-th micro-batch":  # the plain-DDP idiom, which drifts from the run's steps
                    F.cross_entropy(model(x), y).backward()
                    if (i + 1) % 4 == 0:
                        optimizer.step()
                    continue
                F.cross_entropy(model(x), y).backward()
                if mistake in ("no_sync", "no_sync with accumulation"):
                    model.no_sync()
                if mistake == "closure":
                    optimizer.step(lambda: 0.0)
                if mistake != "no optimizer.step":
                    optimizer.step()
                if mistake == "step twice":
                    optimizer.step()
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    if ft.prepared:
        ft.run.close()


def test_a_model_left_on_the_meta_device_is_refused_at_prepare_in_one_line(tmp_path: Path, capsys: Any) -> None:
    """Built under ``torch.device("meta")`` with ``to_empty`` forgotten, it died healing or being
    healed on every node in turn, which kept each node out in turn for ever."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    _, optimizer, loader, _ = _parts()
    ft = elastic.Elastic(snapshot_dir=tmp_path, **RUN)
    with pytest.raises(SystemExit) as exc:
        ft.prepare(model, optimizer, loader)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "meta device" in err[0] and "to_empty" in err[0] and "'0.weight'" in err[0], err
    assert not ft.prepared  # refused before anything was set up


def _accumulating_loop(tmp: Path, epochs: int, accumulate: int, inputs: list[list[torch.Tensor]] | None = None,
                       scheduler_lrs: list[float] | None = None) -> nn.Module:
    """The plain loop of ``_plain_loop`` with accumulation: every line runs per micro-batch."""
    model, optimizer, loader, scheduler = _parts(batch=3, scheduler=True)
    ft = elastic.Elastic(snapshot_dir=tmp, gradient_accumulation_steps=accumulate,
                         **_with_ledger(tmp / "ledger.jsonl"))
    model, optimizer, loader, scheduler = ft.prepare(model, optimizer, loader, scheduler)
    for _ in ft.epochs(epochs):
        for x, y in loader:
            optimizer.zero_grad()  # a no-op within a step: the micro-batches' gradients add up
            (F.cross_entropy(model(x), y) / accumulate).backward()
            if ft.sync_gradients:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            trained = optimizer.step()
            scheduler.step()
            if inputs is not None:
                inputs.append([x.clone(), y.clone(), torch.tensor(bool(trained))])
            if scheduler_lrs is not None and trained:
                scheduler_lrs.append(scheduler.get_last_lr()[0])
    return model


def test_accumulation_commits_every_kth_micro_batch_and_equals_a_hand_written_accumulation(tmp_path: Path) -> None:
    """40 samples, micro-batches of 3, 4 per step: 3 whole steps (36 samples) and a step of
    2 micro-batches (3 + 1) per epoch; each micro-batch collated alone; the sampler and the
    scheduler move by whole steps; the parameters are those of the same accumulation done by
    hand on the same micro-batches (the world of one: DDP's all-reduce is the identity)."""
    seen: list[list[torch.Tensor]] = []
    lrs: list[float] = []
    model = _accumulating_loop(tmp_path, 2, 4, seen, lrs)
    assert [len(x) for x, _, _ in seen] == ([3] * 12 + [3, 1]) * 2
    assert [bool(t) for _, _, t in seen] == ([False, False, False, True] * 3 + [False, True]) * 2
    assert len(lrs) == 8 and lrs[-1] == pytest.approx(0.1 * 0.5 ** 2), "the scheduler stepped per committed step"
    report = check_ledger(tmp_path / "ledger.jsonl", dataset_size=N, expect_epochs=2)
    assert report.ok, report.violations
    half = len(seen) // 2
    for epoch in (seen[:half], seen[half:]):
        rows = [tuple(row.tolist()) for x, _, _ in epoch for row in x]
        assert len(rows) == len(set(rows)) == N, "every sample once per epoch, in micro-batches"

    ref, optimizer, _, scheduler = _parts(batch=3, scheduler=True)
    step: list[tuple[torch.Tensor, torch.Tensor]] = []
    for x, y, trained in seen:
        step.append((x, y))
        if not trained:
            continue
        optimizer.zero_grad()
        for mx, my in step:
            (F.cross_entropy(ref(mx), my) / 4).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 10.0)
        optimizer.step()
        scheduler.step()
        step = []
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_an_accumulating_run_resumes_from_its_snapshot_at_a_step_boundary(tmp_path: Path) -> None:
    _accumulating_loop(tmp_path, 1, 4)
    seen: list[list[torch.Tensor]] = []
    _accumulating_loop(tmp_path, 2, 4, seen)
    assert [len(x) for x, _, _ in seen] == [3] * 12 + [3, 1], "only the second epoch is trained, whole steps"
    report = check_ledger(tmp_path / "ledger.jsonl", dataset_size=N, expect_epochs=2)
    assert report.ok, report.violations


class _Stream(IterableDataset[Any]):
    def __iter__(self) -> Any:
        return iter([])


class _Bucket:
    def __init__(self, tensor: torch.Tensor) -> None:
        self._t = tensor

    def buffer(self) -> torch.Tensor:
        return self._t


def test_the_comm_hook_records_a_lost_peer_instead_of_raising_and_scales_the_bucket() -> None:
    sync = GradSync(nn.Linear(1, 1), metrics=None, user_backward=True)

    def broken(_state: Any, _bucket: Any) -> Any:
        fut: Any = torch.futures.Future()
        fut.set_exception(RuntimeError("[gloo] Connection closed by peer"))
        return fut

    hook = _recording_hook(None, broken)
    sync.grad_scale = 0.5
    bucket = torch.ones(3)
    out = hook(sync, _Bucket(bucket)).wait()
    assert torch.equal(out, torch.full((3,), 0.5)) and sync.failure == "[gloo] Connection closed by peer"
    called: list[int] = []
    hook2 = _recording_hook(None, lambda s, b: called.append(1))
    assert torch.equal(hook2(sync, _Bucket(torch.ones(2))).wait(), torch.ones(2)) and not called, \
        "a later bucket of a broken step skips its all-reduce"
    assert sync.take_failure() is not None and sync.take_failure() is None


# ------------------------------------------------------------------ several ranks (forked as mp.spawn's, gloo, FileStore)

def _spawned(rank: int, tmp: str) -> None:
    """World 3 holding a global batch of 10 (4/3/3, then a 1-sample tail: two stand-ins), with
    the metrics' comm hook; world 2 keeping the loader's per-rank 3, without metrics."""
    import torch.distributed as dist

    from elastic.jobs.mlp import SyntheticClassification, as_batch
    from tests.elastic.test_trainer_gradients import DATASET as SIZE
    from tests.elastic.test_trainer_gradients import _model

    torch.set_num_threads(1)
    for world, kwargs in ((3, {"global_batch_size": 10, "metrics": True}), (2, {"metrics": False})):
        if rank >= world:
            continue
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store-{world}", world), rank=rank,
                                world_size=world)
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        loader = DataLoader(SyntheticClassification(SIZE, seed=1), batch_size=3, collate_fn=as_batch)
        ft = elastic.Elastic(snapshot_dir=f"{tmp}/snap-{world}", steps=2,
                             snapshots=elastic.SnapshotConfig(every_steps=None),
                             handle_sigterm=False, **kwargs)
        model, optimizer, loader = ft.prepare(model, optimizer, loader)
        params = []
        for _ in ft.epochs():
            for x, y in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                assert optimizer.step()
                params.append([p.detach().clone() for p in model.parameters()])
        dist.destroy_process_group()
        if rank == 0:
            torch.save(params, f"{tmp}/params-{world}.pt")


@pytest.mark.slow  # starts processes
def test_the_update_is_the_mean_over_the_global_batch_at_several_ranks(tmp_path: Path) -> None:
    from tests.elastic.test_trainer_gradients import _reference
    from tests.support.spawn import ranks

    ranks(_spawned, (str(tmp_path),), 3, tmp_path / "logs")
    for world, reference in ((3, _reference(batch=10)), (2, _reference(batch=6))):  # per rank 3 x 2, lr as set
        got = torch.load(tmp_path / f"params-{world}.pt")
        assert len(got) == 2
        for step, (mine, ref) in enumerate(zip(got, reference)):
            for a, b in zip(mine, ref):
                assert torch.allclose(a, b, atol=1e-6), (world, step)


def _accumulating_ranks(rank: int, tmp: str) -> None:
    """Two ranks, micro-batches of 3, 2 per step, 27 samples: 2 whole steps (24 samples), then
    a step of 3 (2 + 1: one micro-batch each). The prepared loop, then plain DDP with
    ``no_sync`` on the same micro-batches; both save their parameters after each step. In the
    short last step the run weighs each rank by its share of the step's samples (the mean
    over the step, as without accumulation): the reference's loss carries that weight."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from elastic.jobs.mlp import SyntheticClassification, as_batch
    from tests.elastic.test_trainer_gradients import _model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 2), rank=rank, world_size=2)
    data = SyntheticClassification(27, seed=1)
    model, optimizer = _model(), None
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    ft = elastic.Elastic(snapshot_dir=f"{tmp}/snap", epochs=1, gradient_accumulation_steps=2,
                         snapshots=elastic.SnapshotConfig(every_steps=None), handle_sigterm=False, metrics=False)
    model, optimizer, loader = ft.prepare(model, optimizer, DataLoader(data, batch_size=3, collate_fn=as_batch))
    micro: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
    mine = []
    for _ in ft.epochs():
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            micro[-1].append((x, y))
            if optimizer.step():
                mine.append([p.detach().clone() for p in model.parameters()])
                micro.append([])
    ft.run.close()
    ref = DDP(_model())
    ref_optimizer = torch.optim.Adam(ref.parameters(), lr=0.01)
    theirs = []
    for step in micro[:-1]:
        ref_optimizer.zero_grad()
        for x, y in step[:-1]:
            with ref.no_sync():
                F.cross_entropy(ref(x), y).backward()
        weight = 1.0 if len(step) == 2 else 2 * len(step[-1][0]) / 3  # share x world / step's samples
        (F.cross_entropy(ref(step[-1][0]), step[-1][1]) * weight).backward()
        ref_optimizer.step()
        theirs.append([p.detach().clone() for p in ref.parameters()])
    torch.save({"mine": mine, "theirs": theirs, "sizes": [[len(x) for x, _ in s] for s in micro[:-1]]},
               f"{tmp}/rank-{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow  # starts processes
def test_accumulation_at_two_ranks_equals_plain_ddp_with_no_sync_on_the_same_micro_batches(tmp_path: Path) -> None:
    from tests.support.spawn import ranks

    ranks(_accumulating_ranks, (str(tmp_path),), 2, tmp_path / "logs")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank-{rank}.pt")
        assert got["sizes"] == [[3, 3], [3, 3], [2 if rank == 0 else 1]], got["sizes"]
        assert len(got["mine"]) == len(got["theirs"]) == 3
        for step, (mine, theirs) in enumerate(zip(got["mine"], got["theirs"])):
            for a, b in zip(mine, theirs):
                if step < 2:  # whole steps: DDP's own averaging, bit for bit
                    assert torch.equal(a, b), (rank, step, (a - b).abs().max())
                else:  # the weight is in the bucket here, in the loss there: rounding apart
                    assert torch.allclose(a, b, atol=1e-6), (rank, step, (a - b).abs().max())


def _peer_dies(rank: int, tmp: str, accumulate: int) -> None:
    """Rank 1 dies before step 3's (last micro-batch's) backward; rank 0's own
    ``loss.backward()`` must return and its ``optimizer.step()`` abandon the step (the
    restart path: exit 1 for its agent)."""
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 2), rank=rank, world_size=2)
    model, optimizer, loader, _ = _parts()
    ft = elastic.Elastic(snapshot_dir=f"{tmp}/snap", handle_sigterm=False, metrics=False,
                         snapshots=elastic.SnapshotConfig(every_steps=1),
                         gradient_accumulation_steps=accumulate)
    model, optimizer, loader = ft.prepare(model, optimizer, loader)
    for _ in ft.epochs(3):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if rank == 1 and ft.step_count == 2 and ft.sync_gradients:
                os._exit(0)
            loss.backward()
            if ft.sync_gradients:
                Path(f"{tmp}/backward-{rank}-{ft.step_count}").touch()
            try:
                optimizer.step()
            except SystemExit as exc:
                Path(f"{tmp}/exit-{rank}-{exc.code}-at-{ft.step_count}").touch()
                os._exit(0)


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_peer_lost_in_the_scripts_own_backward_is_caught_at_optimizer_step(tmp_path: Path, accumulate: int) -> None:
    from tests.support.spawn import ranks

    ranks(_peer_dies, (str(tmp_path), accumulate), 2, tmp_path / "logs")
    assert (tmp_path / "backward-0-2").exists(), "rank 0's loss.backward() raised"
    assert (tmp_path / "exit-0-1-at-2").exists(), sorted(p.name for p in tmp_path.iterdir())


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # no optimizer here
def test_a_prepared_scheduler_does_not_step_for_an_abandoned_step(tmp_path: Path) -> None:
    from elastic.prepare import PreparedScheduler
    from elastic.step_result import StepResult

    model, optimizer, loader, scheduler = _parts(scheduler=True)
    ft = elastic.Elastic(snapshot_dir=tmp_path, **RUN)
    wrapped = PreparedScheduler(ft, scheduler)
    ft.last_step = StepResult(False, 1, 0)
    wrapped.step()
    assert scheduler.last_epoch == 0, "stepped for a step that was not applied"
    ft.last_step = StepResult(True, 1, 0)
    wrapped.step()
    assert scheduler.last_epoch == 1 and wrapped.get_last_lr() == scheduler.get_last_lr()


@pytest.mark.parametrize("pin", [False, True])
def test_the_loaders_pin_memory_is_kept(tmp_path: Path, pin: bool) -> None:
    """A plain DataLoader does not pin; a dataset already on the GPU cannot be pinned, so the
    prepared loop must not pin what the script's own loop did not (found on an H200)."""
    model, optimizer, loader, _ = _parts()
    loader = DataLoader(loader.dataset, batch_size=8, pin_memory=pin)
    ft = elastic.Elastic(snapshot_dir=tmp_path, **RUN)
    ft.prepare(model, optimizer, loader)
    try:
        assert ft.run.plan.pin_memory is pin
    finally:
        ft.run.close()
    bare = elastic.Elastic(snapshot_dir=tmp_path / "bare", batch_size=8, **RUN)
    bare.prepare(*_parts()[:2], loader.dataset)
    try:
        assert bare.run.plan.pin_memory is None  # a bare dataset: the run's default (pin on CUDA)
    finally:
        bare.run.close()
