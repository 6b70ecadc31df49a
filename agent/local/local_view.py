"""What ``elastic local`` shows while the job runs: the live view on a terminal, plain lines
otherwise (a log, a pipe, CI), so a run nobody watches still says what it does."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from agent.local.local_faults import Cluster, ClusterNode
from agent.local.local_node import Crash

STATUS_EVERY_S = 5.0  # without a terminal: a status line this often, besides one per event

_COLOURS = {"killed": "red", "frozen": "yellow", "up": "green", "crashed": "red", "hung": "red"}
_NO_LOSS_NOTE = ("loss, samples/s: '-' until your script reports them: "
                 "elastic.report_progress(step, loss=loss, samples=batch_size) after each step")


def view(cluster: Cluster, title: str) -> Group:
    table = Table(title=title, expand=False)
    for col in ("node", "state", "rank", "world", "step", "samples/s", "loss", "faults", "crashes"):
        table.add_column(col, justify="right" if col not in ("node", "state") else "left")
    for n in cluster.nodes:
        rows = n.node.progress()
        last = rows[-1] if rows else None
        rate = _rate(rows)
        state = cluster.node_state(n)
        colour = _COLOURS.get(state, "red" if state.startswith("failed") else "white")
        table.add_row(
            n.node.name, f"[{colour}]{state}[/{colour}]",
            str(last["rank"]) if last else "-", str(last["world_size"]) if last else "-",
            str(last["step"]) if last else "-", f"{rate:.0f}" if rate else "-",
            f"{last['loss']:.4f}" if last and last.get("loss") is not None else "-", str(n.faults),
            str(len(n.node.crashes())),
        )
    return Group(table, *(Text(line) for line in _footer(cluster)))


def _footer(cluster: Cluster) -> list[str]:
    """Under the table: snapshots, faults, the latest crash and where its log is."""
    recovered = sum(f.recovered_at is not None for f in cluster.faults)
    lines = [f"last snapshot: {cluster.last_snapshot()}   faults: {len(cluster.faults)}   "
             f"recovered: {recovered}   crashes: {sum(len(f.crashes) for f in cluster.crashes)}   "
             "keys: k=kill f=freeze q=quit"]
    last = _last_crash(cluster)
    if last is not None:
        n, crash = last
        lines.append(f"last crash: {n.node.name}: {crash.describe()} (log {n.node.log_path})")
    rows = cluster.rows()
    if rows and all(r.get("loss") is None for r in rows):
        lines.append(_NO_LOSS_NOTE)
    return lines


def _last_crash(cluster: Cluster) -> tuple[ClusterNode, Crash] | None:
    found = [(c.at, i, n, c) for i, n in enumerate(cluster.nodes) for c in n.node.crashes()]
    if not found:
        return None
    _, _, n, crash = max(found, key=lambda t: (t[0], t[1]))
    return n, crash


def _rate(rows: list[dict[str, Any]], window: float = 5.0) -> float:
    """A node's samples/s over its last ``window`` seconds of rows: its share of the global
    batch for a progress file's rows, its ranks' own samples for heartbeat rows."""
    if len(rows) < 2:
        return 0.0
    recent = [r for r in rows if r["time"] >= rows[-1]["time"] - window]
    if len(recent) < 2 or recent[-1]["time"] <= recent[0]["time"]:
        return 0.0
    samples = sum(r["samples"] / max(1, r["world_size"]) if r.get("kind", "file") == "file" else r["samples"]
                  for r in recent[1:])
    return samples / (recent[-1]["time"] - recent[0]["time"])


def status_line(cluster: Cluster) -> str:
    """The view in one line, for a log or a pipe."""
    row = cluster.latest()
    where = (f"world {row['world_size']}, step {row['step']}" + (f", loss {row['loss']:.4g}" if row.get("loss")
             is not None else "")) if row else "no step yet"
    nodes = ", ".join(f"{n.node.name} {cluster.node_state(n)}" for n in cluster.nodes)
    recovered = sum(f.recovered_at is not None for f in cluster.faults)
    return (f"{where}; {nodes}; faults {len(cluster.faults)} (recovered {recovered}), "
            f"crashes {sum(len(f.crashes) for f in cluster.crashes)}")


def say(console: Console, text: str) -> None:
    """One plain line, whatever the console's width: paths and errors stay whole and greppable."""
    console.print(text, soft_wrap=True, markup=False, highlight=False)


class Display:
    """On a terminal, the live view, with each event printed above it; otherwise (a log, a
    pipe, CI) plain lines: one per event and a status line every ``every`` seconds, so a
    run that is not watched still says what it does while it does it."""

    def __init__(self, console: Console, cluster: Cluster, started: float, every: float = STATUS_EVERY_S) -> None:
        self.console, self.cluster, self.started, self.every = console, cluster, started, every
        self.live: Live | None = None
        self._shown = 0
        self._status_at = started + every

    def __enter__(self) -> "Display":
        if self.console.is_terminal:
            self.live = Live(view(self.cluster, "elastic local"), console=self.console, refresh_per_second=4)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cluster.settle_snapshot_view()
        self.update()
        if self.live is not None:
            self.live.__exit__(None, None, None)
        else:
            self.console.print(view(self.cluster, f"elastic local  {time.time() - self.started:.0f} s"))

    def update(self) -> None:
        for at, text in self.cluster.events[self._shown:]:
            say(self.console, f"[{at - self.started:6.1f} s] {text}")
        self._shown = len(self.cluster.events)
        now = time.time()
        if self.live is not None:
            self.live.update(view(self.cluster, f"elastic local  {now - self.started:5.0f} s"))
        elif now >= self._status_at:
            say(self.console, f"[{now - self.started:6.1f} s] {status_line(self.cluster)}")
            self._status_at = now + self.every
