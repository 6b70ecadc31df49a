"""``elastic local``: a whole elastic cluster on one machine, with faults on a schedule.

An embedded etcd, N ``elastic agent`` nodes (each its own process tree), a training job,
and a live view. Faults land on a schedule or on a keypress (k = kill, f = freeze, q = quit);
killed nodes come back later, so scale-up shows too. A worker that crashes (or hangs) is a
fault too, read from its node's log. At the end: one line per fault with the seconds to
recovery and the steps rolled back, the final loss, and one line with the job's outcome.

Workers run where ``elastic local`` was started, as under torchrun. The run directory holds
only what the tool writes: the nodes' logs and agent directories, etcd's data, the
rendezvous key and ``snapshots/`` (every worker's ``ELASTIC_SNAPSHOT_DIR``).

Fault kinds (``bench/chaos_soak.py`` draws from the same set):

* ``kill``: SIGKILL of a node's whole process tree;
* ``freeze``: SIGSTOP of the tree for longer than the lease TTL, then SIGCONT;
* ``kill-rank0-snapshot``: SIGKILL of rank 0's node while its snapshot writer's temp dir
  exists (caught by polling the snapshot dir), else right after a snapshot step;
* ``etcd-outage``: etcd stopped, then started again on the same ports and data.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import secrets
import signal
import select
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from checkpoints.layout import parse_temp_dirname, pid_alive
from elastic.etcd import EmbeddedEtcd, free_port
from elastic.goodput import Account, describe, newest_account
from elastic.goodput.files import JOB_FILE
from elastic.rendezvous.registry import DEFAULT_LEASE_TTL
from elastic.rendezvous.signing import HMAC_KEY_FILE_ENV, HmacKeyError, StateSigner, load_hmac_key

from .local_node import Crash, LocalNode

KILL, FREEZE, KILL_SNAPSHOT, ETCD_OUTAGE = "kill", "freeze", "kill-rank0-snapshot", "etcd-outage"
KINDS = (KILL, FREEZE, KILL_SNAPSHOT, ETCD_OUTAGE)
ETCD_TARGET = "etcd"
KEY_FILE = "rdzv.key"  # the run's rendezvous key, in its run directory
STATUS_EVERY_S = 5.0  # without a terminal: a status line this often, besides one per event
DEFAULT_MAX_RESTARTS = 20


@dataclass
class Fault:
    kind: str
    node: str
    at: float  # wall time the fault landed
    world_before: int
    step_before: int
    round_before: int
    recovered_at: float | None = None
    resumed_step: int | None = None
    lifted_at: float | None = None  # etcd-outage: when etcd served again
    note: str = ""  # kill-rank0-snapshot: how the snapshot write was caught
    last_step_at: float | None = None  # rank 0's last step before the fault
    pid_before: int | None = None  # rank 0's process before the fault (a script's own rows)
    resumed_pid: int | None = None  # ... and at the first step after it: another one started over
    crashes: list[tuple[str, Crash]] = field(default_factory=list)  # a crash: each node's, as its log says

    @property
    def recovery_seconds(self) -> float | None:
        """From the fault to the first step of the new world; for etcd, from etcd's return."""
        start = self.lifted_at if self.kind == ETCD_OUTAGE and self.lifted_at is not None else self.at
        return None if self.recovered_at is None else self.recovered_at - start

    @property
    def steps_rolled_back(self) -> int | None:
        return None if self.resumed_step is None else max(0, self.step_before - (self.resumed_step - 1))

    @property
    def started_over(self) -> bool:
        """Rank 0 went on in a new process: a script that restores nothing began again."""
        return self.pid_before is not None and self.resumed_pid is not None and self.resumed_pid != self.pid_before

    @property
    def pause_seconds(self) -> float | None:
        """Training stood still this long: the last step before the fault to the first after."""
        return None if self.recovered_at is None or self.last_step_at is None else self.recovered_at - self.last_step_at


@dataclass
class ClusterNode:
    node: LocalNode
    state: str = "starting"  # starting | up | killed | frozen
    back_at: float | None = None  # when a killed node restarts / a frozen one thaws
    faults: int = 0
    exited: int | None = None  # the agent's exit code, once it exited on its own (not killed by us)
    crashes_seen: int = 0  # of its log's crashes, those already made faults


