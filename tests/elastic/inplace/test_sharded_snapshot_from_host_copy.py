"""A sharded snapshot written from each rank's host copy is the snapshot a capture of its own writes.

Issue 52 item 3, for sharded layouts: with peer copies on, each rank already holds a complete
host copy of its shards of the step (:mod:`elastic.inplace.peer_copies`); a sharded snapshot
of that step takes its shards' bytes from it (:mod:`elastic.host_shards`) instead of copying
them again, under the plan ``dcp.save`` makes of the live state. Here two real ranks (a gloo
world over a file store), a real FSDP2 model on a 1-D mesh and an HSDP one on a 2-D mesh,
AdamW, real :class:`elastic.snapshots.Snapshots` and a real directory: each step's snapshot is
written twice, by the old capture path and from the host copy, and read back (DCP's own load,
tensor by tensor, every shard file byte by byte, the run state). The pairing's refusals are
pure (milliseconds).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.host_shards import HostShards, host_shards
from elastic.inplace.peer_copies import Copy
from tests.support.trees import assert_same_tree

STEP = 3


def _copy(step: int, model: dict[str, Any], optimizer: dict[str, Any], tag: int = 0) -> Copy:
    return Copy(step, 0, -1, {"state": {"model": model, "optimizer": optimizer}, "recent": []}, 0, tag=tag)


def test_a_host_copy_of_another_step_another_state_or_another_tree_is_never_paired() -> None:
    w, m = torch.ones(4), torch.zeros(4)
    live = lambda: ({"w": w}, {"state": {0: {"exp_avg": m}}})  # noqa: E731
    held = _copy(STEP, {"w": w.clone()}, {"state": {0: {"exp_avg": m.clone()}}}, tag=1)
    assert host_shards(held, STEP, 1, live) is not None
    assert host_shards(held, STEP + 1, 1, live) is None  # another step
    assert host_shards(held, STEP - 1, 1, live) is None
    assert host_shards(held, STEP, 2, live) is None  # a state loaded since (a rollback trains it again)
    assert host_shards(None, STEP, 1, live) is None  # no complete copy
    other = _copy(STEP, {"w": torch.ones(2)}, {"state": {0: {"exp_avg": m.clone()}}}, tag=1)
    assert host_shards(other, STEP, 1, live) is None  # shards of another shape (another world's)
    fewer = _copy(STEP, {"w": w.clone()}, {"state": {}}, tag=1)
    assert host_shards(fewer, STEP, 1, live) is None  # another tree


def test_an_item_the_host_copy_does_not_hold_is_copied_never_guessed() -> None:
    w = torch.arange(8.0)
    host = HostShards.pair({"w": w}, {"w": w.clone()})
    assert host is not None
    copied: list[torch.Tensor] = []
    stage = host.stage(lambda _i, t: copied.append(t) or t.clone())
    assert stage(None, w.detach()).data_ptr() != w.data_ptr()  # the host copy's own tensor
    assert not copied and host.taken_bytes == 32
    stage(None, w[2:6])  # a view of another extent: not the copy's, copied as without copies
    assert len(copied) == 1 and host.copied_bytes == 16


def _layouts(rank: int, tmp: str) -> None:
    """Each rank: for an FSDP2 (1-D mesh) and an HSDP (2-D mesh) model after STEP steps of
    AdamW, snapshot STEP written by the capture path and from the host copy; rank 0 compares."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from checkpoints import SnapshotStore
    from checkpoints.reading import DCP_DIR_KEY
    from elastic.distributed import DistInfo
    from elastic.inplace.hsdp import capture_local
    from elastic.inplace.peer_copies import host_copy
    from elastic.metrics.training import NoMetrics
    from elastic.run_config import SnapshotConfig
    from elastic.sampler import ElasticSampler
    from elastic.snapshots import Snapshots
    from elastic.train_state import TrainState

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 2), rank=rank, world_size=2)
    info = DistInfo(rank=rank, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo",
                    node=f"n{rank}")
    for name, shape, names in (("fsdp", (2,), ("shard",)), ("hsdp", (2, 1), ("replicate", "shard"))):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 4))  # 33: an uneven shard
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(rank)
        for _ in range(STEP):
            model(torch.randn(6, 16, generator=g)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        state = TrainState(model, optimizer, ElasticSampler(100, seed=1))
        state.sharded = state.shards_in_snapshots = True
        state.sampler.cursor, state.step, state.samples = 12, STEP, 12
        payload, nbytes = host_copy({"state": state.capture(local=True), "recent": []})  # as PeerCopies makes it
        fed = Copy(STEP, rank, -1, payload, nbytes, tag=state.loads)
        taken: dict[str, Any] = {}
        for way in ("own", "host"):
            snapshots = Snapshots(Path(tmp) / f"{name}-{way}", SnapshotConfig(every_steps=None, keep=5),
                                  metrics=NoMetrics(), round_of=lambda: -1)
            snapshots.collective = True
            snapshots.attach(info, check_dir=False)
            assert snapshots.takes_sharded_host_copies and snapshots.host_copy_wanted(STEP) == (False, False)
            host = host_shards(fed, STEP, state.loads, lambda: capture_local(model, optimizer)) \
                if way == "host" else None
            torch.manual_seed(7)  # the RNG as both captures find it
            snapshots.commit(STEP, None, state.capture, world_size=2, epoch=0, cursor=12, samples=12, force=True,
                             host=host)
            assert snapshots.sharded is not None
            snapshots.sharded.flush()
            taken[way] = (snapshots.fed_from_host, host)
            snapshots.close()
        assert taken["own"][0] == 0 and taken["host"][0] == 1, taken
        host = taken["host"][1]
        assert host.taken_bytes > 0 and host.copied_bytes == 0, (host.taken_bytes, host.copied_bytes)
        dist.barrier()
        if rank == 0:
            got = {way: SnapshotStore(Path(tmp) / f"{name}-{way}", create=False).load(STEP) for way in ("own", "host")}
            rest = {way: {k: v for k, v in s.items() if k not in (DCP_DIR_KEY, "dcp_files")} for way, s in got.items()}
            torch.save(rest, f"{tmp}/{name}-rest.pt")
            for way, s in got.items():
                where = Path(s[DCP_DIR_KEY])
                dcp_to_torch_save(where, f"{tmp}/{name}-{way}.pt")  # DCP's own load, every shard
                files = sorted(p.name for p in where.iterdir() if p.suffix == ".distcp")
                torch.save({f: (where / f).read_bytes() for f in files}, f"{tmp}/{name}-{way}-files.pt")
        dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # two processes
def test_a_sharded_snapshot_from_the_host_copies_equals_one_from_the_capture_path(tmp_path: Path) -> None:
    from tests.support.spawn import ranks

    ranks(_layouts, (str(tmp_path),), 2, tmp_path / "logs", timeout=240)
    for name in ("fsdp", "hsdp"):
        own, host = (torch.load(tmp_path / f"{name}-{way}.pt", weights_only=False) for way in ("own", "host"))
        assert set(own) == {"model", "optimizer"} and own["model"] and own["optimizer"]["state"], own
        assert_same_tree(host, own, f"{name}: DCP's load")  # model and AdamW state (moments, step counts), whole
        files = {way: torch.load(tmp_path / f"{name}-{way}-files.pt") for way in ("own", "host")}
        assert files["host"] == files["own"], f"{name}: the shard files differ"  # the same bytes, file by file
        rest = torch.load(tmp_path / f"{name}-rest.pt", weights_only=False)
        assert_same_tree(rest["host"], rest["own"], f"{name}: the run state")
        assert rest["own"]["progress"] == {"step": STEP, "samples": 12} and rest["own"]["sampler"]["cursor"] == 12
