"""Chaos soak: three local nodes train under random faults; an outside ledger proves nothing was lost.

Three ``elastic agent`` nodes (``agent.local.local_cluster``) train against an embedded etcd:
the ``mlp`` job through ``ElasticRun`` (``--job mlp``, the default), or a user's plain DDP
loop changed only by the prepare API's lines (``--job plain``: ``bench/plain_loop_job.py``,
with its own set-up barrier and metric all-reduce). Whenever the world is whole again (all three nodes in the newest round)
and has trained ``--min-steps``, the soak waits a random gap and lands the next fault:

* ``kill``: SIGKILL of a random node's whole process tree (rank 0's node included);
* ``freeze``: SIGSTOP of a random node for longer than the lease TTL, then SIGCONT;
* ``kill-rank0-snapshot``: SIGKILL of rank 0's node while a snapshot is being written;
* ``etcd-outage``: etcd stopped for a few seconds, once, then started on the same ports;
* ``sdc`` (with ``--sdc``): one bit flipped in a random node's worker; recovered when the
  replica check (every 10 steps here) names it and every replica went back.

Killed nodes restart after a random delay, so the world grows back. The first four faults
are the four kinds in a random order (a short run still sees each); later ones are kills,
freezes and kills during a snapshot. At the end the soak checks, from outside the job:

* the ledger (rank 0's append-only ``ledger.jsonl``): every sample of every completed epoch
  consumed exactly once by the surviving history, whose step numbers are contiguous;
* every snapshot verifies (``python -m checkpoints verify``) and the newest one loads into
  a fresh model;
* the loss went down; the job finished or was still training (a step within
  ``--wedge-after`` seconds), and every fault was recovered from within
  ``--recovery-deadline`` seconds.

It prints one line per fault (kind, node, seconds to recovery, steps rolled back), then
totals, and exits 1 on any violation. Everything is seeded by ``--seed``.

    .venv/bin/python bench/chaos_soak.py                      # 10 minutes
    .venv/bin/python bench/chaos_soak.py --duration 120 --faults 5 --seed 1
    .venv/bin/python bench/chaos_soak.py --job plain          # a plain DDP loop, prepared
    .venv/bin/python bench/chaos_soak.py --netns              # issue 19's network and etcd faults (root)
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from agent.local.local_cluster import (  # noqa: E402
    ETCD_OUTAGE, FREEZE, KILL, KILL_SNAPSHOT, KINDS, SDC, SDC_CHECK_EVERY, Cluster, ClusterNode, Fault, job_goodput,
)
from agent.local.local_node import AUTO_METRICS_PORT, LocalNode  # noqa: E402
from agent.local.zygote import Zygote  # noqa: E402
from agent.etcd import EmbeddedEtcd  # noqa: E402
from elastic.goodput import Account, describe  # noqa: E402
from elastic.ledger import check_ledger  # noqa: E402

NODES = 3
PLAIN_JOB = Path(__file__).resolve().with_name("plain_loop_job.py")
DATASET_SIZE = 1024  # the mlp job's default: 32 steps per epoch at a global batch of 32


@dataclass
class Outcome:
    """What the soak saw; ``violations`` empty means the promise held."""

    faults: list[Fault] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/chaos_soak.py", description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0,
                   help="seconds of faults after the first world of 3 (default 600; with --faults, at most)")
    p.add_argument("--faults", type=int, default=0,
                   help="end once this many faults are over and the world is whole (default: run --duration)")
    p.add_argument("--seed", type=int, default=0, help="seeds the fault plan, targets and timings")
    p.add_argument("--job", choices=("mlp", "plain"), default="mlp",
                   help="mlp: the mlp job through ElasticRun (default); plain: a user's plain DDP loop with the "
                        "prepare API's lines (bench/plain_loop_job.py)")
    p.add_argument("--snapshot-every-steps", type=int, default=10, help="the job's snapshot interval (default 10)")
    p.add_argument("--step-sleep", type=float, default=0.05, help="the job's pretend work per step (default 0.05 s)")
    p.add_argument("--epochs", type=int, default=0, help="let the job finish after this many epochs (default: "
                                                          "train until the soak ends)")
    p.add_argument("--lease-ttl", type=int, default=3, help="agents' --lease-ttl (default 3)")
    p.add_argument("--in-place", action=argparse.BooleanOptionalAction, default=True,
                   help="survivors re-form in place (default); --no-in-place runs the restart path, for comparison")
    p.add_argument("--min-steps", type=int, default=20,
                   help="steps the whole world trains between faults, so faults land on progress and not on "
                        "restarts when the machine is slow (default 20)")
    p.add_argument("--gap", type=float, nargs=2, default=(1.0, 8.0), metavar=("MIN", "MAX"),
                   help="seconds between the world being whole again and the next fault (default 1 8)")
    p.add_argument("--back-after", type=float, nargs=2, default=(2.0, 10.0), metavar=("MIN", "MAX"),
                   help="seconds until a killed node restarts (default 2 10)")
    p.add_argument("--freeze-extra", type=float, nargs=2, default=(1.0, 4.0), metavar=("MIN", "MAX"),
                   help="a freeze lasts the lease TTL plus this many seconds (default 1 4)")
    p.add_argument("--etcd-outage", type=float, nargs=2, default=(3.0, 6.0), metavar=("MIN", "MAX"),
                   help="seconds etcd stays down (default 3 6)")
    p.add_argument("--recovery-deadline", type=float, default=120.0,
                   help="a fault not recovered from (or a world not whole again) this long after it is a wedge")
    p.add_argument("--start-deadline", type=float, default=240.0, help="seconds for the first world of 3")
    p.add_argument("--wedge-after", type=float, default=30.0,
                   help="at the end, the job must have stepped within this many seconds (default 30)")
    p.add_argument("--run-dir", type=Path, default=None, help="logs, ledger, snapshots (default runs/soak-TIME)")
    p.add_argument("--sdc", action="store_true",
                   help="add silent data corruption (a bit flipped in a node's worker) to the faults drawn; the "
                        f"job's replica check runs every {SDC_CHECK_EVERY} steps")
    p.add_argument("--netns", action="store_true",
                   help="issue 19's fault table instead: nodes in network namespaces, a 3-member etcd cluster, "
                        "partitions, cuts and etcd leader faults (root only; see bench/netns_soak.py)")
    p.add_argument("--kinds", nargs="+", default=None, metavar="KIND",
                   help="--netns: draw faults only from these kinds (partition cut-etcd cut-peers leader-kill "
                        "leader-in-round member-cut etcd-down; default all)")
    p.add_argument("--collective-timeout", type=float, default=6.0,
                   help="--netns: the job's collective timeout, which bounds how long a node cut from its peers "
                        "stalls the others before it is kept out (default 6)")
    args = p.parse_args(argv)
    if args.snapshot_every_steps < 1:
        p.error("--snapshot-every-steps must be at least 1: kill-rank0-snapshot needs snapshots")
    if args.lease_ttl < 2:
        p.error("--lease-ttl must be at least 2 (the agent's minimum)")
    return args


# ------------------------------------------------------------------ the plan


def next_kind(rng: random.Random, index: int, first: list[str]) -> str:
    """The first faults are every kind once, in ``first``'s order; then never etcd again."""
    if index < len(first):
        return first[index]
    if SDC in first:
        return rng.choices((KILL, FREEZE, KILL_SNAPSHOT, SDC), weights=(2, 1, 1, 1))[0]
    return rng.choices((KILL, FREEZE, KILL_SNAPSHOT), weights=(2, 1, 1))[0]


