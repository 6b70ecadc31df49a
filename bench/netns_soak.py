"""``bench/chaos_soak.py --netns``: the fault table of issue 19, at random, on real networks.

Three ``elastic agent`` nodes, each in its own network namespace, train ``elastic.train``
in place against a 3-member etcd cluster whose members live in namespaces too
(``tests/support``: the same harness the tests use). Whenever the world of three is whole
and has trained ``--min-steps``, one fault from the table lands, lasts its time, and is
healed:

* ``partition``: a node's link down for 10 s;
* ``cut-etcd``: a node cut from every etcd member, still reaching its peers;
* ``cut-peers``: a node cut from its peers, still reaching etcd;
* ``leader-kill``: the etcd leader SIGKILLed during training (restarted after a while);
* ``leader-in-round``: a node cut from etcd, and the etcd leader SIGKILLed the moment the
  round that leaves it out opens (the node stops its workers and its round store by its
  own clock, which proves it gone; the round must complete);
* ``member-cut``: the etcd leader cut from the other two members;
* ``etcd-down``: every etcd member down for 30 s while a node is SIGKILLed (once).

The first seven faults are the seven kinds in a random order; later ones are drawn from
all but ``etcd-down``. For each fault it records what the table promises and flags what
breaks it as a violation: survivors training without the node (seconds after the fault),
the node's stale worker stopped while it was still cut off, no step of the old world
after etcd dropped the node, at most two failed rounds before a kept-out node is left
out, no round change for an etcd fault alone, the whole world back after healing
(seconds), steps rolled back. At the end: the ledger (no split brain, every sample of
every completed epoch once) and every snapshot verifies.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from agent.local.netns import NodeNetwork, unavailable_reason
from agent.etcd import EtcdError
from elastic.ledger import check_ledger
from agent.rendezvous.rounds import OPEN, RoundRecord
from tests.support.etcd_cluster import EtcdCluster
from tests.support.fault_cluster import DATASET, FaultCluster, KeyWatch, pid_alive

NODES = ("node-0", "node-1", "node-2")
MEMBERS = ("e0", "e1", "e2")
PARTITION, CUT_ETCD, CUT_PEERS = "partition", "cut-etcd", "cut-peers"
LEADER_KILL, LEADER_IN_ROUND, MEMBER_CUT, ETCD_DOWN = "leader-kill", "leader-in-round", "member-cut", "etcd-down"
KINDS = (PARTITION, CUT_ETCD, CUT_PEERS, LEADER_KILL, LEADER_IN_ROUND, MEMBER_CUT, ETCD_DOWN)
NODE_FAULTS = (PARTITION, CUT_ETCD, CUT_PEERS, LEADER_IN_ROUND, ETCD_DOWN)
KEY = b"chaos-soak-netns-job-key-0123456789abcdef"


@dataclass
class NetFault:
    kind: str
    target: str
    at: float
    world_before: int
    step_before: int
    round_before: int
    healed_at: float | None = None
    out_at: float | None = None  # node faults: the survivors' first step without the target
    whole_at: float | None = None  # the world of three trained again after healing
    resumed_step: int | None = None
    rounds: int | None = None  # rounds the job went through during the fault
    note: str = ""

    @property
    def out_seconds(self) -> float | None:
        return None if self.out_at is None else self.out_at - self.at

    @property
    def back_seconds(self) -> float | None:
        return None if self.whole_at is None or self.healed_at is None else self.whole_at - self.healed_at

    @property
    def rolled_back(self) -> int | None:
        return None if self.resumed_step is None else max(0, self.step_before - (self.resumed_step - 1))


@dataclass
class Soak:
    cluster: FaultCluster
    etcd: EtcdCluster
    args: argparse.Namespace
    rng: random.Random
    started: float = field(default_factory=time.time)
    faults: list[NetFault] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ reading the job

    def newest(self) -> dict[str, Any] | None:
        rows = [r for n in NODES for r in self.cluster.rows(n)]
        return max(rows, key=lambda r: (r["round"], r["time"])) if rows else None

    def whole(self, after: float = 0.0, steps: int = 5) -> bool:
        return self.cluster.train_together(NODES, 3, steps=steps, after=after)

    def log(self, text: str) -> None:
        print(f"[{time.time() - self.started:6.1f} s] {text}", flush=True)

    def wait(self, what: str, done: Callable[[], Any], timeout: float) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if done():
                return True
            time.sleep(0.05)
        self.violations.append(f"wedged: no {what} within {timeout:.0f} s")
        return False

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        self.cluster.start()
        if not self.wait("first world of 3", lambda: self.whole(), self.args.start_deadline):
            return
        self.log(f"world of 3 at step {self.newest()['step']}")  # type: ignore[index]
        kinds = tuple(self.args.kinds or KINDS)
        first = list(kinds)
        self.rng.shuffle(first)
        self.started = time.time()
        while time.time() - self.started < self.args.duration and not self.violations_wedged():
            if self.args.faults and len(self.faults) >= self.args.faults:
                break  # inject() returns once the fault is healed and judged
            kind = first[len(self.faults)] if len(self.faults) < len(first) else \
                self.rng.choice([k for k in kinds if k != ETCD_DOWN] or list(kinds))
            since = time.time()
            time.sleep(self.rng.uniform(*self.args.gap))
            if not self.wait("whole world before the next fault",
                             lambda: self.whole(after=since, steps=self.args.min_steps), self.args.recovery_deadline):
                return
            self.inject(kind, self.rng.choice(NODES))

    def violations_wedged(self) -> bool:
        return any(v.startswith("wedged") for v in self.violations)

    def inject(self, kind: str, target: str) -> None:
        row = self.newest()
        assert row is not None
        if kind in (LEADER_KILL, MEMBER_CUT):
            target = self.etcd.wait_for_leader(30)
        fault = NetFault(kind, target, time.time(), row["world_size"], row["step"], row["round"])
        self.faults.append(fault)
        self.log(f"{kind} {target} (step {fault.step_before}, round {fault.round_before})")
        {PARTITION: self._partition, CUT_ETCD: self._cut_etcd, CUT_PEERS: self._cut_peers,
         LEADER_KILL: self._leader_kill, LEADER_IN_ROUND: self._leader_in_round, MEMBER_CUT: self._member_cut,
         ETCD_DOWN: self._etcd_down}[kind](fault)
        healed = fault.healed_at or time.time()
        if self.wait(f"world of 3 after {kind} {target}", lambda: self.whole(after=healed, steps=3),
                     self.args.recovery_deadline):
            fault.whole_at = min(r["time"] for n in NODES for r in self.cluster.rows(n, 3, after=healed))
        newest = self.newest()
        fault.rounds = (newest["round"] - fault.round_before) if newest else None
        self.log("  " + line(fault))

    # ------------------------------------------------------------------ node faults

    def _survivors_out(self, fault: NetFault, timeout: float) -> None:
        survivors = [n for n in NODES if n != fault.target]

        def out() -> bool:
            rows = [r for n in survivors for r in self.cluster.rows(n, 2, after=fault.at)]
            if rows:
                first = min(rows, key=lambda r: r["time"])
                fault.out_at, fault.resumed_step = first["time"], first["step"]
            return bool(rows)

        self.wait(f"survivors training without {fault.target}", out, timeout)

    def _stale_stopped(self, fault: NetFault, pid: int, timeout: float) -> float | None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not pid_alive(pid):
                return time.time()
            time.sleep(0.02)
        self.violations.append(f"{fault.kind} {fault.target}: its stale worker {pid} still ran {timeout:.0f} s "
                               "after the cut (not fenced by its own clock)")
        return None

    def _hold(self, fault: NetFault, seconds: float) -> None:
        time.sleep(max(0.0, fault.at + seconds - time.time()))

    def _heal_node(self, fault: NetFault) -> None:
        self.cluster.net.heal(fault.target)
        fault.healed_at = time.time()

    def _partition(self, fault: NetFault) -> None:
        stale = self.cluster.worker_pid(fault.target)
        self.cluster.net.partition(fault.target)
        try:
            self._survivors_out(fault, self.args.recovery_deadline)
            stopped = self._stale_stopped(fault, stale, 30)
            if stopped is not None:
                fault.note = f"stale worker stopped {stopped - fault.at:.1f} s after the cut"
            self._hold(fault, 10.0)
        finally:
            self._heal_node(fault)

    def _cut_etcd(self, fault: NetFault) -> None:
        stale = self.cluster.worker_pid(fault.target)
        expiry = KeyWatch(self.cluster, fault.target)
        with_target = fault.round_before
        self.cluster.net.cut_from_peers(fault.target, list(MEMBERS))  # every etcd member, not its peers
        try:
            stopped = self._stale_stopped(fault, stale, 30)
            self._survivors_out(fault, self.args.recovery_deadline)
            self._hold(fault, 10.0)
        finally:
            expiry.close()
            self._heal_node(fault)
        gone = expiry.gone_at
        if gone is None:
            self.violations.append(f"{fault.kind} {fault.target}: etcd never dropped the cut-off node's lease")
            return
        late = [r for n in NODES for r in self.cluster.rows(n, 3, after=gone)
                if r["round"] <= with_target and r["time"] < (fault.healed_at or gone)]
        if late:
            self.violations.append(f"{fault.kind} {fault.target}: the world of three trained steps "
                                   f"{sorted({r['step'] for r in late})} after etcd dropped {fault.target}")
        if stopped is not None:
            fault.note = (f"worker stopped {gone - stopped:.2f} s before etcd dropped the lease"
                          if stopped <= gone else f"worker stopped {stopped - gone:.2f} s AFTER etcd dropped it")
            if stopped > gone + 0.05:
                self.violations.append(f"{fault.kind} {fault.target}: {fault.note}")

    def _cut_peers(self, fault: NetFault) -> None:
        self.cluster.net.cut_from_peers(fault.target, [n for n in NODES if n != fault.target])
        try:
            self._survivors_out(fault, self.args.recovery_deadline)
            kept = self.wait(f"{fault.target} to say it is kept out",
                             lambda: self.cluster.metric(fault.target, "elastic_agent_kept_out") == 1, 30)
            failed_rounds = None
            survivors = [r for n in NODES if n != fault.target for r in self.cluster.rows(n, 2, after=fault.at)]
            if survivors:
                failed_rounds = min(r["round"] for r in survivors) - fault.round_before
                if failed_rounds > 2:
                    self.violations.append(f"cut-peers {fault.target}: {failed_rounds} rounds failed before it "
                                           "was kept out (at most 2)")
            backoff = self.cluster.metric(fault.target, "elastic_agent_keep_out_backoff_seconds")
            fault.note = (f"kept out after {failed_rounds} failed round(s), back-off {backoff or 0:.0f} s"
                          if kept else "never said it was kept out")
            self._hold(fault, 15.0)
        finally:
            self._heal_node(fault)

    def _leader_in_round(self, fault: NetFault) -> None:
        leader = self.etcd.wait_for_leader(30)
        key = f"/elastic/{self.cluster.run_id}/rdzv/round"
        killed: dict[str, Any] = {}
        lock = threading.Lock()

        def on_round(response: Any) -> None:
            if isinstance(response, BaseException):
                return
            for event in response.events:
                if not event.value:
                    continue
                record = RoundRecord.from_json(self.cluster.signer.open(key.encode(), event.value))
                with lock:
                    if record.state == OPEN and record.round > fault.round_before and not killed:
                        self.etcd.members[leader].kill()
                        killed.update(at=time.time(), round=record.round)

        watch = self.cluster.client.call(lambda c: c.add_watch_callback(key, on_round))
        try:
            self._cut_etcd(fault)
        finally:
            try:
                self.cluster.client.call(lambda c: c.cancel_watch(watch), deadline=2.0)
            except EtcdError:
                pass
            self.etcd.members[leader].start()
        survivors = [r for n in NODES if n != fault.target for r in self.cluster.rows(n, 2, after=fault.at)]
        if not killed:
            fault.note += "; the round opened before the watch saw it (leader not killed)"
        elif survivors and min(r["round"] for r in survivors) != killed["round"]:
            self.violations.append(f"leader-in-round: round {killed['round']}, open when leader {leader} died, "
                                   "did not complete")
            self.log(f"  what the agents logged about round {killed['round']}:\n" + self._round_lines(killed["round"]))
        else:
            fault.note += f"; leader {leader} killed while round {killed['round']} was open, and it completed"
        self.etcd.wait_for_leader(60)

    def _round_lines(self, number: int) -> str:
        """Every agent's log lines that name the round, or the next: the evidence for a flag."""
        marks = (f"round {number} ", f"round {number}:", f"round {number + 1} ", f"-> {number}")
        lines = [f"    {n}: {text}" for n in NODES
                 for text in self.cluster[n].log_path.read_text(errors="replace").splitlines()
                 if any(m in text for m in marks)]
        return "\n".join(lines[-40:])

    def _etcd_down(self, fault: NetFault) -> None:
        self.etcd.stop_all()
        self.cluster[fault.target].kill()
        died = time.time()
        self._hold(fault, 30.0)
        during = [r for n in NODES if n != fault.target for r in self.cluster.rows(n, after=died + 3)]
        if during:
            self.violations.append(f"etcd-down: the survivors trained {len(during)} steps without {fault.target} "
                                   "while no round could form")
        back = time.time()
        self.etcd.start()
        fault.note = "etcd down 30 s"
        self._survivors_out(fault, self.args.recovery_deadline)
        if fault.out_at is not None:
            fault.note += f"; survivors trained again {fault.out_at - back:.1f} s after etcd returned"
        self.cluster[fault.target].start()
        fault.healed_at = time.time()

    # ------------------------------------------------------------------ etcd faults alone

    def _unchanged(self, fault: NetFault, before: dict[str, tuple[int, int]]) -> None:
        after = {n: (self.cluster.worker_pid(n), self.cluster.rows(n)[-1]["round"]) for n in NODES}
        if after != before:
            self.violations.append(f"{fault.kind} {fault.target}: the job restarted or re-formed for an etcd fault "
                                   f"alone ({before} -> {after})")
        else:
            fault.note = f"training went on in round {fault.round_before}, no worker restarted"

    def _pause(self, fault: NetFault) -> None:
        rows = sorted((r for r in self.cluster.rows(NODES[0]) if r["time"] > fault.at - 5), key=lambda r: r["time"])
        gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:]) if b["time"] > fault.at]
        if gaps:
            fault.note += f"; longest pause between steps {max(gaps):.2f} s"

    def _leader_kill(self, fault: NetFault) -> None:
        before = {n: (self.cluster.worker_pid(n), self.cluster.rows(n)[-1]["round"]) for n in NODES}
        self.etcd.members[fault.target].kill()
        self._hold(fault, 5.0)
        self._unchanged(fault, before)
        self.etcd.members[fault.target].start()
        fault.healed_at = time.time()
        self.etcd.wait_for_leader(60)
        self._pause(fault)

    def _member_cut(self, fault: NetFault) -> None:
        before = {n: (self.cluster.worker_pid(n), self.cluster.rows(n)[-1]["round"]) for n in NODES}
        self.etcd.isolate(fault.target)
        try:
            self._hold(fault, 8.0)
            self._unchanged(fault, before)
        finally:
            self.cluster.net.heal(fault.target)
            fault.healed_at = time.time()
        self.etcd.wait_for_leader(60)
        self._pause(fault)

    # ------------------------------------------------------------------ the end

    def check(self) -> dict[str, Any]:
        facts: dict[str, Any] = {}
        path = self.cluster.workdir / "ledger.jsonl"
        if path.exists():
            report = check_ledger(path, DATASET)
            facts.update(ledger_steps=report.steps, completed_epochs=len(report.completed_epochs))
            self.violations += [f"ledger: {v}" for v in report.violations]
        else:
            self.violations.append("ledger: none written")
        done = subprocess.run([sys.executable, "-m", "checkpoints", "verify", str(self.cluster.workdir / "snapshots")],
                              capture_output=True, text=True, timeout=300)
        facts["verify"] = (done.stdout.strip().splitlines() or [done.stderr.strip()])[-1]
        if done.returncode != 0:
            self.violations.append(f"snapshots: checkpoints verify exited {done.returncode}")
        return facts


