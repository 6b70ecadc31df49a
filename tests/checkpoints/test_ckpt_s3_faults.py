"""An S3 server that answers 500 and 503 SlowDown, or stalls, for a while: a real proxy
(tests/support/faulty_proxy.py) in front of the real SeaweedFS. Transient errors are retried
with back-off and the snapshot lands whole; a window of outage is one line when it goes and
one when it is back; training steps do not wait for it; nothing partial is ever read."""

from __future__ import annotations

import logging
import threading
import time
from typing import Iterator

import pytest
import torch

from checkpoints import AsyncSnapshotWriter
from checkpoints.s3store import S3SnapshotStore
from checkpoints.stores import open_store
from tests.support.faulty_proxy import FaultyProxy
from tests.support.s3server import SeaweedS3

KEY = b"k" * 32


@pytest.fixture
def proxy(s3_server: SeaweedS3) -> Iterator[FaultyProxy]:
    with FaultyProxy(s3_server.endpoint) as p:
        yield p


@pytest.fixture
def url(s3: str) -> str:
    """A fresh prefix, the server's variables set (tests/checkpoints/conftest.py's ``s3``)."""
    return s3


def _direct(url: str, **kw: object) -> S3SnapshotStore:
    """A store that talks to SeaweedFS itself (AWS_ENDPOINT_URL is the server's here)."""
    store = open_store(url, key=KEY, **kw)
    assert isinstance(store, S3SnapshotStore)
    return store


def _through(url: str, proxy: FaultyProxy, monkeypatch: pytest.MonkeyPatch, **kw: object) -> S3SnapshotStore:
    """A store whose every request goes through the proxy (the endpoint is read at open)."""
    with monkeypatch.context() as m:
        m.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        return _direct(url, **kw)


def _state(step: int, n: int = 1000) -> dict:
    return {"model": {"w": torch.full((n,), float(step))}, "step": step}


def _outage_lines(caplog: pytest.LogCaptureFixture) -> tuple[int, int]:
    lines = [r.getMessage() for r in caplog.records if r.name == "checkpoints.s3client"]
    return sum("does not answer" in m for m in lines), sum("answers again" in m for m in lines)


@pytest.mark.parametrize("status", [500, 503])
def test_transient_errors_are_retried_with_back_off_and_the_snapshot_lands_whole(
        url: str, proxy: FaultyProxy, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        status: int) -> None:
    caplog.set_level(logging.INFO)
    store = _through(url, proxy, monkeypatch, keep=3, timeout_s=5.0, retry_for_s=60)
    store.save(1, _state(1), world_size=1)
    proxy.fail_next(12, status)
    info = store.save(2, _state(2), world_size=1)
    assert info.step == 2
    faults = proxy.faulted()
    assert len(faults) == 12 and all(s.status == status for s in faults)
    # back-off: the save's first call (its manifest's GET, alone) takes all 12; botocore tries
    # it at most 3 times per tenacity attempt, and tenacity waits 0.2 s, 0.4 s, 0.8 s, ...
    # between attempts, so the 12 refusals span at least 0.2 + 0.4 + 0.8 s
    assert faults[-1].at - faults[0].at >= 1.4, [round(s.at - faults[0].at, 2) for s in faults]
    reader = _direct(url, create=False)
    assert reader.check(2) == []
    got, state = reader.load_latest()
    assert got.step == 2 and torch.equal(state["model"]["w"], torch.full((1000,), 2.0))
    assert _outage_lines(caplog) == (1, 1)  # one line when it went, one when it was back


