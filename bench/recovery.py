"""Seconds from a node fault to the first completed step of the new world.

Two local nodes train the ``mlp`` job (``python -m elastic.train``, snapshots on, so our
figure includes the restore). One node's whole process tree is SIGKILLed (or SIGSTOPped),
and the clock runs from the fault to the first step the survivor completes in a world of
one. Configurations, each over ``--trials`` fresh clusters in the same run:

* ``ours-kill`` / ``ours-stop``: ``elastic agent`` (etcd-v3, lease TTL ``--lease-ttl``);
* ``ours-kill-rank0``: the killed node is rank 0's;
* ``ours-kill-cold``: as ``ours-kill`` with ``--no-warm-start`` (every worker imports torch
  after the fault): what the standby workers of ``agent/warm_start.py`` save;
* ``c10d-tuned`` / ``c10d-default``: plain torchrun, torch's c10d backend, tuned
  (``last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2``) or default;
* ``c10d-tuned-store-host``: the killed node hosts c10d's store (the job is expected to die);
* ``torchrun-stop``: plain torchrun (c10d, tuned) with a SIGSTOPped node;
* ``ours-join`` / ``c10d-tuned-join`` / ``c10d-default-join``: no fault; a second node joins a node training
  alone, and the figure is how long training stood still (the last step of the world of
  one to the first step of the world of two, on the first node).

etcd-v2 runs only where torch's v2 client (``python-etcd``) is installed; it is not here.
A configuration that does not recover within ``--give-up`` seconds is reported as such.

    python bench/recovery.py --trials 5 [--configs ours-kill,ours-stop,c10d-tuned]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from elastic.etcd import EmbeddedEtcd, free_port
from agent.local_node import LocalNode

CONFIGS = ("ours-kill", "ours-stop", "ours-kill-rank0", "ours-kill-cold", "c10d-tuned", "c10d-default",
           "c10d-tuned-store-host", "torchrun-stop", "ours-join", "c10d-tuned-join",
           "c10d-default-join")
DEFAULT_CONFIGS = CONFIGS[:8]
TUNED = {"last_call_timeout": "1", "keep_alive_interval": "1", "keep_alive_max_attempt": "2"}


def trial(config: str, work: Path, etcd: EmbeddedEtcd, lease_ttl: int, give_up: float) -> float | None:
    ours = config.startswith("ours")
    run_id = f"{config}-{time.time_ns()}"
    snapshots = work / run_id / "snapshots"
    job = ["--job", "mlp", "--steps", "1000000", "--snapshot-dir", str(snapshots), "--snapshot-every-steps", "20",
           "--step-sleep", "0.02", "--progress", "{progress}"]
    common = dict(run_id=run_id, workdir=(work / run_id), module="elastic.train", module_args=job, nnodes="1:2")
    (work / run_id).mkdir(parents=True)
    nodes = []
    store_port = free_port()
    for i, name in enumerate(("a", "b")):
        if ours:
            node = LocalNode(name=name, endpoint=etcd.endpoint, launcher="elastic", metrics_port=free_port(),
                             agent_args=["--lease-ttl", str(lease_ttl)]
                             + (["--no-warm-start"] if config.endswith("-cold") else []), **common)  # type: ignore[arg-type]
        else:
            conf = dict(TUNED) if "tuned" in config or config == "torchrun-stop" else {}
            conf["is_host"] = "1" if i == 0 else "0"
            node = LocalNode(name=name, endpoint=f"127.0.0.1:{store_port}", launcher="torchrun",
                             rdzv_backend="c10d", rdzv_conf=conf, **common)  # type: ignore[arg-type]
        nodes.append(node)
    if config.endswith("-join"):
        try:
            return join_pause(nodes, ours, give_up)
        finally:
            for n in nodes:
                n.cleanup()
    for node in nodes:
        node.start()  # both at once: a 1 s last call cannot wait for a slow import
    try:
        deadline = time.time() + 120
        while not all(len(n.steps_at(2)) >= 20 for n in nodes):
            if time.time() > deadline:
                print(f"  {config}: no world of 2 within 120 s (torch's c10d handler chases a stale "
                      "bootstrap store after a scale-up); skipping", file=sys.stderr, flush=True)
                return None
            time.sleep(0.1)
        if ours and not config.endswith("-cold"):
            # steady state: each survivor's standby worker has finished importing torch
            while not all(_standbys_ready(n) for n in nodes):
                if time.time() > deadline:
                    print(f"  {config}: standby workers not ready within 120 s", file=sys.stderr, flush=True)
                    return None
                time.sleep(0.2)
        host_node = nodes[0]
        if config == "c10d-tuned-store-host":
            victim = host_node
        elif config == "ours-kill-rank0":
            victim = next(n for n in nodes if n.steps_at(2)[-1]["rank"] == 0)
        elif ours:
            victim = next(n for n in nodes if n.steps_at(2)[-1]["rank"] != 0)
        else:
            victim = nodes[1]
        survivor = next(n for n in nodes if n is not victim)
        fault_at = time.time()
        if config.endswith("stop"):  # ours-kill-cold is a kill
            victim.freeze()
        else:
            victim.kill()
        while time.time() - fault_at < give_up:
            after = survivor.steps_at(1, after=fault_at)
            if after:
                return after[0]["time"] - fault_at
            if not survivor.alive():
                return None  # the job died with the node
            time.sleep(0.02)
        return None
    finally:
        for n in nodes:
            n.cleanup()


def join_pause(nodes: list[LocalNode], ours: bool, give_up: float) -> float | None:
    """Seconds the first node's training stood still while the second joined."""
    first, second = nodes
    first.start()
    deadline = time.time() + 120
    while len(first.steps_at(1)) < 20 or (ours and not _standbys_ready(first)):
        if time.time() > deadline or not first.alive():
            return None
        time.sleep(0.1)
    joined_at = time.time()
    second.start()
    while time.time() - joined_at < give_up:
        together = first.steps_at(2, after=joined_at)
        if together:
            alone_before = [r["time"] for r in first.steps_at(1) if r["time"] < together[0]["time"]]
            return together[0]["time"] - max(alone_before)
        time.sleep(0.05)
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated, from {', '.join(CONFIGS)} (default: all but the -join ones)")
    p.add_argument("--lease-ttl", type=int, default=3)
    p.add_argument("--give-up", type=float, default=90.0, help="seconds after which a trial counts as not recovered")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # clean up nodes and etcd
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    results: dict[str, list[float | None]] = {c: [] for c in configs}
    with EmbeddedEtcd(work / "etcd") as etcd:
        for t in range(args.trials):
            for config in configs:  # interleaved, so machine noise lands on every config alike
                seconds = trial(config, work, etcd, args.lease_ttl, args.give_up)
                results[config].append(seconds)
                shown = f"{seconds:.2f} s" if seconds is not None else "not recovered"
                print(f"trial {t + 1}/{args.trials} {config:24s} {shown}", flush=True)
    anchors = {False: _median(results.get("c10d-tuned", [])), True: _median(results.get("c10d-tuned-join", []))
               or _median(results.get("c10d-default-join", []))}
    print(f"\n{'config':24s} {'median s':>9s} {'recovered':>10s} {'vs c10d-tuned[-join]':>21s}")
    for config, values in results.items():
        med = _median(values)
        ok = sum(v is not None for v in values)
        anchor = anchors[config.endswith("-join")]
        ratio = f"{med / anchor:.2f}x" if med is not None and anchor else "-"
        print(f"{config:24s} {med if med is not None else float('nan'):9.2f} {ok:>4d}/{len(values):<5d} {ratio:>21s}")
    print(f"\nlease TTL {args.lease_ttl} s; give-up {args.give_up:.0f} s; work dir {work}")
    return 0


def _standbys_ready(node: LocalNode) -> bool:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=5).read().decode()
    except OSError:
        return False
    return any(line.startswith("elastic_agent_standby_workers_ready ") and float(line.split()[1]) >= 1
               for line in text.splitlines())


def _median(values: list[float | None]) -> float | None:
    done = [v for v in values if v is not None]
    return statistics.median(done) if done else None


if __name__ == "__main__":
    sys.exit(main())
