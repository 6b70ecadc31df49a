"""One notion of valid: ``ls``, ``verify``, ``prune``, a re-save and resume agree on every snapshot.

Valid = every file has its manifest's size and sha256 *and* loads with the resume loader.
Real files on disk, small tensors.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoints import SnapshotStore
from checkpoints.cli import main
from checkpoints.manifest import Manifest
from ckpt_testutil import assert_equal_state, cli_rows


def _state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((4096,), float(step))}, "step": step}


def _dir(root: Path, step: int) -> Path:
    return root / f"step-{step:012d}"


def _flip_64_bytes(p: Path) -> None:
    """Same size, so only the sha256 sees it; in the tensor payload, so it would still load."""
    data = bytearray(p.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    p.write_bytes(bytes(data))


def _replace_with_matching_manifest(snapshot: Path, fname: str, data: bytes) -> None:
    """Overwrite a file and recompute its manifest entry (and the manifest's self-checksum)."""
    (snapshot / fname).write_bytes(data)
    m = Manifest.from_bytes((snapshot / "MANIFEST.json").read_bytes())
    files = tuple(
        replace(f, size=len(data), sha256=hashlib.sha256(data).hexdigest()) if f.file == fname else f
        for f in m.files
    )
    (snapshot / "MANIFEST.json").write_bytes(replace(m, files=files).to_bytes())


def _snaps(root: Path, steps: tuple[int, ...]) -> SnapshotStore:
    store = SnapshotStore(root, keep=10)
    for step in steps:
        store.save(step, _state(step), world_size=2)
    return store


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().out


def _resumes_from(out: str) -> int | None:
    m = re.search(r"a restart resumes from step (\d+)", out)
    return int(m.group(1)) if m else None


def _newest_valid_row(out: str) -> int:
    [step] = [s for s, line in cli_rows(out).items() if "OK (newest valid)" in line]
    return int(step)


def test_prune_keep_1_keeps_the_newest_valid_snapshot_when_the_newest_is_bit_flipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _snaps(tmp_path, (10, 20, 30))
    _flip_64_bytes(_dir(tmp_path, 30) / "000-model.pt")

    rc, out = _run(capsys, "prune", "--keep", "1", str(tmp_path))

    assert rc == 0
    assert "removed step 10" in out and "removed step 20" not in out and "removed step 30" not in out
    assert sorted(os.listdir(tmp_path)) == ["step-000000000020", "step-000000000030"]
    assert "INVALID: 000-model.pt: sha256 mismatch" in cli_rows(out)["30"]
    assert "2 snapshot(s), 1 valid, 1 INVALID (steps 30); a restart resumes from step 20" in out

    # Every tool, and resume itself, names step 20.
    rc, out = _run(capsys, "verify", str(tmp_path))
    assert rc == 1 and _resumes_from(out) == 20 and _newest_valid_row(out) == 20
    rc, out = _run(capsys, "ls", str(tmp_path))
    assert rc == 0 and _resumes_from(out) == 20 and _newest_valid_row(out) == 20
    assert "INVALID: 000-model.pt: sha256 mismatch" in cli_rows(out)["30"]
    rc, out = _run(capsys, "prune", "--keep", "1", str(tmp_path))
    assert rc == 0 and "removed" not in out and _resumes_from(out) == 20
    latest = store.load_latest()
    assert latest is not None and latest[0].step == 20
    assert_equal_state(latest[1], _state(20))


def test_prune_removes_nothing_when_no_snapshot_is_fully_valid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _snaps(tmp_path, (10, 20))
    for step in (10, 20):
        _flip_64_bytes(_dir(tmp_path, step) / "000-model.pt")

    rc, out = _run(capsys, "prune", "--keep", "1", str(tmp_path))

    assert rc == 0 and "nothing to prune" in out
    assert sorted(os.listdir(tmp_path)) == ["step-000000000010", "step-000000000020"]
    assert "NO valid snapshot - a restart starts from scratch" in out
    assert store.load_latest() is None


class _NotAllowed:
    """Pickled by reference: ``torch.load(weights_only=True)`` refuses to rebuild it."""


def _pickled_object() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": _NotAllowed()}, buf)
    return buf.getvalue()


@pytest.mark.parametrize(
    "garbage",
    [pytest.param(lambda: b"this is not a torch file\n" * 100, id="not-torch"),
     pytest.param(_pickled_object, id="forbidden-pickle")],
)
def test_a_file_whose_hash_matches_but_does_not_load_is_invalid_everywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, garbage: Any
) -> None:
    store = _snaps(tmp_path, (10, 20))
    _replace_with_matching_manifest(_dir(tmp_path, 20), "000-model.pt", garbage())
    assert store.verify(20, full=False) == []  # sizes match: this is the hash-matching case

    rc, out = _run(capsys, "verify", str(tmp_path))
    assert rc == 1 and "INVALID: 000-model.pt does not load" in cli_rows(out)["20"]
    assert _resumes_from(out) == 10 and _newest_valid_row(out) == 10

    rc, out = _run(capsys, "ls", str(tmp_path))
    assert rc == 0 and "INVALID: 000-model.pt does not load" in cli_rows(out)["20"]
    assert "2 snapshot(s), 1 valid, 1 INVALID (steps 20); a restart resumes from step 10" in out

    with caplog.at_level(logging.WARNING, logger="checkpoints"):
        latest = store.load_latest()
    assert latest is not None and latest[0].step == _resumes_from(out) == 10
    assert_equal_state(latest[1], _state(10))
    assert "000-model.pt does not load" in caplog.text


