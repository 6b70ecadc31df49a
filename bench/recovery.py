"""Seconds from a node fault to the first completed step of the new world; join stalls.

Local nodes on this machine, each a real process tree (``elastic agent`` or plain
torchrun), on an embedded etcd. Configurations, interleaved trial by trial so machine
noise lands on all of them alike:

Two nodes, the ``mlp`` job (``python -m elastic.train``, snapshots on), one fault per trial,
the clock from the fault to the survivor's first step in a world of one:

* ``ours-kill`` / ``ours-stop`` / ``ours-kill-rank0``: ``elastic agent`` (etcd-v3, lease TTL
  ``--lease-ttl``), in-place recovery (the default);
* ``restart-kill`` / ``restart-stop``: the same with ``--no-in-place``: the restart path
  (warm standbys, restore from disk); ``restart-kill-cold`` adds ``--no-warm-start``;
* ``ours-kill-spare``: three agents at ``--nnodes 2:2`` (two train, one waits as a spare
  whose workers started ahead, docs/agent.md "Spares"); a member is SIGKILLed and the clock
  runs to the survivor's first step in the next round, a world of two again: the spare
  admitted and healed from a replica; ``ours-kill-spare-rank0`` kills rank 0's node instead;
* ``c10d-tuned`` / ``c10d-default``: plain torchrun, torch's c10d backend, tuned
  (``last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2``) or default;
  ``c10d-tuned-store-host`` kills the node hosting c10d's store; ``torchrun-stop`` freezes.

A plain training script (written here; it never imports ``elastic``), two faults per run,
each after 10 s of steady training in the whole world (the second once the killed node is
back), both counted; under torchrun a restarted node that never rejoins leaves the
second fault "not recovered":

* ``script-kill`` / ``script-stop``: under ``elastic agent``; ``torchrun-script-kill``:
  plain torchrun, c10d tuned, the same script.

Freezes, three nodes (``elastic agent``, the ``mlp`` job, in place), a member that is not
rank 0 SIGSTOPped, the clock from the SIGSTOP to a survivor's first step in the next round:

* ``freeze``: the default: a step stuck beyond the job's own pace makes the agents ask the
  peers' witnesses, and the silent one is written off (``agent/node/freeze.py``);
* ``freeze-lease``: its anchor, the same with ``ELASTIC_FREEZE_PROBE=0``: written off when
  its etcd lease expires (``--lease-ttl``). The summary prints the ratio of the two medians.
* ``freeze-host``: the same three nodes, rank 0's node frozen instead: the first node of the
  current round, whose agent hosts the round's store (the handle exchange of the next round
  that only adds members goes through it; issue 39);
* ``freeze-host-spare``: four agents at ``--nnodes 3:3`` (one waits as a spare, its workers
  started ahead), the current round's host frozen mid-training: the clock runs to a
  survivor's first step in the next round, a world of three with the spare;
  ``freeze-host-spare-early`` freezes it as soon as the stall rule knows the pace (12 steps),
  without waiting for the spare's workers to finish their start-up: the survivors then also
  wait for that (a world of three cannot train without the spare);
* ``freeze-host-joining``: as ``ours-stop-joining`` below, but the node frozen the moment the
  round that takes a node back closes is that round's first, its store host (the issue's
  first case: the survivors' watcher and the joiner used to block on its store until it
  thawed).

A fault while a join is in progress, three nodes in place (one killed and started again;
the round that adds it back has closed, the survivors still train without it):

* ``ours-kill-joining`` / ``ours-stop-joining``: a survivor that is not rank 0 SIGKILLed /
  SIGSTOPped; the clock runs to rank 0's first step in a world without it
  (``agent/node/freeze.py``: a world that fails while a join is pending lost a member);
  ``ours-kill-joining-lease`` is its anchor, the same with ``ELASTIC_FREEZE_PROBE=0``
  (the victim left out when its lease expires, as before). The summary prints the ratio.

Sharded models (issue 42), two nodes x 2 local ranks, the same model and prepared loop
(written here: FSDP2's docs plus the prepare lines), node b SIGKILLed after 10 s of steady
training, the clock from the kill to node a's first step in a world of 2:

* ``hsdp-kill``: HSDP (``init_device_mesh((nodes, 2), ("replicate", "shard"))``), in place;
* ``ddp-prepared-kill``: the same model under DDP, in place (the anchor: goal within 20 %);
* ``hsdp-restart-kill``: HSDP with ``--no-in-place``: the restart path, resumed from the
  newest snapshot, as torchrun's restart-from-DCP would;
* ``hsdp-freeze``, ``ddp-prepared-freeze``: node b frozen (SIGSTOP) instead of killed, HSDP
  against the same model under DDP, both in place;
* ``fsdp-kill`` (issue 52): the same model sharded across every node (a 1-D mesh over all
  four ranks) with peer copies after every step (``ELASTIC_PEER_COPY_EVERY=1``), in place:
  node a re-shards the whole state over its two ranks from its live shards and the copies it
  kept of node b's; the summary prints it beside ``hsdp-kill`` (goal: within 1.5x) and
  ``fsdp-restart-kill``, the same 1-D model without copies (the restart path, resumed from
  the newest snapshot), measured in the same run.

Joins (no fault: how long the first node's training stood still while another joined):

* ``ours-join`` / ``c10d-tuned-join`` / ``c10d-default-join``: the ``mlp`` job;
* ``hsdp-join-large``: HSDP with a wider model (205 MB of parameters and AdamW state), node a
  alone, node b joins; a's stand-still and rank 0's pair's transfer, against raw gloo
  send/recv of the same bytes over two pairs at once, measured after the job;
* ``ours-join-resnet``: three nodes... two train ResNet-50 + Adam (307 MB of state), a third
  joins; the figure is the survivors' stand-still (their re-formation, transfer included)
  beside the transfer alone and a raw gloo broadcast of the same bytes in the same run.

Faults 12 s apart (``--churn SECONDS``): three nodes, a kill or a freeze every 12 s whether
or not the previous recovery has settled (killed nodes restarted 4 s later, frozen ones
thawed then), as faults cluster in real life; every SIGKILL's recovery counted, for
``churn-ours``, ``churn-restart`` and ``churn-c10d-tuned`` (whose store host is spared).

    python bench/recovery.py --trials 5 [--configs ours-kill,restart-kill,c10d-tuned]
    python bench/recovery.py --trials 3 --configs script-kill,script-stop,torchrun-script-kill
    python bench/recovery.py --churn 120 --configs churn-ours,churn-restart,churn-c10d-tuned
    python bench/recovery.py --trials 7 --configs freeze,freeze-lease
    python bench/recovery.py --trials 5 --configs freeze,freeze-host,freeze-host-spare
    python bench/recovery.py --trials 5 --configs ours-kill-joining,ours-stop-joining,ours-kill-joining-lease
    python bench/recovery.py --trials 5 --configs hsdp-kill,ddp-prepared-kill,hsdp-restart-kill
    python bench/recovery.py --trials 3 --configs fsdp-kill,hsdp-kill,fsdp-restart-kill
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from agent.local.local_node import AUTO_METRICS_PORT, LocalNode  # noqa: E402
from agent.etcd import EmbeddedEtcd, free_port  # noqa: E402

CONFIGS = ("ours-kill", "ours-stop", "ours-kill-rank0", "ours-kill-spare", "ours-kill-spare-rank0",
           "restart-kill", "restart-stop", "restart-kill-cold",
           "c10d-tuned", "c10d-default", "c10d-tuned-store-host", "torchrun-stop",
           "script-kill", "script-stop", "torchrun-script-kill",
           "ours-join", "c10d-tuned-join", "c10d-default-join", "ours-join-resnet",
           "churn-ours", "churn-restart", "churn-c10d-tuned", "freeze", "freeze-lease", "freeze-host",
           "freeze-host-spare", "freeze-host-spare-early", "freeze-host-joining", "ours-kill-joining",
           "ours-stop-joining", "ours-kill-joining-lease", "hsdp-kill", "ddp-prepared-kill", "hsdp-restart-kill",
           "hsdp-freeze", "ddp-prepared-freeze", "hsdp-join-large", "fsdp-kill", "fsdp-restart-kill")
STEADY_S = 10.0  # script-*: seconds of steady training before each fault
DEFAULT_CONFIGS = ("ours-kill", "ours-stop", "ours-kill-rank0", "restart-kill", "restart-stop", "c10d-tuned")
TUNED = {"last_call_timeout": "1", "keep_alive_interval": "1", "keep_alive_max_attempt": "2"}

PLAIN_SCRIPT = textwrap.dedent('''\
    import json, os, sys, time
    import torch, torch.distributed as dist
    from torch import nn
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(10**9):
        loss = model(torch.randn(32, 16)).pow(2).mean()
        optimizer.zero_grad(); loss.backward(); optimizer.step()
        time.sleep(0.02)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            with open(sys.argv[1], "a") as f:
                f.write(json.dumps({"node": os.environ.get("ELASTIC_NODE_NAME", ""), "rank": rank, "world_size": world,
                                    "step": step, "time": time.time(),
                                    "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                                    "round": int(os.environ.get("ELASTIC_ROUND", "-1"))}) + "\\n")
''')


PREPARED_SCRIPT = textwrap.dedent('''\
    import json, os, sys, time
    import torch, torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    import elastic

    sharded = sys.argv[2] in ("hsdp", "fsdp")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    width = int(sys.argv[3]) if len(sys.argv) > 3 else 256  # hsdp-join-large: shards worth timing a heal of
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        if sys.argv[2] == "fsdp":  # across every node: no replica (peer copies, or the restart path)
            mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
        else:
            mesh = init_device_mesh("cpu", (dist.get_world_size() // local, local),
                                    mesh_dim_names=("replicate", "shard"))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(1 << 17, 64), torch.randint(0, 4, (1 << 17,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    ft = elastic.Elastic(snapshot_dir=os.path.join(os.path.dirname(sys.argv[1]), "snapshots"),
                         snapshots=elastic.SnapshotConfig(every_steps=20))
    model, optimizer, loader = ft.prepare(model, optimizer, loader)
    for epoch in ft.epochs(1):
        for x, y in loader:
            optimizer.zero_grad(); F.cross_entropy(model(x), y).backward(); optimizer.step()
            time.sleep(0.02)
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                with open(sys.argv[1], "a") as f:
                    f.write(json.dumps({"node": os.environ.get("ELASTIC_NODE_NAME", ""), "rank": ft.rank,
                                        "world_size": ft.world_size, "step": ft.step_count, "time": time.time(),
                                        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                                        "round": -1}) + "\\n")
''')


def _agent_args(config: str, lease_ttl: int) -> list[str]:
    args = ["--lease-ttl", str(lease_ttl)]
    if config.startswith("restart") or config == "churn-restart" or "-restart-" in config:
        args.append("--no-in-place")
    if config.endswith("-cold"):
        args.append("--no-warm-start")
    return args


def make_nodes(config: str, names: tuple[str, ...], work: Path, etcd: EmbeddedEtcd, lease_ttl: int,
               module: str = "elastic.train", job: list[str] | None = None, script: str | None = None,
               nnodes: str | None = None, nproc: int = 1) -> list[LocalNode]:
    ours = not ("c10d" in config or "torchrun" in config)
    run_id = f"{config}-{time.time_ns()}"
    workdir = work / run_id
    workdir.mkdir(parents=True)
    if job is None:
        job = ["--job", "mlp", "--steps", "1000000", "--snapshot-dir", str(workdir / "snapshots"),
               "--snapshot-every-steps", "20", "--step-sleep", "0.02", "--progress", "{progress}"]
    env = {"OMP_NUM_THREADS": "1", **({"ELASTIC_FREEZE_PROBE": "0"} if config.endswith("-lease") else {}),
           **({"ELASTIC_PEER_COPY_EVERY": "1"} if config == "fsdp-kill" else {})}
    common: dict[str, Any] = dict(run_id=run_id, workdir=workdir, module=module, module_args=job,
                                  nnodes=nnodes or f"1:{len(names)}", script=script, env=env, nproc_per_node=nproc)
    nodes = []
    # torchrun's c10d store: every node needs its endpoint before any starts, so it cannot be port 0;
    # a lost race shows as the baseline failing to form (a by-hand bench, not CI)
    store_port = free_port()
    for i, name in enumerate(names):
        if ours:
            nodes.append(LocalNode(name=name, endpoint=etcd.endpoint, launcher="elastic", metrics_port=AUTO_METRICS_PORT,
                                   agent_args=_agent_args(config, lease_ttl), **common))
        else:
            conf = dict(TUNED) if "tuned" in config or "torchrun" in config else {}
            conf["is_host"] = "1" if i == 0 else "0"
            nodes.append(LocalNode(name=name, endpoint=f"127.0.0.1:{store_port}", launcher="torchrun",
                                   rdzv_backend="c10d", rdzv_conf=conf, **common))
    return nodes


def _epoch(row: dict[str, Any]) -> tuple[int, int]:
    """What changes when the world re-forms: our round, or torchrun's restart count."""
    return int(row.get("round", -1)), int(row.get("restart", 0))