def hold_for(kind: str, rng: random.Random, args: argparse.Namespace) -> float:
    """How long the fault lasts: a killed node's time down, a freeze (> TTL), an outage."""
    if kind == FREEZE:
        return args.lease_ttl + rng.uniform(*args.freeze_extra)
    if kind == ETCD_OUTAGE:
        return rng.uniform(*args.etcd_outage)
    return rng.uniform(*args.back_after)


# ------------------------------------------------------------------ the cluster


def job_args(args: argparse.Namespace, run_dir: Path) -> list[str]:
    epochs = args.epochs or 100_000  # more than any soak reaches: it trains until we stop it
    if args.job == "plain":  # 8 a rank: 24 a step in a world of 3, as near the mlp job's 32 as 3 ranks split
        return ["--epochs", str(epochs), "--dataset-size", str(DATASET_SIZE), "--seed", str(args.seed),
                "--snapshot-dir", str(run_dir / "snapshots"), "--snapshot-every-steps", str(args.snapshot_every_steps),
                "--ledger", str(run_dir / "ledger.jsonl"), "--progress", "{progress}",
                "--save", str(run_dir / "model.pt"), "--step-sleep", str(args.step_sleep)]
    return ["--job", "mlp", "--epochs", str(epochs), "--dataset-size", str(DATASET_SIZE), "--seed", str(args.seed),
            "--snapshot-dir", str(run_dir / "snapshots"), "--snapshot-every-steps", str(args.snapshot_every_steps),
            "--ledger", str(run_dir / "ledger.jsonl"), "--progress", "{progress}",
            "--step-sleep", str(args.step_sleep)]