def test_a_commit_applied_but_answered_500_is_still_the_snapshot(
        url: str, proxy: FaultyProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest PUT reaches the server, which stores it, but the answer is a 500: the
    retry's If-None-Match finds a manifest there - our own, not a rival's."""
    store = _through(url, proxy, monkeypatch, keep=3, timeout_s=5.0, retry_for_s=60)
    proxy.fail_next(1, 500, method="PUT", path_part="MANIFEST.json", after_forward=True)
    info = store.save(1, _state(1), world_size=1)
    assert info.step == 1 and len(proxy.faulted()) == 1
    reader = _direct(url, create=False)
    assert reader.check(1) == [] and reader.load_latest()[1]["step"] == 1


def test_an_outage_window_delays_uploads_not_steps_and_nothing_partial_is_read(
        url: str, proxy: FaultyProxy, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Down (500) for 3 s, then refusing only manifests (503) for 2 s so that files land with
    no commit, then stalling every answer by 1.5 s (past the 1 s request timeout) for 2 s:
    steps keep their pace, snapshots due meanwhile are skipped with a line each (one waits
    at most: the staging buffers are not copied again), one line says the store went and
    one that it is back, uploads catch up, and a reader straight at the server only ever
    loads whole, verified snapshots."""
    caplog.set_level(logging.INFO)
    store = _through(url, proxy, monkeypatch, keep=3, timeout_s=1.0, retry_for_s=60)
    reader = _direct(url, create=False)
    read_errors: list[str] = []
    reads = [0]
    stop = threading.Event()

    def read_all_the_time() -> None:
        while not stop.is_set():
            try:
                got = reader.load_latest()
                if got is not None:
                    info, state = got
                    if state["step"] != info.step or not torch.equal(
                            state["model"]["w"], torch.full((1000,), float(info.step))):
                        read_errors.append(f"step {info.step} loaded {state['step']}")
                    reads[0] += 1
            except Exception as e:  # noqa: BLE001 - any failure to read is what this test looks for
                read_errors.append(repr(e))

    submitted = 0
    with AsyncSnapshotWriter(store, mode="thread") as writer:
        writer.submit(1, _state(1), world_size=1)
        writer.flush(timeout=60)
        reading = threading.Thread(target=read_all_the_time, daemon=True)
        reading.start()
        try:
            worst, step = 0.0, 2
            for phase in ("down", "manifests refused", "slow"):
                if phase == "down":
                    proxy.fail_for(3.0, 500)
                    t_end = time.monotonic() + 3.0
                elif phase == "manifests refused":
                    proxy.fail_for(2.0, 503, method="PUT", path_part="MANIFEST.json")
                    t_end = time.monotonic() + 2.0
                else:
                    proxy.fail_for(2.0, 0, stall_s=1.5)
                    t_end = time.monotonic() + 2.0
                while time.monotonic() < t_end:
                    t0 = time.perf_counter()
                    writer.submit(step, _state(step), world_size=1)
                    submitted += 1
                    time.sleep(0.05)  # a training step
                    worst = max(worst, time.perf_counter() - t0)
                    step += 1
            writer.flush(timeout=90)  # the upload in flight through the outage completes
            assert writer.submit(step, _state(step), world_size=1)
            submitted += 1
            writer.flush(timeout=60)
        finally:
            stop.set()
            reading.join(timeout=60)
        stats = writer.stats
    # below every fault's own length (the shortest, a stalled answer, 1.5 s), so a step that waited on
    # one fails; a loaded machine made a step 1.03 s once (the reader thread and the upload share the GIL)
    assert worst < 1.4, f"a step waited {worst:.2f}s on the object store"
    assert stats.errors == 0 and stats.snapshots_skipped > 0
    # at most one snapshot waits at a time: each other due one is skipped, with a line
    assert stats.snapshots_written + stats.snapshots_skipped == submitted + 1
    skip_lines = [r for r in caplog.records if "skipped: step" in r.getMessage()]
    assert len(skip_lines) == stats.snapshots_skipped
    assert read_errors == [] and reads[0] > 0
    assert _direct(url, create=False).load_latest()[0].step == step
    assert len(proxy.faulted()) > 10
    went, back = _outage_lines(caplog)
    assert went == back and 1 <= went <= 3, (went, back)  # per window, never per retry


def test_a_hung_server_is_one_line_when_a_request_goes_unanswered_and_one_when_it_answers(
        url: str, s3_server: SeaweedS3, caplog: pytest.LogCaptureFixture) -> None:
    """The real SeaweedFS stopped (SIGSTOP: connections accepted, nothing answered) under a PUT
    whose own timeout is far longer: the outage is named once the request has gone unanswered
    for the silence (1 s here, 10 s by default), not at its timeout, and once when it answers."""
    import os
    import signal

    from checkpoints.location import parse_s3
    from checkpoints.s3client import S3Objects
    from tests.support.waiting import wait_until

    caplog.set_level(logging.INFO)
    objects = S3Objects(parse_s3(url), timeout_s=60.0, retry_for_s=120.0, silent_after_s=1.0)
    objects.put("warm", b"x")  # connected, credentials good: what follows is the server's silence alone
    assert s3_server.proc is not None
    done: list[str] = []
    os.kill(s3_server.proc.pid, signal.SIGSTOP)
    try:
        putting = threading.Thread(target=lambda: done.append(objects.put("during", b"y" * 1024)), daemon=True)
        putting.start()
        wait_until(lambda: _outage_lines(caplog)[0] == 1, 30, "the outage's line while the server is stopped")
        assert not done and _outage_lines(caplog) == (1, 0)
    finally:
        os.kill(s3_server.proc.pid, signal.SIGCONT)
    putting.join(timeout=90)
    assert done, "the PUT never completed once the server answered again"
    assert _outage_lines(caplog) == (1, 1)
    assert objects.get("during")[0] == b"y" * 1024
    lines = [r.getMessage() for r in caplog.records if r.name == "checkpoints.s3client"]
    assert any("no answer to a request for" in m for m in lines), lines