def _first_after(node: LocalNode, fault_at: float, before: tuple[int, int], give_up: float) -> float | None:
    while time.time() - fault_at < give_up:
        for row in node.progress():
            if row["time"] > fault_at and _epoch(row) > before:
                return row["time"] - fault_at
        if not node.alive():
            return None  # the job died with the node
        time.sleep(0.01)
    return None


def _steady(nodes: list[LocalNode], world: int, steps: int, timeout: float) -> bool:
    deadline = time.time() + timeout
    while not all(len(n.steps_at(world)) >= steps for n in nodes):
        if time.time() > deadline:
            return False
        time.sleep(0.1)
    return True


# ------------------------------------------------------------------ one fault, two nodes


def trial(config: str, work: Path, etcd: EmbeddedEtcd, lease_ttl: int, give_up: float) -> list[float | None]:
    if config.endswith("-join"):
        return [join_pause(config, work, etcd, lease_ttl, give_up)]
    if config in ("ours-kill-spare", "ours-kill-spare-rank0"):
        return [spare_trial(config, work, etcd, lease_ttl, give_up)]
    if config in ("freeze", "freeze-lease", "freeze-host"):
        return [freeze_trial(config, work, etcd, lease_ttl, give_up)]
    if config in ("freeze-host-spare", "freeze-host-spare-early"):
        return [freeze_spare_trial(config, work, etcd, lease_ttl, give_up)]
    if config in ("ours-kill-joining", "ours-stop-joining", "ours-kill-joining-lease", "freeze-host-joining"):
        return [kill_joining_trial(config, work, etcd, lease_ttl, give_up)]
    nodes = make_nodes(config, ("a", "b"), work, etcd, lease_ttl)
    for node in nodes:
        node.start()  # both at once: a 1 s last call cannot wait for a slow import
    try:
        if not _steady(nodes, 2, 20, 120):
            print(f"  {config}: no world of 2 within 120 s; skipping", file=sys.stderr, flush=True)
            return [None]
        if config.startswith(("ours", "restart")) and not config.endswith("-cold"):
            _wait_standbys(nodes, 120)  # steady state: each survivor's standby worker has imported torch
        if config == "c10d-tuned-store-host":
            victim = nodes[0]
        elif config == "ours-kill-rank0":
            victim = next(n for n in nodes if n.steps_at(2)[-1]["rank"] == 0)
        elif config.startswith(("ours", "restart")):
            victim = next(n for n in nodes if n.steps_at(2)[-1]["rank"] != 0)
        else:
            victim = nodes[1]
        survivor = next(n for n in nodes if n is not victim)
        before = _epoch(survivor.steps_at(2)[-1])
        fault_at = time.time()
        victim.freeze() if config.endswith("stop") else victim.kill()
        return [_first_after(survivor, fault_at, before, give_up)]
    finally:
        for n in nodes:
            n.cleanup()


