"""The heartbeat record (``elastic.heartbeat``) and what ``elastic.report_progress`` writes to it.

Every record size ever written must stay readable, and a newer, longer one must read as
the prefix this version knows: an old worker and a new agent (or the other way round)
meet during an upgrade. The layouts are spelled out here, not imported, so that changing
one on disk fails a test.
"""

from __future__ import annotations

import math
import os
import struct
import time
from pathlib import Path
from typing import Iterator

import pytest

from elastic import progress
from elastic.heartbeat import JOB_STEP, LOCAL_COUNT, Beat, Heartbeat, mark_finished, parse_beat, read_beats

V1 = struct.Struct("<qdq")  # step, time, pid (24 bytes): always a job step
V2 = struct.Struct("<qdqq")  # + kind (32 bytes)
V3 = struct.Struct("<qdqqdq")  # + loss (NaN: none), samples (a running total) (48 bytes)
V4 = struct.Struct("<qdqqdqd")  # + finished: when the script returned, 0 while it runs (56 bytes)


def _write(directory: Path, rank: int, raw: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank-{rank}").write_bytes(raw)


def test_a_beat_round_trips_with_its_loss_and_samples(tmp_path: Path) -> None:
    beat = Heartbeat(tmp_path / "rank-1")
    before = time.time()
    beat.beat(7, JOB_STEP, 0.25, 96)
    beat.beat(8, LOCAL_COUNT)  # overwrites in place: no loss, no samples
    beat.close()
    assert (tmp_path / "rank-1").stat().st_size == V4.size == 56
    (got,) = read_beats(tmp_path).items()
    assert got[0] == 1 and got[1].time >= before
    assert got[1] == Beat(8, got[1].time, os.getpid(), LOCAL_COUNT, None, 0)


@pytest.mark.parametrize("layout, fields, expected", [
    (V1, (5, 100.0, 42), Beat(5, 100.0, 42, JOB_STEP)),
    (V2, (5, 100.0, 42, LOCAL_COUNT), Beat(5, 100.0, 42, LOCAL_COUNT)),
    (V3, (5, 100.0, 42, JOB_STEP, 1.5, 640), Beat(5, 100.0, 42, JOB_STEP, 1.5, 640)),
    (V3, (5, 100.0, 42, JOB_STEP, math.nan, 0), Beat(5, 100.0, 42, JOB_STEP, None, 0)),
    (V4, (5, 100.0, 42, JOB_STEP, 1.5, 640, 0.0), Beat(5, 100.0, 42, JOB_STEP, 1.5, 640, None)),
    (V4, (5, 100.0, 42, LOCAL_COUNT, math.nan, 0, 130.0), Beat(5, 100.0, 42, LOCAL_COUNT, None, 0, 130.0)),
])
def test_every_record_size_ever_written_is_read(tmp_path: Path, layout: struct.Struct, fields: tuple[object, ...],
                                                expected: Beat) -> None:
    _write(tmp_path, 0, layout.pack(*fields))
    assert read_beats(tmp_path) == {0: expected}


def test_a_newer_longer_record_reads_as_the_prefix_known_here(tmp_path: Path) -> None:
    _write(tmp_path, 0, V4.pack(5, 100.0, 42, JOB_STEP, 2.0, 8, 0.0) + struct.pack("<qq", 1, 2))
    assert read_beats(tmp_path) == {0: Beat(5, 100.0, 42, JOB_STEP, 2.0, 8)}


def test_an_older_reader_reads_a_new_record_as_its_own() -> None:
    """The agent of the last version reads the first 48 bytes of a 56-byte record."""
    raw = V4.pack(5, 100.0, 42, LOCAL_COUNT, 2.0, 8, 130.0)
    assert V3.unpack(raw[: V3.size]) == (5, 100.0, 42, LOCAL_COUNT, 2.0, 8)


def test_a_finished_script_is_marked_and_the_rest_of_its_record_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_HEARTBEAT_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "3")
    beacon = Heartbeat(tmp_path / "rank-3")
    beacon.beat(41, LOCAL_COUNT, 0.5, 640)
    (before,) = read_beats(tmp_path).values()
    mark_finished()
    (after,) = read_beats(tmp_path).values()
    assert after.finished is not None and after.finished >= before.time
    assert after == Beat(41, before.time, os.getpid(), LOCAL_COUNT, 0.5, 640, after.finished)
    beacon.beat(42, LOCAL_COUNT)  # a thread of the script still stepping: running again
    assert read_beats(tmp_path)[3].finished is None


def test_only_a_record_of_this_process_is_marked_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_HEARTBEAT_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    mark_finished()  # never beat: nothing to mark, nothing created
    assert not (tmp_path / "rank-0").exists()
    _write(tmp_path, 0, V4.pack(5, 100.0, os.getpid() + 1, JOB_STEP, 1.0, 8, 0.0))  # a predecessor's
    mark_finished()
    assert read_beats(tmp_path)[0].finished is None


def test_a_record_too_short_for_any_layout_is_skipped(tmp_path: Path) -> None:
    _write(tmp_path, 0, b"")  # created, not yet written
    _write(tmp_path, 1, b"\0" * 10)
    assert read_beats(tmp_path) == {} and parse_beat(b"\0" * 23) is None


@pytest.fixture
def beacon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh ``elastic.progress`` state beating ``tmp_path/rank-0``, as under the agent."""
    for name, value in (("_heartbeat", Heartbeat(tmp_path / "rank-0")), ("_heartbeat_loaded", True), ("_count", 0),
                        ("_samples", 0), ("_taken_over", False), ("_hook_handle", None)):
        monkeypatch.setattr(progress, name, value)
    yield tmp_path
    if progress._hook_handle is not None:  # a test that registered torch's global hook removes it
        progress._hook_handle.remove()
    assert progress._heartbeat is not None
    progress._heartbeat.close()


def test_report_progress_carries_loss_and_a_running_total_of_samples(beacon: Path) -> None:
    progress.report_progress(3, loss=0.5, samples=8)
    progress.report_progress(4, loss=0.25, samples=8)
    beat = read_beats(beacon)[0]
    assert (beat.step, beat.kind, beat.loss, beat.samples) == (4, JOB_STEP, 0.25, 16)
    progress.report_progress(samples=4)  # no step, no loss: a count, and the total goes on
    beat = read_beats(beacon)[0]
    assert (beat.step, beat.kind, beat.loss, beat.samples) == (1, LOCAL_COUNT, None, 20)


def test_report_progress_is_cheap(beacon: Path) -> None:
    calls = 2000
    started = time.perf_counter()
    for step in range(calls):
        progress.report_progress(step, loss=0.1, samples=32)
    assert (time.perf_counter() - started) / calls < 200e-6  # a few microseconds; generous on a shared machine


def test_the_optimizer_hook_beats_counts_until_the_script_reports_for_itself(beacon: Path) -> None:
    import torch

    progress._register()  # what install_optimizer_hook does once torch.optim is imported
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    param.grad = torch.ones(1)
    optimizer.step()
    optimizer.step()
    beat = read_beats(beacon)[0]
    assert (beat.step, beat.kind, beat.loss, beat.samples) == (2, LOCAL_COUNT, None, 0)
    progress.report_progress(10, loss=1.0, samples=4)
    assert progress._hook_handle is None  # taken over: the hook's beats would overwrite the script's
    optimizer.step()
    beat = read_beats(beacon)[0]
    assert (beat.step, beat.kind, beat.loss, beat.samples) == (10, JOB_STEP, 1.0, 4)
