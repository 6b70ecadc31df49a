"""Opening and listing a store never imports torch.

``elastic local``'s snapshot view and its check of an ``s3://`` location run in the CLI's own
process: with torch imported there, every ``elastic local`` start paid 2-5 s of CPU before its
first node (measured: the S3 case's etcd started 7-10 s after the command). Writing or loading
a snapshot's payload (``newest_valid`` loads it to verify it) imports torch where it happens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_PROBE = """
import json, sys
from checkpoints.stores import open_store
import checkpoints.s3store, checkpoints.s3parts, checkpoints.tiered  # every store a location can name
import agent.local.local_cluster, agent.local.local_snapshots  # elastic local's own process
store = open_store(sys.argv[1], create=True, key=None)
found = [s.step for s in store.list()]  # what elastic local's view and start-up check call
print(json.dumps({"found": found,
                  "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))[:3]}))
"""

_WRITE = """
import sys, torch
from checkpoints.stores import open_store
open_store(sys.argv[1], create=True, key=None).save(7, {"w": torch.ones(3)}, world_size=1)
"""


@pytest.mark.slow  # starts processes: torch is imported in this one
def test_listing_a_store_and_its_newest_snapshot_leave_torch_unimported(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    store_dir = tmp_path / "snaps"
    subprocess.run([sys.executable, "-c", _WRITE, str(store_dir)], check=True, cwd=root, timeout=120)
    out = subprocess.run([sys.executable, "-c", _PROBE, str(store_dir)], capture_output=True, text=True,
                         cwd=root, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["found"] == [7], seen  # the reader did find the snapshot
    assert seen["torch"] == [], f"a store reader imported {seen['torch']}: make that import lazy"