def make_cluster(args: argparse.Namespace, run_dir: Path, etcd: EmbeddedEtcd) -> Cluster:
    zygote = Zygote()  # the agents forked from one torch import, as elastic local's (agent/local/zygote.py)
    nodes = [ClusterNode(LocalNode(
        name=f"node-{i}", endpoint=etcd.endpoint, run_id="soak", workdir=run_dir, module="elastic.train",
        script=str(PLAIN_JOB) if args.job == "plain" else None, module_args=job_args(args, run_dir), nnodes=f"1:{NODES}", max_restarts=1000,
        metrics_port=AUTO_METRICS_PORT,
        agent_args=["--lease-ttl", str(args.lease_ttl), *([] if args.in_place else ["--no-in-place"])],
        env={"ELASTIC_CHECK_EVERY_STEPS": str(SDC_CHECK_EVERY)} if args.sdc else {}, zygote=zygote,
    )) for i in range(NODES)]
    return Cluster(nodes, run_dir, 1, etcd=etcd, snapshot_every=args.snapshot_every_steps)


def whole(cluster: Cluster) -> bool:
    """No fault in flight and all three nodes stepping together in the newest round."""
    row = cluster.latest()
    return cluster.quiet() and row is not None and row["world_size"] == NODES and time.time() - row["time"] < 5


def finished(cluster: Cluster) -> bool:
    """Every agent exited 0: the job reached its last epoch."""
    procs = [n.node.process for n in cluster.nodes]
    return all(p is not None and p.poll() == 0 for p in procs)


def log(started: float, text: str) -> None:
    print(f"[{time.time() - started:6.1f} s] {text}", flush=True)


# ------------------------------------------------------------------ the soak


def soak(cluster: Cluster, args: argparse.Namespace, rng: random.Random, out: Outcome) -> None:
    """Land faults until ``--duration`` is over; record wedges as violations."""
    started = time.time()
    for n in cluster.nodes:
        n.node.start()
    _wait(cluster, lambda: whole(cluster), args.start_deadline, "a first world of 3", out)
    if out.violations:
        return
    log(started, f"world of 3 at step {cluster.step()}")
    first = list(KINDS) + ([SDC] if args.sdc else [])
    rng.shuffle(first)
    started, whole_since, gap = time.time(), time.time(), rng.uniform(*args.gap)
    whole_step, trouble_since = cluster.step(), None
    while time.time() - started < args.duration and not finished(cluster):
        time.sleep(0.05)
        cluster.tick()
        if not whole(cluster):
            trouble_since = trouble_since or time.time()
            if time.time() - trouble_since > args.recovery_deadline:
                out.violations.append(_wedge(cluster, trouble_since))
                return
            continue
        if trouble_since is not None:
            whole_since, gap, trouble_since = time.time(), rng.uniform(*args.gap), None
            whole_step = cluster.step()
        trained = cluster.step() - whole_step >= args.min_steps
        if args.faults and len(cluster.faults) >= args.faults:
            if trained:  # the last fault is behind us and the whole world trains again: done
                break
            continue
        if time.time() - whole_since < gap or not trained:
            continue
        kind = next_kind(rng, len(cluster.faults), first)
        target = rng.choice([n for n in cluster.nodes])
        fault = cluster.inject(kind, target, hold_for(kind, rng, args))
        log(started, f"{kind} {fault.node} (world {fault.world_before}, step {fault.step_before})"
                     + (f": {fault.note}" if fault.note else ""))
        trouble_since = time.time()
    _wait(cluster, cluster.quiet, args.recovery_deadline, "the last fault to be recovered from", out)


def _wait(cluster: Cluster, done: Any, timeout: float, what: str, out: Outcome) -> None:
    deadline = time.time() + timeout
    while not done():
        if time.time() > deadline:
            out.violations.append(f"wedged: no {what} within {timeout:.0f} s")
            return
        gone = [n for n in cluster.nodes if n.exited is not None]
        if gone:  # a node this harness started is out: the world it waits for cannot form
            out.violations.append(f"no {what}: {gone[0].node.name} exited ({gone[0].exited}) while it formed: "
                                  f"{gone[0].node.log.last_error or 'see its log'} ({gone[0].node.log_path})")
            return
        time.sleep(0.05)
        cluster.tick()


