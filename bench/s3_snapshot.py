"""Snapshots to an S3-compatible server (SeaweedFS on this host) against boto3's own transfer.

    .venv/bin/python bench/s3_snapshot.py --gb 1

Measures, for one snapshot of ``--gb`` GB (one tensor, as a large model's state is):
  * ``store.save`` to ``s3://`` end to end (serialise + hash to a spool file, multipart upload,
    manifest), and its upload part alone, against boto3's ``upload_file`` of the very same
    file with its default TransferConfig (the library's own best transfer) to the same server;
  * the training stall of ``AsyncSnapshotWriter.submit`` + ``wait_capture`` for the local-
    directory store and the S3 store (the writer's capture does not depend on the store);
  * resume (``load_latest``, full verification) from S3 and from a local directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoints import AsyncSnapshotWriter, SnapshotStore  # noqa: E402
from checkpoints.s3store import S3SnapshotStore, _spool_file  # noqa: E402
from checkpoints.workers import DaemonPool  # noqa: E402
from tests.support.s3server import SeaweedS3  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
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
        print(f"snapshot: {size_gb:.2f} GB, one tensor; SeaweedFS 4.48 on 127.0.0.1; best of {args.repeats}")
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
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
