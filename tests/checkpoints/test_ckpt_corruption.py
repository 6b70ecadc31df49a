"""A damaged snapshot is never handed back: it is named in one log line and skipped."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import pytest

from checkpoints import SnapshotCorruptError, SnapshotStore
from ckpt_testutil import assert_equal_state, state_for


def _truncate(p: Path) -> None:
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size // 2)


def _flip_byte(p: Path) -> None:
    with open(p, "r+b") as f:
        f.seek(p.stat().st_size // 2)  # in the tensor payload: same size, torch.load would not notice
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))


def _flip_world_size(p: Path) -> None:
    p.write_text(p.read_text().replace('"world_size": 2', '"world_size": 3'))


DAMAGE: dict[str, tuple[str, Callable[[Path], None], str, bool]] = {
    # name: (file to damage, how, expected problem text, detected by quick verification)
    "truncated": ("001-optimizer.pt", _truncate, "001-optimizer.pt: size", True),
    "bit-flip": ("000-model.pt", _flip_byte, "000-model.pt: sha256 mismatch", False),
    "deleted-file": ("000-model.pt", Path.unlink, "000-model.pt: missing", True),
    "deleted-manifest": ("MANIFEST.json", Path.unlink, "MANIFEST.json: missing", True),
    "manifest-edited": ("MANIFEST.json", _flip_world_size, "MANIFEST.json: self-checksum mismatch", True),
}


@pytest.fixture
def two_snapshots(tmp_path: Path) -> SnapshotStore:
    store = SnapshotStore(tmp_path, keep=5)
    store.save(100, state_for(100), world_size=2)
    store.save(200, state_for(200), world_size=2)
    return store


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_is_detected_and_store_falls_back(
    two_snapshots: SnapshotStore, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = two_snapshots
    fname, how, problem, quick_sees_it = DAMAGE[damage]
    newest = store.root / "step-000000000200"
    how(newest / fname)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="checkpoints"):
        found = store.newest_valid(full=True)
    assert found is not None and found.step == 100
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert str(newest) in lines[0] and problem in lines[0] and "\n" not in lines[0]
    assert_equal_state(store.load(found), state_for(100))

    assert any(problem in p for p in store.verify(200, full=True))
    assert bool(store.verify(200, full=False)) == quick_sees_it
    assert store.verify(100, full=True) == []

    with pytest.raises(SnapshotCorruptError) as err:
        store.load(200)
    assert str(newest) in str(err.value) and fname in str(err.value)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="checkpoints"):
        latest = store.load_latest()
    assert latest is not None and latest[0].step == 100
    assert_equal_state(latest[1], state_for(100))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and str(newest) in lines[0] and fname in lines[0], lines


def test_all_snapshots_corrupt_means_none(two_snapshots: SnapshotStore) -> None:
    store = two_snapshots
    for step in (100, 200):
        _flip_byte(store.root / f"step-{step:012d}" / "001-optimizer.pt")
    assert store.newest_valid(full=True) is None
    assert store.load_latest() is None
    assert store.newest_valid(full=False) is not None  # quick mode cannot see a flipped byte


def test_load_without_verify_still_refuses_a_truncated_file(two_snapshots: SnapshotStore) -> None:
    _truncate(two_snapshots.root / "step-000000000200" / "000-model.pt")
    with pytest.raises(SnapshotCorruptError, match="000-model.pt: size"):
        two_snapshots.load(200, verify=False)