def spare_trial(config: str, work: Path, etcd: EmbeddedEtcd, lease_ttl: int, give_up: float) -> float | None:
    """``--nnodes 2:2`` and a third agent, a spare: a member's SIGKILL to the first step of a
    world of two again (the survivor's; the admitted spare takes part in it)."""
    nodes = make_nodes(config, ("a", "b", "c"), work, etcd, lease_ttl, nnodes="2:2")
    for node in nodes:
        node.start()
    try:
        deadline = time.time() + 120
        while sum(len(n.steps_at(2)) >= 20 for n in nodes) < 2 or not any(_is_spare(n) for n in nodes):
            if time.time() > deadline:
                print(f"  {config}: no world of 2 beside a spare within 120 s; skipping", file=sys.stderr, flush=True)
                return None
            time.sleep(0.1)
        members = [n for n in nodes if not _is_spare(n)]
        spare = next(n for n in nodes if _is_spare(n))
        while not _gauge_at_least(spare, "elastic_agent_spare_workers_ready", 1):  # started ahead, set up
            if time.time() > deadline:
                print(f"  {config}: the spare's workers not ready within 120 s; skipping", file=sys.stderr, flush=True)
                return None
            time.sleep(0.1)
        rank0 = config.endswith("rank0")
        victim = next(n for n in members if (n.steps_at(2)[-1]["rank"] == 0) == rank0)
        survivor = next(n for n in members if n is not victim)
        before = _epoch(survivor.steps_at(2)[-1])
        fault_at = time.time()
        victim.kill()
        took = _first_after(survivor, fault_at, before, give_up)
        if took is not None and any(r["world_size"] != 2 for r in survivor.progress() if r["time"] > fault_at):
            print(f"  {config}: the world shrank instead of taking the spare", file=sys.stderr, flush=True)
            return None
        return took
    finally:
        for n in nodes:
            n.cleanup()


