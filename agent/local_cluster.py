"""``elastic local``: a whole elastic cluster on one machine, with faults on a schedule.

An embedded etcd, N ``elastic agent`` nodes (each its own process tree), a training job,
and a live view. Faults land on a schedule or on a keypress (k = kill, f = freeze, q = quit);
killed nodes come back later, so scale-up shows too. At the end: one line per fault with
the seconds to recovery and the steps rolled back, then the final loss.

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

from checkpoints.layout import parse_temp_dirname, pid_alive
from elastic.etcd import EmbeddedEtcd, free_port
from elastic.goodput import Account, describe, newest_account
from elastic.goodput.files import JOB_FILE
from elastic.rendezvous.registry import DEFAULT_LEASE_TTL

from .local_node import LocalNode

KILL, FREEZE, KILL_SNAPSHOT, ETCD_OUTAGE = "kill", "freeze", "kill-rank0-snapshot", "etcd-outage"
KINDS = (KILL, FREEZE, KILL_SNAPSHOT, ETCD_OUTAGE)
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

    @property
    def recovery_seconds(self) -> float | None:
        """From the fault to the first step of the new world; for etcd, from etcd's return."""
        start = self.lifted_at if self.kind == ETCD_OUTAGE and self.lifted_at is not None else self.at
        return None if self.recovered_at is None else self.recovered_at - start

    @property
    def steps_rolled_back(self) -> int | None:
        return None if self.resumed_step is None else max(0, self.step_before - (self.resumed_step - 1))

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


@dataclass
class Cluster:
    nodes: list[ClusterNode]
    run_dir: Path
    nproc: int
    faults: list[Fault] = field(default_factory=list)
    etcd: EmbeddedEtcd | None = None  # needed for etcd-outage
    snapshot_every: int = 20  # the job's --snapshot-every-steps: kill-rank0-snapshot's fallback
    etcd_back_at: float | None = None

    @property
    def snapshot_dir(self) -> Path:
        return self.run_dir / "snapshots"

    def rows(self) -> list[dict[str, Any]]:
        """Every progress line of rank 0 (which speaks for the job), in time order."""
        rows = [r for n in self.nodes for r in n.node.progress() if r["rank"] == 0]
        return sorted(rows, key=lambda r: r["time"])

    def latest(self) -> dict[str, Any] | None:
        """Rank 0's newest line of the newest round: a thawed node's stale line cannot win."""
        rows = self.rows()
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
                      last_step_at=row["time"] if row else None)
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
        return fault

    def tick(self) -> None:
        """Bring nodes (and etcd) back when due; note recoveries."""
        now = time.time()
        for n in self.nodes:
            if n.state == "starting" and n.node.progress():
                n.state = "up"
            if n.back_at is not None and now >= n.back_at:
                if n.state == "killed":
                    n.node.start()
                elif n.state == "frozen":
                    n.node.thaw()
                n.state, n.back_at = "up", None
        if self.etcd is not None and self.etcd_back_at is not None and now >= self.etcd_back_at:
            self.etcd.start()
            self.etcd_back_at = None
            for fault in self.faults:
                if fault.kind == ETCD_OUTAGE and fault.lifted_at is None:
                    fault.lifted_at = time.time()
        rows = self.rows()
        for fault in self.faults:
            if fault.recovered_at is None:
                after = _recovery_rows(fault, rows)
                if after:
                    fault.recovered_at, fault.resumed_step = after[0]["time"], after[0]["step"]
                    if fault.kind == ETCD_OUTAGE:
                        fault.note = _outage_note(fault, rows, after[0])

    def quiet(self) -> bool:
        """No fault in flight: every fault recovered, etcd up, nothing frozen or due back."""
        return (all(f.recovered_at is not None for f in self.faults) and self.etcd_back_at is None
                and all(n.back_at is None for n in self.nodes))

    def up(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.state in ("up", "starting") and n.node.alive()]

    def finished(self, steps: int | None) -> bool:
        """The job is over: every node that was up has exited (0) and, for an example job,
        it reached ``steps``. A node still frozen or due back counts as not finished."""
        running = [n for n in self.nodes if n.state in ("up", "starting", "frozen")]
        if not running or any(n.node.alive() for n in running) or not self.quiet():
            return False
        codes = [n.node.process.returncode for n in running if n.node.process is not None]
        return all(code == 0 for code in codes) and (steps is None or self.step() >= steps)

    def reports_job_steps(self) -> bool:
        """Whether the step numbers seen are the job's own (so rollbacks can be counted)."""
        rows = self.rows()
        return bool(rows) and all(r.get("kind", "file") in ("file", "job") for r in rows)


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


