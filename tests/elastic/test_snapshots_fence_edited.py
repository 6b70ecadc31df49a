"""An edited ``.fence`` (round 10**12 of this very run), during a run and at start.

With a job key the fence is signed like the manifests: an edited one does not verify, is
ignored with one line naming the file, and the next raise replaces it, so snapshots go on.
Without a key an edited fence cannot be told from a newer round's; what it stops is said
once, naming ``.fence`` and what to do (the agent refuses such a fence at start: exit 2,
``tests/redteam/test_forged_fence.py``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from checkpoints import Fence, FenceToken, SnapshotFencedError, SnapshotStore
from checkpoints.fence import FENCE_NAME
from elastic.distributed import DistInfo
from elastic.snapshots import StaleGroupError
from tests.elastic.test_snapshots_fence import RUN, Rounds, opened, state, world_of_one  # noqa: F401 - a fixture

KEY = b"k" * 32
EDITED = {"run": RUN, "round": 10**12}


def _edit(root: Path, meta: dict[str, object] = EDITED) -> None:
    (root / FENCE_NAME).write_text(json.dumps(meta))


def _fence_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and FENCE_NAME in r.getMessage()]


def test_a_signed_fence_verifies_and_an_edited_one_is_ignored_once(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    fence = Fence(tmp_path, key=KEY)
    fence.raise_to(FenceToken(RUN, 3))
    assert "hmac" in json.loads((tmp_path / FENCE_NAME).read_text())
    assert fence.current() == FenceToken(RUN, 3)
    assert Fence(tmp_path, key=None).current() == FenceToken(RUN, 3), "a reader without the key still reads it"
    assert Fence(tmp_path, key=b"o" * 32).current() is None, "another job's key"
    caplog.clear()
    _edit(tmp_path)
    assert [fence.current() for _ in range(3)] == [None] * 3
    lines = _fence_lines(caplog)
    assert len(lines) == 1 and str(tmp_path / FENCE_NAME) in lines[0] and "not signed" in lines[0], lines
    with fence.holding(FenceToken(RUN, 3)):
        pass  # the edited fence stops nothing
    fence.raise_to(FenceToken(RUN, 4))
    assert fence.current() == FenceToken(RUN, 4), "the next raise replaces it, signed"


def test_without_a_key_a_refusal_names_the_fence_and_what_to_do(tmp_path: Path) -> None:
    fence = Fence(tmp_path, key=None)
    fence.raise_to(FenceToken(RUN, 3))
    _edit(tmp_path)
    with pytest.raises(SnapshotFencedError) as caught:
        with fence.holding(FenceToken(RUN, 3)):
            pass
    assert str(tmp_path / FENCE_NAME) in str(caught.value) and "delete" in str(caught.value)


def test_a_signed_job_snapshots_on_past_a_fence_edited_during_the_run_and_at_start(
    tmp_path: Path, world_of_one: DistInfo, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
    caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ELASTIC_RDZV_HMAC_KEY", KEY.decode())
    root, rounds = tmp_path / "snapshots", Rounds()
    snapshots = opened(root, rounds, world_of_one)
    _edit(root)  # during the run
    for step in (5, 6, 7):
        snapshots.commit(step, None, lambda: state(step), world_size=1, epoch=0, cursor=0, samples=0, force=True)
        snapshots.writer.flush()
    snapshots.close()
    assert [i.step for i in SnapshotStore(root, keep=5, create=False).list()] == [5, 6, 7]

    _edit(root)  # at start: a new process opens the directory
    rounds.now = 2
    again = opened(root, rounds, world_of_one)
    again.final(8, state(8), world_size=1, meta={})
    again.close()
    assert Fence(root, key=KEY).current() == FenceToken(RUN, 2)
    assert 8 in [i.step for i in SnapshotStore(root, keep=5, create=False).list()]
    assert all("ignoring the snapshot fence" in line for line in _fence_lines(caplog)), _fence_lines(caplog)


def test_an_unsigned_job_says_once_which_file_stops_its_snapshots(
    tmp_path: Path, world_of_one: DistInfo, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    root, rounds = tmp_path / "snapshots", Rounds()
    snapshots = opened(root, rounds, world_of_one)
    _edit(root)
    for step in (5, 6, 7):
        snapshots.commit(step, None, lambda: state(step), world_size=1, epoch=0, cursor=0, samples=0, force=True)
        try:
            snapshots.writer.flush()
        except SnapshotFencedError:
            pass
    with pytest.raises(StaleGroupError, match=FENCE_NAME.replace(".", r"\.")):
        snapshots.final(8, state(8), world_size=1, meta={})
    snapshots.close()
    lines = [line for line in _fence_lines(caplog) if "snapshot step" in line]
    assert len(lines) == 1, lines
    assert str(root / FENCE_NAME) in lines[0] and "delete" in lines[0]