def freeze_trial(config: str, work: Path, etcd: EmbeddedEtcd, lease_ttl: int, give_up: float) -> float | None:
    """Three nodes in place; a member that is not rank 0 SIGSTOPped (whole tree; ``freeze-host``:
    rank 0's, the round's store host): the SIGSTOP to a survivor's first step in the round
    without it (a survivor's, not the frozen node's)."""
    nodes = make_nodes(config, ("a", "b", "c"), work, etcd, lease_ttl)
    for node in nodes:
        node.start()
    try:
        if not _steady(nodes, 3, 40, 150):  # 40: the stall rule has the job's pace (elastic/inplace/stall.py)
            print(f"  {config}: no world of 3 within 150 s; skipping", file=sys.stderr, flush=True)
            return None
        _wait_standbys(nodes, 120)
        host = config == "freeze-host"
        victim = next(n for n in nodes if (n.steps_at(3)[-1]["rank"] == 0) == host)
        survivor = next(n for n in nodes if n is not victim)
        before = _epoch(survivor.steps_at(3)[-1])
        fault_at = time.time()
        victim.freeze()
        return _first_after(survivor, fault_at, before, give_up)
    finally:
        for n in nodes:
            n.cleanup()


def freeze_spare_trial(config: str, work: Path, etcd: EmbeddedEtcd, lease_ttl: int, give_up: float) -> float | None:
    """``--nnodes 3:3`` and a fourth agent, a spare: the current round's host (rank 0's node)
    SIGSTOPped mid-training, to a survivor's first step in the next round (a world of three
    again, the spare in the frozen node's place)."""
    nodes = make_nodes(config, ("a", "b", "c", "d"), work, etcd, lease_ttl, nnodes="3:3")
    for node in nodes:
        node.start()
    try:
        deadline = time.time() + 180
        early = config.endswith("-early")
        steps = 12 if early else 40
        while sum(len(n.steps_at(3)) >= steps for n in nodes) < 3 or not any(_is_spare(n) for n in nodes):
            if time.time() > deadline:
                print(f"  {config}: no world of 3 beside a spare within 180 s; skipping", file=sys.stderr, flush=True)
                return None
            time.sleep(0.1)
        spare = next(n for n in nodes if _is_spare(n))
        while not early and not _gauge_at_least(spare, "elastic_agent_spare_workers_ready", 1):
            if time.time() > deadline:
                print(f"  {config}: the spare's workers not ready within 180 s; skipping", file=sys.stderr, flush=True)
                return None
            time.sleep(0.1)
        if early and _gauge_at_least(spare, "elastic_agent_spare_workers_ready", 1):
            print(f"  {config}: the spare's workers were ready already", file=sys.stderr, flush=True)
        members = [n for n in nodes if n is not spare]
        victim = next(n for n in members if n.steps_at(3)[-1]["rank"] == 0)
        survivor = next(n for n in members if n is not victim)
        before = _epoch(survivor.steps_at(3)[-1])
        fault_at = time.time()
        victim.freeze()
        return _first_after(survivor, fault_at, before, give_up)
    finally:
        for n in nodes:
            n.cleanup()