def _wedge(cluster: Cluster, since: float) -> str:
    row = cluster.latest()
    pending = [f"{f.kind} {f.node}" for f in cluster.faults if f.recovered_at is None]
    return (f"wedged: world not whole for {time.time() - since:.0f} s (newest step {row and row['step']}, "
            f"world {row and row['world_size']}, unrecovered: {pending or 'none'})")


# ------------------------------------------------------------------ the checks


def check(cluster: Cluster, args: argparse.Namespace, out: Outcome, was_finished: bool) -> None:
    """Everything a user would look at once the nodes are gone."""
    run_dir = cluster.run_dir
    rows = cluster.rows()
    last = max((r["time"] for r in rows), default=0.0)
    out.facts["finished"] = was_finished
    out.facts["seconds_since_last_step"] = round(time.time() - last, 1)
    if not was_finished and time.time() - last > args.wedge_after:
        out.violations.append(f"wedged: no step in the last {time.time() - last:.0f} s")
    for f in cluster.faults:
        if f.recovered_at is None:
            out.violations.append(f"{f.kind} {f.node} at {f.at:.0f}: never recovered")
    _goodput(job_goodput(cluster), out)
    _check_ledger(run_dir / "ledger.jsonl", out)
    _check_snapshots(run_dir / "snapshots", out)
    _check_loss(rows, out)


def _goodput(account: Account | None, out: Outcome) -> None:
    """The job's goodput record: its line for the summary, its figures for soak.json."""
    out.facts["goodput_line"] = describe(account)
    if account is not None and account.goodput is not None:
        out.facts["goodput"] = round(account.goodput, 4)
        out.facts["wall_seconds"] = round(account.wall, 1)
        out.facts["lost_seconds"] = {cause: round(s, 1) for cause, s in account.lost.items()}


def _check_ledger(path: Path, out: Outcome) -> None:
    if not path.exists():
        out.violations.append("ledger: no ledger written")
        return
    report = check_ledger(path, DATASET_SIZE)
    out.facts["ledger_steps"] = report.steps
    out.facts["completed_epochs"] = len(report.completed_epochs)
    out.facts["incarnations"] = len(report.incarnations)
    out.violations += [f"ledger: {v}" for v in report.violations]


def _check_snapshots(snapshots: Path, out: Outcome) -> None:
    done = subprocess.run([sys.executable, "-m", "checkpoints", "verify", str(snapshots)],
                          capture_output=True, text=True, timeout=300)
    out.facts["verify"] = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr.strip()
    if done.returncode != 0:
        out.violations.append(f"snapshots: checkpoints verify exited {done.returncode}: {done.stdout}{done.stderr}")
    from checkpoints import SnapshotStore
    from elastic.jobs.mlp import make_model

    try:
        found = SnapshotStore(snapshots, create=False).load_latest()
        if found is None:
            out.violations.append("snapshots: no valid snapshot to load")
            return
        info, state = found
        make_model().load_state_dict(state["model"])  # strict: every key, every shape
        out.facts["final_snapshot_step"] = info.step
        if info.step > out.facts.get("ledger_steps", 0):
            out.violations.append(f"snapshot step {info.step} is past the ledger's {out.facts.get('ledger_steps')}")
    except Exception as e:  # noqa: BLE001 - any failure to load is the finding
        out.violations.append(f"final model does not load: {type(e).__name__}: {e}")


def _check_loss(rows: list[dict[str, Any]], out: Outcome, window: int = 32) -> None:
    """Median of rank 0's first epoch of losses against its last; one step is too noisy."""
    if len(rows) < 2 * window:
        out.violations.append(f"loss: only {len(rows)} steps reported, too few to tell")
        return
    first = statistics.median(r["loss"] for r in rows[:window])
    final = statistics.median(r["loss"] for r in rows[-window:])
    out.facts["loss_first"], out.facts["loss_final"] = round(first, 4), round(final, 4)
    if not final < first:
        out.violations.append(f"loss did not go down: median {first:.4f} at the start, {final:.4f} at the end")


# ------------------------------------------------------------------ the report


