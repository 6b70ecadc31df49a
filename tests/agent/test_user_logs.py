"""What a new user sees in the console when a node dies under their ``ElasticRun`` script.

The script is written here, as a user would write it: ``ElasticRun`` over a small
dataset and no ``logging`` set-up at all. Two real ``elastic agent`` nodes train it; one
is SIGKILLed, tree and all. The survivor's console (its agent's and its worker's output,
as ``elastic agent`` prints them) shows no raw gloo error, no traceback and no DDP
deprecation warning, and says what happened: in place, one line naming the lost node and
saying that nothing restarted; on the restart path (``--no-in-place``), one line from the
worker that its agent restarts it, and the agent's lines naming the lost node, the warm
start, and where the recovery's time went.
"""

from __future__ import annotations

import re
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest

from agent.etcd import EmbeddedEtcd
from tests.elastic.inplace.support import read_rows
from tests.elastic.metrics.scrape import fetch
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until
from agent.local.local_node import AUTO_METRICS_PORT
from tests.support.metrics_url import metrics_url

FORM_TIMEOUT = 120  # cold torch imports on a loaded 2-core machine

USER_SCRIPT = textwrap.dedent('''\
    import json, os, time
    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import TensorDataset
    import elastic

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = TensorDataset(torch.randn(512, 8), torch.randint(0, 2, (512,)))
    rows = open(os.environ["ROWS"], "a") if os.environ.get("LOCAL_RANK", "0") == "0" else None

    def report(info):
        if rows is not None:
            rows.write(json.dumps({"step": info.step, "world": info.world_size, "rank": info.rank,
                                   "time": time.time()}) + "\\n")
            rows.flush()

    run = elastic.ElasticRun(model, optimizer, data, global_batch_size=16, steps=100000,
                             snapshot_dir=os.environ["SNAPSHOTS"], on_step_end=report)
    for x, y in run:
        run.step(F.cross_entropy(run.model(x), y))
        time.sleep(0.02)
''')


def standbys(node: Node) -> float:
    series = fetch(metrics_url(node), timeout=5) or {}
    return sum(v for (name, _labels), v in series.items() if name == "elastic_agent_standby_workers_ready")


def start(nodes: Callable[..., Node], name: str, etcd: EmbeddedEtcd, run_id: str, tmp_path: Path,
          script: Path, agent_args: list[str]) -> Node:
    env = {"ROWS": str(tmp_path / f"{name}.rows.jsonl"), "SNAPSHOTS": str(tmp_path / "snapshots"),
           "OMP_NUM_THREADS": "1"}
    return nodes(name=name, endpoint=etcd.endpoint, run_id=run_id, script=str(script), nnodes="1:2",
                 metrics_port=AUTO_METRICS_PORT, env=env, agent_args=["--lease-ttl", "2", *agent_args])


@pytest.mark.slow
@pytest.mark.parametrize("path", ["in place", "restart"])
def test_a_node_lost_under_a_script_without_logging_set_up_is_one_plain_line_on_the_survivor(
    path: str, etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)
    agent_args = ["--warm-start"] if path == "in place" else ["--warm-start", "--no-in-place"]
    a = start(nodes, "a", etcd_server, run_id, tmp_path, script, agent_args)
    b = start(nodes, "b", etcd_server, run_id, tmp_path, script, agent_args)
    a_rows, b_rows = tmp_path / "a.rows.jsonl", tmp_path / "b.rows.jsonl"

    def logs() -> str:
        return a.log_tail(80) + "\n" + b.log_tail(80)

    wait_until(lambda: sum(r["world"] == 2 for r in read_rows(b_rows)) >= 10, FORM_TIMEOUT,
               "a world of 2", on_timeout=logs)
    lost = "b" if read_rows(a_rows)[-1]["rank"] == 0 else "a"
    victim, survivor = (b, a) if lost == "b" else (a, b)
    if path == "restart":  # its standby is up (a restart takes one as soon as it exists)
        wait_until(lambda: standbys(survivor) >= 1, FORM_TIMEOUT, "the survivor's standby worker",
                   on_timeout=lambda: survivor.log_tail(80))
    survivor_rows = tmp_path / f"{survivor.name}.rows.jsonl"
    before = len(survivor.log_path.read_text(errors="replace"))
    killed_at = time.time()
    victim.kill()
    wait_until(lambda: sum(r["world"] == 1 and r["time"] > killed_at for r in read_rows(survivor_rows)) >= 10,
               60, "the survivor to train on alone", on_timeout=lambda: survivor.log_tail(80))
    if path == "restart":  # the agent's account of the restart comes at the new workers' first step
        wait_until(lambda: "training again" in survivor.log_path.read_text(errors="replace")[before:], 30,
                   "the agent to explain the restart", on_timeout=lambda: survivor.log_tail(80))

    whole = survivor.log_path.read_text(errors="replace")
    after = whole[before:]
    for noise in ("pair.cc", "Traceback", "broadcast_buffers is deprecated", "FutureWarning", "Read error"):
        assert noise not in whole, f"{noise!r} in the survivor's console:\n{whole[-6000:]}"
    worker = [line for line in after.splitlines() if "elastic.trainer" in line]
    if path == "in place":
        reformed = [line for line in worker if "re-formed" in line]
        assert len(reformed) == 1, after
        assert re.search(rf"lost node {lost} \(rank \d\) in step \d+: its connection closed", reformed[0]), reformed
        assert "re-formed in place" in reformed[0] and "warm (no process restarted)" in reformed[0], reformed[0]
        return
    left = [line for line in worker if "lost a peer" in line]
    assert len(left) == 1 and "the agent restarts this worker" in left[0], after
    agent = [line for line in after.splitlines() if "elastic.agent" in line]
    restart = [line for line in agent if "restart (peer_lost)" in line]
    assert len(restart) == 1 and f"without {lost}" in restart[0] and "started warm" in restart[0], after
    explained = [line for line in agent if "training again" in line]
    assert len(explained) == 1 and "workers started warm" in explained[0], after
