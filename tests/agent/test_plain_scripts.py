"""Any training script under ``elastic agent``: a plain DDP loop that never imports ``elastic``.

The script is written by the test (as a user would write it: ``init_process_group``, a DDP
model, SGD, a loop that prints its steps). What is checked is what its user sees: no
restart for a healthy script however long it runs, a real hang detected with stacks in
the log, restarts from pre-imported standbys every time, and ``elastic local`` running it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest

from agent.etcd import EmbeddedEtcd
from tests.elastic.metrics.scrape import fetch
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until
from agent.local.local_node import AUTO_METRICS_PORT
from tests.support.metrics_url import metrics_url

FORM_TIMEOUT = 150

PLAIN = textwrap.dedent('''\
    import atexit, json, os, sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from torch import nn

    if os.environ.get("EXIT_HOOK_TIME"):  # a slow exit hook, as wandb.finish() can be
        atexit.register(time.sleep, float(os.environ["EXIT_HOOK_TIME"]))
    dist.init_process_group("gloo", timeout=timedelta(seconds=int(os.environ.get("COLLECTIVE_TIMEOUT", "30"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps, hang_at = int(sys.argv[1]), int(os.environ.get("HANG_AT", "-1"))
    marker = os.environ.get("HANG_MARKER", "")
    for step in range(steps):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        if step == hang_at and rank == 0 and marker and not os.path.exists(marker):
            open(marker, "w").close()
            while True:          # a real hang inside the loop: the others wait in the next all-reduce
                time.sleep(3600)
        optimizer.step()
        time.sleep(float(os.environ.get("STEP_TIME", "0.05")))
        if rank == 0 and os.environ.get("ROWS"):
            with open(os.environ["ROWS"], "a") as f:
                f.write(json.dumps({"step": step, "world": world, "pid": os.getpid(), "time": time.time()}) + "\\n")
    dist.destroy_process_group()
''')


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(PLAIN)
    return path


def start(nodes: Callable[..., Node], name: str, etcd: EmbeddedEtcd, run_id: str, script: Path, steps: int,
          agent_args: list[str], env: dict[str, str] | None = None, **kw: object) -> Node:
    return nodes(name=name, endpoint=etcd.endpoint, run_id=run_id, script=str(script), module_args=[str(steps)],
                 metrics_port=AUTO_METRICS_PORT, agent_args=agent_args, env={"OMP_NUM_THREADS": "1", **(env or {})}, **kw)


def scrape(node: Node, name: str) -> dict[str, float]:
    series = fetch(metrics_url(node), timeout=5)
    assert series is not None, f"{node.name} serves no /metrics"
    return {dict(labels).get("reason", dict(labels).get("mode", "")): v for (metric, labels), v in series.items()
            if metric == name}


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_a_healthy_plain_script_runs_past_the_hang_timeout_and_the_startup_budget_without_a_restart(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], script: Path, tmp_path: Path
) -> None:
    """Its exit hook, longer than the hang timeout, is not a hang either: restarting a script
    that has finished would train it all over again (it once did, when a loaded machine made
    the interpreter's teardown alone outlast a 2 s timeout)."""
    rows = tmp_path / "rows.jsonl"
    node = start(nodes, "solo", etcd_server, run_id, script, steps=200, nnodes="1:1",
                 agent_args=["--hang-timeout", "2", "--hang-startup-timeout", "3"],
                 env={"ROWS": str(rows), "EXIT_HOOK_TIME": "4"})
    wait_until(lambda: not node.alive(), FORM_TIMEOUT, "the script to finish", on_timeout=lambda: node.log_tail(60))
    assert node.process is not None and node.process.returncode == 0, node.log_tail(60)
    seen = read_rows(rows)
    assert len(seen) == 200 and len({r["pid"] for r in seen}) == 1, "the worker was restarted"
    assert seen[-1]["time"] - seen[0]["time"] > 3 * 2, "the run was too short to outlast the hang timeout"
    log = node.log_path.read_text()
    assert "restart (" not in log and "dumping worker stacks" not in log


@pytest.mark.slow
def test_a_plain_script_that_hangs_is_restarted_with_its_stacks_in_the_log(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], script: Path, tmp_path: Path
) -> None:
    rows = tmp_path / "rows.jsonl"
    node = start(nodes, "solo", etcd_server, run_id, script, steps=60, nnodes="1:1", nproc_per_node=2,
                 agent_args=["--hang-timeout", "4", "--no-warm-start"],  # the cold path, end to end
                 env={"ROWS": str(rows), "HANG_AT": "20", "HANG_MARKER": str(tmp_path / "hung"),
                      "COLLECTIVE_TIMEOUT": "300"})
    wait_until(lambda: not node.alive(), 2 * FORM_TIMEOUT, "the job to finish despite the hang",
               on_timeout=lambda: node.log_tail(80))
    assert node.process is not None and node.process.returncode == 0, node.log_tail(80)
    log = node.log_path.read_text()
    assert "dumping worker stacks" in log
    assert "train.py" in log and "most recent call first" in log  # every worker's stacks, via faulthandler
    assert "restart (hang)" in log
    assert len({r["pid"] for r in read_rows(rows)}) == 2  # the hang cost exactly one restart
    assert "warm_worker" not in log  # --no-warm-start: every worker started cold, through the bootstrap


