"""The object store's pure decisions, without a server: which locations parse, which manifest
is a stale group's late commit, when a writer's leftovers may go, how an outage is logged."""

from __future__ import annotations

import datetime as dt
import logging
import os

import pytest

from checkpoints import FenceToken, layout
from checkpoints.location import LocationError, S3Location, is_remote, parse_s3
from checkpoints.s3client import Outage
from checkpoints.s3fence import stale_commit
from checkpoints.s3store import ObjectPath, _writer_gone, writer_name
from checkpoints.stores import location_of


def test_locations() -> None:
    assert parse_s3("s3://bucket-1/a//b/") == S3Location("bucket-1", "a/b/")
    assert parse_s3("s3://bucket-1") == S3Location("bucket-1", "")
    assert str(parse_s3("s3://bucket-1/a/b/")) == "s3://bucket-1/a/b"
    assert is_remote("s3://x") and not is_remote("/data/s3:/x") and not is_remote(os.fspath("rel"))
    with pytest.raises(LocationError, match="did you mean s3://x"):  # tests/test_snapshot_location_typos.py
        is_remote("S3://x")
    for bad in ("s3://", "s3://B/x", "s3://ab/x", "s3://bucket-1/../x", "s3://bucket-1/./x"):
        with pytest.raises(LocationError):
            parse_s3(bad)
    assert location_of("s3://bucket-1/p") == "s3://bucket-1/p"  # never folded to s3:/ by Path
    assert str(location_of("/tmp/x")) == "/tmp/x"
    p = ObjectPath("s3://bucket-1/p") / "step-000000000001"
    assert p.name == "step-000000000001" and str(p) == "s3://bucket-1/p/step-000000000001"


def test_a_late_commit_of_an_older_round_is_stale() -> None:
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    later, fence = t0 + dt.timedelta(seconds=5), FenceToken("run", 2)
    meta1 = {"run": "run", "round": 1}
    assert stale_commit(meta1, fence, t0, later) is not None  # committed after round 2 took over
    assert stale_commit(meta1, fence, later, t0) is None  # committed before: a snapshot like any
    assert stale_commit({"run": "run", "round": 2}, fence, t0, later) is None
    assert stale_commit({"run": "other", "round": 1}, fence, t0, later) is None  # another run's: not ours to judge
    assert stale_commit(None, fence, t0, later) is None and stale_commit(meta1, None, None, later) is None


def test_leftovers_go_when_their_writer_is_dead_or_too_old() -> None:
    mine = writer_name()
    assert not _writer_gone(mine, 10, 600)  # this process: alive
    dead = f"{layout.host_tag()}-999999999-0000abcd"
    assert _writer_gone(dead, 1, 600)
    other_host = "ffffffff-1-0000abcd"
    assert not _writer_gone(other_host, 10, 600) and _writer_gone(other_host, 700, 600)
    assert _writer_gone("not-a-writer", 700, 600) and not _writer_gone("not-a-writer", 1, 600)


def test_an_outage_is_two_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    o = Outage("s3://b/p")
    o.answered()
    for _ in range(5):
        o.failed(ConnectionError("refused"))
    o.answered()
    o.answered()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "does not answer (refused)" in lines[0] and "answers again" in lines[1]


def test_two_tiers_are_a_local_dir_then_an_s3_url() -> None:
    from checkpoints.location import split_tiers, uses_object_store

    assert split_tiers("/nvme/ckpt,s3://bucket-1/job") == ("/nvme/ckpt", "s3://bucket-1/job")
    assert split_tiers("/a,b/ckpt,s3://bucket-1/job") == ("/a,b/ckpt", "s3://bucket-1/job")
    for single in ("/nvme/ckpt", "s3://bucket-1/job", "s3://bucket-1/a,s3://bucket-1/b", ",s3://bucket-1/x",
                   "/a,/b"):
        assert split_tiers(single) is None, single
    assert uses_object_store("/nvme/ckpt,s3://bucket-1/job") and uses_object_store("s3://bucket-1/job")
    assert not uses_object_store("/nvme/ckpt") and location_of("/n,s3://bucket-1/j") == "/n,s3://bucket-1/j"
