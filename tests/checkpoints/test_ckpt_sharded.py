"""Sharded snapshots in the store (:mod:`checkpoints.sharded`), in one process.

``dcp.save`` runs here without a process group (``no_dist``), as one rank; the other ranks'
parts are written by this process too, as their background threads would write them. What
is checked: the seal is atomic as a whole (a rank's part missing or the world changed: no
snapshot, no temp dir), the manifest covers every file so a torn or forged shard is refused
before DCP reads anything, the CLI and pruning treat a sharded snapshot like any other, and
torch's stock reader loads what the deferred writer wrote (the guard on the private name
:mod:`checkpoints.dcp_private` uses)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from checkpoints import SnapshotError, SnapshotStore, dcp_private
from checkpoints.reading import DCP_DIR_KEY
from checkpoints.sharded import DeferredDcpWriter, Part, part_name, write_part

KEY = b"k" * 32


def _model_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g)}


def _deferred(store: SnapshotStore, step: int, state: dict[str, torch.Tensor]) -> DeferredDcpWriter:
    writer = DeferredDcpWriter(store.root, lambda: store.begin_parts(step))
    dcp.save({"model": state}, storage_writer=writer, no_dist=True)
    assert writer.part is not None and writer.metadata is not None
    return writer


def _sharded(store: SnapshotStore, step: int, seed: int, *, other_ranks: int = 0) -> None:
    """Snapshot ``step`` as a world of ``1 + other_ranks`` would leave it (the others' parts empty)."""
    writer = _deferred(store, step, _model_state(seed))
    assert writer.part is not None and writer.metadata is not None
    write_part(store.root, writer.part)
    for rank in range(1, 1 + other_ranks):
        write_part(store.root, Part(rank, writer.part.temp, f"__{rank}_0.distcp", []))
    store.seal_parts(step, writer.part.temp, ranks=1 + other_ranks, metadata=writer.metadata,
                     state={"progress": {"step": step}}, world_size=1 + other_ranks,
                     deadline=time.monotonic() + 5)


def test_torchs_private_storage_record_is_what_the_deferred_writer_needs() -> None:
    """Fails loudly when torch renames or reshapes ``_StorageInfo`` (its fields are pickled
    into ``.metadata``, which torch's own reader then reads)."""
    assert dcp_private.PROBLEM is None, dcp_private.PROBLEM
    info = dcp_private.storage_info("__0_0.distcp", 7, 11)
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 7, 11)
    assert pickle.loads(pickle.dumps(info)) == info
    assert (dcp_private.METADATA_NAME, dcp_private.SUFFIX) == (".metadata", ".distcp")


def test_a_sealed_sharded_snapshot_verifies_and_dcp_loads_it(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, key=KEY)
    _sharded(store, 5, seed=1, other_ranks=2)  # ranks 1 and 2 held no chunk of their own: empty parts
    assert store.check(5) == []
    info, state = store.load_latest() or (None, {})
    assert info is not None and info.step == 5 and state["progress"] == {"step": 5}
    assert sorted(p.name for p in state[DCP_DIR_KEY].iterdir()) == [".metadata", "000-progress.pt",
                                                                     "MANIFEST.json", "__0_0.distcp"]
    target = {"model": {k: torch.zeros_like(v) for k, v in _model_state(0).items()}}
    dcp.load(target, checkpoint_id=str(state[DCP_DIR_KEY]), no_dist=True)
    assert all(torch.equal(target["model"][k], v) for k, v in _model_state(1).items())


def test_the_training_state_it_captured_is_the_one_written_though_training_moved_on(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, key=None)
    live = _model_state(2)
    writer = _deferred(store, 3, live)
    live["w"].add_(1.0)  # the next optimizer step, before the background write
    assert writer.part is not None and writer.metadata is not None
    write_part(store.root, writer.part)
    store.seal_parts(3, writer.part.temp, ranks=1, metadata=writer.metadata, state={"progress": {"step": 3}},
                     world_size=1, deadline=time.monotonic() + 5)
    target = {"model": {k: torch.zeros_like(v) for k, v in live.items()}}
    dcp.load(target, checkpoint_id=str(tmp_path / "step-000000000003"), no_dist=True)
    assert torch.equal(target["model"]["w"], _model_state(2)["w"])


@pytest.mark.parametrize("why", ["late", "abandoned"])
def test_a_rank_whose_shards_never_arrive_leaves_no_snapshot_and_no_temp_dir(tmp_path: Path, why: str) -> None:
    store = SnapshotStore(tmp_path, key=KEY)
    _sharded(store, 4, seed=1)
    writer = _deferred(store, 8, _model_state(2))
    assert writer.part is not None and writer.metadata is not None
    write_part(store.root, writer.part)  # rank 0's; rank 1's never comes
    t0 = time.monotonic()
    with pytest.raises(SnapshotError) as err:
        store.seal_parts(8, writer.part.temp, ranks=2, metadata=writer.metadata, state={"progress": {"step": 8}},
                         world_size=2, deadline=time.monotonic() + (0.3 if why == "late" else 60),
                         abandoned=(lambda: True) if why == "abandoned" else (lambda: False))
    assert time.monotonic() - t0 < 10
    said = str(err.value)
    assert "rank(s) [1] never wrote their shards" in said and "\n" not in said
    assert ("the world changed" if why == "abandoned" else "did not arrive in time") in said
    assert [s.step for s in store.list()] == [4]  # the previous snapshot stays the newest
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_torn_or_forged_shard_is_refused_before_anything_is_read_and_the_previous_one_used(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, key=KEY)
    _sharded(store, 4, seed=1)
    _sharded(store, 8, seed=2)
    shard = tmp_path / "step-000000000008" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-9] ^= 0x40  # same size, one bit: only the hash can tell
    shard.write_bytes(bytes(data))
    assert any("__0_0.distcp: sha256 mismatch" in p for p in store.check(8))
    found = store.load_latest()
    assert found is not None and found[0].step == 4
    meta = tmp_path / "step-000000000004" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:-3])  # a torn .metadata: DCP would unpickle it
    assert any(".metadata: size" in p for p in store.check(4))
    assert store.load_latest() is None


@pytest.mark.slow  # runs the CLI as a process
def test_ls_verify_and_prune_treat_a_sharded_snapshot_like_any_other(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=2, key=None, recycle=False)  # as the run opens it for shards
    for step in (2, 4, 6):
        _sharded(store, step, seed=step)
    assert [s.step for s in store.list()] == [4, 6]  # pruned to keep=2 by the seal's housekeeping
    ls = subprocess.run([sys.executable, "-m", "checkpoints", "ls", str(tmp_path)], capture_output=True, text=True)
    assert ls.returncode == 0 and "a restart resumes from step 6" in ls.stdout, ls.stdout + ls.stderr
    verify = subprocess.run([sys.executable, "-m", "checkpoints", "verify", str(tmp_path)], capture_output=True,
                            text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    (tmp_path / "step-000000000006" / "__0_0.distcp").write_bytes(b"torn")
    verify = subprocess.run([sys.executable, "-m", "checkpoints", "verify", str(tmp_path)], capture_output=True,
                            text=True)
    assert verify.returncode != 0 and "__0_0.distcp" in verify.stdout + verify.stderr


def test_part_records_are_named_by_rank() -> None:
    assert part_name(3) == "part-00003.json"