def line(f: NetFault) -> str:
    def secs(value: float | None) -> str:
        return f"{value:5.1f} s" if value is not None else "    -  "

    lost = f"{f.rolled_back:3d}" if f.rolled_back is not None else "  -"
    return (f"{f.kind:<15} {f.target:<6}  step {f.step_before:5d}  out {secs(f.out_seconds)}  "
            f"back {secs(f.back_seconds)}  rounds {f.rounds if f.rounds is not None else '-'}  "
            f"rolled back {lost}  {f.note}")


def totals(soak: Soak, facts: dict[str, Any]) -> list[str]:
    faults = soak.faults
    lines = [f"faults: {len(faults)} (" + ", ".join(f"{k} {sum(f.kind == k for f in faults)}" for k in KINDS) + ")"]
    for label, attr in (("survivors trained without the node", "out_seconds"),
                        ("whole world again after healing", "back_seconds")):
        parts = []
        for kind in KINDS:
            values = [getattr(f, attr) for f in faults if f.kind == kind and getattr(f, attr) is not None]
            if values:
                parts.append(f"{kind} {statistics.median(values):.1f} s (max {max(values):.1f})")
        lines.append(f"median, {label}: " + ("; ".join(parts) or "none"))
    lost = [f.rolled_back for f in faults if f.rolled_back is not None]
    if lost:
        lines.append(f"steps rolled back per node fault: median {statistics.median(lost):g}, max {max(lost)}")
    lines.append(f"ledger: {facts.get('ledger_steps', '?')} steps, {facts.get('completed_epochs', '?')} completed "
                 f"epochs; snapshots: {facts.get('verify', '?')}")
    lines.append(f"violations: {len(soak.violations)}")
    lines += [f"  VIOLATION {v}" for v in soak.violations]
    return lines