def test_a_resave_at_an_existing_bit_flipped_step_replaces_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _snaps(tmp_path, (10, 20, 30))
    _flip_64_bytes(_dir(tmp_path, 30) / "000-model.pt")
    store = SnapshotStore(tmp_path, keep=10, if_exists="error")  # a restarted job
    latest = store.load_latest()
    assert latest is not None and latest[0].step == 20

    new_30 = {"model": {"w": torch.full((4096,), 30.5)}, "step": 30}
    with caplog.at_level(logging.WARNING, logger="checkpoints"):
        info = store.save(30, new_30, world_size=2)  # neither kept (skip) nor refused (error)

    assert "moved invalid snapshot" in caplog.text and "sha256 mismatch" in caplog.text
    assert info.step == 30 and store.verify(30) == []
    latest = store.load_latest()
    assert latest is not None and latest[0].step == 30
    assert_equal_state(latest[1], new_30)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".corrupt")]  # the save's prune removed it


def test_the_writers_prune_fully_checks_snapshots_it_did_not_write_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a restart, 30 is bit-flipped and 10, 20 are from the earlier run. Trusting their
    sizes would keep 30 and 25 and remove 20: one restorable snapshot where keep=2 promises two."""
    _snaps(tmp_path, (10, 20, 30))
    _flip_64_bytes(_dir(tmp_path, 30) / "000-model.pt")
    store = SnapshotStore(tmp_path, keep=2, recycle=False)

    store.save(25, _state(25), world_size=2)  # its prune fully checks 30 (bad) and 20 (good)
    assert [i.step for i in store.list()] == [20, 25, 30]
    assert store.verify(20) == []

    full_checks: list[int] = []
    check = store.check
    monkeypatch.setattr(store, "check", lambda step: full_checks.append(step) or check(step))
    store.save(26, _state(26), world_size=2)

    assert full_checks == []  # 30's verdict is remembered, 26 and 25 were written by this store
    assert [i.step for i in store.list()] == [25, 26, 30]
    latest = store.load_latest()
    assert latest is not None and latest[0].step == 26


def test_verify_of_a_live_directory_does_not_call_a_snapshot_pruned_under_it_invalid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`verify` beside a running job: the job's prune renames the oldest snapshot into the
    spare between our listing and our reads. That snapshot is gone, not invalid (a CI run of
    the netns faults test failed on exactly this: "380 INVALID: 001-optimizer.pt: missing")."""
    _snaps(tmp_path, (10, 20, 30))
    real_check = SnapshotStore.check

    def pruned_while_read(self: SnapshotStore, step: int) -> list[str]:
        if step == 10:  # what the job's prune does: one rename, the snapshot unmade
            os.rename(_dir(tmp_path, 10), tmp_path / ".spare-step-000000000010")
        return real_check(self, step)

    monkeypatch.setattr(SnapshotStore, "check", pruned_while_read)
    rc, out = _run(capsys, "verify", str(tmp_path))
    assert rc == 0, out
    assert "INVALID" not in out and "2 valid" in out, out
