"""NCCL path of the comm hook and the loss reader: CUDA events, read without synchronising.

Needs a GPU; skipped on the CPU-only test machines. A world of one NCCL rank is enough to
check what the CPU tests cannot: the events are recorded and later read, the bytes match
the gradient, and the gradients are those of DDP without a hook. Also here: the GPU uuid
a worker puts in ``elastic_rank_info`` is the one DCGM labels that GPU's series with.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                                reason="needs CUDA and NCCL")
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8)).cuda()


def _worker(rank: int, tmp: str) -> None:
    from elastic.metrics import families, register_comm_hook
    from elastic.metrics.training import LossReader

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    plain = DistributedDataParallel(_model(), device_ids=[0])
    hooked = DistributedDataParallel(_model(), device_ids=[0])
    timer = register_comm_hook(hooked, "nccl")
    reader = LossReader()
    readings = []
    same = True
    for step in range(STEPS):
        x = torch.randn(16, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for m in (plain, hooked):
            m.zero_grad()
        plain(x).square().mean().backward()
        loss = hooked(x).square().mean()
        loss.backward()
        readings.append(reader(loss))
        same &= all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), hooked.parameters()))
    torch.cuda.synchronize()
    timer.drain()
    settled = reader(loss)  # the copy enqueued at the last step has landed by now
    registry = families().registry
    labels = {"op": "allreduce", "backend": "nccl"}
    torch.save({
        "same": same, "readings": readings, "settled": settled, "numel": sum(p.numel() for p in hooked.parameters()),
        "bytes": registry.get_sample_value("elastic_collective_bytes_total", labels),
        "count": registry.get_sample_value("elastic_collective_duration_seconds_count", labels),
        "sum": registry.get_sample_value("elastic_collective_duration_seconds_sum", labels),
    }, f"{tmp}/out.pt")
    dist.destroy_process_group()


def test_nccl_buckets_are_timed_with_events_and_gradients_are_unchanged(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=1, join=True)
    r = torch.load(tmp_path / "out.pt")
    assert r["same"], "gradients differ from DDP without a hook"
    assert r["bytes"] == r["numel"] * 4 * STEPS
    assert r["count"] >= STEPS, "every bucket's events were read once the GPU passed them"
    assert r["sum"] > 0
    assert r["readings"][0] is None, "the first loss is still in flight: no synchronising read"
    assert r["settled"] is not None and r["settled"] > 0


_UUID_PROBE = """
import json, torch
from elastic.metrics.rank_info import agent_gpu_uuids, query_gpus
from elastic.metrics.training import cuda_gpu_uuid
print(json.dumps({"torch": cuda_gpu_uuid(torch.device("cuda", 0)), "raw": str(torch.cuda.get_device_properties(0).uuid),
                  "smi": [u for _, u, _ in query_gpus()], "agent": agent_gpu_uuids(1)[0]}))
"""


def test_a_workers_gpu_uuid_is_the_one_dcgm_labels_its_series_with() -> None:
    """torch's bare uuid, prefixed, is nvidia-smi's (= NVML's = DCGM's ``UUID``); the agent,
    which asks nvidia-smi instead of CUDA, names the same GPU for local rank 0. In a fresh
    process, so that this one never initialises CUDA."""
    done = subprocess.run([sys.executable, "-c", _UUID_PROBE], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", got["torch"]), got
    assert got["torch"] == "GPU-" + got["raw"].lower()
    if got["smi"]:  # nvidia-smi is installed wherever the driver is, but a container may lack it
        assert got["torch"] in got["smi"]
        assert got["agent"] in (got["torch"], ""), "the agent named another GPU"  # "": a mixed-model host