def view(cluster: Cluster, title: str) -> Group:
    table = Table(title=title, expand=False)
    for col in ("node", "state", "rank", "world", "step", "samples/s", "loss", "faults"):
        table.add_column(col, justify="right" if col not in ("node", "state") else "left")
    for n in cluster.nodes:
        rows = n.node.progress()
        last = rows[-1] if rows else None
        rate = _rate(rows)
        state = n.state if n.state != "up" or last else "starting"
        colour = {"killed": "red", "frozen": "yellow", "up": "green"}.get(state, "white")
        table.add_row(
            n.node.name, f"[{colour}]{state}[/{colour}]",
            str(last["rank"]) if last else "-", str(last["world_size"]) if last else "-",
            str(last["step"]) if last else "-", f"{rate:.0f}" if rate else "-",
            f"{last['loss']:.4f}" if last and last.get("loss") is not None else "-", str(n.faults),
        )
    snaps = sorted((cluster.run_dir / "snapshots").glob("step-*"))
    recoveries = [f for f in cluster.faults if f.recovered_at is not None]
    footer = (f"last snapshot: {snaps[-1].name if snaps else 'none yet'}   faults: {len(cluster.faults)}   "
              f"recovered: {len(recoveries)}   keys: k=kill f=freeze q=quit")
    return Group(table, footer)


def _rate(rows: list[dict[str, Any]], window: float = 5.0) -> float:
    if len(rows) < 2:
        return 0.0
    recent = [r for r in rows if r["time"] >= rows[-1]["time"] - window]
    if len(recent) < 2 or recent[-1]["time"] <= recent[0]["time"]:
        return 0.0
    samples = sum(r["samples"] for r in recent[1:])
    return samples / (recent[-1]["time"] - recent[0]["time"]) / max(1, recent[-1]["world_size"])


def job_goodput(cluster: Cluster) -> Account | None:
    """The job's goodput record as the agents last mirrored it (each keeps a copy)."""
    return newest_account(n.node.agent_dir / "goodput" / JOB_FILE for n in cluster.nodes)


def summary(console: Console, cluster: Cluster) -> bool:
    table = Table(title="Faults and recoveries")
    for col in ("#", "fault", "node", "world before", "recovery s", "steps rolled back"):
        table.add_column(col, justify="right" if col not in ("fault", "node") else "left")
    known = cluster.reports_job_steps()
    for i, f in enumerate(cluster.faults, 1):
        rec = f"{f.recovery_seconds:.1f}" if f.recovery_seconds is not None else "[red]not seen[/red]"
        if not known:
            lost = "not known"  # the script reports no step numbers of its own: no guessing
        else:
            lost = str(f.steps_rolled_back) if f.steps_rolled_back is not None else "-"
        table.add_row(str(i), f.kind, f.node, str(f.world_before), rec, lost)
    console.print(table)
    rows = cluster.rows()
    if rows and known and rows[-1].get("loss") is not None:
        console.print(f"final step {rows[-1]['step']} in a world of {rows[-1]['world_size']}, "
                      f"final loss {rows[-1]['loss']:.4g} (first {rows[0]['loss']:.4g})")
    elif rows:
        console.print(f"last progress in a world of {rows[-1]['world_size']}"
                      + ("" if known else " (the script reports no step numbers; steps rolled back are not known: "
                                           "call elastic.report_progress(step) to have them counted)"))
    console.print(describe(job_goodput(cluster)))
    console.print(f"logs and snapshots: {cluster.run_dir}")
    return all(f.recovered_at is not None for f in cluster.faults)


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
        prog="elastic local", description=__doc__.splitlines()[0],
        usage="elastic local [options] [--job mlp|resnet|resnet50 [-- job args] | SCRIPT [args] | -m MODULE [args]]",
        epilog="With no SCRIPT or -m, an example job runs (python -m elastic.train; arguments after -- go to "
               "it). SCRIPT or -m MODULE runs your own training script on every node, as torchrun takes it.")
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
    p.add_argument("--first-fault-after", type=float, default=10.0, help="seconds of training before the first fault")
    p.add_argument("--fault-every", type=float, default=20.0, help="seconds between scheduled faults")
    p.add_argument("--back-after", type=float, default=15.0,
                   help="seconds until a killed node restarts or a frozen one thaws (default 15)")
    p.add_argument("--lease-ttl", type=int, default=DEFAULT_LEASE_TTL,
                   help=f"node lease TTL, seconds (default {DEFAULT_LEASE_TTL})")
    p.add_argument("--timeout", type=float, default=280.0, help="give up after this many seconds")
    p.add_argument("--run-dir", type=Path, default=None, help="logs and snapshots (default runs/local-TIME)")
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


