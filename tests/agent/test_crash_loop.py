"""A node whose worker fails right after every start is kept out, and the others train to the end.

Three real ``elastic agent`` nodes at ``--nnodes 2:3`` run an ``ElasticRun`` script written
here; on node ``c`` it raises at its first batch, every time. ``ElasticRun`` (in place)
because that is where a crash loop hurt most: each time ``c``'s worker was started again
and healed, the two healthy nodes stood still for it (the issue measured about 2.5 s a
time, 20 times, before the job failed for want of restarts). The restart path's rule (a
survivor whose collective broke is not the culprit) is checked in ``test_policy.py``.

What is checked is what the operator sees: ``c`` is kept out after three tries, with one
line naming it and its traceback's last line and ``elastic_agent_crash_loops_total`` at 1;
the healthy nodes train on together without it and exit 0 at the last step.
"""

from __future__ import annotations

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
STEPS = 300  # at 0.2 s a step until the test says "fast": more than the crash loop takes to be seen

SCRIPT = textwrap.dedent('''\
    import json, os, time
    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import TensorDataset
    import elastic

    node = os.environ["ELASTIC_NODE_NAME"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = TensorDataset(torch.randn(512, 8), torch.randint(0, 2, (512,)))
    rows = open(os.environ["ROWS"], "a")

    def report(info):
        rows.write(json.dumps({"step": info.step, "world": info.world_size, "time": time.time()}) + "\\n")
        rows.flush()

    run = elastic.ElasticRun(model, optimizer, data, global_batch_size=16, steps=int(os.environ["STEPS"]),
                             snapshot_dir=os.environ["SNAPSHOTS"], on_step_end=report)
    for x, y in run:
        if node == os.environ["CRASH_ON"]:
            raise ValueError(f"boom on {node}")
        run.step(F.cross_entropy(run.model(x), y))
        time.sleep(0 if os.path.exists(os.environ["FAST"]) else 0.2)
''')


def metric(node: Node, name: str) -> float:
    series = fetch(metrics_url(node), timeout=5)
    assert series is not None, f"{node.name} serves no /metrics"
    return sum(v for (metric_name, _labels), v in series.items() if metric_name == name)


@pytest.mark.slow
def test_a_node_whose_worker_fails_at_every_start_is_kept_out_and_the_others_finish(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    fast = tmp_path / "fast"

    def start(name: str) -> Node:
        env = {"ROWS": str(tmp_path / f"{name}.rows.jsonl"), "SNAPSHOTS": str(tmp_path / "snapshots"),
               "OMP_NUM_THREADS": "1", "STEPS": str(STEPS), "CRASH_ON": "c", "FAST": str(fast)}
        return nodes(name=name, endpoint=etcd_server.endpoint, run_id=run_id, script=str(script), nnodes="2:3",
                     metrics_port=AUTO_METRICS_PORT, env=env,
                     agent_args=["--lease-ttl", "2"])

    a, b, c = start("a"), start("b"), start("c")

    def logs() -> str:
        return "\n".join(n.log_tail(60) for n in (a, b, c))

    def kept_out_line() -> str | None:
        return next((line for line in c.log_path.read_text(errors="replace").splitlines()
                     if "[c] kept out of the job for" in line), None)

    line = wait_until(kept_out_line, FORM_TIMEOUT, "c to be kept out for its crash loop", on_timeout=logs)
    kept_out_at = time.time()
    assert "ValueError: boom on c" in line and "crash loop" in line, line
    assert metric(c, "elastic_agent_crash_loops_total") == 1
    assert metric(c, "elastic_agent_kept_out") == 1
    text = c.log_path.read_text(errors="replace")
    tries = text[:text.index(line)].count("\nValueError: boom on c")  # one traceback per start
    assert tries == 3, f"{tries} starts before c was kept out:\n{c.log_tail(80)}"

    fast.touch()  # the healthy nodes may finish now
    wait_until(lambda: not a.alive() and not b.alive(), 120, "a and b to finish", on_timeout=logs)
    for node in (a, b):
        assert node.process is not None and node.process.returncode == 0, node.log_tail(60)
        rows = read_rows(tmp_path / f"{node.name}.rows.jsonl")
        assert rows and rows[-1]["step"] == STEPS, rows[-3:]
        assert any(r["world"] == 2 and r["time"] > kept_out_at for r in rows), "a and b did not train on together"
        assert "no restarts left" not in node.log_path.read_text(errors="replace")
