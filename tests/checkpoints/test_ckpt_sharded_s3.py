"""Sharded snapshots in a real S3 server (SeaweedFS): every rank uploads its own shards under
the snapshot's writer name, rank 0 commits the manifest, and ``torch.distributed.checkpoint``
reads it back from the bucket with ranged GETs, each checked against the signed manifest.

As in test_ckpt_sharded.py, ``dcp.save`` runs here as one rank and this process uploads the
other ranks' parts as their background threads would. Multi-process worlds that train,
snapshot to the bucket and resume at other replica and shard counts are in
tests/elastic/test_sharded_snapshots.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from checkpoints import SnapshotError
from checkpoints.reading import DCP_DIR_KEY, DCP_FILES_KEY
from checkpoints.s3dcp import S3DcpReader, unwrapped
from checkpoints.s3store import S3SnapshotStore
from checkpoints.sharded import DeferredDcpWriter, Part
from checkpoints.cli import main as cli_main
from checkpoints.errors import SnapshotCorruptError
from tests.support.s3server import SeaweedS3

KEY = b"k" * 32


def _model_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 8, generator=g), "b": torch.randn(8, generator=g)}


def _part(store: S3SnapshotStore, step: int, seed: int) -> DeferredDcpWriter:
    writer = DeferredDcpWriter(store.root, lambda: store.begin_parts(step))
    dcp.save({"model": _model_state(seed)}, storage_writer=writer, no_dist=True)
    assert writer.part is not None and writer.metadata is not None
    return writer


def _sharded(store: S3SnapshotStore, step: int, seed: int, *, other_ranks: int = 0) -> None:
    writer = _part(store, step, seed)
    assert writer.part is not None
    store.write_part(writer.part)
    for rank in range(1, 1 + other_ranks):
        store.write_part(Part(rank, writer.part.temp, f"__{rank}_0.distcp", []))
    store.seal_parts(step, writer.part.temp, ranks=1 + other_ranks, metadata=writer.metadata,
                     state={"progress": {"step": step}}, world_size=1 + other_ranks,
                     deadline=time.monotonic() + 10)


def _load(url: str, files: dict[str, tuple[int, str]], reader: S3DcpReader | None = None) -> dict[str, torch.Tensor]:
    """What docs/training.md shows: dcp.load from the bucket; a refusal as the reader's own error."""
    target = {"model": {k: torch.zeros_like(v) for k, v in _model_state(0).items()}}
    try:
        dcp.load(target, storage_reader=reader or S3DcpReader(url, files), no_dist=True)
    except BaseException as e:  # noqa: BLE001 - dcp wraps it in its CheckpointException
        raise unwrapped(e) or e from None
    return target["model"]


def test_each_rank_uploads_its_shards_and_the_bucket_holds_a_dcp_checkpoint_once_committed(s3: str) -> None:
    store = S3SnapshotStore(s3, key=KEY)
    _sharded(store, 5, seed=1, other_ranks=2)  # ranks 1 and 2 held no chunk of their own: empty parts
    assert store.check(5) == []
    info, state = store.load_latest() or (None, {})
    assert info is not None and info.step == 5 and state["progress"] == {"step": 5}
    url = str(state[DCP_DIR_KEY])
    assert url.startswith(f"{s3}/step-000000000005/") and "model" not in state
    names = sorted(o["Key"].rsplit("/", 1)[-1] for o in store.objects.list("step-000000000005/"))
    assert names == [".metadata", "000-progress.pt", "MANIFEST.json", "__0_0.distcp"]  # the part records went
    assert set(state[DCP_FILES_KEY]) == {".metadata", "__0_0.distcp"}
    got = _load(url, state[DCP_FILES_KEY])
    assert all(torch.equal(got[k], v) for k, v in _model_state(1).items())