def fault_line(i: int, f: Fault) -> str:
    rec = f"{f.recovery_seconds:6.1f} s" if f.recovery_seconds is not None else "   never"
    lost = f"{f.steps_rolled_back:3d}" if f.steps_rolled_back is not None else "  -"
    note = f"  ({f.note})" if f.note else ""
    return (f"fault {i:2d}  {f.kind:<19} {f.node:<6}  world {f.world_before}  step {f.step_before:5d}  "
            f"recovery {rec}  rolled back {lost} steps{note}")


def totals(out: Outcome, args: argparse.Namespace) -> list[str]:
    faults = out.faults
    kinds = KINDS + ((SDC,) if args.sdc else ())
    lines = [f"faults: {len(faults)} (" + ", ".join(f"{k} {sum(f.kind == k for f in faults)}" for k in kinds) + ")"]
    per_kind = []
    for kind in kinds:
        times = [f.recovery_seconds for f in faults if f.kind == kind and f.recovery_seconds is not None]
        if times:
            per_kind.append(f"{kind} {statistics.median(times):.1f} s (n={len(times)}, max {max(times):.1f})")
    lines.append("median recovery: " + ("; ".join(per_kind) or "none"))
    lost = [f.steps_rolled_back for f in faults if f.steps_rolled_back is not None and f.kind != ETCD_OUTAGE]
    if lost:
        lines.append(f"median steps lost per fault: {statistics.median(lost):g} (max {max(lost)}, snapshot every "
                     f"{args.snapshot_every_steps} steps)")
        zero = sum(n == 0 for n in lost)
        lines.append(f"faults with no step rolled back: {zero} of {len(lost)} ({zero / len(lost):.0%})")
    facts = out.facts
    lines.append(f"ledger: {facts.get('ledger_steps', '?')} steps in the surviving history, "
                 f"{facts.get('completed_epochs', '?')} completed epochs, {facts.get('incarnations', '?')} incarnations")
    lines.append(f"snapshots: {facts.get('verify', '?')}; final model (step {facts.get('final_snapshot_step', '?')}) "
                 f"loads")
    lines.append(f"loss (median of rank 0's first and last 32 steps): {facts.get('loss_first', '?')} -> "
                 f"{facts.get('loss_final', '?')}")
    lines.append(str(facts.get("goodput_line", "goodput: ?")))
    lines.append("job: finished" if facts.get("finished") else
                 f"job: still training (last step {facts.get('seconds_since_last_step', '?')} s before the end)")
    lines.append(f"violations: {len(out.violations)}")
    lines += [f"  VIOLATION {v}" for v in out.violations]
    return lines


def write_json(path: Path, out: Outcome, args: argparse.Namespace) -> None:
    data = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "faults": [{**asdict(f), "recovery_seconds": f.recovery_seconds, "steps_rolled_back": f.steps_rolled_back}
                       for f in out.faults],
            "violations": out.violations, "facts": out.facts}
    path.write_text(json.dumps(data, indent=1))


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM (a test's timeout, systemd) must still clean up every node we started."""
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.netns:
        from bench.netns_soak import run as run_netns

        signal.signal(signal.SIGTERM, _terminate)
        return run_netns(args)
    rng = random.Random(args.seed)
    run_dir = (args.run_dir or Path("runs") / time.strftime("soak-%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _terminate)
    out = Outcome()
    print(f"chaos soak: {NODES} nodes, job {args.job}, {args.duration:.0f} s, seed {args.seed}, snapshot every "
          f"{args.snapshot_every_steps} steps, lease TTL {args.lease_ttl} s, "
          f"{'in place' if args.in_place else 'restart path (--no-in-place)'}; logs in {run_dir}", flush=True)
    etcd = EmbeddedEtcd(data_dir=run_dir / "etcd")
    cluster: Cluster | None = None
    try:
        etcd.start()
        cluster = make_cluster(args, run_dir, etcd)
        soak(cluster, args, rng, out)
    except KeyboardInterrupt:
        out.violations.append("interrupted before the end")
    finally:
        was_finished = cluster is not None and finished(cluster)
        for n in cluster.nodes if cluster else []:
            n.node.cleanup()
        etcd.close()
    if cluster is not None:
        out.faults = cluster.faults
        check(cluster, args, out, was_finished)
    for i, f in enumerate(out.faults, 1):
        print(fault_line(i, f))
    for line in totals(out, args):
        print(line)
    write_json(run_dir / "soak.json", out, args)
    return 1 if out.violations else 0


if __name__ == "__main__":
    sys.exit(main())