_JOIN_ROUND = re.compile(r"round (\d+) -> (\d+) in place with (\w+): world of 3 nodes \(([^)]*)\)")


def kill_joining_trial(config: str, work: Path, etcd: EmbeddedEtcd, lease_ttl: int, give_up: float) -> float | None:
    """Three nodes in place; c is killed and started again; once the round that adds it back
    has closed (a survivor's agent says so) and before the survivors switch to it, b (a
    survivor that is not rank 0) is SIGKILLed (``ours-stop-joining``: SIGSTOPped). The clock
    runs from that fault to rank 0's first step in a round after the join round: a world
    without the victim. ``freeze-host-joining``: rank 0's node, the first of the join round
    and so its store host, is SIGSTOPped instead, and the clock runs to b's first step."""
    nodes = make_nodes(config, ("a", "b", "c"), work, etcd, lease_ttl)
    for node in nodes:
        node.start()
    try:
        if not _steady(nodes, 3, 40, 150):
            print(f"  {config}: no world of 3 within 150 s; skipping", file=sys.stderr, flush=True)
            return None
        _wait_standbys(nodes, 120)
        by_rank = {n.steps_at(3)[-1]["rank"]: n for n in nodes}
        survivor = by_rank[0]
        joiner, victim = [n for n in nodes if n is not survivor]
        joiner.kill()
        if not _trained_for(survivor, 2, 3.0, time.time(), 60):
            print(f"  {config}: no world of 2 after the first kill; skipping", file=sys.stderr, flush=True)
            return None
        seen = survivor.log_path.stat().st_size
        joiner.start()
        deadline = time.time() + 120
        while time.time() < deadline:
            with survivor.log_path.open() as f:
                f.seek(seen)
                found = _JOIN_ROUND.search(f.read())
            if found is not None and found.group(3) == joiner.name:
                break
            time.sleep(0.005)
        else:
            print(f"  {config}: {joiner.name} never joined; skipping", file=sys.stderr, flush=True)
            return None
        join_round = int(found.group(2))
        if config == "freeze-host-joining":
            if found.group(4).split(", ")[0] != survivor.name:
                print(f"  {config}: rank 0's node does not host the join round; skipping", file=sys.stderr, flush=True)
                return None
            survivor, victim = victim, survivor
        fault_at = time.time()
        victim.freeze() if config in ("ours-stop-joining", "freeze-host-joining") else victim.kill()
        switched = [r for r in survivor.progress() if r["time"] <= fault_at and int(r.get("round", -1)) >= join_round]
        if switched:  # the survivors were already training in the join round: not a kill during a join
            print(f"  {config}: the join had completed before the kill; skipping", file=sys.stderr, flush=True)
            return None
        return _first_after(survivor, fault_at, (join_round, 10**9), give_up)
    finally:
        for n in nodes:
            n.cleanup()


def script_trial(config: str, work: Path, etcd: EmbeddedEtcd, lease_ttl: int, give_up: float) -> list[float | None]:
    """A plain script, two faults of one kind on node b; both recoveries counted."""
    script = work / "plain_train.py"
    script.write_text(PLAIN_SCRIPT)
    nodes = make_nodes(config, ("a", "b"), work, etcd, lease_ttl, job=["{progress}"], script=str(script))
    for node in nodes:
        node.start()
    a, b = nodes
    out: list[float | None] = []
    try:
        if not _steady(nodes, 2, 10, 120) or not _trained_for(a, 2, STEADY_S, 0.0, 120):
            return [None, None]
        for fault in (1, 2):
            before = _epoch(a.steps_at(2)[-1])
            fault_at = time.time()
            b.freeze() if config.endswith("stop") else b.kill()
            out.append(_first_after(a, fault_at, before, give_up))
            if fault == 1:
                if config.endswith("stop"):
                    b.thaw()
                else:
                    b.start()
                back_at = time.time()
                if not _trained_for(a, 2, STEADY_S, back_at, 120):  # whole again, then steady as before
                    out.append(None)  # torchrun's c10d: the restarted node never rejoined
                    break
        return out
    finally:
        for n in nodes:
            n.cleanup()


def sharded_trial(config: str, work: Path, etcd: EmbeddedEtcd, lease_ttl: int, give_up: float) -> float | None:
    """Two nodes x 2 local ranks, the prepared script (HSDP or DDP); node b SIGKILLed after
    10 s of steady training (frozen, for a ``-freeze`` config); seconds to node a's first step
    in a world of 2."""
    script = work / "prepared_train.py"
    script.write_text(PREPARED_SCRIPT)
    kind = "ddp" if config.startswith("ddp") else "fsdp" if config.startswith("fsdp") else "hsdp"
    nodes = make_nodes(config, ("a", "b"), work, etcd, lease_ttl, job=["{progress}", kind], script=str(script),
                       nproc=2)
    for node in nodes:
        node.start()
    a, b = nodes
    try:
        if not _steady(nodes, 4, 10, 180) or not _trained_for(a, 4, STEADY_S, 0.0, 180):
            return None
        fault_at = time.time()
        if config.endswith("-freeze"):
            b.freeze()  # cleanup's SIGKILL ends the frozen tree too
        else:
            b.kill()
        while time.time() - fault_at < give_up:
            rows = a.steps_at(2, after=fault_at)
            if rows:
                return rows[0]["time"] - fault_at
            if not a.alive():
                return None
            time.sleep(0.01)
        return None
    finally:
        for n in nodes:
            n.cleanup()


