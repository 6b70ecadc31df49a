"""A NaN in one replica, and a training that truly diverges, under real agents (``elastic local``).

The script is a plain DDP loop (its own process group, a set-up barrier, a metric
all-reduce per epoch, its state in loop locals, rank 0 prints) with the prepare lines.
The fault is what ``elastic inject-sdc node-1 --nan`` writes, a NaN over element 0 of the
first parameter of one node's worker, written by the script itself after a given step so
that the run is reproducible (the request path is tested in test_check_command.py).

Before, with the replica check every 10 steps, the NaN reached every replica through the
next gradient all-reduce; the check then saw every replica non-finite ("training
diverged ... nothing is rolled back"), the job trained to its end in NaN and exited 0, and
every snapshot it kept held NaN. Now the step whose gradients the NaN made non-finite is
not applied, the NaN replica is healed from the other where it stands, and the job ends
with exit 0 and the model of an undisturbed run, bitwise, on both ranks. A loss that goes
infinite at a given step on every rank is a true divergence: the step is computed again
once, then the job ends with exit 1 and the one line saying so, and its newest snapshot is
the last finite state.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from agent.node.proctree import kill_tree
from checkpoints import SnapshotStore
from checkpoints.tree import iter_tensors

ROOT = Path(__file__).resolve().parents[2]
STEPS_PER_EPOCH, EPOCHS = 24, 2  # 384 samples, 8 per rank, 2 ranks

SCRIPT = textwrap.dedent('''\
    import logging, os
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from elastic.jobs.mlp import SyntheticClassification, as_batch
    from elastic.consistency.inject import poison  # the fault: what `elastic inject-sdc --nan` writes
    import elastic                                                                    # added

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    dist.barrier()  # the script's own set-up collective
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = SyntheticClassification(384, seed=1)
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler, collate_fn=as_batch)
    ft = elastic.Elastic(seed=3, snapshots=elastic.SnapshotConfig(every_steps=5))  # added
    model, optimizer, loader = ft.prepare(model, optimizer, loader)                   # added
    node = os.environ["ELASTIC_NODE_NAME"]
    nan_at, nan_on = int(os.environ.get("NAN_AT", "0")), os.environ.get("NAN_ON")
    inf_at = int(os.environ.get("INF_AT", "0"))
    poisoned = False
    for epoch in ft.epochs(2):                                                        # was: range(2)
        sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if ft.step_count + 1 == inf_at:  # every rank: the training itself goes infinite at this step
                loss = loss * float("inf")
            loss.backward()
            if optimizer.step():
                total, batches = total + float(loss.detach()), batches + 1
                if ft.step_count == nan_at and node == nan_on and not poisoned:
                    poisoned = True
                    poison(optimizer.param_groups[0]["params"][0], "nan")
                    print(f"NAN written into {node}'s first parameter after step {nan_at}", flush=True)
        mean = torch.tensor([total, batches], dtype=torch.float64)
        dist.all_reduce(mean)  # the script's metric all-reduce
        if dist.get_rank() == 0:
            print(f"epoch {epoch} mean loss {mean[0] / max(1.0, float(mean[1])):.4f}", flush=True)
    torch.save({"params": [p.detach().clone() for p in optimizer.param_groups[0]["params"]],
                "optimizer": optimizer.state_dict(), "step": ft.step_count},
               os.path.join(os.environ["OUT"], f"final-{dist.get_rank()}.pt"))
''')


def _start(tmp: Path, tag: str, **env: str) -> tuple[subprocess.Popen[str], Path]:
    """``elastic local --nodes 2`` running the script, its run directory ``tmp/tag``."""
    run = tmp / tag
    out = tmp / f"{tag}-out"
    out.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "local", "--nodes", "2", "--faults", "0", "--timeout", "300",
         "--run-dir", str(run), str(tmp / "train.py")],
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


def _assert_equal(a: object, b: object, where: str) -> None:
    ta, tb = iter_tensors(a), iter_tensors(b)
    assert len(ta) == len(tb) > 0, where
    for x, y in zip(ta, tb):
        assert torch.isfinite(x).all() or not x.is_floating_point(), f"{where}: non-finite values"
        assert torch.equal(x, y), f"{where}: differs from the undisturbed run"


@pytest.mark.slow
@pytest.mark.timeout(800)
def test_a_nan_in_one_replica_is_healed_at_its_step_and_the_model_is_an_undisturbed_runs(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    reference, ref_run = _start(tmp_path, "ref")
    ref_output = _finish(reference)
    assert reference.returncode == 0, ref_output[-4000:] + _logs(ref_run)[-4000:]
    nan, nan_run = _start(tmp_path, "nan", NAN_AT="23", NAN_ON="node-1")
    output = _finish(nan)
    logs = _logs(nan_run)
    assert nan.returncode == 0, output[-4000:] + logs[-6000:]
    assert "NAN written into node-1's first parameter after step 23" in logs, logs[-4000:]
    named = [line for line in logs.splitlines() if "non-finite values in one replica at step 23" in line]
    assert named and "node node-1 (rank" in named[0] and "(0 steps lost)" in named[0], logs[-6000:]
    assert "diverged" not in logs and "returns to step" not in logs, logs[-6000:]
    assert "nan" not in " ".join(line for line in logs.splitlines() if "mean loss" in line), logs[-4000:]
    for rank in range(2):
        final = _final(tmp_path, "nan", rank)
        assert final["step"] == STEPS_PER_EPOCH * EPOCHS, final["step"]
        _assert_equal(final, _final(tmp_path, "ref", 0), f"rank {rank}")


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_true_divergence_ends_the_job_non_zero_in_one_line_keeping_the_last_finite_snapshot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    proc, run = _start(tmp_path, "inf", INF_AT="33")
    output = _finish(proc)
    logs = _logs(run)
    assert proc.returncode == 1, output[-4000:] + logs[-6000:]
    errors = [line for line in logs.splitlines() if line.startswith("error: training diverged at step 33")]
    assert len(errors) == 1, logs[-6000:]
    assert "every replica stands at step 32, the last finite agreed state" in errors[0], errors[0]
    assert "ELASTIC_SKIP_NONFINITE=1" in errors[0] and "Traceback" not in logs, logs[-6000:]
    assert "computed again once" in logs, logs[-6000:]  # the recompute came first
    last = [line for line in output.splitlines() if line.strip()][-1]
    assert "training diverged at step 33" in last, output[-4000:]
    # the snapshots kept: the newest is the last finite state, and none holds a NaN or an Inf
    monkeypatch.setenv("ELASTIC_RDZV_HMAC_KEY_FILE", str(run / "rdzv.key"))
    store = SnapshotStore(run / "snapshots", create=False)
    kept = store.list()
    assert kept and kept[-1].step == 32, [s.step for s in kept]
    for info in kept:
        state = store.load(info)
        assert all(torch.isfinite(t).all() for t in iter_tensors(state) if t.is_floating_point()), info.step