@dataclass
class Cluster:
    nodes: list[ClusterNode]
    run_dir: Path
    nproc: int
    faults: list[Fault] = field(default_factory=list)
    etcd: EmbeddedEtcd | None = None  # needed for etcd-outage
    snapshot_every: int = 20  # the job's --snapshot-every-steps: kill-rank0-snapshot's fallback
    etcd_back_at: float | None = None
    crashes: list[Fault] = field(default_factory=list)  # workers that crashed or hung (kind crash | hang)
    events: list[tuple[float, str]] = field(default_factory=list)  # (unix time, what happened), for the view

    @property
    def snapshot_dir(self) -> Path:
        return self.run_dir / "snapshots"

    def note(self, text: str) -> None:
        self.events.append((time.time(), text))

    def rows(self) -> list[dict[str, Any]]:
        """Every progress line of rank 0 (which speaks for the job), in time order."""
        rows = [r for n in self.nodes for r in n.node.progress() if r["rank"] == 0]
        return sorted(rows, key=lambda r: r["time"])

    def latest(self, until: float | None = None) -> dict[str, Any] | None:
        """Rank 0's newest line of the newest round (up to ``until``): a thawed node's stale
        line cannot win."""
        rows = [r for r in self.rows() if until is None or r["time"] <= until]
        return max(rows, key=lambda r: (r.get("round", -1), r["time"])) if rows else None

    def world(self) -> int:
        row = self.latest()
        return row["world_size"] if row else 0

    def step(self) -> int:
        row = self.latest()
        return row["step"] if row else 0

    def rank0(self) -> ClusterNode | None:
        """The node whose worker is rank 0 in the newest round, if it is up."""
        row = self.latest()
        found = [n for n in self.up() if row and n.node.name == row["node"]]
        return found[0] if found else None

    def inject(self, kind: str, target: ClusterNode | None, back_after: float) -> Fault:
        """Land one fault; ``target`` is ignored for etcd-outage (etcd) and kill-rank0-snapshot (rank 0)."""
        row = self.latest()
        if kind == KILL_SNAPSHOT:
            target = self.rank0() or target
        name = ETCD_TARGET if kind == ETCD_OUTAGE else (target.node.name if target else "?")
        fault = Fault(kind, name, time.time(), self.world(), self.step(), row.get("round", -1) if row else -1,
                      last_step_at=row["time"] if row else None, pid_before=row.get("pid") if row else None)
        if kind == ETCD_OUTAGE:
            if self.etcd is None:
                raise ValueError("etcd-outage needs Cluster(etcd=...)")
            self.etcd.stop()
            self.etcd_back_at = time.time() + back_after
        else:
            if target is None:
                raise ValueError(f"{kind} needs a target node")
            if kind == KILL_SNAPSHOT:
                fault.note = kill_during_snapshot(target, self.snapshot_dir, self.snapshot_every)
                fault.at, fault.step_before = time.time(), self.step()
            elif kind == KILL:
                target.node.kill()
            else:
                target.node.freeze()
            target.state = "frozen" if kind == FREEZE else "killed"
            target.back_at, target.faults = time.time() + back_after, target.faults + 1
        self.faults.append(fault)
        self.note(f"{kind} {name} (world {fault.world_before}, step {fault.step_before})")
        return fault

    def tick(self) -> None:
        """Bring nodes (and etcd) back when due; take in crashes and exits; note recoveries."""
        now = time.time()
        for n in self.nodes:
            if n.state == "starting" and n.node.progress():
                n.state = "up"
            if n.back_at is not None and now >= n.back_at:
                if n.state == "killed":
                    n.node.start()
                    self.note(f"{n.node.name} started again")
                elif n.state == "frozen":
                    n.node.thaw()
                    self.note(f"{n.node.name} thawed")
                n.state, n.back_at = "up", None
        if self.etcd is not None and self.etcd_back_at is not None and now >= self.etcd_back_at:
            self.etcd.start()
            self.etcd_back_at = None
            self.note("etcd started again")
            for fault in self.faults:
                if fault.kind == ETCD_OUTAGE and fault.lifted_at is None:
                    fault.lifted_at = time.time()
        for n in self.nodes:
            exited = self._take_exit(n)
            self._take_crashes(n)
            if exited:
                self.note(f"{n.node.name}: agent exited (0)" if n.exited == 0 else
                          f"{n.node.name}: agent failed (exit {n.exited}): {n.node.log.last_error or 'see its log'}")
        rows = self.rows()
        for fault in self.faults + self.crashes:
            if fault.recovered_at is None:
                after = _recovery_rows(fault, rows)
                if after:
                    fault.recovered_at, fault.resumed_step = after[0]["time"], after[0]["step"]
                    fault.resumed_pid = after[0].get("pid")
                    if fault.kind == ETCD_OUTAGE:
                        fault.note = _outage_note(fault, rows, after[0])
                    self.note(f"recovered from {fault.kind} {fault.node} in {fault.recovery_seconds:.1f} s: "
                              f"world {after[0]['world_size']}, step {after[0]['step']}")

    def _take_exit(self, n: ClusterNode) -> bool:
        """Whether the node's agent has just exited on its own; keeps its code (a killed node's is ours)."""
        process = n.node.process
        if n.state == "killed" or n.exited is not None or process is None or process.poll() is None:
            return False
        n.exited = process.returncode
        n.node.log.settle()  # a crash its agent had not yet told apart from a peer's doing was its own
        return True

    def _take_crashes(self, n: ClusterNode) -> None:
        """A worker crash (or hang) its node's log shows becomes a fault. Crashes in the same
        round are one fault (every rank of a script fails alike), named by every node."""
        crashes = n.node.crashes()
        for crash in crashes[n.crashes_seen:]:
            name = n.node.name
            row = self.latest(until=crash.at)
            round_before = row.get("round", -1) if row else -1
            same = [f for f in self.crashes if f.kind == crash.kind and f.recovered_at is None
                    and f.round_before == round_before]
            if same:
                fault = same[-1]
                fault.node += "" if name in fault.node.split(",") else f",{name}"
            else:
                fault = Fault(crash.kind, name, crash.at, row["world_size"] if row else 0, row["step"] if row else 0,
                              round_before, last_step_at=row["time"] if row else None,
                              pid_before=row.get("pid") if row else None)
                self.crashes.append(fault)
            fault.crashes.append((name, crash))
            self.note(f"{name}: {crash.describe()} (log {n.node.log_path})"
                      + (f"; its agent gave up: {crash.gave_up}" if crash.gave_up else ""))
        n.crashes_seen = len(crashes)

    def quiet(self) -> bool:
        """No fault in flight: every fault recovered, etcd up, nothing frozen or due back."""
        return (all(f.recovered_at is not None for f in self.faults) and self.etcd_back_at is None
                and all(n.back_at is None for n in self.nodes))

    def up(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.state in ("up", "starting") and n.node.alive()]

    def ended(self) -> bool:
        """The job is over, whatever its outcome: every node we did not kill has exited on
        its own (a frozen one has not: it still holds its place). A killed node due back
        is not waited for: the job it would rejoin has ended."""
        ours = [n for n in self.nodes if n.state != "killed"]
        return bool(ours) and all(n.exited is not None for n in ours)

    def outcome(self, steps: int | None) -> tuple[bool, str]:
        """Once :meth:`ended`: whether the job finished, and one line saying so or why not."""
        failed = [n for n in self.nodes if n.exited not in (None, 0)]
        if failed:
            return False, _why_failed(failed)
        if not self.rows():
            return False, "the job ended without a step: see the nodes' logs in " + str(self.run_dir)
        if steps is not None and self.step() < steps:
            return False, f"the job ended at step {self.step()}, before step {steps}"
        return True, "the job finished"

    def finished(self, steps: int | None) -> bool:
        """The job is over and it trained to the end (every agent exited 0)."""
        return self.ended() and self.outcome(steps)[0]

    def node_state(self, n: ClusterNode) -> str:
        """What the view says of a node: what we did to it, else what its agent and workers did."""
        if n.state in ("killed", "frozen"):
            return n.state
        if n.exited is not None:
            return "exited (0)" if n.exited == 0 else f"failed (exit {n.exited})"
        crashes, rows = n.node.crashes(), n.node.progress()
        if crashes and (not rows or crashes[-1].at > rows[-1]["time"]):
            return "crashed" if crashes[-1].kind == "crash" else "hung"
        return "up" if rows else "starting"

    def reports_job_steps(self) -> bool:
        """Whether the step numbers seen are the job's own (so rollbacks can be counted)."""
        rows = self.rows()
        return bool(rows) and all(r.get("kind", "file") in ("file", "job") for r in rows)


