"""``python -m checkpoints ls|verify|prune`` on a real directory with one corrupted snapshot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoints import SnapshotStore
from checkpoints.cli import main
from ckpt_testutil import REPO_ROOT, child_env, cli_rows


@pytest.fixture
def snaps(tmp_path: Path) -> Path:
    store = SnapshotStore(tmp_path / "snaps", keep=10)
    for step in (100, 200, 300, 400):
        store.save(step, {"model": {"w": torch.full((1000,), float(step))}, "step": step}, world_size=4)
    p = store.root / "step-000000000300" / "000-model.pt"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    return store.root


def test_ls_is_quick_and_shows_every_snapshot(snaps: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", str(snaps)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["STEP", "SIZE", "AGE", "WORLD", "STATUS"]
    rows = cli_rows(out)
    assert list(rows) == ["100", "200", "300", "400"]
    assert "OK (newest valid)" in rows["400"] and " 4 " in rows["400"] and "ago" in rows["400"]
    # A flipped byte keeps the size: ls fully checks only down to the newest valid (400), as
    # resume does; verify (every snapshot fully) sees 300's.
    assert "OK" in rows["300"]


def test_verify_names_the_bad_snapshot_and_file_and_exits_1(snaps: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(snaps)]) == 1
    out = capsys.readouterr().out
    rows = cli_rows(out)
    assert "INVALID: 000-model.pt: sha256 mismatch" in rows["300"]
    assert all(rows[s].rstrip().endswith("OK") for s in ("100", "200"))
    assert "4 snapshot(s), 3 valid, 1 INVALID (steps 300); a restart resumes from step 400" in out
    assert main(["ls", "--full", str(snaps)]) == 0  # ls reports, verify judges


def test_prune_keeps_k(snaps: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prune", "--keep", "1", str(snaps)]) == 0
    out = capsys.readouterr().out
    # 300 is corrupt and older than 400, the newest valid one, which is all keep=1 keeps.
    assert "removed step 100" in out and "removed step 200" in out and "removed step 300" in out
    assert [p.name for p in sorted(snaps.iterdir())] == ["step-000000000400"]
    assert main(["verify", str(snaps)]) == 0


def test_verify_all_good_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    SnapshotStore(tmp_path).save(1, {"x": torch.ones(2)}, world_size=1)
    assert main(["verify", str(tmp_path)]) == 0
    assert "1 snapshot(s), 1 valid; a restart resumes from step 1" in capsys.readouterr().out


def test_ls_shows_the_spare_and_prune_deletes_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = SnapshotStore(tmp_path, keep=1)
    for step in (1, 2):
        store.save(step, {"model": {"w": torch.zeros(250_000)}}, world_size=1)  # ~1 MB each
    [spare] = store.spares()

    assert main(["ls", str(tmp_path)]) == 0
    rows = cli_rows(capsys.readouterr().out)
    assert "OK (newest valid)" in rows["2"]
    assert rows["1"].split()[1:3] == ["1.0", "MB"] and "spare: not a snapshot; the next save writes over" in rows["1"]

    assert main(["prune", "--keep", "1", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"removed spare {spare.name}" in out and "1" not in cli_rows(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000000002"]


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("cmd", ["ls", "verify", "prune"])
def test_bad_dir_is_one_line_on_stderr_exit_2(tmp_path: Path, cmd: str) -> None:
    missing = tmp_path / "nope"
    r = subprocess.run(
        [sys.executable, "-m", "checkpoints", cmd, str(missing)],
        capture_output=True, text=True, env=child_env(), cwd=str(REPO_ROOT), timeout=120,
    )
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1 and str(missing) in r.stderr and "does not exist" in r.stderr
    assert not missing.exists()  # looking never creates anything
