"""Snapshots in a real S3-compatible server (SeaweedFS, started once per session): the store's
promises without rename - commit by manifest, never a torn or forged snapshot read, stale
writers refused, dead writers' leftovers pruned, bad locations refused at start."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from checkpoints import AsyncSnapshotWriter, FenceToken, SnapshotDirError, SnapshotFencedError
from checkpoints.cli import main as cli_main
from checkpoints.s3store import S3SnapshotStore
from checkpoints.stores import open_store
from checkpoints.tiered import TIER_KEY
from tests.support.s3server import SeaweedS3

KEY = b"k" * 32


def _state(step: int, n: int = 1000) -> dict:
    return {"model": {"w": torch.full((n,), float(step))}, "step": step}


def test_round_trip_prune_and_cli(s3: str, capsys: pytest.CaptureFixture[str]) -> None:
    store = open_store(s3, keep=2, key=KEY)
    assert isinstance(store, S3SnapshotStore)
    for step in (1, 2, 3):
        store.save(step, _state(step), world_size=2)
    info, state = store.load_latest()
    assert info.step == 3 and state["step"] == 3 and torch.equal(state["model"]["w"], torch.full((1000,), 3.0))
    assert [s.step for s in store.status(full=True) if s.valid] == [2, 3]  # step 1 pruned (keep=2)
    # a resumed job reaching a step that exists keeps it (if_exists='skip'), never overwrites
    assert store.save(3, _state(99), world_size=2).step == 3
    assert store.load_latest()[1]["step"] == 3
    os.environ["ELASTIC_RDZV_HMAC_KEY"] = KEY.decode()
    assert cli_main(["verify", s3]) == 0
    out = capsys.readouterr().out
    assert "a restart resumes from step 3" in out and "2 signed" in out


def test_torn_forged_and_unsigned_objects_are_never_read(s3: str, s3_server: SeaweedS3) -> None:
    store = open_store(s3, keep=5, key=KEY)
    for step in (1, 2, 3, 4):
        store.save(step, _state(step), world_size=1)
    # a forged snapshot: written with another key under the step above all others
    open_store(s3, keep=5, key=b"x" * 32).save(5, _state(5), world_size=1, housekeeping=False)
    c = s3_server.client()
    bucket, prefix = s3.split("/")[2], s3.split("/")[3]
    objs = {o["Key"]: o for o in c.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")["Contents"]}
    data4 = next(k for k in objs if k.startswith(f"{prefix}/step-000000000004/") and k.endswith("model.pt"))
    body = c.get_object(Bucket=bucket, Key=data4)["Body"].read()
    c.put_object(Bucket=bucket, Key=data4, Body=body[:-8] + b"\0" * 8)  # same size, other bytes
    man3 = f"{prefix}/step-000000000003/MANIFEST.json"
    c.put_object(Bucket=bucket, Key=man3, Body=c.get_object(Bucket=bucket, Key=man3)["Body"].read()[:40])  # torn
    info, state = store.load_latest()
    assert info.step == 2 and state["step"] == 2
    statuses = {s.step: s for s in store.status(full=True)}
    assert "sha256 mismatch" in statuses[4].problems[0]
    assert "MANIFEST.json" in statuses[3].problems[0] and "self-checksum" not in statuses[5].problems[0]
    assert statuses[5].signed and "MANIFEST.json" in statuses[5].problems[0]
    # prune never removes the newest valid one nor a snapshot refused for its signature alone
    store.prune(keep=1)
    assert store.load_latest()[0].step == 2
    assert 5 in {s.step for s in store.status()}


def test_stale_writer_is_refused_and_its_late_commit_never_read(s3: str) -> None:
    store = open_store(s3, keep=5, key=KEY)
    store.fence.raise_to(FenceToken("run", 1))
    store.save(1, _state(1), world_size=1, extra_meta={"fence": {"run": "run", "round": 1}})
    store.fence.raise_to(FenceToken("run", 2))
    with pytest.raises(SnapshotFencedError):
        store.save(2, _state(2), world_size=1, extra_meta={"fence": {"run": "run", "round": 1}})
    assert [s.step for s in store.status()] == [1]  # nothing of the refused write is a snapshot
    # a stale writer that passed its check before the raise, and died before its second check:
    # its manifest lands after the fence moved; readers refuse it.
    time.sleep(1.1)  # the server stamps objects to the second
    stale = open_store(s3, keep=5, key=KEY)
    stale.fence.check = lambda token: None  # it saw the old fence
    stale.save(3, _state(3), world_size=1, extra_meta={"fence": {"run": "run", "round": 1}})
    assert store.load_latest()[0].step == 1
    store.save(4, _state(4), world_size=1, extra_meta={"fence": {"run": "run", "round": 2}})
    assert store.load_latest()[0].step == 4


_WRITER = textwrap.dedent("""
    import sys, torch
    from checkpoints.stores import open_store
    store = open_store(sys.argv[1], keep=100, key=b"k" * 32, multipart_chunk=5 << 20, io_threads=1)
    store.save(1, {"model": {"w": torch.zeros(1000)}, "step": 1}, world_size=1)
    print("ready", flush=True)
    step = 2
    while True:
        store.save(step, {"model": {"w": torch.randn(12 << 20)}, "step": step}, world_size=1, housekeeping=False)
        step += 1