def main(argv: Sequence[str]) -> int:
    args, job_args = parse_args(argv)
    console = Console()
    run_dir = (args.run_dir or Path("runs") / time.strftime("local-%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    job, what = _job(args, job_args, run_dir)
    with _network(args.nodes, args.netns) as net, \
            EmbeddedEtcd(data_dir=run_dir / "etcd", host=net.central_addr if net else "127.0.0.1") as etcd:
        console.print(f"etcd at [cyan]{etcd.url}[/cyan]; {args.nodes} nodes x {args.nproc_per_node} workers; "
                      f"{what}; logs in {run_dir}")
        cluster = Cluster([
            ClusterNode(LocalNode(
                name=f"node-{i}", endpoint=etcd.endpoint, run_id="local", workdir=run_dir,
                nnodes=f"1:{args.nodes}", nproc_per_node=args.nproc_per_node,
                rdzv_conf={"last_call_timeout": "5"}, metrics_port=free_port(),
                agent_args=["--lease-ttl", str(args.lease_ttl)], netns=net[f"node-{i}"] if net else None, **job,
            )) for i in range(args.nodes)
        ], run_dir, args.nproc_per_node, etcd=etcd,
            snapshot_every=_snapshot_every(job["module_args"]) if not args.script else 0)
        stop, pressed, ctrl_c = threading.Event(), [], threading.Event()
        if sys.stdin.isatty():
            threading.Thread(target=_keys, args=(stop, pressed), daemon=True).start()
        finished = False
        with _ctrl_c_sets(ctrl_c):
            try:
                for n in cluster.nodes:
                    n.node.start()
                started, trained_at = time.time(), None
                next_fault, scheduled = None, 0
                with Live(view(cluster, "elastic local"), console=console, refresh_per_second=4) as live:
                    while time.time() - started < args.timeout:
                        if ctrl_c.wait(0.1):  # Ctrl-C quits like q: clean up, then the summary
                            break
                        cluster.tick()
                        if trained_at is None and cluster.rows():
                            trained_at = time.time()
                            next_fault = trained_at + args.first_fault_after
                        key = pressed.pop(0) if pressed else ""
                        due = (next_fault is not None and scheduled < args.faults and time.time() >= next_fault
                               and (args.script or cluster.step() < 0.8 * args.steps))  # room to recover in
                        candidates = [n for n in cluster.up() if n.node.progress()]
                        if key == "q":
                            break
                        if (((due and cluster.quiet()) or key in ("k", "f")) and len(candidates) >= 2
                                and cluster.world() == len(cluster.up()) * cluster.nproc):
                            kind = {"k": KILL, "f": FREEZE}.get(key) or args.kinds[scheduled % len(args.kinds)]
                            target = random.choice(candidates)
                            cluster.inject(kind, target, args.back_after)
                            if due:
                                scheduled += 1
                                next_fault = time.time() + args.fault_every
                        live.update(view(cluster, f"elastic local  {time.time() - started:5.0f} s"))
                        if cluster.finished(None if args.script else args.steps):
                            finished = True
                            break
            finally:
                stop.set()
                for n in cluster.nodes:
                    n.node.cleanup()
        interrupted = ctrl_c.is_set() and not finished
    ok = summary(console, cluster)
    if not finished:
        why = "Ctrl-C" if interrupted else "timeout or q"
        console.print(f"[yellow]stopped before {'the script finished' if args.script else f'step {args.steps}'}"
                      f"[/yellow] ({why})")
    if interrupted:
        return 130  # the shell's code for an interrupted command
    return 0 if ok and (finished or args.timeout <= 0) else 1