def run(args: argparse.Namespace) -> int:
    """Called by ``bench/chaos_soak.py --netns``."""
    unknown = sorted(set(args.kinds or ()) - set(KINDS))
    if unknown:
        print(f"error: --kinds: unknown fault kind(s) {', '.join(unknown)}; choose from {' '.join(KINDS)}",
              file=sys.stderr)
        return 2
    reason = unavailable_reason()
    if reason:
        print(f"error: --netns: {reason}; run bench/chaos_soak.py without --netns", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    run_dir = (args.run_dir or Path("runs") / time.strftime("soak-netns-%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"chaos soak --netns: {len(NODES)} nodes in namespaces, a {len(MEMBERS)}-member etcd cluster, "
          f"{args.duration:.0f} s, seed {args.seed}, lease TTL {args.lease_ttl} s, collective timeout "
          f"{args.collective_timeout:.0f} s; logs in {run_dir}", flush=True)
    with NodeNetwork([*NODES, *MEMBERS]) as net:
        etcd = EtcdCluster(net, run_dir, MEMBERS)
        cluster = FaultCluster(net, etcd.endpoints, run_dir, NODES, run_id="soak", lease_ttl=args.lease_ttl,
                               collective_timeout=args.collective_timeout, step_sleep=args.step_sleep,
                               seed=args.seed, hmac_key=KEY)
        soak = Soak(cluster, etcd, args, rng)
        try:
            etcd.start()
            soak.run()
        except KeyboardInterrupt:
            soak.violations.append("interrupted before the end")
        finally:
            cluster.close()
            etcd.close()
    facts = soak.check()
    for i, fault in enumerate(soak.faults, 1):
        print(f"fault {i:2d}  {line(fault)}")
    for text in totals(soak, facts):
        print(text)
    (run_dir / "soak.json").write_text(json.dumps({
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "faults": [{**asdict(f), "out_seconds": f.out_seconds, "back_seconds": f.back_seconds,
                    "rolled_back": f.rolled_back} for f in soak.faults],
        "violations": soak.violations, "facts": facts}, indent=1))
    return 1 if soak.violations else 0
