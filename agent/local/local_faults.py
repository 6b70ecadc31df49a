"""The cluster ``elastic local`` drives, and the faults it lands on it.

:class:`Cluster` holds the nodes (:class:`ClusterNode`) and every fault, injected or a
worker's crash (:class:`Fault`); :meth:`Cluster.tick` brings nodes back when due and
notes each recovery from rank 0's progress. The view (:mod:`agent.local.local_view`) and the
summary (:mod:`agent.local.local_summary`) only read it; :mod:`agent.local.local_cluster` runs it.

Fault kinds (``bench/chaos_soak.py`` draws from the same set):

* ``kill``: SIGKILL of a node's whole process tree;
* ``freeze``: SIGSTOP of the tree for longer than the lease TTL, then SIGCONT;
* ``kill-rank0-snapshot``: SIGKILL of rank 0's node while its snapshot writer's temp dir
  exists (caught by polling the snapshot dir), else right after a snapshot step;
* ``etcd-outage``: etcd stopped, then started again on the same ports and data;
* ``sdc``: one bit flipped in the first parameter of a node's local rank 0 (as ``elastic
  inject-sdc`` does, through the node's heartbeat directory); "recovered" when the replica
  check names a node for it (its event in that directory), with the rollback it cost. Not
  in :data:`KINDS` (the default soak's set): only when asked for (``--chaos sdc``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpoints.layout import parse_temp_dirname, pid_alive
from checkpoints.location import is_remote, split_tiers
from elastic import contract
from agent.etcd import EmbeddedEtcd

from agent.local.local_node import Crash, LocalNode
from agent.local.local_snapshots import NewestSnapshot
from agent.node.policy import Reason

KILL, FREEZE, KILL_SNAPSHOT, ETCD_OUTAGE = "kill", "freeze", "kill-rank0-snapshot", "etcd-outage"
KINDS = (KILL, FREEZE, KILL_SNAPSHOT, ETCD_OUTAGE)
SDC = "sdc"
ALL_KINDS = (*KINDS, SDC)  # what --chaos takes
ETCD_TARGET = "etcd"


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
    lease_losses_seen: int = 0  # of its log's lost leases, those already told


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
    snapshots: str | None = None  # the workers' snapshot location (--snapshot-dir); None: the run's snapshots/
    newest: NewestSnapshot | None = None  # the view's look at it, made at the first look

    @property
    def snapshot_dir(self) -> Path:
        """The snapshot directory on this machine (kill-rank0-snapshot watches its temp dirs):
        the location, or its first tier; the run's ``snapshots/`` by default."""
        if self.snapshots is None or is_remote(self.snapshots):
            return self.run_dir / "snapshots"
        tiers = split_tiers(self.snapshots)
        return Path(tiers[0] if tiers is not None else self.snapshots)

    def _newest_look(self) -> NewestSnapshot:
        """The view's look at the snapshots, made at its first use."""
        if self.newest is None:
            self.newest = NewestSnapshot(self.snapshots or str(self.run_dir / "snapshots"))
        return self.newest

    def last_snapshot(self) -> str:
        """The newest snapshot's name wherever the workers write them (a directory or a bucket)."""
        return self._newest_look().text()

    def settle_snapshot_view(self) -> None:
        """The job is over: the view's last look at the snapshots, waited for (the summary's)."""
        self._newest_look().settle()

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
            elif kind == SDC:
                from elastic.consistency.inject import request_flip

                request_flip(target.node.agent_dir / "heartbeat", 0, "first")
                target.faults += 1
            elif kind == KILL:
                target.node.kill()
            else:
                target.node.freeze()
            if kind != SDC:  # a corrupted node stays up: the replicas heal it in place
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
            self._take_lease_losses(n)
            if exited:
                self.note(f"{n.node.name}: agent exited (0)" if n.exited == 0 else
                          f"{n.node.name}: agent failed (exit {n.exited}): {n.node.log.last_error or 'see its log'}")
        rows = self.rows()
        for fault in self.faults:
            if fault.kind == SDC and fault.recovered_at is None:
                self._take_sdc(fault)
        for fault in self.faults + self.crashes:
            if fault.recovered_at is None and fault.kind != SDC:
                after = _recovery_rows(fault, rows)
                if after:
                    fault.recovered_at, fault.resumed_step = after[0]["time"], after[0]["step"]
                    fault.resumed_pid = after[0].get("pid")
                    if fault.kind == ETCD_OUTAGE:
                        fault.note = _outage_note(fault, rows, after[0])
                    self.note(f"recovered from {fault.kind} {fault.node} in {fault.recovery_seconds:.1f} s: "
                              f"world {after[0]['world_size']}, step {after[0]['step']}")

    def _take_sdc(self, fault: Fault) -> None:
        """The replica check named a node after the flip: caught, and every replica went back
        (step_before: the step it was found at; resumed_step - 1: the agreed step returned to)."""
        events = [e for n in self.nodes for e in sdc_events(n.node.agent_dir / "heartbeat", n.node.name)
                  if isinstance(e.get("time"), (int, float)) and e["time"] >= fault.at]
        if not events:
            return
        first = min(events, key=lambda e: e["time"])
        step, back_to = int(first.get("step", 0)), int(first.get("back_to", 0))
        fault.recovered_at, fault.step_before, fault.resumed_step = float(first["time"]), step, back_to + 1
        named = sorted({str(e.get("node", "?")) for e in events if e.get("step") == step})
        fault.note = (f"named {', '.join(named)} at step {step} ({', '.join(map(str, first.get('differing', [])[:3]))}"
                      f"); every replica back to step {back_to}")
        self.note(f"caught {fault.kind} {fault.node}: {fault.note}")

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

    def _take_lease_losses(self, n: ClusterNode) -> None:
        """A node that lost its etcd lease (frozen, cut off) stopped its workers as stale: said
        under the fault that caused it (a freeze of that node), in the same words as its agent."""
        n.node.log.read()
        losses = n.node.log.lease_losses
        for loss in losses[n.lease_losses_seen:]:
            name = n.node.name
            fault = next((f for f in reversed(self.faults) if name in f.node.split(",") and f.at <= loss.at), None)
            if fault is not None:
                fault.crashes.append((name, loss))
            self.note(f"{name}: {loss.describe()} (log {n.node.log_path})")
        n.lease_losses_seen = len(losses)

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
        out = n.node.kept_out_by_health()
        if out is not None and (not rows or out[0] > rows[-1]["time"]):
            return f"kept out: {out[1]}"  # its own health check failed; the agent's line says the same
        return "up" if rows else "starting"

    def reports_job_steps(self) -> bool:
        """Whether the step numbers seen are the job's own (so rollbacks can be counted)."""
        rows = self.rows()
        return bool(rows) and all(r.get("kind", "file") in ("file", "job") for r in rows)


def _why_failed(failed: list[ClusterNode]) -> str:
    """One line: the node whose agent gave up first, with its workers' last error and its log.

    A job-wide verdict that the script itself is broken comes before any other: the agents of
    such a job give up within moments of each other, and one that ran out of restarts first
    says less (its peer's crash had not reached it yet). Then a node whose workers said why:
    rank 0 alone speaks for an error every rank hits (a usage error, a diverged training)."""
    gave_up = sorted(((c.gave_up_for != Reason.SCRIPT_ERROR.value, not c.error, c.at, i, n, c)
                      for i, n in enumerate(failed) for c in n.node.crashes() if c.gave_up),
                     key=lambda t: (t[0], t[1], t[2], t[3]))
    if gave_up:
        *_, n, crash = gave_up[0]
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


def sdc_events(heartbeat_dir: Path, node: str) -> list[dict[str, Any]]:
    """The replica check's events in one node's heartbeat directory (elastic.consistency.report)."""
    out: list[dict[str, Any]] = []
    for path in sorted(heartbeat_dir.glob(contract.SDC_EVENTS_FILE.format(local_rank="*"))):
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                out.append({**event, "node": node})
    return out
