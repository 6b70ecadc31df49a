"""Silent data corruption: one bit flipped in one replica is found, named, and undone.

Real processes, a real gloo world (3 and 2 ranks, each its own "node" by name), a real
training loop with Adam and dropout. A script flips one bit of one rank's parameter, Adam
second moment or registered tensor right after a committed step; the replica check (every
4 steps) must name that node (both, with 2 replicas), return every replica to the last
agreed state and retrain the steps since, so that the final model and optimizer state are
bitwise those of an undisturbed run at the same world size, on every rank.
"""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest
import torch

import torch.distributed as dist

from tests.elastic.trainer_support import assert_state_equal, read_jsonl
from tests.support.spawn import Process, python

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY = 22, 4

SCRIPT = textwrap.dedent('''\
    import json, logging, os
    import torch
    from torch import nn
    from torch.nn import functional as F
    from elastic import DataConfig, ElasticRun, SnapshotConfig
    from elastic.consistency.inject import flip_bit, poison, target
    from elastic.jobs.mlp import SyntheticClassification, as_batch

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 4))
    run = ElasticRun(model, torch.optim.Adam(model.parameters(), lr=1e-2), SyntheticClassification(96, seed=1),
                     global_batch_size=12, steps=int(os.environ["STEPS"]), snapshot_dir=os.environ["SNAPSHOTS"],
                     snapshots=SnapshotConfig(every_steps=0, ledger=os.environ["LEDGER"]),
                     data=DataConfig(collate_fn=as_batch), seed=3,
                     check_every_steps=int(os.environ["EVERY"]))
    ema = run.register("ema", torch.zeros(4))
    if os.environ.get("LOCAL_STATE"):  # rank-local by design: found so once, then no longer compared
        run.register("mine", {"rank": run.rank})
    node = os.environ["ELASTIC_NODE_NAME"]
    flips = json.loads(os.environ.get("FLIPS", "[]"))  # [step, node, what], each done once
    done = set()
    inf_at, inf_on, inf_every = (os.environ.get("INF_LOSS") or "0::").split(":")  # step, node or *, every try?
    infinite = 0
    for x, y in run:
        loss = F.cross_entropy(run.model(x), y)
        if run.step_count + 1 == int(inf_at) and inf_on in ("*", node) and (inf_every or not infinite):
            infinite += 1  # this rank's loss goes infinite at that step: once (a transient fault), or every try
            loss = loss * float("inf")
        if run.step(loss):
            with torch.no_grad():
                ema.mul_(0.9).add_(run.model.module[-1].bias, alpha=0.1)
            for i, (step, on, what) in enumerate(flips):
                if i not in done and run.step_count == step and on == node:
                    done.add(i)
                    if what == "kept copy too":  # the host copy of the last agreed state goes bad as well
                        flip_bit(run.replica_check.agreed.state["model"]["0.bias"], 1, 9)
                        what = "0.bias"
                    kind, _, what = what.rpartition(":")  # "nan:0.weight": a NaN written, not a bit flipped
                    t = ema if what == "registered" else target(run.state.module, run.optimizer, what)
                    poison(t, kind or "bit", 3)
                    print(f"FLIPPED {what} on {node} after step {step}", flush=True)
    torch.save({"model": run.state.module.state_dict(), "optimizer": run.optimizer.state_dict(), "ema": ema},
               os.environ["OUT"] + f"/final-{run.rank}.pt")
''')


def _world(tmp: Path, tag: str, world: int, flips: str,
           stores: list[dist.TCPStore], **extra: str) -> list[Process]:
    """``world`` worker processes, nodes ``{tag}0..``: a gloo world under plain env:// (no agent).

    The world's store is hosted here on a port the kernel picks, read back, and every rank is
    its client (torch's agent-store mode): a port found free and handed to rank 0 to bind was
    taken in between once (EADDRINUSE)."""
    out = tmp / tag
    out.mkdir()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    stores.append(store)  # lives until the test ends
    port = store.port
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "ELASTIC_NODE_NAME": f"{tag}{rank}",
               "OMP_NUM_THREADS": "1", "STEPS": str(STEPS), "EVERY": str(EVERY), "FLIPS": flips,
               "SNAPSHOTS": str(out / "snapshots"), "LEDGER": str(out / "ledger.jsonl"), "OUT": str(out),
               "PYTHONPATH": str(ROOT), "TORCHELASTIC_USE_AGENT_STORE": "True", **extra}
        env.pop("ELASTIC_HEARTBEAT_DIR", None)
        procs.append(python([str(tmp / "job.py")], out / f"rank{rank}.log", env=env, cwd=out))
    return procs


