"""Two tiers (``LOCAL_DIR,s3://...``) against a real S3 server (SeaweedFS): the local tier is
created where it is opened, a local copy counts only for the object store it was written
for, and the step chosen to resume is one every rank, on every node, can load."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from checkpoints import SnapshotDirError
from checkpoints.stores import open_store
from checkpoints.tiered import TIER_KEY

KEY = b"k" * 32


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((100,), float(step))}, "step": step}


def test_the_local_tier_is_made_on_a_node_whose_disk_lacks_it(s3: str, tmp_path: Path) -> None:
    """A rank other than 0 opens the store with create=False: its node's missing local tier
    crash-looped its worker ("does not exist") while the other nodes trained on."""
    rank0 = open_store(f"{tmp_path / 'node-a'},{s3}", key=KEY)
    rank0.save(1, _state(1), world_size=2)
    new_node = tmp_path / "fresh" / "nvme"
    store = open_store(f"{new_node},{s3}", create=False, key=KEY)
    assert new_node.is_dir() and store.load(1, verify_shards=False)["step"] == 1
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(SnapshotDirError, match="cannot create snapshot directory") as refused:
        open_store(f"{blocked / 'nvme'},{s3}", create=False, key=KEY)
    assert "\n" not in str(refused.value)


def test_a_local_copy_counts_only_for_the_object_store_it_was_written_for(s3: str, tmp_path: Path) -> None:
    """Job A's local step 120 in a node directory it shares with job B (same key file): job B,
    on a new, empty prefix, starts from scratch instead of resuming job A's state."""
    shared = tmp_path / "nvme"
    job_a = open_store(f"{shared},{s3}-a", key=KEY)
    job_a.save(120, _state(120), world_size=1)
    job_b = open_store(f"{shared},{s3}-b", key=KEY)
    assert job_b.load_latest() is None
    assert job_a.load_latest()[0].step == 120  # still job A's own, from its local copy
    job_b.save(130, _state(130), world_size=1)  # job B's own local copy counts for job B
    assert job_b.load_latest()[1]["step"] == 130 and job_b.ours(130) and not job_a.ours(130)
    # job B's object store lacks step 120: a load of it is the object store's answer, not job A's copy
    assert not job_b.ours(120)


def test_a_step_only_in_rank_0s_local_tier_is_not_chosen(s3: str, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Rank 0's upload of step 20 never finished: rank 0 chose it, and the ranks on other nodes
    failed to load it (MANIFEST.json: missing). The step chosen is the newest every node can
    load, and rank 0 says why it passed over its own newer copy."""
    rank0 = open_store(f"{tmp_path / 'node-a'},{s3}", key=KEY)
    rank0.save(10, _state(10), world_size=2)
    rank0.local.save(20, _state(20), world_size=2, extra_meta={TIER_KEY: rank0.bound_to})  # upload lost
    caplog.set_level(logging.WARNING, logger="checkpoints.tiered")
    info, state = rank0.load_latest()
    assert info.step == 10 and state["step"] == 10
    assert any("step 20 is only in this node's local tier" in r.getMessage() for r in caplog.records)
    rank1 = open_store(f"{tmp_path / 'node-b'},{s3}", create=False, key=KEY)
    assert rank1.load(info.step, verify_shards=False)["step"] == 10  # what every other rank then does


def test_the_local_tier_s_prune_deletes_only_its_own_jobs_copies(s3: str, tmp_path: Path) -> None:
    """Two jobs share a node-local directory (the same key file, their own prefixes). Job B's
    prune after each save counted job A's local copies among the newest ``keep`` and deleted
    them (and A's newest local copy, its fast resume, went first). Now each job's prune keeps
    its own newest ``keep`` and leaves the other's alone."""
    shared = tmp_path / "nvme"
    job_a = open_store(f"{shared},{s3}-prune-a", keep=2, key=KEY)
    for step in (10, 20):
        job_a.save(step, _state(step), world_size=1)
    job_b = open_store(f"{shared},{s3}-prune-b", keep=2, key=KEY)
    for step in (100, 200, 300):
        job_b.save(step, _state(step), world_size=1)
    local = sorted(p.name for p in shared.iterdir() if p.name.startswith("step-"))
    assert local == ["step-000000000010", "step-000000000020", "step-000000000200", "step-000000000300"], local
    info, state = job_a.load_latest()
    assert info.step == 20 and state["step"] == 20 and job_a.ours(20)  # job A's fast resume, still there
    job_a.save(30, _state(30), world_size=1)  # job A's own prune: its step 10 goes, job B's stay
    local = sorted(p.name for p in shared.iterdir() if p.name.startswith("step-"))
    assert local == ["step-000000000020", "step-000000000030", "step-000000000200", "step-000000000300"], local