def _trained_for(node: LocalNode, world: int, seconds: float, after: float, timeout: float) -> bool:
    """``node`` has trained ``seconds`` in a world of ``world`` since ``after`` (the issue's
    measurement: 10 s of steady training before each fault; churn-* is the unsteady case)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        rows = node.steps_at(world, after=after)
        if rows and rows[-1]["time"] - rows[0]["time"] >= seconds:
            return True
        time.sleep(0.1)
    return False


def join_pause(config: str, work: Path, etcd: EmbeddedEtcd, lease_ttl: int, give_up: float) -> float | None:
    """Seconds the first node's training stood still while the second joined."""
    first, second = make_nodes(config, ("a", "b"), work, etcd, lease_ttl)
    ours = config.startswith("ours")
    try:
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
    finally:
        first.cleanup()
        second.cleanup()


# ------------------------------------------------------------------ a ResNet-50 joiner


# rank 0's line (elastic.restore / world.formed): "node c joined; re-formed in place in 0.49 s, warm (...): world
# of 2 -> 3 at step 40, ranks [2] healed from [0] (282.6 MB in 0.43 s over gloo (eth0)), round 3"
_JOINED = re.compile(r"joined; re-formed in place in ([\d.]+) s.*?healed from \[[\d, ]+\] \(([\d.]+) MB in "
                     r"([\d.]+) s")


def join_resnet(work: Path, etcd: EmbeddedEtcd, lease_ttl: int, give_up: float) -> dict[str, float] | None:
    """Two nodes train ResNet-50 + Adam; a third joins. The survivors' stand-still is their
    re-formation (logged by rank 0 with the transfer's size and time)."""
    nodes = make_nodes("ours-join-resnet", ("a", "b", "c"), work, etcd, lease_ttl, job=[
        "--job", "resnet50", "--steps", "1000000", "--global-batch-size", "6", "--image-size", "32",
        "--dataset-size", "256", "--snapshot-dir", str(work / "resnet-snapshots"), "--snapshot-every-steps", "0",
        "--progress", "{progress}"])
    a, b, c = nodes
    try:
        a.start()
        b.start()
        if not _steady([a, b], 2, 5, 300):
            return None
        joined_at = time.time()
        c.start()
        deadline = time.time() + give_up + 120
        while time.time() < deadline:
            for node in (a, b):
                match = _JOINED.search(node.log_path.read_text(errors="replace"))
                if match:
                    stall = float(match.group(1))
                    steps = [r["time"] for r in a.progress()]
                    return {"stall": stall, "mb": float(match.group(2)), "transfer": float(match.group(3)),
                            "joined_after": time.time() - joined_at, "steps": len(steps)}
            time.sleep(0.2)
        return None
    finally:
        for n in nodes:
            n.cleanup()


HEAL_WIDTH = 4096  # hsdp-join-large: 17.1 M parameters, 205 MB of them and AdamW's state, in two shards


def hsdp_join(work: Path, etcd: EmbeddedEtcd, lease_ttl: int, give_up: float,
              width: int = HEAL_WIDTH) -> dict[str, float] | None:
    """HSDP, node a (2 local ranks) trains alone; node b joins and its local rank i is healed
    from a's local rank i, both pairs at once. Rank 0 logs the re-formation (a's stand-still)
    and its own pair's transfer (half the shards)."""
    script = work / "prepared_train.py"
    script.write_text(PREPARED_SCRIPT)
    nodes = make_nodes("hsdp-join-large", ("a", "b"), work, etcd, lease_ttl, job=["{progress}", "hsdp", str(width)],
                       script=str(script), nproc=2)
    a, b = nodes
    try:
        a.start()
        if not _steady([a], 2, 5, 300):
            return None
        b.start()
        deadline = time.time() + give_up + 120
        while time.time() < deadline:
            match = _JOINED.search(a.log_path.read_text(errors="replace"))
            if match:
                return {"stall": float(match.group(1)), "mb": float(match.group(2)), "transfer": float(match.group(3))}
            time.sleep(0.2)
        return None
    finally:
        for n in nodes:
            n.cleanup()


def raw_pairs_seconds(nbytes: int, work: Path) -> float:
    """Raw gloo send/recv of ``nbytes`` over two pairs at once (ranks 0 -> 2 and 1 -> 3), as an
    HSDP heal moves a node's shards: the anchor of ``hsdp-join-large``."""
    return _raw_gloo_seconds(4, nbytes, "dist.send(flat, rank + 2) if rank < 2 else dist.recv(flat, rank - 2)", work)


def raw_broadcast_seconds(nbytes: int, work: Path) -> float:
    """A raw gloo broadcast of ``nbytes`` from rank 0 to two others, as the join's anchor."""
    return _raw_gloo_seconds(3, nbytes, "dist.broadcast(flat, 0)", work)