""")


def test_writer_killed_mid_upload_leaves_the_previous_snapshot_and_prune_cleans_up(s3: str, tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, str(script), s3], stdout=subprocess.PIPE, env=env)
    store = open_store(s3, keep=2, key=KEY, stale_temp_grace_s=3600)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 30
        while not store.objects.multipart_uploads():  # mid-upload: a multipart upload is open
            assert time.monotonic() < deadline, "never saw an upload in flight"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    info, state = store.load_latest()
    assert state["step"] == info.step and info.step >= 1
    assert all(not s.problems for s in store.status(full=True))  # the torn step is no snapshot at all
    left = store.temp_dirs()
    assert left and all(t.stale and t.pid == proc.pid for t in left)  # its writer is dead: stale at once
    store.clean_stale_temps()
    store.prune(keep=1)
    assert store.temp_dirs() == [] and store.objects.multipart_uploads() == []
    assert store.load_latest()[0].step == info.step  # never the newest valid one


def test_bad_locations_are_one_line_at_start(s3: str, s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    bucket, prefix = s3.split("/")[2], s3.split("/")[3]
    with pytest.raises(SnapshotDirError, match="does not exist"):
        open_store("s3://no-such-bucket-here/job")
    s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/notes.txt", Body=b"mine")
    with pytest.raises(SnapshotDirError, match="did not write"):
        open_store(s3)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(SnapshotDirError, match="refuses these credentials"):
        open_store(s3)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    assert cli_main(["ls", s3]) == 2
    err = capsys.readouterr().err
    assert "does not answer" in err and err.count("\n") == 1 and "wrong-secret" not in err


def test_server_outage_delays_uploads_not_steps(s3: str, s3_server: SeaweedS3,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """The server frozen for ~5 s: steps go on at their pace, snapshots due meanwhile are
    skipped, one line says it went and one that it is back, and uploads catch up."""
    store = open_store(s3, keep=3, key=KEY, timeout_s=1.0, retry_for_s=60)
    caplog.set_level(logging.INFO)
    assert s3_server.proc is not None
    with AsyncSnapshotWriter(store, mode="thread") as writer:
        writer.submit(1, _state(1), world_size=1)
        writer.flush()
        os.killpg(s3_server.proc.pid, signal.SIGSTOP)
        try:
            worst, t_end, step = 0.0, time.monotonic() + 5, 2
            while time.monotonic() < t_end:
                t0 = time.perf_counter()
                writer.submit(step, _state(step), world_size=1)
                time.sleep(0.05)  # a training step
                worst = max(worst, time.perf_counter() - t0)
                step += 1
        finally:
            os.killpg(s3_server.proc.pid, signal.SIGCONT)
        writer.flush(timeout=60)  # the upload in flight through the outage completes
        assert writer.submit(step, _state(step), world_size=1)
        writer.flush(timeout=60)
    assert worst < 1.0, f"a step waited {worst:.2f}s on the object store"
    assert writer.stats.snapshots_skipped > 0
    assert store.load_latest()[0].step == step
    lines = [r.getMessage() for r in caplog.records if r.name == "checkpoints.s3client"]
    assert sum("does not answer" in m for m in lines) == 1 and sum("answers again" in m for m in lines) == 1


def test_two_tiers_resume_from_the_newest_valid_of_both(s3: str, tmp_path: Path) -> None:
    node_a = f"{tmp_path / 'node-a'},{s3}"
    store = open_store(node_a, keep=5, key=KEY)
    for step in (1, 2):
        store.save(step, _state(step), world_size=1)
    assert store.local.newest_valid().step == 2 and store.remote.newest_valid().step == 2
    store.local.save(3, _state(3), world_size=1, extra_meta={TIER_KEY: store.bound_to})  # never uploaded
    assert store.load_latest()[0].step == 2  # other nodes could not load step 3 (test_ckpt_tiers.py)
    store.remote.save(4, _state(4), world_size=1)  # newer remotely (written from another node)
    assert store.load_latest()[1]["step"] == 4
    # healed onto a node whose disk is empty: the object store's newest
    node_b = open_store(f"{tmp_path / 'node-b'},{s3}", keep=5, key=KEY)
    assert node_b.load_latest()[1]["step"] == 4 and node_b.load(2)["step"] == 2
    # a local copy gone bad: the same step from the object store, never an older local one
    store.save(5, _state(5), world_size=1)
    bad = next((tmp_path / "node-a" / "step-000000000005").glob("*model.pt"))
    data = bytearray(bad.read_bytes())
    data[-20] ^= 0xFF
    bad.write_bytes(bytes(data))
    info, state = store.load_latest()
    assert info.step == 5 and state["step"] == 5 and torch.equal(state["model"]["w"], torch.full((1000,), 5.0))
    # the writer process opens the same two tiers from the location alone
    with AsyncSnapshotWriter(store) as writer:
        assert writer.wait_writer_process(60)
        writer.submit(6, _state(6), world_size=1)
        writer.flush(60)
    assert store.local.newest_valid().step == 6 and store.remote.newest_valid().step == 6


def test_two_tier_save_serialises_once_and_uploads_the_verified_local_files(
        s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every torch.save call is counted: the local tier serialises each file once, and the
    object store gets those bytes; a local file changed before its upload is never sent."""
    store = open_store(f"{tmp_path / 'node'},{s3}", keep=5, key=KEY)
    calls: list[object] = []
    real_save = torch.save

    def counting_save(obj: object, f: object, *a: object, **kw: object) -> None:
        calls.append(obj)
        real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", counting_save)
    store.save(1, _state(1), world_size=1)
    assert len(calls) == 2  # "model" and "step": once each, not once per tier
    assert store.remote.check(1) == [] and store.remote.load(1)["step"] == 1
    remote_files = {f.file.split("/")[-1]: f.sha256 for f in store.remote._read_manifest(1).files}
    local_files = {f.file: f.sha256 for f in store.local._read_manifest(tmp_path / "node" / "step-000000000001").files}
    assert remote_files == local_files  # the very bytes the local tier wrote and hashed
    # a local copy changed between its write and its upload: refused, serialised again
    real_upload = store.remote._upload_copies

    def tamper_then_upload(src: Path, entries: tuple, where: str) -> list:
        f = next(src.glob("*model.pt"))
        data = bytearray(f.read_bytes())
        data[-20] ^= 0xFF
        f.write_bytes(bytes(data))
        return real_upload(src, entries, where)

    monkeypatch.setattr(store.remote, "_upload_copies", tamper_then_upload)
    calls.clear()
    store.save(2, _state(2), world_size=1)
    assert len(calls) == 4  # the fallback serialised it again for the object store
    assert store.remote.check(2) == [] and store.remote.load(2)["step"] == 2


