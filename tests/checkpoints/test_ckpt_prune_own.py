"""Prune and clean-up delete only what the store wrote, in a directory and in a real S3 server.

A second job's prune deleted a user's ``p/step-000000000005/notes.txt``: a step prefix with
no manifest is no snapshot, so it was "invalid and older than the kept ones", and every
object under it went. Now only the store's own names go (the manifest, its key and DCP
files, under a writer's name in an object store); a user's object under a step, beside a
pruned snapshot's files or in a folder of its own, is left, and said once.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from checkpoints import SnapshotStore, layout
from checkpoints.s3store import S3SnapshotStore

KEY = b"k" * 32


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((64,), float(step))}, "step": step}


def test_s3_prune_and_clean_up_leave_a_users_objects(s3: str, caplog: pytest.LogCaptureFixture) -> None:
    store = S3SnapshotStore(s3, keep=2, key=KEY, stale_temp_grace_s=0)  # every writer's leftover stale at once
    users = {"step-000000000005/notes.txt": b"no manifest here: not a snapshot, and not the store's",
             "step-000000000001/notes.txt": b"beside a snapshot prune removes",
             "step-000000000007/scratch/old.bin": b"a folder of the user's under a kept step"}
    for key, body in users.items():
        store.objects.put(key, body)
    for step in (1, 6, 7):
        store.save(step, _state(step), world_size=1, housekeeping=False)
    dead = f"{layout.host_tag()}-999999999-0000abcd"  # a dead writer's leftover: the store's, and stale
    store.objects.put(f"step-000000000007/{dead}/000-model.pt", b"torn")
    caplog.set_level(logging.INFO)

    assert store.prune() == [1]  # step 5 held nothing of the store's: nothing pruned there
    assert [p.name for p in store.clean_stale_temps()] == [dead]
    keys = sorted(o["Key"] for o in store.objects.list())
    for key, body in users.items():
        assert key in keys and store.objects.get(key)[0] == body, key
    assert not [k for k in keys if k.startswith("step-000000000001/") and k not in users]  # step 1's own went
    assert not [k for k in keys if dead in k]
    assert [s.step for s in store.list()] == [6, 7] and store.load_latest()[1]["step"] == 7
    assert "left 1 object(s) there that this store did not write (e.g. 'notes.txt')" in caplog.text

    caplog.clear()
    assert store.prune() == [] and store.clean_stale_temps() == []  # nothing of ours left to remove: silent
    assert "did not write" not in caplog.text and sorted(o["Key"] for o in store.objects.list()) == keys


@pytest.mark.parametrize("recycle", [False, True])
def test_directory_prune_leaves_a_users_files(tmp_path: Path, recycle: bool, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "snapshots"
    store = SnapshotStore(root, keep=2, key=None, recycle=recycle)
    for step in (1, 2, 6, 7):
        store.save(step, _state(step), world_size=1, housekeeping=False)
    lone = root / layout.step_dirname(5)
    lone.mkdir()
    (lone / "notes.txt").write_text("no manifest here: not a snapshot, and not the store's")
    beside = root / layout.step_dirname(1) / "notes.txt"
    beside.write_text("beside a snapshot prune removes")
    caplog.set_level(logging.INFO)

    assert store.prune() == [1, 2]  # step 2 whole (the spare, with recycle); step 1 only the store's files
    assert (lone / "notes.txt").read_text().startswith("no manifest") and sorted(p.name for p in lone.iterdir()) == [
        "notes.txt"]
    assert beside.read_text() == "beside a snapshot prune removes"
    assert sorted(p.name for p in beside.parent.iterdir()) == ["notes.txt"]
    assert not (root / layout.step_dirname(2)).exists() and len(store.spares()) == int(recycle)
    assert [s.step for s in store.list()] == [6, 7] and store.load_latest()[1]["step"] == 7
    assert "left 1 file(s) there that this store did not write (e.g. 'notes.txt')" in caplog.text

    caplog.clear()
    assert store.prune() == []  # nothing of the store's left in either: silent
    assert "did not write" not in caplog.text and (lone / "notes.txt").exists() and beside.exists()
