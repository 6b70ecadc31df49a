"""Starting nodes that run the in-place test job, and reading what they report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable

from agent.etcd import EmbeddedEtcd
from tests.elastic.metrics.scrape import fetch
from tests.support.nodes import TorchrunNode as Node
from tests.support.stacks import stacks_and_tails
from tests.support.waiting import wait_until
from agent.local.local_node import AUTO_METRICS_PORT
from tests.support.metrics_url import metrics_url

JOB = Path(__file__).with_name("job.py")
FORM_TIMEOUT = 150  # cold torch imports on a loaded 2-core machine
LEASE_TTL = 2


def start_job(nodes: Callable[..., Node], name: str, etcd: EmbeddedEtcd, run_id: str, workdir: Path,
              nnodes: str = "1:3", env: dict[str, str] | None = None, agent_args: Iterable[str] = ()) -> Node:
    return start_script(nodes, name, etcd, run_id, workdir, JOB, nnodes, env, agent_args)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a job's progress file (none yet if it does not exist)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut short by SIGKILL
    return out


def rows(node: Node, workdir: Path) -> list[dict[str, Any]]:
    return read_rows(workdir / f"{node.name}.rows.jsonl")


def at_world(node: Node, workdir: Path, world: int, after: float = 0.0) -> list[dict[str, Any]]:
    return [r for r in rows(node, workdir) if r["world_size"] == world and r["time"] > after]


def logs(*group: Node) -> Callable[[], str]:
    """The nodes' log tails, with every agent's and worker's stacks dumped first (a timeout's
    message then says where each waited)."""
    return lambda: stacks_and_tails(group)


def train_together(group: list[Node], workdir: Path, world: int, steps: int = 8, after: float = 0.0,
                   timeout: float = FORM_TIMEOUT) -> None:
    wait_until(lambda: all(len(at_world(n, workdir, world, after)) >= steps for n in group), timeout,
               f"{[n.name for n in group]} to train {steps} steps in a world of {world}", on_timeout=logs(*group))


def metric(node: Node, name: str, **labels: str) -> float:
    series = fetch(metrics_url(node), timeout=5)
    assert series is not None, f"{node.name} serves no /metrics"
    return sum(v for (n, ls), v in series.items() if n == name and labels.items() <= dict(ls).items())


def ledger_steps(workdir: Path) -> list[int]:
    path = workdir / "ledger.jsonl"
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (json.JSONDecodeError, KeyError):
            pass
    return steps


def start_script(nodes: Callable[..., Node], name: str, etcd: EmbeddedEtcd, run_id: str, workdir: Path,
                 script: Path, nnodes: str = "1:3", env: dict[str, str] | None = None,
                 agent_args: Iterable[str] = (), rdzv_conf: dict[str, str] | None = None) -> Node:
    """A node running ``script`` (the job's, or one a test wrote): its progress rows, the
    shared snapshots and ledger in ``workdir``."""
    job_env = {"PROGRESS": str(workdir / f"{name}.rows.jsonl"), "SNAPSHOTS": str(workdir / "snapshots"),
               "LEDGER": str(workdir / "ledger.jsonl"), "OMP_NUM_THREADS": "1", **(env or {})}
    return nodes(name=name, endpoint=etcd.endpoint, run_id=run_id, script=str(script), nnodes=nnodes,
                 metrics_port=AUTO_METRICS_PORT, env=job_env, agent_args=["--lease-ttl", str(LEASE_TTL), *agent_args],
                 rdzv_conf=dict(rdzv_conf or {}))
