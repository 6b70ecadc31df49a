"""Bitwise resume: losing a node mid-run changes nothing in the final model and optimizer.

Two 2-node runs of the mlp job (dropout + AdamW, so RNG and optimizer state matter) with
the same seed: one undisturbed, one whose node ``a`` (rank 0) is SIGKILLed mid-run and
replaced; afterwards the survivor ``b`` is rank 0.
``--nnodes 2:2`` keeps the world at 2, so the survivor waits for the replacement. The final
snapshots (written at the last step) must be bit-identical, every key of them.

Why this holds although rank 0 moved to another node: a rank's data is
fixed by its rank number (contiguous share of the global batch), not by its node; torch's
RNG is reseeded from (seed, step, rank) every step; and gloo reduces in rank order, so the
floating-point summation order is that of the undisturbed run whichever node is rank 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from checkpoints import SnapshotStore
from agent.etcd import EmbeddedEtcd
from tests.elastic.trainer_support import assert_state_equal, start_runner, wait_all_exit, wait_for_step
from tests.support.nodes import TorchrunNode

STEPS = 40


def _args(snapshots: Path) -> list[str]:
    return [
        "--job", "mlp", "--dataset-size", "200", "--global-batch-size", "16", "--steps", str(STEPS),
        "--snapshot-every-steps", "5", "--seed", "7", "--step-sleep", "0.05", "--snapshot-dir", str(snapshots),
    ]


@pytest.mark.slow
def test_node_loss_then_restart_resumes_bit_identically(
    nodes: Callable[..., TorchrunNode], etcd_server: EmbeddedEtcd, run_id: str, tmp_path: Path
) -> None:
    common = dict(endpoint=etcd_server.endpoint, workdir=tmp_path, nnodes="2:2")
    ref_dir, chaos_dir = tmp_path / "snap-ref", tmp_path / "snap-chaos"

    # Both runs at once (separate rendezvous ids and snapshot dirs): wall time, not a dependency.
    ref = [start_runner(nodes, n, run_id=f"{run_id}ref", args=_args(ref_dir), **common) for n in ("ref-a", "ref-b")]
    a, b = (start_runner(nodes, n, run_id=f"{run_id}kill", args=_args(chaos_dir), **common) for n in ("a", "b"))
    wait_for_step(b, 12, a)
    victim, survivor = (a, b) if a.progress()[0]["rank"] == 0 else (b, a)
    killed_at = wait_for_step(survivor, 12, victim)
    first_round = survivor.progress()[0]["round"]
    victim.kill()  # lose rank 0's node: the hardest case, rank 0 moves to another node
    a2 = start_runner(nodes, "a2", run_id=f"{run_id}kill", args=_args(chaos_dir), **common)
    wait_all_exit([*ref, survivor, a2])

    rows = survivor.progress()
    before = [r for r in rows if r["round"] == first_round]
    resumed = [r for r in rows if r["round"] > first_round]
    assert resumed, f"{survivor.name}'s workers never restarted after rank 0's node was killed"
    assert before[-1]["step"] >= killed_at["step"]
    # the restarted worker resumes from a snapshot (or the one SIGTERM wrote): no step skipped
    assert resumed[0]["step"] <= before[-1]["step"] + 1, "the survivor skipped steps"
    # previous members keep their order in the next round: the survivor is now rank 0
    assert {r["rank"] for r in resumed} == {0}, "rank 0 did not move to the surviving node"
    assert max(r["step"] for r in rows) == STEPS and all(r["world_size"] == 2 for r in rows)

    want = SnapshotStore(ref_dir, create=False).load(STEPS)
    got = SnapshotStore(chaos_dir, create=False).load(STEPS)
    assert_state_equal(got["model"], want["model"], "model")
    assert_state_equal(got["optimizer"], want["optimizer"], "optimizer")
    assert_state_equal(got, want)  # sampler, progress and rank 0's RNG too
