"""SIGKILL a saver at 50 random moments: the newest valid snapshot is always whole."""

from __future__ import annotations

import pytest

import os
import random
import signal
import time
from pathlib import Path

from checkpoints import SnapshotStore
from ckpt_testutil import LineReader, assert_equal_state, start_child, state_for, stop_child

ROUNDS = 50
NUMEL = 1 << 18  # must match _ckpt_crash_zygote.NUMEL


@pytest.mark.slow  # starts processes
def test_sigkill_during_save_never_exposes_a_torn_snapshot(tmp_path: Path) -> None:
    root = tmp_path / "snaps"
    rng = random.Random(20240611)
    zygote = start_child("_ckpt_crash_zygote.py", str(root))
    child = None
    killed_mid_write = 0
    rounds_with_a_spare = 0  # keep=3: from the 4th save on, each save writes over the spare
    last_durable = 0
    try:
        out = LineReader(zygote)
        out.wait_for("ready", timeout=60)
        assert zygote.stdin is not None
        for rnd in range(ROUNDS):
            zygote.stdin.write("fork\n")
            zygote.stdin.flush()
            child = int(out.wait_for("child ", timeout=30).split()[1])
            # The saver writes back to back (~10-30 ms per snapshot), so a uniform kill time
            # lands uniformly across the phases of a save: file writes, fsyncs, manifest,
            # rename, prune. This sleep *is* the kill time, not a wait for a condition.
            time.sleep(rng.uniform(0.0, 0.25))
            os.kill(child, signal.SIGKILL)
            reaped = out.wait_for(f"reaped {child}", timeout=30)
            assert reaped.split()[2] == str(signal.SIGKILL), f"saver died on its own: {out.seen[-5:]}"
            child = None
            durable = [int(s.split()[1]) for s in out.seen if s.startswith("durable ")]
            last_durable = max(durable, default=0)
            names = [p.name for p in root.iterdir()]
            killed_mid_write += any(n.startswith(".tmp-") for n in names)
            rounds_with_a_spare += any(n.startswith(".spare-") for n in names)

            store = SnapshotStore(root, keep=3)
            # A process crash must not lose anything save() had returned for ...
            newest = store.newest_valid(full=True)
            if last_durable:
                assert newest is not None and newest.step >= last_durable, (rnd, newest, last_durable)
            if newest is not None:
                assert_equal_state(store.load(newest), state_for(newest.step, NUMEL))
            # ... and every step-* dir that exists is complete: the rename is the commit point.
            for s in store.status(full=True):
                assert s.valid, f"round {rnd}: torn snapshot visible: {s.path} {s.problems}"
    finally:
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stop_child(zygote)

    # Sanity checks that the kills exercised what this test claims (loose: CI machines are busy).
    assert last_durable >= 10, "savers barely got to save; the kills did not exercise repeated saves"
    assert killed_mid_write >= 10, f"only {killed_mid_write}/{ROUNDS} kills landed mid-write"
    assert rounds_with_a_spare >= 1, "no spare was ever kept: the kills never met a recycled write"
    # All savers are dead now, so every temp dir they left is stale and goes away; the one
    # spare stays for the next save.
    store = SnapshotStore(root)
    store.clean_stale_temps()
    left = [p.name for p in root.iterdir() if p.name.startswith(".")]
    assert len(store.spares()) <= 1 and len(left) == len(store.spares()), left
