"""Layout, manifest, never-overwrite, retention and temp-dir cleanup of SnapshotStore."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from checkpoints import SnapshotError, SnapshotExistsError, SnapshotStore
from checkpoints.layout import host_tag
from ckpt_testutil import assert_equal_state, state_for


def test_save_load_round_trip_and_layout(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snaps")  # root is created
    info = store.save(1234, state_for(1234), world_size=4, extra_meta={"run": "r1"})

    assert info.path == tmp_path / "snaps" / "step-000000001234"
    assert (info.step, info.world_size) == (1234, 4)
    assert info.extra_meta == {"run": "r1"}
    assert sorted(os.listdir(info.path)) == [
        "000-model.pt", "001-optimizer.pt", "002-sampler.pt", "003-step.pt", "004-note.pt", "MANIFEST.json",
    ]
    manifest = json.loads((info.path / "MANIFEST.json").read_text())
    assert manifest["step"] == 1234 and manifest["world_size"] == 4
    assert manifest["torch_version"] == torch.__version__ and manifest["format_version"] == 1
    assert abs(manifest["written_at"] - time.time()) < 60
    for f in manifest["files"]:
        assert (info.path / f["file"]).stat().st_size == f["size"] and len(f["sha256"]) == 64
    assert info.size_bytes == sum(f["size"] for f in manifest["files"])
    assert_equal_state(store.load(info), state_for(1234))
    assert_equal_state(store.load(1234, verify=False), state_for(1234))
    assert not [n for n in os.listdir(store.root) if n.startswith(".")], "temp dir left behind"


def test_existing_valid_step_is_never_overwritten(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=5)
    first = store.save(7, state_for(7), world_size=2)
    again = store.save(7, state_for(8), world_size=3)  # default if_exists="skip"
    assert again == first
    assert_equal_state(store.load(7), state_for(7))

    strict = SnapshotStore(tmp_path, if_exists="error")
    with pytest.raises(SnapshotExistsError, match="already exists and is valid"):
        strict.save(7, state_for(8), world_size=3)
    assert_equal_state(store.load(7), state_for(7))


def test_existing_invalid_step_is_moved_aside_not_clobbered(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=5)
    info = store.save(3, state_for(3), world_size=1)
    (info.path / "MANIFEST.json").unlink()  # torn by hand
    store.save(3, state_for(33), world_size=1)
    assert_equal_state(store.load(3), state_for(33))


def test_list_and_newest_order(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=10)
    for s in (5, 1, 30, 12):
        store.save(s, {"x": torch.tensor(s)}, world_size=1)
    assert [i.step for i in store.list()] == [1, 5, 12, 30]
    newest = store.newest_valid()
    assert newest is not None and newest.step == 30
    assert store.verify(12) == [] and store.verify(12, full=False) == []
    assert store.verify(99) == ["step-000000000099: no such snapshot"]


def test_retention_keeps_last_k_after_the_new_one_is_durable(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=2)
    for s in range(1, 6):
        store.save(s, {"x": torch.tensor(s)}, world_size=1)
        assert [i.step for i in store.list()] == list(range(max(1, s - 1), s + 1))
    assert store.prune(keep=1) == [4]
    assert [i.step for i in store.list()] == [5]


def test_prune_keeps_k_valid_ones_when_newer_ones_are_corrupt(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=10)
    for s in range(1, 6):
        store.save(s, {"x": torch.tensor(s)}, world_size=1)
    (store.root / "step-000000000005" / "000-x.pt").write_bytes(b"junk")
    assert store.prune(keep=2) == [1, 2]
    # 5 is invalid but newer than the kept ones: left for a human to see; 3 and 4 still restore.
    assert [i.step for i in store.list()] == [3, 4, 5]
    assert store.newest_valid().step == 4


def test_prune_with_no_valid_snapshot_removes_nothing(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=1)
    info = store.save(1, {"x": torch.tensor(1)}, world_size=1)
    (info.path / "000-x.pt").unlink()
    assert store.prune() == []
    assert info.path.exists()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.slow  # starts processes
def test_stale_temp_dirs_are_cleaned_but_a_live_writers_is_not(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=3)
    store.save(10, {"x": torch.tensor(10)}, world_size=1)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead_dir = tmp_path / f".tmp-step-000000000011-{host_tag()}-{_dead_pid()}-0badc0de"
        live_dir = tmp_path / f".tmp-step-000000000011-{host_tag()}-{live.pid}-00c0ffee"
        own_old = tmp_path / f".tmp-step-000000000009-{host_tag()}-{os.getpid()}-0000dead"  # pid reused by us
        other_host_new = tmp_path / ".tmp-step-000000000012-ffffffff-1-12345678"
        for d in (dead_dir, live_dir, own_old, other_host_new):
            d.mkdir()
            (d / "000-x.pt").write_bytes(b"partial")

        removed = store.clean_stale_temps()

        assert sorted(removed) == sorted([dead_dir, own_old])
        assert live_dir.exists() and other_host_new.exists()
        # Another host's temp dir older than the newest snapshot and past the grace period is stale.
        old_other = tmp_path / ".tmp-step-000000000002-ffffffff-1-87654321"
        old_other.mkdir()
        os.utime(old_other, (time.time() - 3600, time.time() - 3600))
        assert store.clean_stale_temps() == [old_other]
        assert live_dir.exists()
    finally:
        live.kill()
        live.wait()


@pytest.mark.slow  # starts processes
def test_save_also_cleans_stale_temp_dirs(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    stale = tmp_path / f".tmp-step-000000000001-{host_tag()}-{_dead_pid()}-0badc0de"
    stale.mkdir()
    store.save(2, {"x": torch.tensor(2)}, world_size=1)
    assert not stale.exists()


def test_unstorable_value_is_rejected_at_save_time_naming_it(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    with pytest.raises(SnapshotError, match=r"state\['sampler'\]\['gen'\] is a builtins.object"):
        store.save(1, {"sampler": {"gen": object()}}, world_size=1)
    assert os.listdir(tmp_path) == []


def test_snapshot_files_skip_torch_saves_zip_crc32_on_the_saving_thread(tmp_path: Path) -> None:
    """The manifest's sha256 is the integrity check; torch.load never reads the zip CRCs, and
    computing them was a sixth of a write's CPU. torch keeps that setting per thread, so
    this checks it reached the pool thread that saves, and left the caller's setting alone."""
    store = SnapshotStore(tmp_path)
    state = {"model": {"w": torch.arange(100_000, dtype=torch.float32)}}
    info = store.save(1, state, world_size=1)

    with zipfile.ZipFile(info.path / "000-model.pt") as z:
        records = {i.filename: i for i in z.infolist()}
    data = [i for name, i in records.items() if "/data/" in name]
    assert data and all(i.file_size == 400_000 and i.CRC == 0 for i in data)
    assert torch.serialization.get_crc32_options() is True  # the caller's default, untouched
    assert_equal_state(store.load(info), state)
