"""Snapshots to an S3-compatible server (SeaweedFS on this host) against boto3's own transfer.

    .venv/bin/python bench/s3_snapshot.py --gb 1

Measures, for one snapshot of ``--gb`` GB (one tensor, as a large model's state is):
  * ``store.save`` to ``s3://`` end to end (serialise + hash to a spool file, multipart upload,
    manifest), and its upload part alone, against boto3's ``upload_file`` of the very same
    file with its default TransferConfig (the library's own best transfer) to the same server;
  * the training stall of ``AsyncSnapshotWriter.submit`` + ``wait_capture`` for the local-
    directory store and the S3 store (the writer's capture does not depend on the store);
  * resume (``load_latest``, full verification) from S3 and from a local directory;
  * the two-tier save (local directory, then S3), which serialises once and uploads the local
    tier's files, against the same two tiers written the old way (each tier serialising);
  * the step stall (``submit`` + ``wait_capture``) of the S3 writer against the local-directory
    writer, the median of ``--stall-runs`` snapshots each (the first of each dropped: it pays
    the staging buffers' first touch), as a ratio to the local writer's.

``--parts`` picks what to run (default all): ``upload,resume,tiers,stall``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoints import AsyncSnapshotWriter, SnapshotStore  # noqa: E402
from checkpoints.s3store import S3SnapshotStore, _spool_file  # noqa: E402
from checkpoints.tiered import TieredStore  # noqa: E402
from checkpoints.workers import DaemonPool  # noqa: E402
from tests.support.s3server import SeaweedS3  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--stall-runs", type=int, default=6)
    p.add_argument("--parts", default="upload,resume,tiers,stall")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    work = Path(tempfile.mkdtemp(prefix="s3bench-"))
    server = SeaweedS3(work / "weed")
    server.start()
    try:
        os.environ.update(server.env())
        server.bucket("bench")
        n = int(args.gb * (1 << 30) / 4)
        state = {"model": {"w": torch.randn(n)}, "step": 1}
        size_gb = n * 4 / 1e9
        store = S3SnapshotStore("s3://bench/job", keep=2, key=b"k" * 32)
        local = SnapshotStore(work / "local", keep=2, key=b"k" * 32)

        print(f"snapshot: {size_gb:.2f} GB, one tensor; SeaweedFS on 127.0.0.1")
        if parts & {"upload", "resume"}:
            _upload_and_resume(args, work, state, size_gb, store, local)
        if "tiers" in parts:
            _tiers(args, work, state, size_gb, store)
        if "stall" in parts:
            _stall(args, state, store, local)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def _upload_and_resume(args: argparse.Namespace, work: Path, state: dict, size_gb: float,
                       store: S3SnapshotStore, local: SnapshotStore) -> None:
    saves, uploads, bests = [], [], []
    spool = work / "spool.pt"
    _spool_file(spool, state["model"], DaemonPool(2, "h"))
    import boto3
    from boto3.s3.transfer import TransferConfig

    c = boto3.session.Session().client("s3")
    for r in range(args.repeats):
        t0 = time.perf_counter()
        store.save(10 + r, state, world_size=1)
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        store.objects.upload_file(f"bench-ours-{r}", str(spool))
        uploads.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        c.upload_file(str(spool), "bench", f"bench-best-{r}", Config=TransferConfig())
        bests.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    local.save(1, state, world_size=1)
    local_save = time.perf_counter() - t0

    stalls = {}
    for name, st in (("local dir", local), ("s3", store)):
        with AsyncSnapshotWriter(st, mode="thread") as w:
            t0 = time.perf_counter()
            w.submit(100, state, world_size=1)
            w.wait_capture()
            stalls[name] = time.perf_counter() - t0
            w.flush()

    t0 = time.perf_counter()
    s3_found = store.load_latest()
    s3_resume = time.perf_counter() - t0
    t0 = time.perf_counter()
    local_found = local.load_latest()
    local_resume = time.perf_counter() - t0
    assert s3_found and local_found and s3_found[0].step == local_found[0].step == 100

    best = min(saves)
    print(f"best of {args.repeats}")
    print(f"store.save to s3 (serialise+hash+upload+manifest): {best:.2f} s = {size_gb / best:.2f} GB/s")
    print(f"  its upload alone (S3Objects.upload_file, 64 MB parts, 8 threads): {min(uploads):.2f} s = "
          f"{size_gb / min(uploads):.2f} GB/s")
    print(f"boto3 upload_file, default TransferConfig, same file: {min(bests):.2f} s = "
          f"{size_gb / min(bests):.2f} GB/s")
    print(f"ratio upload ours/boto3 best: {min(bests) / min(uploads) * 100:.0f} %; "
          f"end-to-end save/boto3 upload: {min(bests) / best * 100:.0f} %")
    print(f"store.save to a local dir: {local_save:.2f} s")
    print(f"training stall (submit + wait_capture): local dir {stalls['local dir'] * 1e3:.0f} ms, "
          f"s3 {stalls['s3'] * 1e3:.0f} ms")
    print(f"resume (load_latest, full verification): s3 {s3_resume:.2f} s, local dir {local_resume:.2f} s")


def _tiers(args: argparse.Namespace, work: Path, state: dict, size_gb: float, store: S3SnapshotStore) -> None:
    """The two-tier save as it is (serialise once, upload the local files) against the same
    two writes the old way (each tier serialising the state itself)."""
    tiered = TieredStore(SnapshotStore(work / "tier-local", keep=2, key=b"k" * 32), store)
    once, twice, once_cpu, twice_cpu = [], [], [], []
    for r in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        tiered.save(1000 + 2 * r, state, world_size=1)
        once.append(time.perf_counter() - t0)
        once_cpu.append(time.process_time() - c0)
        t0, c0 = time.perf_counter(), time.process_time()
        tiered.local.save(1001 + 2 * r, state, world_size=1)
        store.save(1001 + 2 * r, state, world_size=1)
        twice.append(time.perf_counter() - t0)
        twice_cpu.append(time.process_time() - c0)
    med = statistics.median
    print(f"two-tier save, serialised once (local, then its files uploaded): median {med(once):.2f} s "
          f"{[round(x, 2) for x in once]}, CPU of this process {med(once_cpu):.2f} s")
    print(f"two-tier save, serialised per tier (local.save + s3 save): median {med(twice):.2f} s "
          f"{[round(x, 2) for x in twice]}, CPU {med(twice_cpu):.2f} s; once/per-tier: time "
          f"{med(once) / med(twice):.2f}, CPU {med(once_cpu) / med(twice_cpu):.2f}")


def _stall(args: argparse.Namespace, state: dict, store: S3SnapshotStore, local: SnapshotStore) -> None:
    """submit + wait_capture, the time training is blocked, for each writer; median of runs."""
    stalls: dict[str, list[float]] = {}
    for name, st in (("local dir", local), ("s3", store), ("local dir again", local)):
        with AsyncSnapshotWriter(st, mode="thread") as w:
            out = []
            for r in range(args.stall_runs + 1):
                t0 = time.perf_counter()
                w.submit(2000 + 10 * r + len(stalls), state, world_size=1)
                w.wait_capture()
                out.append(time.perf_counter() - t0)
                w.flush()
            stalls[name] = out[1:]
    anchor = statistics.median(stalls["local dir"] + stalls["local dir again"])
    s3 = statistics.median(stalls["s3"])
    for name, xs in stalls.items():
        print(f"stall {name}: median {statistics.median(xs) * 1e3:.0f} ms {[round(x * 1e3) for x in xs]}")
    print(f"step stall, s3 writer {s3 * 1e3:.0f} ms vs local-directory writer {anchor * 1e3:.0f} ms (the anchor, "
          f"runs before and after): ratio {s3 / anchor:.2f}")


if __name__ == "__main__":
    main()
