"""``elastic local``'s "last snapshot" reads the workers' snapshot location, a bucket or a directory.

It globbed the run directory's ``snapshots/``, so with ``--snapshot-dir s3://...`` (or any
other directory) the console said "last snapshot: none yet" to the end of a job that had
written many. Now it reads the location through the store's public API: tested here with
the view's own footer over a real S3 server (SeaweedFS) and over a directory, snapshots
written by the store as the workers write them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent.local.local_faults import Cluster
from agent.local.local_view import _footer
from checkpoints.stores import open_store
from tests.support.s3server import SeaweedS3
from tests.support.waiting import wait_until


def _footer_says(cluster: Cluster, name: str) -> str:
    def look() -> str | None:
        line = _footer(cluster)[0]
        return line if f"last snapshot: {name} " in line else None

    return wait_until(look, 30, f"the view to show {name}", on_timeout=lambda: _footer(cluster)[0])


def _save(location: str, step: int) -> None:
    open_store(location, key=None).save(step, {"w": torch.full((8,), float(step))}, world_size=1)


@pytest.mark.parametrize("tiers", [False, True], ids=["s3", "dir,s3"])
def test_the_view_shows_the_newest_snapshot_in_a_bucket(s3_server: SeaweedS3, tmp_path: Path, tiers: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{s3_server.bucket(f'local-view-{int(tiers)}')}/job"
    location = f"{tmp_path / 'local'},{url}" if tiers else url  # two tiers: shown from the object store's
    cluster = Cluster([], tmp_path / "run", 1, snapshots=location)
    _footer_says(cluster, "none yet")
    for step in (20, 40):
        _save(location, step)
    _footer_says(cluster, "step-000000000040")
    assert not (tmp_path / "run").exists()  # nothing looked for, or made, in the run directory


def test_the_view_shows_the_newest_snapshot_in_the_given_directory(tmp_path: Path) -> None:
    given = tmp_path / "elsewhere"
    cluster = Cluster([], tmp_path / "run", 1, snapshots=str(given))
    _footer_says(cluster, "none yet")  # the workers have not made it yet
    _save(str(given), 20)
    _footer_says(cluster, "step-000000000020")
    assert cluster.snapshot_dir == given  # and kill-rank0-snapshot watches that directory, not the run's


def test_the_last_view_looks_once_more_and_waits_for_the_answer(tmp_path: Path) -> None:
    """The summary printed as the job ends names its final snapshot, not the answer of a look
    made before it was written (a job shorter than the first look, which imports torch in its
    thread, once ended with "last snapshot: none yet" over three snapshots)."""
    given = tmp_path / "snapshots"
    cluster = Cluster([], tmp_path / "run", 1, snapshots=str(given))
    assert _footer(cluster)[0].startswith("last snapshot: none yet ")  # the first look, before any snapshot
    _save(str(given), 20)
    _save(str(given), 40)
    cluster.settle_snapshot_view()  # what the view's exit does, before its last print
    assert _footer(cluster)[0].startswith("last snapshot: step-000000000040 ")
