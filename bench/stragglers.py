"""Stragglers and spares: how soon a half-speed node is evicted, and that a healthy one never is.

Real local ``elastic agent`` nodes against an embedded etcd, ``--nnodes 3:3`` and one more
agent waiting as a spare; default agent settings (a pace record every 5 s, three slow
windows in a row). The job is a small ``ElasticRun`` loop whose per-step work is a sleep
of ``--work`` seconds, so four nodes fit on two cores; one node's work doubles when a
flag file appears (its step takes twice as long: a node at half speed).

* ``evict`` (default), ``--trials`` times: once the world of 3 trains steadily, one member
  (not rank 0's node) goes to half speed. Printed per trial and as medians: seconds from
  the slow-down to its eviction (its agent's ``elastic_agent_straggler_evictions_total``),
  to the first step of a world of 3 with the spare in it, and the job's step rate healthy,
  with the straggler and after the spare took its place (goals: eviction <= 30 s,
  throughput back within 10 % of healthy).
* ``soak``: no slow node, ``--duration`` seconds (600) beside ``--load`` busy processes (a
  loaded machine). Counted: straggler evictions, nodes written off as frozen, and every
  re-formation of the world (goal: 0, since nothing is wrong).

    .venv/bin/python bench/stragglers.py --trials 3
    .venv/bin/python bench/stragglers.py --mode soak --duration 600 --load 2
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from agent.local.local_node import AUTO_METRICS_PORT, LocalNode  # noqa: E402
from agent.etcd import EmbeddedEtcd  # noqa: E402

NAMES = ("a", "b", "c", "d")  # three members and a spare
EVICTION_GOAL_S = 30.0
THROUGHPUT_GOAL = 0.90

JOB = textwrap.dedent('''\
    """A small ElasticRun loop; its step's work is a sleep, doubled while SLOW_FLAG exists."""
    import json, os, sys, time
    import torch
    from torch import nn
    from torch.nn import functional as F
    import elastic
    from elastic.jobs.mlp import SyntheticClassification, as_batch

    progress, snapshots, work, flag = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    run = elastic.ElasticRun(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                             SyntheticClassification(4096, seed=1), global_batch_size=48, steps=10**9,
                             snapshot_dir=snapshots, snapshots=elastic.SnapshotConfig(every_steps=50),
                             data=elastic.DataConfig(collate_fn=as_batch), seed=3)
    rows = open(progress, "a")
    for x, y in run:
        loss = F.cross_entropy(run.model(x), y)
        time.sleep(work * (2 if os.path.exists(flag) else 1))  # this rank's own work
        if run.step(loss):
            rows.write(json.dumps({"step": run.step_count, "rank": run.rank, "world_size": run.world_size,
                                   "round": run.round, "time": time.time()}) + "\\n")
            rows.flush()
