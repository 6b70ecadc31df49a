"""Deterministic errors fail fast: one line, exit 2, no restart.

An error that would come back at every start is not worth ``--max-restarts`` tracebacks:

* a training script that is not there: ``elastic agent`` says so before it starts
  anything (no etcd registration, no worker), exit 2;
* ``ElasticRun`` in a user's own script, started on another model's snapshot directory:
  one ``error:`` line from rank 0, every rank exits 2 after one start, the agent does not
  restart them and exits 2 too, and no file in the snapshot directory is deleted or changed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest

from agent.etcd import EmbeddedEtcd, EtcdClient
from agent.local.local_node import AUTO_METRICS_PORT
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until

AGENT = [sys.executable, "-m", "agent.cli", "agent"]

# A user's script: its own model (WIDTH wide), ElasticRun, a loop. Each start is noted.
SCRIPT = textwrap.dedent('''\
    import os
    with open(os.environ["STARTS"], "a") as f:
        f.write(f"{os.environ.get('RANK', '0')} {os.getpid()}\\n")
    import torch
    from torch import nn
    from torch.nn import functional as F
    import elastic
    from elastic.jobs.mlp import SyntheticClassification, as_batch

    width = int(os.environ["WIDTH"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 4))
    run = elastic.ElasticRun(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                             SyntheticClassification(256, seed=1), global_batch_size=16, steps=4,
                             snapshot_dir=os.environ["SNAPSHOTS"], snapshots=elastic.SnapshotConfig(every_steps=2),
                             data=elastic.DataConfig(collate_fn=as_batch))
    for x, y in run:
        run.step(F.cross_entropy(run.model(x), y))
''')


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ELASTIC_", "PET_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("target", "says"), [
    (["train.py"], "training script train.py (in {cwd}): no such file"),
    (["scripts"], "training script scripts (in {cwd}) is a directory with no __main__.py"),
    (["-m", "no_such_package_here.train"], "-m no_such_package_here.train: no module named no_such_package_here"),
], ids=["missing-script", "directory", "missing-module"])
def test_a_target_that_cannot_start_is_one_line_and_exit_2_before_anything_starts(
    target: list[str], says: str, etcd_server: EmbeddedEtcd, etcd_client: EtcdClient, run_id: str, tmp_path: Path
) -> None:
    (tmp_path / "scripts").mkdir()
    (tmp_path / "tmp").mkdir()
    began = time.monotonic()
    done = subprocess.run([*AGENT, "--nnodes", "1:1", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run_id,
                           "--metrics-port", "0", "--max-restarts", "3", *target],
                          cwd=tmp_path, env=clean_env(TMPDIR=str(tmp_path / "tmp")), capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.splitlines() == error_lines(done.stderr), done.stderr  # that line and nothing else
    [line] = error_lines(done.stderr)
    assert line.startswith("error: " + says.format(cwd=tmp_path)), line
    assert time.monotonic() - began < 60
    # nothing started: the agent never registered in etcd, and left no directory behind
    assert not list(etcd_client.call(lambda c: list(c.get_prefix(f"/elastic/{run_id}/")))), "the agent joined etcd"
    assert list((tmp_path / "tmp").iterdir()) == [], "the agent left its temporary directory"


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "restart-path"])
def test_elastic_run_on_another_models_snapshots_is_one_line_exit_2_and_no_restart(
    in_place: bool, etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script, snapshots, starts = tmp_path / "train.py", tmp_path / "snapshots", tmp_path / "starts"
    script.write_text(SCRIPT)
    made = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=clean_env(WIDTH="32", SNAPSHOTS=str(snapshots), STARTS=str(tmp_path / "first")))
    assert made.returncode == 0, made.stderr  # a world of one, as on a laptop: the other model's snapshots
    before = digest(snapshots)
    assert [p.name for p in snapshots.iterdir() if p.name.startswith("step-")], before

    node = nodes(name="a", endpoint=etcd_server.endpoint, run_id=run_id, script=str(script), nnodes="1:1",
                 nproc_per_node=2, max_restarts=3, metrics_port=AUTO_METRICS_PORT,
                 env={"WIDTH": "64", "SNAPSHOTS": str(snapshots), "STARTS": str(starts), "OMP_NUM_THREADS": "1"},
                 agent_args=["--lease-ttl", "2", *([] if in_place else ["--no-in-place"])])
    wait_until(lambda: not node.alive(), 120, "the agent to give up", on_timeout=lambda: node.log_tail(60))
    log = node.log_path.read_text(errors="replace")
    assert node.process is not None and node.process.returncode == 2, node.log_tail(60)
    assert "Traceback (most recent call last)" not in log, node.log_tail(80)
    [line] = error_lines(log)
    assert line.startswith("error: snapshot model does not match this model: shape mismatch 0.weight"), line
    assert "exited with code 2" in log and "not restarting" in log, node.log_tail(30)
    ranks = sorted(row.split()[0] for row in starts.read_text().splitlines())
    assert ranks == ["0", "1"], f"each rank should have started exactly once: {ranks}"
    after = digest(snapshots)
    assert {name: after.get(name) for name in before} == before, "a file of the other model's snapshots changed"
    # the one thing written: rank 0 stands the job's fence before it reads (checkpoints/fence.py)
    assert set(after) - set(before) <= {".fence", ".fence.lock"}, sorted(set(after) - set(before))
