"""Recycling: the newest pruned snapshot is kept as the spare, and the next save writes over it."""

from __future__ import annotations

import fcntl
import os
import struct
from pathlib import Path

import pytest
import torch

from checkpoints import AsyncSnapshotWriter, SnapshotDiskFullError, SnapshotStore
from checkpoints.layout import parse_spare_dirname
from ckpt_testutil import assert_equal_state, state_for


_FS_IOC_FIEMAP = 0xC020660B
_FIEMAP_FLAG_SYNC = 1


def _first_block(path: Path) -> int | None:
    """Physical byte offset of the file's first extent (FIEMAP), or None where the filesystem
    cannot say. Same inode *and* same first block is what proves the blocks were written
    over, not truncated and reallocated."""
    header = struct.pack("=QQIIII", 0, 2**64 - 1, _FIEMAP_FLAG_SYNC, 0, 1, 0)
    buf = bytearray(header + bytes(56))
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, _FS_IOC_FIEMAP, buf)
    except OSError:
        return None
    finally:
        os.close(fd)
    mapped = struct.unpack_from("=I", buf, 20)[0]
    return struct.unpack_from("=Q", buf, 32 + 8)[0] if mapped else None


def _files(path: Path) -> dict[str, tuple[int, int | None]]:
    return {e.name: (e.inode(), _first_block(Path(e.path))) for e in os.scandir(path) if e.name != "MANIFEST.json"}


def test_the_pruned_snapshot_becomes_the_spare_and_the_next_save_writes_over_its_files(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=2)
    for step in (1, 2, 3):
        store.save(step, state_for(step), world_size=1)
    [spare] = store.spares()
    assert parse_spare_dirname(spare.name) == 1
    assert [i.step for i in store.list()] == [2, 3]  # the spare is no snapshot
    spare_files = _files(spare)

    info = store.save(4, state_for(4), world_size=1)

    assert not spare.exists()
    assert _files(info.path) == spare_files, "the save wrote new files instead of over the spare's"
    assert store.verify(4, full=True) == []
    assert_equal_state(store.load(info), state_for(4))
    assert_equal_state(store.load(3), state_for(3))
    [next_spare] = store.spares()
    assert parse_spare_dirname(next_spare.name) == 2
    assert sorted(os.listdir(tmp_path)) == sorted([next_spare.name, "step-000000000003", "step-000000000004"])


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("mode", ["process", "thread"])
def test_the_background_writer_writes_over_the_spare_in_either_mode(tmp_path: Path, mode: str) -> None:
    store = SnapshotStore(tmp_path, keep=2)
    with AsyncSnapshotWriter(store, mode=mode) as writer:
        writer.wait_writer_process()
        for step in (1, 2, 3):
            writer.submit(step, state_for(step), world_size=1)
            writer.flush()
        [spare] = store.spares()
        spare_files = _files(spare)
        writer.submit(4, state_for(4), world_size=1)
        writer.flush()
    assert writer.stats.snapshots_written == 4 and writer.stats.errors == 0
    assert _files(tmp_path / "step-000000000004") == spare_files
    assert_equal_state(store.load(4), state_for(4))


def test_a_smaller_state_with_other_keys_over_a_spare_leaves_none_of_its_bytes(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=1)
    store.save(1, state_for(1), world_size=1)
    store.save(2, state_for(2), world_size=1)
    small = {"model": {"w": torch.arange(10.0)}, "extra": torch.ones(3)}  # 000-model.pt shrinks, the rest go

    info = store.save(3, small, world_size=1)

    assert sorted(os.listdir(info.path)) == ["000-model.pt", "001-extra.pt", "MANIFEST.json"]
    assert store.verify(3, full=True) == []  # sizes and sha256: the file was cut to its new length
    assert_equal_state(store.load(info), small)


def test_at_most_one_spare_and_none_without_recycling(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=5)
    for step in range(1, 6):
        store.save(step, state_for(step, numel=64), world_size=1)

    assert store.prune(keep=1) == [1, 2, 3, 4]
    assert [parse_spare_dirname(p.name) for p in store.spares()] == [4]

    plain = SnapshotStore(tmp_path, keep=1, recycle=False)
    plain.save(6, state_for(6, numel=64), world_size=1)
    assert plain.spares() == []  # the old spare went, and step 5 was deleted rather than kept
    assert sorted(os.listdir(tmp_path)) == ["step-000000000006"]
    assert_equal_state(plain.load(6), state_for(6, numel=64))


@pytest.mark.slow  # starts processes
def test_a_full_disk_while_writing_over_the_spare_leaves_the_earlier_snapshot_and_frees_the_spare(
    tiny_fs: Path,
) -> None:
    store = SnapshotStore(tiny_fs, keep=1)
    small = {"model": {"w": torch.arange(1000.0)}, "step": 1}
    store.save(1, small, world_size=1)
    store.save(2, small | {"step": 2}, world_size=1)
    assert len(store.spares()) == 1

    big = {"model": {"w": torch.zeros(1 << 20)}, "step": 3}  # 4 MB on a 2 MiB filesystem
    with pytest.raises(SnapshotDiskFullError, match="earlier snapshots are intact"):
        store.save(3, big, world_size=1)

    assert sorted(os.listdir(tiny_fs)) == ["step-000000000002"]  # the half-overwritten spare is gone
    assert_equal_state(store.load(2), small | {"step": 2})
    store.save(4, small | {"step": 4}, world_size=1)  # its space is back
    assert [i.step for i in store.list()] == [4]