@pytest.mark.slow
def test_two_sigkills_of_the_other_node_in_a_row_both_restart_the_survivor_warm(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], script: Path, tmp_path: Path
) -> None:
    rows = tmp_path / "rows.jsonl"
    common = dict(steps=100000, nnodes="1:2", agent_args=["--lease-ttl", "2", "--warm-start"], env={"ROWS": str(rows)})
    a = start(nodes, "a", etcd_server, run_id, script, **common)
    b = start(nodes, "b", etcd_server, run_id, script, **common)

    def at_world(world: int, after: float) -> list[dict]:
        return [r for r in read_rows(rows) if r["world"] == world and r["time"] > after]

    def standby_ready() -> bool:
        return scrape(a, "elastic_agent_standby_workers_ready").get("", 0) >= 1

    wait_until(lambda: len(at_world(2, 0)) >= 5, FORM_TIMEOUT, "a world of 2", on_timeout=lambda: a.log_tail(60))
    for fault in (1, 2):
        wait_until(standby_ready, FORM_TIMEOUT, f"a's standby before fault {fault}", on_timeout=lambda: a.log_tail(60))
        killed_at = time.time()
        b.kill()
        wait_until(lambda: len(at_world(1, killed_at)) >= 3, 60, f"a alone after kill {fault}",
                   on_timeout=lambda: a.log_tail(60))
        if fault == 1:  # b returns once a's standby is back, so the scale-up restart is warm too
            wait_until(standby_ready, FORM_TIMEOUT, "a's standby before b returns", on_timeout=lambda: a.log_tail(60))
            back_at = time.time()
            b.start()
            wait_until(lambda: len(at_world(2, back_at)) >= 5, FORM_TIMEOUT, "b back",
                       on_timeout=lambda: a.log_tail(60) + b.log_tail(60))
    starts = scrape(a, "elastic_agent_worker_starts_total")
    assert starts.get("cold", 0) == 0 and starts.get("warm", 0) >= 4, starts  # first start, 2 kills, 1 scale-up
    assert scrape(a, "elastic_agent_restarts_total").get("peer_lost", 0) >= 2


@pytest.mark.slow
def test_elastic_local_runs_a_users_own_script_through_a_kill_and_a_freeze(script: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli", "local", "--nodes", "3", "--faults", "2", "--first-fault-after", "3",
         "--fault-every", "6", "--back-after", "4", "--lease-ttl", "2", "--timeout", "240",
         "--run-dir", str(tmp_path / "run"), str(script), "300"],
        capture_output=True, text=True, timeout=420, stdin=subprocess.DEVNULL,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    faults = re.findall(r"│\s*\d+\s*│\s*(kill|freeze)\s*│.*│\s*([\d.]+|not seen)\s*│\s*(up to \d+|\d+|-)\s*│", output)
    assert [kind for kind, _, _ in faults] == ["kill", "freeze"], output
    assert all(rec != "not seen" for _, rec, _ in faults), output  # both recovered, with a time
    # no step numbers of its own: each restart started the script over, and what that cost is said
    assert all(lost.startswith("up to ") for _, _, lost in faults), output
    assert "started it over in a new process" in output and done.stdout.rstrip().endswith("the job finished"), output