def _raw_gloo_seconds(world: int, nbytes: int, move: str, work: Path) -> float:
    """The median of three timings of ``move`` (a statement over ``flat``, ``nbytes`` bytes) in
    ``world`` fresh processes on one gloo group, between barriers."""
    import subprocess

    code = textwrap.dedent(f'''\
        import sys, time, torch, torch.distributed as dist
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", store=dist.FileStore({str(work / f"raw-store-{time.time_ns()}")!r}, {world}),
                                rank=rank, world_size={world})
        flat = torch.empty({nbytes}, dtype=torch.uint8)
        times = []
        for _ in range(3):
            dist.barrier(); t0 = time.perf_counter()
            {move}
            dist.barrier()
            times.append(time.perf_counter() - t0)
        if rank == 0: print(sorted(times)[1])
    ''')
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stdout=subprocess.PIPE, text=True)
             for r in range(world)]
    out = procs[0].communicate(timeout=300)[0]
    for p in procs[1:]:
        p.wait(timeout=60)
    return float(out.strip())


# ------------------------------------------------------------------ faults 12 s apart


def churn(config: str, work: Path, etcd: EmbeddedEtcd, lease_ttl: int, duration: float,
          every: float = 12.0, back: float = 4.0) -> list[float | None]:
    """Three nodes; a kill or a freeze every ``every`` s; every SIGKILL's recovery."""
    nodes = make_nodes(config, ("a", "b", "c"), work, etcd, lease_ttl)
    for n in nodes:
        n.start()
    recoveries: list[float | None] = []
    due_back: dict[str, tuple[float, str]] = {}
    try:
        if not _steady(nodes, 3, 20, 180):
            return [None]
        started, k = time.time(), 0
        while time.time() - started < duration:
            kind = "freeze" if k % 3 == 2 else "kill"
            up = [n for n in nodes if n.name not in due_back and n.alive()]
            if config == "churn-c10d-tuned":
                up = [n for n in up if n is not nodes[0]]  # c10d cannot lose its store host
            latest = {n.name: (n.progress() or [{}])[-1] for n in nodes}
            watcher = next((n for n in nodes if n.name not in due_back and n.alive()
                            and (config != "churn-c10d-tuned" or n is nodes[0])), None)
            if not up or watcher is None:
                time.sleep(0.5)
                continue
            victim = next((n for n in up if n is not watcher), up[0])
            before = _epoch(latest[watcher.name]) if latest[watcher.name] else (-1, 0)
            fault_at = time.time()
            if kind == "kill":
                victim.kill()
            else:
                victim.freeze()
            due_back[victim.name] = (fault_at + back, kind)
            k += 1
            end = fault_at + every
            recovered: float | None = None
            while time.time() < end:
                for name, (when, how) in list(due_back.items()):
                    if time.time() >= when:
                        node = next(n for n in nodes if n.name == name)
                        node.thaw() if how == "freeze" else node.start()
                        del due_back[name]
                if recovered is None:
                    recovered = next((r["time"] - fault_at for r in watcher.progress()
                                      if r["time"] > fault_at and _epoch(r) > before), None)
                time.sleep(0.02)
            if kind == "kill":
                recoveries.append(recovered)
        return recoveries
    finally:
        for n in nodes:
            n.cleanup()