def _wait(procs: list[Process], tmp: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    logs = "\n".join(f.read_text() for f in sorted(tmp.glob("*/rank*.log")))
    assert codes == [0] * len(procs), f"exit codes {codes}\n{logs[-6000:]}"


def _final(tmp: Path, tag: str, rank: int) -> dict[str, object]:
    return torch.load(tmp / tag / f"final-{rank}.pt", weights_only=True)


def _log(tmp: Path, tag: str) -> str:
    return "\n".join(f.read_text() for f in sorted((tmp / tag).glob("rank*.log")))


@pytest.mark.slow
def test_flipped_bits_are_named_rolled_back_and_retrained_bitwise(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(SCRIPT)
    # 3 replicas: a parameter (right after a check's step: the longest rollback), an Adam
    # second moment, a registered tensor; 2 replicas: a parameter. References undisturbed.
    three = ('[[9, "c1", "0.weight"], [13, "c2", "3.weight.exp_avg_sq"], [18, "c1", "registered"], '
             '[21, "c2", "kept copy too"]]')
    stores: list[dist.TCPStore] = []
    runs = {"r": _world(tmp_path, "r", 3, "[]", stores), "c": _world(tmp_path, "c", 3, three, stores),
            "p": _world(tmp_path, "p", 2, "[]", stores, LOCAL_STATE="1"),
            "d": _world(tmp_path, "d", 2, '[[9, "d1", "0.bias"]]', stores, LOCAL_STATE="1")}
    for procs in runs.values():
        _wait(procs, tmp_path)

    chaos = _log(tmp_path, "c")
    assert chaos.count("FLIPPED") == 4, chaos[-3000:]
    named = [line for line in chaos.splitlines() if "silent data corruption at step" in line]
    assert len(named) == 4, chaos[-4000:]
    assert "at step 12: node c1 (rank 1; differs in 0.weight" in named[0], named[0]
    assert "returns to step 8" in named[0] and "retrains 4 step(s)" in named[0], named[0]
    assert "at step 16: node c2 (rank 2; differs in " in named[1] and "3.weight.exp_avg_sq" in named[1], named[1]
    assert "at step 20: node c1 (rank 1; differs in registered 'ema'" in named[2], named[2]
    # after the last step, the run's end checks: c2's live state and its kept copy both
    # changed, so it is healed from a majority replica after the rollback
    assert "at step 22: node c2 (rank 2; differs in 0.bias" in named[3] and "returns to step 20" in named[3]
    assert "healed step 20 from rank 0: this rank's copy of it had changed" in chaos, chaos[-3000:]
    for rank in range(3):
        assert_state_equal(_final(tmp_path, "c", rank), _final(tmp_path, "r", 0), f"3 replicas, rank {rank}")

    # 2 replicas, each registering a rank-local value: the first check differs (step 4), the
    # retrain differs the same way, so that entry is dropped from the check (said once);
    # the flip after step 9 is then found at step 12, both nodes named.
    for tag in ("p", "d"):
        said = _log(tmp_path, tag)
        assert said.count("differ by design") == 0 and said.count("state that differs between ranks by design") == 1
        assert "registered 'mine'['rank']" in said, said[-3000:]
    two = _log(tmp_path, "d")
    named = [line for line in two.splitlines() if "silent data corruption at step" in line]
    assert len(named) == 2 and "at step 12: replicas disagree and no majority decides; node d0 (rank 0) and node " \
        "d1 (rank 1) are all suspects (differing: 0.bias" in named[1], two[-3000:]
    for rank in range(2):
        assert_state_equal(_final(tmp_path, "d", rank), _final(tmp_path, "p", 0), f"2 replicas, rank {rank}")

    # exactly once: the retrained steps' ledger lines supersede the first ones
    rows = read_jsonl(tmp_path / "c" / "ledger.jsonl")
    ref = {r["step"]: r["samples"] for r in read_jsonl(tmp_path / "r" / "ledger.jsonl")}
    latest = {r["step"]: r["samples"] for r in rows}
    assert latest == ref and len(rows) > len(ref)


@pytest.mark.slow
def test_a_non_finite_replica_is_named_and_healed_where_it_stands_losing_no_step(tmp_path: Path) -> None:
    """A NaN (then an Inf in Adam's second moment) written into one of two replicas just
    before a check: the finite replica is right, the other is named and healed from it
    where it stands, no step retrained. A NaN written between checks would reach every
    replica through the next gradient all-reduce (it was found as "training diverged" and
    trained on in NaN): the step whose gradients it made non-finite is not applied, the
    replicas vote at once, and the NaN replica is healed from the other and the step
    trained again. Both end bitwise equal to an undisturbed run, on every rank."""
    (tmp_path / "job.py").write_text(SCRIPT)
    stores: list[dist.TCPStore] = []
    runs = {"q": _world(tmp_path, "q", 2, "[]", stores),
            "n": _world(tmp_path, "n", 2, '[[12, "n1", "nan:0.weight"], [16, "n0", "inf:3.weight.exp_avg_sq"]]',
                        stores),
            "v": _world(tmp_path, "v", 2, '[[9, "v1", "nan:0.weight"]]', stores)}
    for procs in runs.values():
        _wait(procs, tmp_path)

    said = _log(tmp_path, "n")
    named = [line for line in said.splitlines() if "in one replica at step" in line]
    assert len(named) == 2 and "silent data corruption at step" not in said, said[-4000:]
    assert ("non-finite values in one replica at step 12: node n1 (rank 1; non-finite values in 0.weight) "
            "disagrees with the majority of 1 of 2 replicas; no non-finite gradient was applied") in named[0], named[0]
    assert "healed from it at step 12 and training goes on (0 steps lost)" in named[0], named[0]
    assert "at step 16: node n0 (rank 0; non-finite values in 3.weight.exp_avg_sq)" in named[1], named[1]
    assert "returns to step" not in said and "diverged" not in said, said[-4000:]
    for rank in range(2):
        assert_state_equal(_final(tmp_path, "n", rank), _final(tmp_path, "q", 0), f"non-finite, rank {rank}")

    said = _log(tmp_path, "v")
    named = [line for line in said.splitlines() if "in one replica at step" in line]
    assert len(named) == 1 and "at step 9: node v1 (rank 1; non-finite values in 0.weight)" in named[0], said[-4000:]
    assert "(0 steps lost)" in named[0] and "healed step 9 from rank 0" in said, said[-4000:]
    assert "diverged" not in said and "returns to step" not in said, said[-4000:]
    for rank in range(2):
        assert_state_equal(_final(tmp_path, "v", rank), _final(tmp_path, "q", 0), f"NaN between checks, rank {rank}")


@pytest.mark.slow
def test_a_transient_non_finite_loss_is_recomputed_and_a_lasting_one_skipped_when_asked(tmp_path: Path) -> None:
    """A loss that goes infinite once on one rank (a transient fault in that node's compute):
    every replica is finite and agrees, so the step is computed again, the line naming the
    node whose loss it was, and the run ends bitwise equal to an undisturbed one. A loss
    infinite at every try on every rank, with ELASTIC_SKIP_NONFINITE=1: computed again once,
    then that batch is skipped (no update for it), and the run trains to its last step."""
    (tmp_path / "job.py").write_text(SCRIPT)
    stores: list[dist.TCPStore] = []
    runs = {"q": _world(tmp_path, "q", 2, "[]", stores),
            "t": _world(tmp_path, "t", 2, "[]", stores, INF_LOSS="14:t1:"),
            "s": _world(tmp_path, "s", 2, "[]", stores, INF_LOSS="14:*:every", ELASTIC_SKIP_NONFINITE="1")}
    for procs in runs.values():
        _wait(procs, tmp_path)

    said = _log(tmp_path, "t")
    again = [line for line in said.splitlines() if "computed again once" in line]
    assert len(again) == 1 and "step 14: non-finite gradients with every replica's state finite and agreeing (the " \
        "loss went non-finite on node t1 (rank 1))" in again[0], said[-4000:]
    assert "skipped" not in said and "diverged" not in said and "in one replica" not in said, said[-4000:]
    for rank in range(2):
        assert_state_equal(_final(tmp_path, "t", rank), _final(tmp_path, "q", 0), f"transient, rank {rank}")

    said = _log(tmp_path, "s")
    assert said.count("computed again once") == 1 and said.count("its batch is skipped") == 1, said[-4000:]
    assert "loss went non-finite on node s0 (rank 0), node s1 (rank 1)" in said, said[-4000:]
    rows = read_jsonl(tmp_path / "s" / "ledger.jsonl")
    assert max(r["step"] for r in rows) == STEPS, rows[-3:]
    for rank in range(2):
        final = _final(tmp_path, "s", rank)
        assert all(torch.isfinite(t).all() for t in final["model"].values()), f"skipped, rank {rank}"
    assert_state_equal(_final(tmp_path, "s", 1), _final(tmp_path, "s", 0), "skipped: the replicas agree")