def test_a_forged_fence_object_is_refused_with_one_line(s3: str, s3_server: SeaweedS3,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """In a signed job the fence object is signed like the manifests: one written by whoever
    can write the bucket but lacks the key (here: round 99, unsigned) stops nothing."""
    import json

    caplog.set_level(logging.WARNING)
    store = open_store(s3, keep=5, key=KEY)
    store.fence.raise_to(FenceToken("run", 1))
    assert "hmac" in json.loads(store.objects.get(".fence")[0])
    bucket, prefix = s3.split("/")[2], s3.split("/")[3]
    s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/.fence", Body=json.dumps({"run": "run", "round": 99}))
    meta = {"fence": {"run": "run", "round": 1}}
    store.save(1, _state(1), world_size=1, extra_meta=meta)
    store.save(2, _state(2), world_size=1, extra_meta=meta)
    assert store.load_latest()[0].step == 2
    lines = [r.getMessage() for r in caplog.records if "ignoring the snapshot fence" in r.getMessage()]
    assert len(lines) == 1 and ".fence" in lines[0] and "not signed with the job key" in lines[0]
    store.fence.raise_to(FenceToken("run", 2))  # the next round replaces it
    assert store.fence.current() == FenceToken("run", 2)
    with pytest.raises(SnapshotFencedError):
        store.save(3, _state(3), world_size=1, extra_meta=meta)
