"""``elastic local --nodes 2`` scraped as a user would: its nodes found through the etcd registry.

Everything is real: ``elastic local`` (its embedded etcd, two ``elastic agent`` process
trees, the mlp job on gloo). The test only knows what ``elastic local`` prints (the etcd
URL) and its run id (``local``); it lists the nodes from the registry, scrapes each
``metrics_url`` over HTTP, and runs ``elastic top --once`` against the same registry.
Then it stops ``elastic local`` as a user does (Ctrl-C) and makes sure nothing it started
is left running.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from agent.tools.etcd_args import connect
from agent.node.proctree import process_tree
from agent.tools.top import main as top
from agent.rendezvous.registry import list_nodes
from tests.elastic.metrics.scrape import Samples, fetch_samples
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


def _started_at(pid: int) -> str | None:
    """The live process' start time (clock ticks since boot), which tells a pid from a later
    reuse of it; None once it has exited (a zombie has exited too)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else fields[19]


class LocalRun:
    """``elastic local`` as a subprocess; every process of its tree is remembered by pid."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.out_path = run_dir, run_dir.parent / "local.out"
        run_dir.mkdir(parents=True)
        with open(self.out_path, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "agent.cli", "local", "--nodes", "2", "--steps", "100000", "--faults", "0",
                 "--timeout", "200", "--lease-ttl", "2", "--run-dir", str(run_dir)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},
            )
        self.seen: dict[int, str] = {}

    def remember_tree(self) -> None:
        for pid in process_tree(self.process.pid):
            started = _started_at(pid)
            if started is not None:
                self.seen.setdefault(pid, started)

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def etcd_endpoint(self) -> str | None:
        self.remember_tree()
        found = re.search(r"etcd at http://([\d.]+:\d+)", self.output())
        return found[1] if found else None

    def logs(self) -> str:
        tails = [f"--- {p.name} ---\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:])
                 for p in sorted(self.run_dir.glob("node-*.log"))]
        return "\n".join([self.output()[-3000:], *tails])

    def left_running(self) -> list[int]:
        """Processes of its tree seen during the run that are still the same processes now."""
        return [pid for pid, started in self.seen.items() if _started_at(pid) == started]

    def interrupt(self) -> int | None:
        """Ctrl-C, as a user quits; its exit code, or None if it did not exit in time."""
        self.remember_tree()
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGINT)
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """Ctrl-C, then SIGKILL by pid whatever of its tree is still there."""
        self.interrupt()
        for pid in self.left_running():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.process.poll() is None:
            self.process.wait(timeout=10)


@pytest.fixture
def local_run(tmp_path: Path) -> Iterator[LocalRun]:
    run = LocalRun(tmp_path / "run")
    try:
        yield run
    finally:
        run.stop()


@pytest.mark.slow  # starts processes
def test_elastic_local_nodes_serve_metrics_found_through_the_registry(
    local_run: LocalRun, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = wait_until(local_run.etcd_endpoint, 60, "elastic local to start its etcd", on_timeout=local_run.logs)
    key = f"hmac_key_file={local_run.run_dir / 'rdzv.key'}"  # elastic local signs its rendezvous with a key of its own
    target = connect(argparse.Namespace(rdzv_endpoint=endpoint, rdzv_id="local", rdzv_conf=key))
    try:
        def both_training() -> dict[str, Samples] | None:
            local_run.remember_tree()
            records = list_nodes(target.client, "local", target.signer, target.key_prefix)
            if [r.node for r in records] != ["node-0", "node-1"] or not all(r.metrics_url for r in records):
                return None
            try:
                scraped = {r.node: fetch_samples(r.metrics_url or "", timeout=5) for r in records}
            except OSError:
                return None
            steps = [sum(v for _, v in s.get("elastic_steps_total", [])) for s in scraped.values()]
            worlds = [[v for _, v in s.get("elastic_world_size", [])] for s in scraped.values()]
            return scraped if min(steps) >= 5 and worlds == [[2.0], [2.0]] else None

        scraped = wait_until(both_training, 120, "both nodes of elastic local to serve metrics in a world of 2",
                             interval=0.5, on_timeout=local_run.logs)
    finally:
        target.client.close()
    ranks = sorted(labels["rank"] for s in scraped.values() for labels, _ in s["elastic_rank"])
    assert ranks == ["0", "1"]  # one live rank per node, the two ranks of the world
    for node, s in scraped.items():
        assert [v for _, v in s["elastic_agent_nodes_in_round"]] == [2.0], node

    # `elastic top` against elastic local: its etcd, its run id and its key, as its header says.
    code = top(["--once", "--interval", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", "local", "--rdzv-conf", key])
    out = capsys.readouterr().out
    print(out)
    assert code == 0, out
    assert "run local · world 2 · 2 nodes" in out
    rows = [line for line in out.splitlines() if re.match(r"│ node-[01] +│ +[01] +│ running ", line)]
    assert len(rows) == 2, out

    # Ctrl-C ends elastic local and everything it started (etcd, agents, workers), and
    # still prints the summary a user quit to read.
    assert local_run.interrupt() == 130, local_run.logs()
    assert "Faults and recoveries" in local_run.output() and "stopped before step" in local_run.output()
    wait_until(lambda: not local_run.left_running(), 10, "elastic local's processes to be gone after Ctrl-C",
               on_timeout=lambda: str(local_run.left_running()))