''')


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/stragglers.py", description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("evict", "soak"), default="evict")
    p.add_argument("--trials", type=int, default=3, help="evict: runs, each with a fresh job (default 3)")
    p.add_argument("--duration", type=float, default=600.0, help="soak: seconds of steady training (default 600)")
    p.add_argument("--load", type=int, default=2, help="soak: busy processes beside the job (default 2)")
    p.add_argument("--work", type=float, default=0.05, help="seconds of work per step on a healthy node (0.05)")
    p.add_argument("--lease-ttl", type=int, default=3)
    p.add_argument("--start-deadline", type=float, default=240.0)
    return p.parse_args()


# ------------------------------------------------------------------ the cluster


class Job:
    """Four agents (3:3 and a spare) training ``JOB``; each node's flag file slows it."""

    def __init__(self, work_dir: Path, etcd: EmbeddedEtcd, args: argparse.Namespace) -> None:
        self.dir = work_dir
        script = work_dir / "job.py"
        script.write_text(JOB)
        self.flags = {name: work_dir / f"{name}.slow" for name in NAMES}
        run_id = f"stragglers-{time.time_ns()}"
        self.nodes = [LocalNode(
            name=name, endpoint=etcd.endpoint, run_id=run_id, workdir=work_dir,
            script=str(script), module_args=["{progress}", str(work_dir / "snapshots"), str(args.work),
                                             str(self.flags[name])],
            nnodes="3:3", max_restarts=100, metrics_port=AUTO_METRICS_PORT, env={"OMP_NUM_THREADS": "1"},
            agent_args=["--lease-ttl", str(args.lease_ttl)]) for name in NAMES]

    def start(self) -> None:
        for node in self.nodes:
            node.start()

    def close(self) -> None:
        for node in self.nodes:
            node.cleanup()

    def rows(self, node: LocalNode) -> list[dict[str, Any]]:
        return [r for r in node.progress() if r.get("kind", "file") == "file"]

    def members(self) -> list[LocalNode]:
        """The nodes whose newest row is of the newest round."""
        newest = {n.name: max((r["round"] for r in self.rows(n)), default=-1) for n in self.nodes}
        top = max(newest.values())
        return [n for n in self.nodes if newest[n.name] == top and top >= 0]

    def rank0(self) -> LocalNode | None:
        for node in self.members():
            rows = self.rows(node)
            if rows and rows[-1]["rank"] == 0:
                return node
        return None

    def steady(self, steps: int) -> bool:
        """Three members in one round, each with ``steps`` steps in it, and a spare waiting."""
        members = self.members()
        if len(members) != 3 or not any(n.metric("elastic_agent_spare") == 1 for n in self.nodes):
            return False
        top = self.rows(members[0])[-1]["round"]
        return all(sum(r["round"] == top for r in self.rows(n)) >= steps for n in members)

    def rate(self, node: LocalNode, start: float, end: float) -> float:
        """Steps per second ``node`` trained between ``start`` and ``end``."""
        times = [r["time"] for r in self.rows(node) if start <= r["time"] <= end]
        return (len(times) - 1) / (times[-1] - times[0]) if len(times) >= 3 else 0.0


def until(done: Callable[[], bool], timeout: float, poll: float = 0.2) -> bool:
    deadline = time.time() + timeout
    while not done():
        if time.time() > deadline:
            return False
        time.sleep(poll)
    return True


# ------------------------------------------------------------------ evict


def evict_trial(work_dir: Path, etcd: EmbeddedEtcd, args: argparse.Namespace) -> dict[str, float] | None:
    job = Job(work_dir, etcd, args)
    job.start()
    try:
        if not until(lambda: job.steady(40), args.start_deadline):
            print("  no steady world of 3 beside a spare: skipped", flush=True)
            return None
        spare = next(n for n in job.nodes if n.metric("elastic_agent_spare") == 1)
        members = job.members()
        rank0 = job.rank0()
        slow = next(n for n in members if n is not rank0)
        watch = rank0 or next(n for n in members if n is not slow)  # its rows are the job's pace
        healthy_from = time.time()
        time.sleep(10.0)  # the window of healthy steps to measure
        slowed_at = time.time()
        job.flags[slow.name].touch()
        if not until(lambda: (slow.metric("elastic_agent_straggler_evictions_total") or 0) >= 1, 120, 0.1):
            print(f"  {slow.name} at half speed was not evicted within 120 s", flush=True)
            return None
        evicted_at = time.time()
        admitted = lambda: [r for r in job.rows(spare) if r["time"] > slowed_at and r["world_size"] == 3]  # noqa: E731
        if not until(lambda: bool(admitted()), 60):
            print("  the spare did not take the place within 60 s", flush=True)
            return None
        admitted_at = admitted()[0]["time"]
        time.sleep(12.0)  # the window after the spare's admission
        healthy = job.rate(watch, healthy_from, slowed_at)
        straggling = job.rate(watch, slowed_at + 2.0, evicted_at)
        after = job.rate(watch, admitted_at + 2.0, time.time())
        return {"eviction_s": evicted_at - slowed_at, "admitted_s": admitted_at - slowed_at,
                "healthy": healthy, "straggling": straggling, "after": after}
    finally:
        job.close()


def evict(args: argparse.Namespace, base: Path, etcd: EmbeddedEtcd) -> int:
    results = []
    for trial in range(args.trials):
        work_dir = base / f"trial-{trial}"
        work_dir.mkdir()
        found = evict_trial(work_dir, etcd, args)
        if found:
            results.append(found)
            print(f"trial {trial}: evicted {found['eviction_s']:.1f} s after the slow-down, the spare's first step "
                  f"{found['admitted_s']:.1f} s after it; steps/s healthy {found['healthy']:.2f}, with the "
                  f"straggler {found['straggling']:.2f}, after {found['after']:.2f} "
                  f"({found['after'] / found['healthy']:.0%} of healthy)", flush=True)
    if not results:
        print("no trial completed")
        return 1
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    back = statistics.median(r["after"] / r["healthy"] for r in results)
    print(f"\nhalf-speed node, a spare waiting ({len(results)} trials, medians): evicted {med['eviction_s']:.1f} s after "
          f"the slow-down (goal <= {EVICTION_GOAL_S:.0f} s), the world of 3 whole again at "
          f"{med['admitted_s']:.1f} s; throughput after / healthy {back:.2f} (goal >= {THROUGHPUT_GOAL:.2f}); "
          f"with the straggler {statistics.median(r['straggling'] / r['healthy'] for r in results):.2f}")
    met = med["eviction_s"] <= EVICTION_GOAL_S and back >= THROUGHPUT_GOAL
    print("goals: met" if met else "goals: NOT met")
    return 0 if met else 1


# ------------------------------------------------------------------ soak


def soak(args: argparse.Namespace, base: Path, etcd: EmbeddedEtcd) -> int:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    job = Job(base, etcd, args)
    job.start()
    try:
        if not until(lambda: job.steady(40), args.start_deadline):
            print("no steady world of 3 beside a spare: nothing measured")
            return 1
        rounds_at_start = {r["round"] for n in job.nodes for r in job.rows(n)}
        started = time.time()
        print(f"world of 3 and a spare; {args.duration:.0f} s beside {args.load} busy processes", flush=True)
        time.sleep(args.duration)  # the soak: nothing happens to the job, on purpose
        rows = [r for n in job.nodes for r in job.rows(n) if r["time"] >= started]
        new_rounds = sorted({r["round"] for r in rows} - rounds_at_start)
        evictions = sum(n.metric("elastic_agent_straggler_evictions_total") or 0 for n in job.nodes)
        frozen = sum(n.metric("elastic_agent_inplace_reforms_total", reason="frozen") or 0 for n in job.nodes)
        named = sum("is a straggler" in n.log_path.read_text() for n in job.nodes)
        steps = max((r["step"] for r in rows), default=0) - min((r["step"] for r in rows), default=0)
        load = subprocess.run(["cat", "/proc/loadavg"], capture_output=True, text=True).stdout.split()[:3]
        print(f"soak: {time.time() - started:.0f} s, {steps} steps, load average {' '.join(load)}: "
              f"{int(evictions)} straggler evictions, {int(frozen)} nodes written off as frozen, "
              f"{len(new_rounds)} re-formations, {named} nodes' logs naming a straggler (goal: 0 evictions)")
        return 0 if evictions == 0 and frozen == 0 and not new_rounds else 1
    finally:
        job.close()
        for hog in hogs:
            hog.kill()
            hog.wait()


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-stragglers-") as tmp:
        etcd = EmbeddedEtcd(data_dir=Path(tmp) / "etcd")
        etcd.start()
        try:
            return evict(args, Path(tmp), etcd) if args.mode == "evict" else soak(args, Path(tmp), etcd)
        finally:
            etcd.close()


if __name__ == "__main__":
    sys.exit(main())