# ------------------------------------------------------------------ main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated, from {', '.join(CONFIGS)}")
    p.add_argument("--lease-ttl", type=int, default=3)
    p.add_argument("--give-up", type=float, default=90.0, help="seconds after which a trial counts as not recovered")
    p.add_argument("--churn", type=float, default=120.0, help="seconds of faults per churn-* configuration")
    p.add_argument("--json", type=Path, default=None, help="also write every figure here")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # clean up nodes and etcd
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    results: dict[str, list[float | None]] = {c: [] for c in configs}
    extra: dict[str, Any] = {}
    with EmbeddedEtcd(work / "etcd") as etcd:
        for t in range(args.trials):
            for config in configs:  # interleaved, so machine noise lands on every config alike
                if config.startswith("churn"):
                    if t == 0:
                        values = churn(config, work, etcd, args.lease_ttl, args.churn)
                    else:
                        continue
                elif config in ("hsdp-kill", "ddp-prepared-kill", "hsdp-restart-kill", "hsdp-freeze",
                                "ddp-prepared-freeze", "fsdp-kill", "fsdp-restart-kill"):
                    values = [sharded_trial(config, work, etcd, args.lease_ttl, args.give_up)]
                elif config.startswith(("script", "torchrun-script")):
                    values = script_trial(config, work, etcd, args.lease_ttl, args.give_up)
                elif config in ("hsdp-join-large", "ours-join-resnet"):  # a join, then its raw anchor
                    join, raw = (hsdp_join, raw_pairs_seconds) if config == "hsdp-join-large" else \
                        (join_resnet, raw_broadcast_seconds)
                    found = join(work, etcd, args.lease_ttl, args.give_up)
                    if found is not None:
                        found["raw"] = raw(int(found["mb"] * 1e6), work)
                        extra.setdefault(config, []).append(found)
                    values = [found["stall"] if found else None]
                else:
                    values = trial(config, work, etcd, args.lease_ttl, args.give_up)
                results[config].extend(values)
                shown = ", ".join(f"{v:.2f} s" if v is not None else "not recovered" for v in values)
                print(f"trial {t + 1}/{args.trials} {config:24s} {shown}", flush=True)
    anchor = _median(results.get("c10d-tuned", [])) or _median(results.get("torchrun-script-kill", []))
    print(f"\n{'config':24s} {'median s':>9s} {'recovered':>10s} {'vs c10d-tuned':>14s}")
    for config, values in results.items():
        med = _median(values)
        ok = sum(v is not None for v in values)
        ratio = f"{med / anchor:.2f}x" if med is not None and anchor and not config.endswith(("join", "resnet")) else "-"
        print(f"{config:24s} {med if med is not None else float('nan'):9.2f} {ok:>4d}/{len(values):<5d} {ratio:>14s}")
    for found in extra.get("ours-join-resnet", []):
        budget = found["transfer"] + 0.3
        print(f"\nours-join-resnet: survivors stood still {found['stall']:.2f} s (goal <= transfer + 0.3 = "
              f"{budget:.2f} s: {found['stall'] / budget:.2f}x); transfer {found['mb']:.1f} MB in "
              f"{found['transfer']:.2f} s = {found['mb'] / 1e3 / found['transfer']:.2f} GB/s; raw gloo broadcast of the "
              f"same bytes {found['raw']:.2f} s = {found['mb'] / 1e3 / found['raw']:.2f} GB/s; ours at "
              f"{found['raw'] / found['transfer']:.0%} of the raw broadcast's throughput (goal >= 50%)")
    for found in extra.get("hsdp-join-large", []):
        print(f"\nhsdp-join-large: node a stood still {found['stall']:.2f} s while node b joined; rank 0's pair moved "
              f"{found['mb']:.1f} MB of shards in {found['transfer']:.2f} s = {found['mb'] / 1e3 / found['transfer']:.2f} "
              f"GB/s ({found['transfer'] / found['mb'] * 1e3:.2f} s per GB per pair; both pairs at once); raw gloo "
              f"send/recv of the same bytes over two pairs {found['raw']:.2f} s = {found['mb'] / 1e3 / found['raw']:.2f} "
              f"GB/s; the heal at {found['raw'] / found['transfer']:.0%} of raw")
    frozen, lease = _median(results.get("freeze", [])), _median(results.get("freeze-lease", []))
    if frozen is not None and lease:
        print(f"\nfreeze: SIGSTOP to the first step without the node {frozen:.2f} s (median; goal <= 1.0 s) beside "
              f"{lease:.2f} s at the lease TTL (freeze-lease, ELASTIC_FREEZE_PROBE=0): {frozen / lease:.2f}x")
    host = _median(results.get("freeze-host", []))
    if frozen is not None and host is not None:
        print(f"\nfreeze the round's host: {host:.2f} s (median; goal <= 1.0 s) beside {frozen:.2f} s for another "
              f"member (freeze): {host / frozen:.2f}x")
    joining, joining_lease = _median(results.get("ours-kill-joining", [])), \
        _median(results.get("ours-kill-joining-lease", []))
    if joining is not None and joining_lease:
        print(f"\nkill while a join is pending: to the first step without the node {joining:.2f} s (median; goal "
              f"<= 1.0 s) beside {joining_lease:.2f} s at the lease TTL (ours-kill-joining-lease, "
              f"ELASTIC_FREEZE_PROBE=0): {joining / joining_lease:.2f}x")
    fsdp, hsdp, fsdp_restart = (_median(results.get(c, [])) for c in ("fsdp-kill", "hsdp-kill", "fsdp-restart-kill"))
    if fsdp is not None and hsdp:
        print(f"\nfsdp-kill (across every node, in place from peer memory): kill to first step {fsdp:.2f} s (median) "
              f"beside hsdp-kill {hsdp:.2f} s: {fsdp / hsdp:.2f}x (goal <= 1.5x)"
              + (f"; the restart path (fsdp-restart-kill) {fsdp_restart:.2f} s: {fsdp / fsdp_restart:.2f}x, plus the "
                 "steps since its snapshot" if fsdp_restart else ""))
    print(f"\nlease TTL {args.lease_ttl} s; give-up {args.give_up:.0f} s; work dir {work}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "extra": extra}, indent=1))
    return 0


def _wait_standbys(nodes: list[LocalNode], timeout: float) -> None:
    deadline = time.time() + timeout
    while not all(_standbys_ready(n) for n in nodes) and time.time() < deadline:
        time.sleep(0.2)


def _is_spare(node: LocalNode) -> bool:
    """The node's ``elastic_agent_spare`` gauge says it waits beside a full world."""
    return node.metric("elastic_agent_spare") == 1


def _standbys_ready(node: LocalNode) -> bool:
    return _gauge_at_least(node, "elastic_agent_standby_workers_ready", 1)


def _gauge_at_least(node: LocalNode, name: str, value: float) -> bool:
    return (node.metric(name) or 0.0) >= value


def _median(values: list[float | None]) -> float | None:
    done = [v for v in values if v is not None]
    return statistics.median(done) if done else None


if __name__ == "__main__":
    sys.exit(main())
