"""Bad directories and full disks end in one clear line, and nothing good is lost."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from checkpoints import SnapshotDirError, SnapshotDiskFullError, SnapshotStore
from ckpt_testutil import assert_equal_state


def test_directory_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a dir")
    with pytest.raises(SnapshotDirError) as err:
        SnapshotStore(blocker / "snaps")
    msg = str(err.value)
    assert "cannot create snapshot directory" in msg and str(blocker / "snaps") in msg and "\n" not in msg


def test_path_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(SnapshotDirError, match="is not a directory"):
        SnapshotStore(f)


@pytest.mark.slow  # starts processes
def test_unwritable_directory(readonly_dir: Path) -> None:
    with pytest.raises(SnapshotDirError, match="is not writable") as err:
        SnapshotStore(readonly_dir)
    assert str(readonly_dir) in str(err.value)
    # Reading an existing (read-only) store is fine: that is what the CLI does.
    assert SnapshotStore(readonly_dir, create=False).list() == []


@pytest.mark.slow  # starts processes
def test_directory_made_read_only_between_saves(tmp_path: Path, readonly_dir: Path) -> None:
    store = SnapshotStore(tmp_path / "w")
    store.root = readonly_dir  # the same store object, now pointing at a filesystem that refuses writes
    with pytest.raises(SnapshotDirError, match=r"cannot write snapshot step 1 .*Read-only file system"):
        store.save(1, {"x": torch.zeros(1)}, world_size=1)


@pytest.mark.slow  # starts processes
def test_full_disk_leaves_no_partial_snapshot(tiny_fs: Path) -> None:
    store = SnapshotStore(tiny_fs, keep=3)
    small = {"model": {"w": torch.arange(1000.0)}, "step": 1}
    store.save(1, small, world_size=1)

    big = {"model": {"w": torch.zeros(1 << 20)}, "optimizer": {"m": torch.zeros(1 << 18)}, "step": 2}
    with pytest.raises(SnapshotDiskFullError) as err:
        store.save(2, big, world_size=1)
    msg = str(err.value)
    assert msg.startswith("disk full writing snapshot step 2 to ") and "earlier snapshots are intact" in msg
    assert "\n" not in msg

    assert sorted(os.listdir(tiny_fs)) == ["step-000000000001"]  # temp dir removed, nothing half-written
    newest = store.newest_valid(full=True)
    assert newest is not None and newest.step == 1
    assert_equal_state(store.load(newest), small)
    # Space is back after the failed write, so the next small snapshot succeeds.
    store.save(3, small, world_size=1)
    assert [i.step for i in store.list()] == [1, 3]


@pytest.mark.slow  # starts processes
def test_manifest_write_hitting_a_full_disk(tiny_fs: Path) -> None:
    """Fill the disk to within a few bytes so the files fit but the manifest does not."""
    store = SnapshotStore(tiny_fs)
    filler = tiny_fs / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    # tmpfs allocates whole pages: three free pages hold the three small files, not the manifest.
    os.truncate(filler, filler.stat().st_size - 3 * 4096)
    with pytest.raises(SnapshotDiskFullError):
        store.save(1, {"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(10)}, world_size=1)
    assert sorted(os.listdir(tiny_fs)) == ["filler"]
