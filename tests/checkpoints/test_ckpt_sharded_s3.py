"""Sharded snapshots in a real S3 server (SeaweedFS): every rank uploads its own shards under
the snapshot's writer name, rank 0 commits the manifest, and ``torch.distributed.checkpoint``
reads it back from the bucket with ranged GETs, each checked against the signed manifest.

As in test_ckpt_sharded.py, ``dcp.save`` runs here as one rank and this process uploads the
other ranks' parts as their background threads would. Multi-process worlds that train,
snapshot to the bucket and resume at other replica and shard counts are in
tests/elastic/test_sharded_snapshots.py."""

from __future__ import annotations

import time

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
    writer = DeferredDcpWriter(store.root, lambda: store.begin_parts(step))  # type: ignore[arg-type]
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
    found = store.load_latest()
    assert found is not None and found[0].step == 8
    url, files = str(found[1][DCP_DIR_KEY]), found[1][DCP_FILES_KEY]
    shard = url[len(s3) + 1:] + "/__0_0.distcp"
    data, _ = store.objects.get(shard)
    flipped = bytearray(data)
    flipped[-9] ^= 0x40  # same size, one bit
    store.objects.put(shard, bytes(flipped))
    reader = S3DcpReader(url, files)
    reader._etags["__0_0.distcp"] = "\"an-etag-from-before\""  # what it verified: another object now
    with pytest.raises(SnapshotCorruptError, match="replaced since the snapshot was verified"):
        _load(url, files, reader)
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
