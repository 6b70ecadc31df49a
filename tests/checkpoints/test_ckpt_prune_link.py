"""``prune`` with a step directory that is a symbolic link: the link goes, its target never,
and what it prints is what it did (it once said "removed" at every run for a link it kept)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from checkpoints import SnapshotStore, layout
from checkpoints.cli import main
from ckpt_testutil import state_for


def test_a_linked_step_dir_is_unlinked_and_its_target_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, elsewhere = tmp_path / "snapshots", tmp_path / "users-files"
    store = SnapshotStore(root, keep=10)
    for step in (1, 2, 3):
        store.save(step, state_for(step, 64), world_size=1)
    linked = root / layout.step_dirname(1)
    shutil.move(linked, elsewhere)
    os.symlink(elsewhere, linked)
    kept = sorted(p.name for p in elsewhere.iterdir())

    assert main(["prune", str(root), "--keep", "1"]) == 0
    first = capsys.readouterr().out
    assert "removed step 1" in first and "removed step 2" in first
    assert sorted(os.listdir(root)) == [layout.step_dirname(3)], "the link (or its renamed temp) is left behind"
    assert sorted(p.name for p in elsewhere.iterdir()) == kept, "the link's target was touched"

    assert main(["prune", str(root), "--keep", "1"]) == 0
    again = capsys.readouterr().out
    assert "removed" not in again and "nothing to prune" in again, again


def test_a_linked_spare_is_unlinked_too(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "snapshots", tmp_path / "users-files"
    store = SnapshotStore(root, keep=10)
    store.save(5, state_for(5, 64), world_size=1)
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("x")
    spare = root / layout.spare_dirname(2)
    os.symlink(elsewhere, spare)
    assert store.drop_spares() == [spare]
    assert (elsewhere / "precious").exists() and not os.path.lexists(spare)