def test_ls_verify_and_prune_treat_a_bucket_of_sharded_snapshots_like_any_other(
        s3: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    store = S3SnapshotStore(s3, keep=2, key=KEY)
    for step in (2, 4, 6):
        _sharded(store, step, seed=step, other_ranks=1)
    assert [s.step for s in store.list()] == [4, 6]  # pruned to keep=2 by the commit's housekeeping
    assert not list(store.objects.list("step-000000000002/"))
    monkeypatch.setenv("ELASTIC_RDZV_HMAC_KEY", KEY.decode())
    assert cli_main(["verify", s3]) == 0
    assert "a restart resumes from step 6" in capsys.readouterr().out
    found = store.load_latest()
    assert found is not None
    shard = str(found[1][DCP_DIR_KEY])[len(s3) + 1:] + "/__0_0.distcp"
    store.objects.put(shard, b"torn")
    assert cli_main(["verify", s3]) != 0
    assert "__0_0.distcp" in capsys.readouterr().out


def test_a_rank_whose_shards_never_arrive_commits_nothing_and_leaves_nothing(s3: str) -> None:
    store = S3SnapshotStore(s3, key=KEY)
    _sharded(store, 4, seed=1)
    writer = _part(store, 8, seed=2)
    assert writer.part is not None
    store.write_part(writer.part)  # rank 0's; rank 1's never comes
    with pytest.raises(SnapshotError) as err:
        store.seal_parts(8, writer.part.temp, ranks=2, metadata=writer.metadata, state={"progress": {"step": 8}},
                         world_size=2, deadline=time.monotonic() + 0.5)
    assert "rank(s) [1] never wrote their shards" in str(err.value) and "\n" not in str(err.value)
    assert [s.step for s in store.list()] == [4]  # the previous snapshot stays the newest
    assert not list(store.objects.list("step-000000000008/"))  # the writer's uploads went with it


def test_a_torn_or_replaced_shard_is_refused_and_the_previous_snapshot_used(s3: str, s3_server: SeaweedS3) -> None:
    store = S3SnapshotStore(s3, key=KEY)
    _sharded(store, 4, seed=1)
    _sharded(store, 8, seed=2)
    found = store.load_latest()  # verified: the manifest, every file's sha256, and each shard's ETag bound
    assert found is not None and found[0].step == 8
    url, files = str(found[1][DCP_DIR_KEY]), found[1][DCP_FILES_KEY]
    assert all(len(record) == 3 and record[2] for record in files.values())
    shard = url[len(s3) + 1:] + "/__0_0.distcp"
    older = store.load(4)
    other, _ = store.objects.get(str(older[DCP_DIR_KEY])[len(s3) + 1:] + "/__0_0.distcp")
    assert len(other) == files["__0_0.distcp"][0]
    # Replaced after the verification, before the first read: step 4's shard, the same size,
    # a valid file of other values. Bound at its first read, the reader read it as step 8's.
    store.objects.put(shard, other)
    with pytest.raises(SnapshotCorruptError, match="replaced since the snapshot was verified"):
        _load(url, files)
    assert any("__0_0.distcp: sha256 mismatch" in p for p in store.check(8))
    again = store.load_latest()
    assert again is not None and again[0].step == 4  # the whole step refused, before DCP read a byte
    meta = str(again[1][DCP_DIR_KEY])[len(s3) + 1:] + "/.metadata"
    store.objects.put(meta, store.objects.get(meta)[0][:-3])  # a torn .metadata: DCP would unpickle it
    with pytest.raises(SnapshotCorruptError, match="not the bytes the signed manifest names"):
        S3DcpReader(str(again[1][DCP_DIR_KEY]), again[1][DCP_FILES_KEY]).read_metadata()  # before any unpickling
    with pytest.raises(dcp.api.CheckpointException, match="not the bytes the signed manifest names"):
        _load(str(again[1][DCP_DIR_KEY]), again[1][DCP_FILES_KEY])  # the same, inside dcp.load
    assert store.load_latest() is None


def test_a_resume_whose_shard_is_replaced_after_verification_falls_back_to_the_previous_snapshot(
        s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a (re)starting world does (``Snapshots.load_newest``, a world of one over gloo):
    rank 0 verifies the newest snapshot, then every rank reads its shards through DCP; a shard
    replaced in between is refused, and the world resumes from the previous snapshot."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from elastic.distributed import DistInfo
    from elastic.metrics.training import NoMetrics
    from elastic.run_config import SnapshotConfig
    from elastic.sharded import load_dcp
    from elastic.snapshots import Snapshots

    monkeypatch.setenv("ELASTIC_RDZV_HMAC_KEY", KEY.decode())
    store = S3SnapshotStore(s3, key=KEY)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = {}
    for step in (4, 8):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
        model_state, optimizer_state = get_state_dict(model, optimizer)
        writer = DeferredDcpWriter(store.root, lambda s=step: store.begin_parts(s))
        dcp.save({"model": model_state, "optimizer": optimizer_state}, storage_writer=writer, no_dist=True)
        assert writer.part is not None
        store.write_part(writer.part)
        store.seal_parts(step, writer.part.temp, ranks=1, metadata=writer.metadata, state={"progress": {"step": step}},
                         world_size=1, deadline=time.monotonic() + 10)
    shard = {step: str(store.load(step, verify_shards=False)[DCP_DIR_KEY])[len(s3) + 1:] + "/__0_0.distcp"
             for step in (4, 8)}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()

    def take(state: dict[str, Any]) -> None:  # the world's TrainState.load: DCP reads the shards
        taken.append(state["progress"]["step"])
        if taken == [8]:  # rank 0 verified step 8 just now; its shard is replaced before DCP reads it
            store.objects.put(shard[8], store.objects.get(shard[4])[0])
        load_dcp(model, optimizer, state[DCP_DIR_KEY], state[DCP_FILES_KEY])

    taken: list[int] = []
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo", node="n")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg"), 1), rank=0, world_size=1)
    try:
        snapshots = Snapshots(s3, SnapshotConfig(every_steps=None, keep=5, writer="thread"), metrics=NoMetrics())
        snapshots.attach(info, check_dir=False)
        step, _ = snapshots.load_newest(info, take)
        snapshots.close()
    finally:
        dist.destroy_process_group()
    assert taken == [8, 4] and step == 4  # step 8 refused at its first read, step 4 resumed from
    assert all(torch.equal(v, saved[4][k]) for k, v in model.state_dict().items())
