"""``make demo``: an embedded etcd, two local nodes, a node killed, recovery, a summary.

Everything is real: the etcd binary, two torchrun agents rendezvousing through
``etcd-v3``, gloo DDP workers. Node loss is a SIGKILL of one node's whole process tree.
Logs stay in ``runs/demo-*/`` for a look afterwards.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

from elastic.etcd import EmbeddedEtcd

from .local_node import LocalNode

JOB = "elastic.examples.tiny_ddp"
JOB_ARGS = ["--step-time", "0.05", "--progress", "{progress}"]


class PhaseTimeout(RuntimeError):
    pass


@dataclass
class Event:
    what: str
    seconds: float


def wait_for(console: Console, what: str, probe: Callable[[], bool], timeout: float, nodes: list[LocalNode]) -> float:
    started = time.monotonic()
    with console.status(f"[bold]{what}[/bold]") as status:
        while not probe():
            elapsed = time.monotonic() - started
            if elapsed > timeout:
                raise PhaseTimeout(f"gave up after {timeout:.0f} s waiting for {what}")
            status.update(f"[bold]{what}[/bold]  {elapsed:4.1f} s  " + "  ".join(_brief(n) for n in nodes))
            time.sleep(0.1)
    return time.monotonic() - started


def _brief(node: LocalNode) -> str:
    rows = node.progress()
    if not rows:
        return f"{node.name}: starting"
    last = rows[-1]
    state = "alive" if node.alive() else "dead"
    return f"{node.name}: {state} world={last['world_size']} step={last['step']}"


def run(console: Console, run_dir: Path, timeout: float) -> list[Event]:
    events: list[Event] = []
    with EmbeddedEtcd(data_dir=run_dir / "etcd") as etcd:
        console.print(f"etcd serving at [cyan]{etcd.url}[/cyan] (pid {etcd.pid})")
        make = lambda name: LocalNode(  # noqa: E731
            name=name, endpoint=etcd.endpoint, run_id="demo", workdir=run_dir, module=JOB, module_args=JOB_ARGS
        )
        a, b = make("node-a"), make("node-b")
        nodes = [a, b]
        try:
            for node in nodes:
                node.start()
                console.print(f"started {node.name} (torchrun pid {node.pid}, log {node.log_path})")
            took = wait_for(console, "both nodes training in a world of 2",
                            lambda: len(a.steps_at(2)) >= 20 and len(b.steps_at(2)) >= 20, timeout, nodes)
            events.append(Event("2 nodes formed a world and trained 20 steps", took))

            killed_at = time.time()
            pids = b.kill()
            console.print(f"[red]killed node-b[/red]: SIGKILL to its whole process tree {pids}")
            took = wait_for(console, "node-a to recover alone",
                            lambda: bool(a.steps_at(1, after=killed_at)), timeout, nodes)
            events.append(Event("node-b killed -> node-a trains alone (first step)", took))
            wait_for(console, "node-a to train 20 steps alone",
                     lambda: len(a.steps_at(1, after=killed_at)) >= 20, timeout, nodes)

            rejoin_at = time.time()
            b.start()
            console.print(f"restarted node-b (torchrun pid {b.pid})")
            took = wait_for(console, "node-b to rejoin",
                            lambda: bool(a.steps_at(2, after=rejoin_at)) and bool(b.steps_at(2, after=rejoin_at)),
                            timeout, nodes)
            events.append(Event("node-b restarted -> world of 2 again (first step)", took))
            wait_for(console, "20 more steps together",
                     lambda: len(b.steps_at(2, after=rejoin_at)) >= 20, timeout, nodes)
        finally:
            for node in nodes:
                node.cleanup()
    return events


def summary(console: Console, run_dir: Path, events: list[Event]) -> None:
    table = Table(title="What happened")
    table.add_column("event")
    table.add_column("seconds", justify="right")
    for event in events:
        table.add_row(event.what, f"{event.seconds:.1f}")
    console.print(table)
    rows = [r for p in sorted(run_dir.glob("*.progress.jsonl")) for r in LocalNode.read_progress(p)]
    by_world: dict[int, int] = {}
    for row in rows:
        if row["rank"] == 0:
            by_world[row["world_size"]] = by_world.get(row["world_size"], 0) + 1
    console.print("steps trained by world size: " + ", ".join(f"{w} node(s): {n}" for w, n in sorted(by_world.items())))
    if rows:
        console.print(f"final loss: {max(rows, key=lambda r: r['time'])['loss']:.4g}")
    console.print(f"logs: {run_dir}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.demo", description=__doc__)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds allowed per phase")
    parser.add_argument("--run-dir", type=Path, default=None, help="where logs go (default runs/demo-TIME)")
    args = parser.parse_args(argv)
    console = Console()
    run_dir = args.run_dir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        events = run(console, run_dir.resolve(), args.timeout)
    except PhaseTimeout as exc:
        console.print(f"[red]error:[/red] {exc}; see the logs in {run_dir}")
        return 1
    summary(console, run_dir, events)
    return 0


if __name__ == "__main__":
    sys.exit(main())
