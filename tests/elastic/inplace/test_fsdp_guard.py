"""FSDP2's collectives record a lost peer instead of raising in the script's forward and
backward (``elastic.inplace.fsdp_guard``), for a model sharded across every node.

Real processes, a real gloo world of 4 under plain env:// (2 "nodes" x 2 ranks), an FSDP2
model over a 1-D mesh across all four with the run's timed collectives under the guard.
Rank 3 dies (its process exits, its sockets close) before the forward of step 3. The three
left run that step's forward and ``loss.backward()`` to their end without an exception, the
failure recorded once; the steps before it trained normally, and the guard never touched
them (the parameters equal those of an unguarded model trained beside it)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.elastic import test_replica_check as ddp
from tests.support.spawn import python

SCRIPT = textwrap.dedent('''\
    import os, types
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from elastic.inplace.fsdp_guard import guard
    from elastic.metrics.fsdp_timing import time_fsdp_collectives

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 30), nn.ReLU(), nn.Linear(30, 5))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    guarded, plain = build(), build()
    time_fsdp_collectives(guarded[0], "gloo")  # the run's timed comms, kept inside the guard
    sink = types.SimpleNamespace(failure=None)
    assert guard(guarded[0], sink) == 2 and guard(guarded[0], sink) == 2  # the two Linear blocks, once each
    g = torch.Generator().manual_seed(1)
    for step in (1, 2, 3):
        x = torch.randn(8, 16, generator=g)[rank * 2:rank * 2 + 2]
        if step == 3:
            for p, q in zip(guarded[0].parameters(), plain[0].parameters()):
                assert torch.equal(p.to_local(), q.to_local())
            print(f"TRAINED {rank} 2 steps alike", flush=True)
            if rank == 3:
                os._exit(9)  # its sockets close: the others' next collective fails
        for model, optimizer in ((guarded,) if step == 3 else (guarded, plain)):
            optimizer.zero_grad()
            model(x).square().mean().backward()  # raises here without the guard
            if sink.failure is None:
                optimizer.step()
    print(f"RECORDED {rank} {sink.failure is not None}", flush=True)
    os._exit(0)  # the world is broken: nothing to leave cleanly
''')


@pytest.mark.slow
def test_a_peer_lost_in_fsdp2s_own_collectives_is_recorded_not_raised_in_the_scripts_forward_and_backward(
        tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    store = dist.TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False)
    procs = []
    for rank in range(4):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": str(rank),
               "WORLD_SIZE": "4", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ddp.ROOT),
               "TORCHELASTIC_USE_AGENT_STORE": "True"}
        procs.append(python([str(tmp_path / "job.py")], out / f"rank{rank}.log", env=env, cwd=out))
    try:
        for p in procs:
            p.wait(timeout=240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    said = {rank: (out / f"rank{rank}.log").read_text() for rank in range(4)}
    assert [p.returncode for p in procs] == [0, 0, 0, 9], said
    for rank in range(3):
        assert f"TRAINED {rank} 2 steps alike" in said[rank] and f"RECORDED {rank} True" in said[rank], said[rank]
        assert "Traceback" not in said[rank], said[rank]
