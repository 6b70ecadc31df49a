"""HSDP's mesh re-formed in the same processes (:mod:`elastic.inplace.hsdp`), four real gloo
processes on torch's reconfigurable default group, no agent: 2 nodes x 2 local ranks train;
node 1 is SIGKILLed; node 0's ranks notice it in the replicate all-reduce of their backward
(recorded, not raised), apply nothing of that step, re-form as 1 x 2 and train on. Every
step's parameters equal a plain model's trained on the mean gradient of the same batches."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.pair import run_ranks

SCRIPT = """\
import os, signal, sys, time
from datetime import timedelta
from types import SimpleNamespace
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from elastic.inplace import reconfigure as rc
from elastic.inplace.hsdp import HsdpInPlace

rank, port = int(sys.argv[1]), int(sys.argv[2])
t = timedelta(seconds=30)
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False, timeout=t)
rc.init_group("gloo", store, stable_rank=rank, stable_ranks=4, timeout=t)
store.set(f"a{rank}", rc.handle())
rc.reconfigure(1, [store.get(f"a{r}").decode() for r in range(4)], rc.reconfigure_timeout("gloo", t))

def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
model = build()
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
plain = build()
plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
takeover = HsdpInPlace(model, 2)
takeover.rebuild(SimpleNamespace(world_size=4))

def batch(step, r):
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)

def reference(step, world):
    plain_opt.zero_grad()
    for r in range(world):
        x, y = batch(step, r)
        (F.cross_entropy(plain(x), y) / world).backward()
    plain_opt.step()

def compare(step):
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        full = p.full_tensor()
        assert torch.allclose(full, q, atol=1e-5), (step, name, (full - q).abs().max())

def train(step, world):
    opt.zero_grad()
    x, y = batch(step, dist.get_rank())
    F.cross_entropy(model(x), y).backward()
    failure = takeover.take_failure()
    if failure is not None:
        return failure
    opt.step()
    reference(step, world)
    compare(step)

for step in range(3):
    assert train(step, 4) is None

if rank >= 2:  # node 1 is lost
    store.set(f"dead{rank}", str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)

def gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True

pids = [int(store.get(f"dead{r}").decode()) for r in (2, 3)]
deadline = time.monotonic() + 30
while not all(gone(p) for p in pids):
    assert time.monotonic() < deadline, "node 1 did not die"
    time.sleep(0.01)
before = [p.to_local().clone() for p in model.parameters()]
failure = train(3, 4)
assert failure is not None, "the lost node went unnoticed"
print("noticed", failure, flush=True)
assert all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters())), "the failed step was applied"

store.set(f"b{rank}", rc.handle())
rc.reconfigure(2, [store.get(f"b{r}").decode() for r in range(2)], rc.reconfigure_timeout("gloo", t))
takeover.rebuild(SimpleNamespace(world_size=2))
assert mesh.shape == (1, 2) and model[0].weight.device_mesh is mesh, mesh
for step in range(3, 6):
    assert train(step, 2) is None
print("rank", rank, "trained on at 1 x 2", flush=True)
"""


@pytest.mark.slow  # starts four processes
def test_a_lost_node_shrinks_the_replicate_dimension_in_place_and_the_failed_step_is_not_applied(
        tmp_path: Path) -> None:
    outs = run_ranks(SCRIPT, tmp_path, [0, 0, -9, -9], timeout=120)
    for rank in (0, 1):
        assert "noticed" in outs[rank], outs[rank]
        assert f"rank {rank} trained on at 1 x 2" in outs[rank], outs[rank]
