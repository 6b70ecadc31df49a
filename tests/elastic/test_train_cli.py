"""The runner's user errors: one ``error:`` line, exit code 2, and nothing overwritten.

These run ``python -m elastic.train`` without torchrun (a world of one, as on a laptop):
the checks happen before any collective matters, and torchrun would only repeat them. Each run
is forked from the pre-imported zygote as that command line would start it
(:mod:`tests.support.spawn`), its stdout and stderr in one log.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from checkpoints import SnapshotStore
from tests.support.spawn import Process, python

_runs = itertools.count()


@dataclass
class _Done:
    returncode: int
    stderr: str  # the run's stdout and stderr together, as its log holds them


def _start(*args: str, cwd: Path) -> tuple[Process, Path]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ELASTIC_SNAPSHOT_DIR")}
    env["OMP_NUM_THREADS"] = "1"
    log = cwd / f"train-{next(_runs)}.log"
    return python(["-m", "elastic.train", *args], log, env=env, cwd=cwd), log


def _train(*args: str, cwd: Path) -> _Done:
    proc, log = _start(*args, cwd=cwd)
    try:
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return _Done(code, log.read_text(errors="replace"))


def _error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("error:") or ": error:" in line]


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def mlp_snapshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mlp")
    done = _train("--job", "mlp", "--steps", "6", "--dataset-size", "64", "--global-batch-size", "8",
                  "--snapshot-every-steps", "3", "--snapshot-dir", str(root / "snap"), cwd=root)
    assert done.returncode == 0, done.stderr
    assert [i.step for i in SnapshotStore(root / "snap", create=False).list()] == [3, 6]
    return root / "snap"


@pytest.mark.slow  # starts processes
def test_snapshot_from_another_model_is_one_line_naming_keys_and_overwrites_nothing(
    mlp_snapshots: Path, tmp_path: Path
) -> None:
    before = _tree_digest(mlp_snapshots)
    done = _train("--job", "resnet", "--steps", "2", "--dataset-size", "8", "--image-size", "32",
                  "--snapshot-dir", str(mlp_snapshots), cwd=tmp_path)
    assert done.returncode == 2
    [line] = _error_lines(done.stderr)
    assert "snapshot model does not match this model" in line and "conv1.weight" in line, line
    assert _tree_digest(mlp_snapshots) == before, "a failed resume must leave the snapshots byte-identical"


@pytest.mark.slow  # starts processes
def test_a_resume_with_the_same_model_continues_from_the_newest_snapshot(mlp_snapshots: Path, tmp_path: Path) -> None:
    copy = tmp_path / "snap"
    copy.mkdir()
    for src in mlp_snapshots.rglob("*"):
        dst = copy / src.relative_to(mlp_snapshots)
        dst.mkdir(exist_ok=True) if src.is_dir() else dst.write_bytes(src.read_bytes())
    done = _train("--job", "mlp", "--steps", "8", "--dataset-size", "64", "--global-batch-size", "8",
                  "--snapshot-dir", str(copy), "--progress", str(tmp_path / "p.jsonl"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "resumed from snapshot step 6" in done.stderr
    steps = [int(line.split('"step": ')[1].split(",")[0]) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert steps == [7, 8]


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--job", "mlp"], "--snapshot-dir is required"),
        (["--job", "mlp", "--snapshot-dir", "{file}"], "is not a directory"),
        (["--job", "nope", "--snapshot-dir", "x"], "invalid choice: 'nope'"),
        (["--job", "mlp", "--global-batch-size", "0", "--snapshot-dir", "x"], "must be at least 1"),
    ],
)
@pytest.mark.slow  # starts processes
def test_bad_input_is_one_clear_line(args: list[str], expect: str, tmp_path: Path) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("")
    done = _train(*[a.replace("{file}", str(a_file)) for a in args], cwd=tmp_path)
    assert done.returncode == 2
    [line] = _error_lines(done.stderr)
    assert expect in line, line


@pytest.mark.slow  # starts processes
def test_resnet_job_trains_on_fake_data_and_writes_its_final_snapshot(tmp_path: Path) -> None:
    done = _train("--job", "resnet", "--steps", "2", "--dataset-size", "8", "--image-size", "32",
                  "--global-batch-size", "4", "--snapshot-dir", str(tmp_path / "snap"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    state = SnapshotStore(tmp_path / "snap", create=False).load(2)
    assert state["progress"] == {"step": 2, "samples": 8} and "layer4.1.bn2.running_var" in state["model"]


@pytest.mark.slow  # starts processes
def test_sigterm_stops_at_a_step_boundary_flushes_and_exits_143(tmp_path: Path) -> None:
    """What torchrun does to its workers: the run stops cleanly, with its snapshots whole."""
    import signal
    import time

    progress, snap = tmp_path / "p.jsonl", tmp_path / "snap"
    proc, log = _start("--job", "mlp", "--steps", "1000000", "--dataset-size", "4096", "--global-batch-size", "8",
                       "--snapshot-every-steps", "10", "--step-sleep", "0.01", "--snapshot-dir", str(snap),
                       "--progress", str(progress), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not (progress.exists() and len(progress.read_text().splitlines()) >= 35):
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach step 35"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    stderr = log.read_text(errors="replace")
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr, stderr
    stopped = int(stderr.split("got signal 15: stopping at step ")[1].split()[0].rstrip(",;"))
    store = SnapshotStore(snap, create=False)
    newest = store.newest_valid(full=True)
    # A pre-emption: the last step trained is snapshotted before the exit, so a resume loses nothing.
    assert newest is not None and newest.step == stopped, (newest, stopped)
    assert all(s.valid for s in store.status(full=True))
    assert not [p.name for p in snap.iterdir() if p.name.startswith(".tmp-")], "a write was cut off, not flushed"
