"""DDP's bucket rebuild runs in the guarded step, so a lost peer cannot fail the user's forward.

Two real processes: after one training step and :func:`elastic.ddp_buckets.settle`, rank 1
exits; rank 0's next forward must run no collective (and so not raise), which is what lets
an in-place survivor catch the loss in its own step instead of dying in the forward.
Without ``settle`` the same forward broadcasts the bucket order and fails: the second test
keeps that premise honest.
"""

from __future__ import annotations

import pytest

from pathlib import Path

from tests.support.pair import run_pair

SCRIPT = """\
import sys
from datetime import timedelta
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from elastic import ddp_buckets

rank, port, settle = int(sys.argv[1]), int(sys.argv[2]), SETTLE
t = timedelta(seconds=10)
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False, timeout=t)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=t)
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
model(torch.randn(4, 8)).sum().backward()
if settle:
    print("settled", ddp_buckets.settle(model), flush=True)
    print("again", ddp_buckets.settle(model), flush=True)
store.set(f"done{rank}", "1")
if rank == 1:
    sys.exit(0)  # the peer is gone before rank 0's next forward
store.wait(["done1"])
import time; time.sleep(0.5)  # let rank 1's exit close its sockets
try:
    model(torch.randn(4, 8))
    print("forward ok", flush=True)
except RuntimeError as e:
    print("forward failed", str(e).splitlines()[0], flush=True)
"""


@pytest.mark.slow  # starts processes
def test_settled_buckets_leave_no_collective_in_the_forward(tmp_path: Path) -> None:
    rank0, rank1 = run_pair(SCRIPT.replace("SETTLE", "True"), tmp_path)
    assert "settled True" in rank0 and "settled True" in rank1, rank0 + rank1
    assert "again False" in rank0, rank0  # once per DDP
    assert "forward ok" in rank0, rank0


@pytest.mark.slow  # starts processes
def test_unsettled_buckets_fail_the_forward_when_the_peer_is_gone(tmp_path: Path) -> None:
    rank0, _ = run_pair(SCRIPT.replace("SETTLE", "False"), tmp_path)
    assert "forward failed" in rank0, rank0
