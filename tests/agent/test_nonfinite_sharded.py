"""A non-finite gradient in a sharded model (FSDP2 ``fully_shard``), under real agents.

The scripts are written as FSDP2's docs write them (``init_device_mesh``, ``fully_shard`` per
layer and on the root, AdamW after sharding) plus the prepare lines, with a set-up barrier
and a metric all-reduce of their own, their state in loop locals, rank 0 printing.

HSDP on a 2-D mesh (2 nodes x 2 local ranks): a NaN written into node-1's local rank 0's
shard of the first parameter after step 11 (what ``elastic inject-sdc --nan`` writes, by the
script itself so that the run is reproducible). Before, a sharded model's gradients were
never looked at: the NaN reached both replicas through the next all-reduce and Adam applied
it, the job trained to its end in NaN and exited 0. Now the step is not applied, the replicas
vote, the NaN shard is healed from the other replica's, and the job ends with exit 0 and the
model of an undisturbed run, bitwise, on every rank.

FSDP2 over a 1-D mesh (2 nodes, no replica of any shard): a loss gone infinite on one node
once, at step 5, is a transient fault: the step is computed again and the job goes on; a loss
infinite at every try of step 12 is a true divergence: the job ends with exit 1 and one line,
and its newest snapshot is step 11, the last finite state. Before, the job trained on in NaN.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from agent.node.proctree import kill_tree
from checkpoints import SnapshotStore
from checkpoints.reading import DCP_DIR_KEY

ROOT = Path(__file__).resolve().parents[2]

COMMON = '''\
    import logging, os
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from elastic.consistency.inject import poison  # the fault: what `elastic inject-sdc --nan` writes
    import elastic                                                                    # added

    class Data(torch.utils.data.Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(3)
            self.x, self.y = torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)
        def __len__(self): return len(self.x)
        def __getitem__(self, i): return self.x[i], self.y[i]

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    dist.barrier()  # the script's own set-up collective
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    if local > 1:  # HSDP: replicas across nodes, shards inside one
        mesh = init_device_mesh("cpu", (dist.get_world_size() // local, local), mesh_dim_names=("replicate", "shard"))
    else:  # FSDP across every node
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(Data(256), batch_size=int(os.environ["BATCH"]))
    ft = elastic.Elastic(seed=3, snapshots=elastic.SnapshotConfig(every_steps=5))    # added
    model, optimizer, loader = ft.prepare(model, optimizer, loader)                   # added
    node, rank = os.environ["ELASTIC_NODE_NAME"], dist.get_rank()
    nan_at, nan_on = int(os.environ.get("NAN_AT", "0")), os.environ.get("NAN_ON")
    once_at, once_on = int(os.environ.get("INF_ONCE_AT", "0")), os.environ.get("INF_ONCE_ON")
    inf_at = int(os.environ.get("INF_AT", "0"))
    poisoned = once = False
    for epoch in ft.epochs(2):                                                        # was: range(2)
        total, batches = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if ft.step_count + 1 == once_at and node == once_on and not once:  # one node's compute, once
                once = True
                loss = loss * float("inf")
            if ft.step_count + 1 == inf_at:  # every rank, every try: the training itself goes infinite
                loss = loss * float("inf")
            loss.backward()
            if optimizer.step():
                total, batches = total + float(loss.detach()), batches + 1
                if ft.step_count == nan_at and node == nan_on and os.environ["LOCAL_RANK"] == "0" and not poisoned:
                    poisoned = True
                    poison(optimizer.param_groups[0]["params"][0].to_local(), "nan")
                    print(f"NAN written into rank {rank}'s shard of the first parameter after step {nan_at}", flush=True)
        mean = torch.tensor([total, batches], dtype=torch.float64)
        dist.all_reduce(mean)  # the script's metric all-reduce
        if rank == 0:
            print(f"epoch {epoch} mean loss {mean[0] / max(1.0, float(mean[1])):.4f}", flush=True)
    shards = [p.detach().to_local().clone() for p in optimizer.param_groups[0]["params"]]
    moments = [v.to_local().clone() for s in optimizer.state.values() for k, v in sorted(s.items()) if k != "step"]
    torch.save({"params": shards, "moments": moments, "step": ft.step_count},
               os.path.join(os.environ["OUT"], f"final-{rank}.pt"))
'''
SCRIPT = textwrap.dedent(COMMON)


def _start(tmp: Path, tag: str, nodes: int, nproc: int, **env: str) -> tuple[subprocess.Popen[str], Path]:
    """``elastic local`` running the script, its run directory ``tmp/tag``."""
    run, out = tmp / tag, tmp / f"{tag}-out"
    out.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "local", "--nodes", str(nodes), "--nproc-per-node", str(nproc),
         "--faults", "0", "--timeout", "300", "--run-dir", str(run), str(tmp / "train.py")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, cwd=tmp,
        env={**base, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "200",
             "ELASTIC_CHECK_EVERY_STEPS": "10", "OUT": str(out), **env})
    return proc, run


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        output, _ = proc.communicate(timeout=360)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait(timeout=30)
    return output


def _logs(run: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(run.glob("node-*.log")))


def _final(tmp: Path, tag: str, rank: int) -> dict[str, object]:
    return torch.load(tmp / f"{tag}-out" / f"final-{rank}.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.timeout(800)
def test_hsdp_a_nan_in_one_replicas_shard_is_healed_at_its_step_and_the_model_is_an_undisturbed_runs(
        tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    reference, ref_run = _start(tmp_path, "ref", nodes=2, nproc=2, BATCH="4")
    ref_output = _finish(reference)
    assert reference.returncode == 0, ref_output[-4000:] + _logs(ref_run)[-4000:]
    nan, nan_run = _start(tmp_path, "nan", nodes=2, nproc=2, BATCH="4", NAN_AT="11", NAN_ON="node-1")
    output = _finish(nan)
    logs = _logs(nan_run)
    assert nan.returncode == 0, output[-4000:] + logs[-6000:]
    written = re.search(r"NAN written into rank (\d)'s shard of the first parameter after step 11", logs)
    assert written, logs[-4000:]
    poisoned = int(written.group(1))  # node-1's local rank 0: rank 0 or 2, as the round ordered the nodes
    named = [line for line in logs.splitlines() if "non-finite values in one replica at step 11" in line]
    assert named and f"node node-1 (rank {poisoned}" in named[0] and "(0 steps lost)" in named[0], logs[-6000:]
    assert f"healed step 11 from rank {2 - poisoned}" in logs, logs[-6000:]  # node-0's local rank 0
    assert "diverged" not in logs and "returns to step" not in logs and "Traceback" not in logs, logs[-6000:]
    assert "nan" not in " ".join(line for line in logs.splitlines() if "mean loss" in line), logs[-4000:]
    for rank in range(4):
        got, want = _final(tmp_path, "nan", rank), _final(tmp_path, "ref", rank)
        assert got["step"] == want["step"] == 32, (got["step"], want["step"])
        for key in ("params", "moments"):
            ours, theirs = got[key], want[key]
            assert isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs) > 0
            for a, b in zip(ours, theirs):
                assert torch.isfinite(a).all() and torch.equal(a, b), f"rank {rank} {key}: differs from the undisturbed run"


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_fsdp_without_replicas_recomputes_a_transient_fault_and_stops_a_true_divergence_at_the_last_finite_snapshot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    proc, run = _start(tmp_path, "inf", nodes=2, nproc=1, BATCH="8", INF_ONCE_AT="5", INF_ONCE_ON="node-1",
                       INF_AT="12")
    output = _finish(proc)
    logs = _logs(run)
    assert proc.returncode == 1, output[-4000:] + logs[-6000:]
    recomputed = [line for line in logs.splitlines() if "computed again once" in line]
    assert len(recomputed) == 2, logs[-6000:]  # the transient fault at step 5, the first try of step 12
    assert "step 5: non-finite gradients" in recomputed[0], recomputed[0]
    assert "step 12: non-finite gradients" in recomputed[1], recomputed[1]
    errors = [line for line in logs.splitlines() if line.startswith("error: training diverged at step 12")]
    assert len(errors) == 1, logs[-6000:]
    assert "the model stands at step 11, the last finite state" in errors[0], errors[0]
    assert "Traceback" not in logs, logs[-6000:]
    last = [line for line in output.splitlines() if line.strip()][-1]
    assert "training diverged at step 12" in last, output[-4000:]
    # the snapshots kept: the newest is the last finite state (each rank wrote its own shards), none holds a NaN
    monkeypatch.setenv("ELASTIC_RDZV_HMAC_KEY_FILE", str(run / "rdzv.key"))
    store = SnapshotStore(run / "snapshots", create=False)
    kept = store.list()
    assert kept and kept[-1].step == 11, [s.step for s in kept]
    for info in kept:
        plain = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        target = {"model": plain.state_dict()}
        dcp.load(target, checkpoint_id=str(store.load(info)[DCP_DIR_KEY]))
        assert all(torch.isfinite(t).all() for t in target["model"].values()), info.step