def _why_failed(failed: list[ClusterNode]) -> str:
    """One line: the node whose agent gave up first, with its workers' last error and its log."""
    gave_up = sorted(((c.at, i, n, c) for i, n in enumerate(failed) for c in n.node.crashes() if c.gave_up),
                     key=lambda t: (t[0], t[1]))
    if gave_up:
        _, _, n, crash = gave_up[0]
        count = len(n.node.crashes())
        return (f"the job failed: {n.node.name} gave up ({crash.gave_up}) after {count} worker "
                f"{'crash' if count == 1 else 'crashes'}; last: {crash.describe()}; log: {n.node.log_path}")
    n = failed[0]
    return (f"the job failed: {n.node.name}'s agent exited with {n.exited}: "
            f"{n.node.log.last_error or 'no error line in its log'}; log: {n.node.log_path}")


def _recovery_rows(fault: Fault, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's steps that show the job over ``fault``.

    A node fault is over at the first step of a later rendezvous round. An etcd outage
    should cost no round at all: it is over at the first step after etcd is back (in
    whatever round; a new round shows as steps rolled back).
    """
    if fault.kind == ETCD_OUTAGE:
        if fault.lifted_at is None:
            return []
        return [r for r in rows if r["time"] > fault.lifted_at and r["step"] > fault.step_before]
    return [r for r in rows if r["time"] > fault.at and r.get("round", -1) > fault.round_before]


def _outage_note(fault: Fault, rows: list[dict[str, Any]], resumed: dict[str, Any]) -> str:
    """What an etcd outage did to training: it should go on, in the same round."""
    assert fault.lifted_at is not None
    during = [r for r in rows if fault.at < r["time"] <= fault.lifted_at]
    same = resumed.get("round", -1) == fault.round_before
    return (f"etcd down {fault.lifted_at - fault.at:.1f} s, {len(during)} steps trained meanwhile, "
            + ("same round" if same else f"round {fault.round_before} -> {resumed.get('round', -1)}"))


def kill_during_snapshot(target: ClusterNode, snapshot_dir: Path, every: int, window: float | None = None) -> str:
    """SIGKILL ``target`` (rank 0's node) while its snapshot writer's temp dir exists.

    The writer makes ``.tmp-step-...-<pid>-...`` and renames it when durable, so a new temp
    dir whose pid is alive is a write in progress. Its writer is SIGKILLed by pid at once
    (scanning the process tree takes milliseconds, longer than a small write), then the
    whole node. If no write shows within ``window`` seconds, the kill lands right after
    the next snapshot step instead. Returns what happened, for the fault's summary line.
    """
    window = window if window is not None else max(10.0, 3.0 * every * _step_seconds(target))
    seen = _temp_dirs(snapshot_dir)
    deadline = time.monotonic() + window
    while time.monotonic() < deadline:
        for name, pid in _temp_dirs(snapshot_dir).items():
            if name not in seen and pid_alive(pid):
                _sigkill(pid)
                target.node.kill()
                left = (snapshot_dir / name).exists()
                return f"caught {name[:22]}: " + ("write cut short" if left else "rename won the race")
        time.sleep(0.0005)
    boundary = _next_snapshot_step(target, every, timeout=window)
    target.node.kill()
    return f"no write seen in {window:.0f} s; killed after snapshot step {boundary}"


def _temp_dirs(snapshot_dir: Path) -> dict[str, int]:
    try:
        entries = os.listdir(snapshot_dir)
    except OSError:
        return {}
    found = {}
    for name in entries:
        parsed = parse_temp_dirname(name)
        if parsed is not None:
            found[name] = parsed.pid
    return found


def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _step_seconds(target: ClusterNode) -> float:
    rows = target.node.progress()[-20:]
    if len(rows) < 2 or rows[-1]["time"] <= rows[0]["time"]:
        return 0.2
    return (rows[-1]["time"] - rows[0]["time"]) / (len(rows) - 1)


def _next_snapshot_step(target: ClusterNode, every: int, timeout: float) -> int | None:
    """Wait until ``target`` reports a step that is a multiple of ``every``."""
    start = len(target.node.progress())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for row in target.node.progress()[start:]:
            if every and row["step"] % every == 0:
                return int(row["step"])
        time.sleep(0.005)
    return None


_COLOURS = {"killed": "red", "frozen": "yellow", "up": "green", "crashed": "red", "hung": "red"}
_NO_LOSS_NOTE = ("loss, samples/s: '-' for your own script (only the example jobs report them; "
                 "elastic.report_progress(step) reports the job's step)")


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
    snaps = sorted(cluster.snapshot_dir.glob("step-*"))
    recovered = sum(f.recovered_at is not None for f in cluster.faults)
    lines = [f"last snapshot: {snaps[-1].name if snaps else 'none yet'}   faults: {len(cluster.faults)}   "
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
    if len(rows) < 2:
        return 0.0
    recent = [r for r in rows if r["time"] >= rows[-1]["time"] - window]
    if len(recent) < 2 or recent[-1]["time"] <= recent[0]["time"]:
        return 0.0
    samples = sum(r["samples"] for r in recent[1:])
    return samples / (recent[-1]["time"] - recent[0]["time"]) / max(1, recent[-1]["world_size"])


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


def job_goodput(cluster: Cluster) -> Account | None:
    """The job's goodput record as the agents last mirrored it (each keeps a copy)."""
    return newest_account(n.node.agent_dir / "goodput" / JOB_FILE for n in cluster.nodes)


_STARTED_OVER = ("steps rolled back 'up to N': the script reports no step numbers, so each restart started it over "
                 "in a new process; N is what rank 0's process had done, all redone unless the script loads a "
                 "checkpoint of its own (elastic local cannot see that); elastic.report_progress(step) with the "
                 "job's step makes it exact")
_UNKNOWN_NOTE = (" (unknown: after a fault, a redone step cannot be told from a new one for a script that reports "
                 "no step numbers)")


def _rolled_back(fault: Fault, known: bool) -> str:
    if fault.steps_rolled_back is None:
        return "-"
    if known:
        return str(fault.steps_rolled_back)
    return f"up to {fault.step_before}" if fault.started_over else "0"


def summary(console: Console, cluster: Cluster) -> bool:
    """The faults (injected and crashes) and what each cost, the last progress, goodput;
    returns whether every injected fault was recovered from."""
    table = Table(title="Faults and recoveries")
    for col in ("#", "fault", "node", "world before", "recovery s", "steps rolled back"):
        table.add_column(col, justify="right" if col not in ("fault", "node") else "left")
    known = cluster.reports_job_steps()
    faults = sorted(cluster.faults + cluster.crashes, key=lambda f: f.at)
    for i, f in enumerate(faults, 1):
        rec = f"{f.recovery_seconds:.1f}" if f.recovery_seconds is not None else "[red]not seen[/red]"
        table.add_row(str(i), f.kind, f.node, str(f.world_before), rec, _rolled_back(f, known))
    console.print(table)
    for line in _crash_lines(cluster, faults):
        say(console, line)
    rows = cluster.rows()
    if rows and known and rows[-1].get("loss") is not None:
        say(console, f"final step {rows[-1]['step']} in a world of {rows[-1]['world_size']}, "
                     f"final loss {rows[-1]['loss']:.4g} (first {rows[0]['loss']:.4g})")
    elif rows and known:
        say(console, f"last step {rows[-1]['step']} in a world of {rows[-1]['world_size']}")
    elif rows:
        say(console, f"last progress in a world of {rows[-1]['world_size']}")
        if any(f.started_over for f in faults):
            say(console, _STARTED_OVER)
    account = job_goodput(cluster)
    unknown = account is not None and account.lost.get("unknown", 0.0) >= 0.05
    say(console, describe(account) + (_UNKNOWN_NOTE if unknown and rows and not known else ""))
    say(console, f"logs and snapshots: {cluster.run_dir}")
    return all(f.recovered_at is not None for f in cluster.faults)


def _crash_lines(cluster: Cluster, faults: list[Fault]) -> list[str]:
    """One line per node and error: which faults (#) it was, the error, and where the log is."""
    logs = {n.node.name: n.node.log_path for n in cluster.nodes}
    seen: dict[tuple[str, str], list[int]] = {}
    for i, f in enumerate(faults, 1):
        for name, crash in f.crashes:
            seen.setdefault((name, crash.describe()), []).append(i)
    return [f"{'#' + ', #'.join(map(str, numbers))} {name}: {what} (log {logs.get(name, '?')})"
            for (name, what), numbers in seen.items()]


@contextlib.contextmanager
def _ctrl_c_sets(event: threading.Event) -> Iterator[None]:
    """Ctrl-C sets ``event`` instead of raising KeyboardInterrupt, for the duration.

    A KeyboardInterrupt is raised at whatever bytecode the main thread is on, and this loop
    spends its time inside rich's Live, whose refresh thread shares locks with it: raised
    between a lock's acquire and the ``try`` that releases it, it would leave the refresh
    thread blocked and Live's exit waiting on it forever. Once in CI, Ctrl-C left ``elastic
    local`` running with its nodes training for 30 s. A flag the loop checks stops it at a
    known point, and a second Ctrl-C cannot cut the clean-up short.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread; elsewhere nothing to change
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _keys(stop: threading.Event, pressed: list[str]) -> None:
    """Single keypresses without Enter, when stdin is a terminal."""
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        while not stop.is_set():
            if select.select([sys.stdin], [], [], 0.2)[0]:
                pressed.append(sys.stdin.read(1))
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    job_args: list[str] = []
    if "--" in argv:
        job_args, argv = argv[argv.index("--") + 1:], argv[: argv.index("--")]
    p = argparse.ArgumentParser(
        prog="elastic local", description=__doc__.splitlines()[0].replace("``", ""),
        usage="elastic local [options] [--job mlp|resnet|resnet50 [-- job args] | SCRIPT [args] | -m MODULE [args]]",
        epilog="With no SCRIPT or -m, an example job runs (python -m elastic.train; arguments after -- go to "
               "it). SCRIPT or -m MODULE runs your own training script on every node, as torchrun takes it: in "
               "the directory elastic local was started from, with ELASTIC_SNAPSHOT_DIR set to the run "
               "directory's snapshots/. Logs (node-N.log: the agent's lines and the workers' output) stay in the "
               "run directory. Without a terminal, progress is printed as plain lines. A script reports the "
               "job's step with elastic.report_progress(step) (then steps rolled back are counted); loss and "
               "samples/s are shown for the example jobs only. More: docs/agent.md, section elastic local.")
    p.add_argument("--nodes", type=int, default=3, help="local nodes (default 3)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (default 1)")
    p.add_argument("--job", choices=("mlp", "resnet", "resnet50"), default="mlp", help="example job (default mlp)")
    p.add_argument("--steps", type=int, default=600, help="example job: steps to train (default 600)")
    p.add_argument("-m", "--module", dest="as_module", action="store_true",
                   help="SCRIPT is a module to run with python -m, as in torchrun")
    p.add_argument("--netns", action="store_true",
                   help="give each node its own network namespace and address, etcd on a bridge (root only)")
    p.add_argument("--chaos", default="kill,freeze",
                   help=f"fault kinds to cycle through, comma-separated, from {', '.join(KINDS)} "
                        "(default kill,freeze; bench/chaos_soak.py adds random timing and end-of-run checks)")
    p.add_argument("--faults", type=int, default=2, help="scheduled faults (default 2; 0 = only on keypress)")
    p.add_argument("--first-fault-after", type=float, default=10.0,
                   help="seconds of training before the first scheduled fault (default 10)")
    p.add_argument("--fault-every", type=float, default=20.0,
                   help="seconds between scheduled faults, each once the last one is recovered from (default 20)")
    p.add_argument("--back-after", type=float, default=15.0,
                   help="seconds until a killed node restarts or a frozen one thaws (default 15)")
    p.add_argument("--lease-ttl", type=int, default=DEFAULT_LEASE_TTL,
                   help=f"node lease TTL, seconds: how fast a frozen node is written off (default {DEFAULT_LEASE_TTL})")
    p.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                   help="per node: restarts for its own workers' crashes and hangs before the job fails "
                        f"(default {DEFAULT_MAX_RESTARTS}; a peer lost or a node joining does not count)")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop after this many seconds (default: none; the job runs until it ends, q or Ctrl-C)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="logs, snapshots, etcd data and the rendezvous key (default runs/local-TIME)")
    p.add_argument("script", nargs="?", default=None, metavar="SCRIPT",
                   help="your training script (or module, with -m); runs under elastic agent on every node")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="the script's arguments")
    args = p.parse_args(argv)
    if args.as_module and not args.script:
        p.error("-m needs a MODULE to run, e.g. elastic local -m my_pkg.train")
    if args.script and job_args:
        p.error("arguments after -- go to the example job; give your script's arguments after it instead")
    if args.script and not args.as_module and not Path(args.script).is_file():
        p.error(f"{args.script}: no such file; give the path of your training script (or -m MODULE)")
    if args.netns:
        from .netns import unavailable_reason

        reason = unavailable_reason()
        if reason:
            p.exit(2, f"error: --netns: {reason}; or run without --netns\n")
    if args.nodes < 2:
        p.error("--nodes must be at least 2: a fault needs survivors")
    if args.timeout is not None and not args.timeout > 0:
        p.error(f"--timeout {args.timeout:g}: give positive seconds, or leave it out to run until the job ends")
    if args.max_restarts < 0:
        p.error(f"--max-restarts {args.max_restarts}: give 0 or more")
    kinds = [k.strip() for k in args.chaos.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        p.error(f"--chaos {args.chaos!r}: use a comma-separated list of {', '.join(KINDS)}")
    if args.script and KILL_SNAPSHOT in kinds:
        p.error(f"--chaos {KILL_SNAPSHOT} needs to know where the job writes snapshots; it works with the "
                "example jobs only")
    args.kinds = kinds
    return args, job_args


def _snapshot_every(module_args: Sequence[str]) -> int:
    """The job's last --snapshot-every-steps (arguments after -- override ours)."""
    flags = [i for i, a in enumerate(module_args) if a == "--snapshot-every-steps"]
    return int(module_args[flags[-1] + 1]) if flags and flags[-1] + 1 < len(module_args) else 100


@contextlib.contextmanager
def _network(nodes: int, netns: bool) -> Iterator[Any]:
    """With --netns, nodes node-0... on their own network (removed on the way out)."""
    if not netns:
        yield None
        return
    from .netns import NodeNetwork

    with NodeNetwork([f"node-{i}" for i in range(nodes)]) as net:
        yield net


def _job(args: argparse.Namespace, job_args: list[str], run_dir: Path) -> tuple[dict[str, Any], str]:
    """What every node runs (LocalNode fields) and how the header names it."""
    if args.script:
        if args.as_module:
            return {"module": args.script, "module_args": args.script_args}, f"-m {args.script}"
        return ({"script": str(Path(args.script).resolve()), "module_args": args.script_args},
                Path(args.script).name)
    module_args = ["--job", args.job, "--steps", str(args.steps), "--snapshot-dir", str(run_dir / "snapshots"),
                   "--snapshot-every-steps", "20", "--step-sleep", "0.03", "--progress", "{progress}", *job_args]
    return {"module": "elastic.train", "module_args": module_args}, f"job {args.job}"


def run_key(run_dir: Path) -> Path:
    """The run's rendezvous key (0600), made once: a --run-dir used again keeps its key,
    since its etcd data was signed with it. Raises HmacKeyError for a key that cannot be used."""
    path = run_dir / KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        StateSigner(load_hmac_key(str(path), {}))  # readable, and long enough
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


def _nodes(args: argparse.Namespace, job: dict[str, Any], run_dir: Path, etcd: EmbeddedEtcd, net: Any,
           key: Path) -> list[ClusterNode]:
    """Every node runs in the user's directory, signs the rendezvous with the run's key and
    hands its workers the run's snapshot directory (ELASTIC_SNAPSHOT_DIR)."""
    agent_args = ["--lease-ttl", str(args.lease_ttl), "--snapshot-dir", str(run_dir / "snapshots")]
    return [ClusterNode(LocalNode(
        name=f"node-{i}", endpoint=etcd.endpoint, run_id="local", workdir=run_dir, cwd=Path.cwd(),
        nnodes=f"1:{args.nodes}", nproc_per_node=args.nproc_per_node, max_restarts=args.max_restarts,
        rdzv_conf={"last_call_timeout": "5"}, metrics_port=free_port(), env={HMAC_KEY_FILE_ENV: str(key)},
        agent_args=agent_args, netns=net[f"node-{i}"] if net else None, **job,
    )) for i in range(args.nodes)]


def _header(console: Console, etcd: EmbeddedEtcd, args: argparse.Namespace, what: str, run_dir: Path,
            key: Path) -> None:
    console.print(f"etcd at [cyan]{etcd.url}[/cyan]; {args.nodes} nodes x {args.nproc_per_node} workers; "
                  f"{what}; logs in {run_dir}", soft_wrap=True)
    say(console, f"workers run in {Path.cwd()}; ELASTIC_SNAPSHOT_DIR={run_dir / 'snapshots'}")
    say(console, f"rendezvous signed with {key}; watch it with: elastic top --rdzv-endpoint {etcd.endpoint} "
                 f"--rdzv-id local --rdzv-conf hmac_key_file={key}")


def _drive(cluster: Cluster, args: argparse.Namespace, display: Display, ctrl_c: threading.Event,
           pressed: list[str]) -> str:
    """Run the job to its end, landing faults; returns why it stopped: ended, q, timeout or ctrl-c."""
    started, trained_at = display.started, None
    next_fault, scheduled = None, 0
    while args.timeout is None or time.time() - started < args.timeout:
        if ctrl_c.wait(0.1):  # Ctrl-C quits like q: clean up, then the summary
            return "ctrl-c"
        cluster.tick()
        display.update()
        if cluster.ended():
            return "ended"
        if trained_at is None and cluster.rows():
            trained_at = time.time()
            next_fault = trained_at + args.first_fault_after
        key = pressed.pop(0) if pressed else ""
        if key == "q":
            return "q"
        due = (next_fault is not None and scheduled < args.faults and time.time() >= next_fault
               and (args.script or cluster.step() < 0.8 * args.steps))  # room to recover in
        calm = cluster.quiet() and all(f.recovered_at is not None for f in cluster.crashes)
        candidates = [n for n in cluster.up() if n.node.progress()]
        if (((due and calm) or key in ("k", "f")) and len(candidates) >= 2
                and cluster.world() == len(cluster.up()) * cluster.nproc):
            kind = {"k": KILL, "f": FREEZE}.get(key) or args.kinds[scheduled % len(args.kinds)]
            cluster.inject(kind, random.choice(candidates), args.back_after)
            if due:
                scheduled += 1
                next_fault = time.time() + args.fault_every
    return "timeout"


def main(argv: Sequence[str]) -> int:
    args, job_args = parse_args(argv)
    # a log or a pipe has no width: wide enough that the tables' rows stay one line each
    console = Console() if sys.stdout.isatty() or "COLUMNS" in os.environ else Console(width=120)
    run_dir = (args.run_dir or Path("runs") / time.strftime("local-%Y%m%d-%H%M%S")).resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        key = run_key(run_dir)
    except (OSError, HmacKeyError) as exc:
        print(f"error: --run-dir {run_dir}: {exc}; use a new --run-dir", file=sys.stderr)
        return 2
    job, what = _job(args, job_args, run_dir)
    with _network(args.nodes, args.netns) as net, \
            EmbeddedEtcd(data_dir=run_dir / "etcd", host=net.central_addr if net else "127.0.0.1") as etcd:
        _header(console, etcd, args, what, run_dir, key)
        cluster = Cluster(_nodes(args, job, run_dir, etcd, net, key), run_dir, args.nproc_per_node, etcd=etcd,
                          snapshot_every=_snapshot_every(job["module_args"]) if not args.script else 0)
        stop, pressed, ctrl_c = threading.Event(), [], threading.Event()
        if sys.stdin.isatty():
            threading.Thread(target=_keys, args=(stop, pressed), daemon=True).start()
        with _ctrl_c_sets(ctrl_c):
            try:
                for n in cluster.nodes:
                    n.node.start()
                with Display(console, cluster, time.time()) as display:
                    why = _drive(cluster, args, display, ctrl_c, pressed)
            finally:
                stop.set()
                for n in cluster.nodes:
                    n.node.cleanup()
    recovered = summary(console, cluster)
    return _verdict(console, cluster, args, why, recovered)


def _verdict(console: Console, cluster: Cluster, args: argparse.Namespace, why: str, recovered: bool) -> int:
    """The last line: how the job ended (or why it was stopped), and the exit code to match."""
    if why != "ended":
        target = "the script ended" if args.script else f"step {args.steps}"
        reason = {"ctrl-c": "Ctrl-C", "q": "q", "timeout": f"--timeout {args.timeout:g} s"}[why]
        console.print(f"[yellow]stopped before {target}[/yellow] ({reason})")
        return 130 if why == "ctrl-c" else 1  # 130: the shell's code for an interrupted command
    ok, line = cluster.outcome(None if args.script else args.steps)
    if ok and not recovered:
        ok, line = False, "the job ended, but a fault above was never recovered from (recovery 'not seen')"
    console.print(Text(line, style="green" if ok else "red"), soft_wrap=True)
    return 0 if ok else 1
