"""HSDP in place (issue 42): an FSDP2 script over a 2-D mesh, under ``elastic agent``, loses a
node and gets it back without restarting the survivors.

The script is written as FSDP2's docs write it (``init_device_mesh`` with replicas across
nodes and shards inside one, ``fully_shard`` per block and on the root, AdamW after
sharding) plus the prepare lines, with collectives of its own as real scripts have (a set-up
barrier, a metric all-reduce in the loop body).

3 nodes x 2 local ranks, the global batch held: rank 0's node's whole process tree is
SIGKILLed, then another node is frozen (SIGSTOP); both come back. 2 nodes x 2 local ranks:
rank 0's node is SIGTERMed (pre-empted: it leaves at a step boundary) and comes back. In
both, the workers of a node that stayed keep their pids, the replicate dimension shrinks,
the step that failed is not applied and none is rolled back; a returning node's local rank
i is healed from a live replica's local rank i (shards, not the disk), and from then on the
replicas' shards are bitwise equal at every step. Every sample of each epoch is trained
once (the ledger). At 3 nodes the trained model also equals an undisturbed run's. The
SIGTERM case snapshots to a real S3 server (SeaweedFS): every rank uploads its own shards.

While a test waits for a node's return, the script steps once a second (``_held``): a return
that a loaded machine makes slow costs few steps, so the jobs are short and few steps follow
the last fault (each step is ~20 ms of CPU a rank, most of these tests' cost)."""

from __future__ import annotations

import contextlib
import os
import signal
import textwrap
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
from agent.etcd import EmbeddedEtcd
from agent.local.local_node import AUTO_METRICS_PORT
from checkpoints.reading import DCP_DIR_KEY
from checkpoints.s3store import S3SnapshotStore
from elastic.ledger import check_ledger
from tests.support.stacks import stacks_and_tails
from tests.support.nodes import TorchrunNode as Node
from tests.support.s3server import SeaweedS3
from tests.support.waiting import wait_until
from tests.elastic.inplace.support import read_rows

FORM_TIMEOUT = 150
DATASET = 768
# a kill is seen at once (the connection resets): the lease only has to outlast a loaded machine
# (at 2 s a whole-suite run starved a survivor's keep-alive, and its workers were restarted)
LEASE_TTL = 5
HOLD = "hold"  # while this file is in a run's folder, its ranks step once a second (_held)

HSDP = textwrap.dedent('''\
    import hashlib, json, os, sys, time
    import torch, torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import elastic

    class Data(torch.utils.data.Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(3)
            self.x, self.y = torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)
        def __len__(self): return len(self.x)
        def __getitem__(self, i): return self.x[i], self.y[i]

    dist.init_process_group("gloo")
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (dist.get_world_size() // local, local), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Data(int(sys.argv[1])), batch_size=4)
    held = {"global_batch_size": int(os.environ["GLOBAL_BATCH"])} if "GLOBAL_BATCH" in os.environ else {}
    ft = elastic.Elastic(snapshots=elastic.SnapshotConfig(every_steps=4, ledger=os.environ["LEDGER"]), **held)  # + the prepare lines
    model, optimizer, loader = ft.prepare(model, optimizer, loader)
    dist.barrier()  # the script's own set-up collective, as real scripts have
    rows = open(os.environ["ROWS"], "a")
    for epoch in ft.epochs(2):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            time.sleep(float(os.environ.get("WORK_S", "0")))  # a GPU's own work, which a loaded CPU does not stretch
            if os.path.exists(os.environ.get("SLOW_FLAG", "/nonexistent")):
                time.sleep(0.15)  # this node straggles: a throttled GPU, its own work takes longer
            loss.backward()
            trained = optimizer.step()
            seen = torch.ones(1)
            # as documented (after a trained step, keyed on the run's count), or as many scripts are
            if (trained or os.environ.get("UNGUARDED")) and ft.step_count % 3 == 0:
                dist.all_reduce(seen)  # the script's own metric all-reduce, in the loop body
            shards = hashlib.sha1(b"".join(p.to_local().detach().numpy().tobytes()
                                           for p in model.parameters())).hexdigest()[:16]
            rows.write(json.dumps({"step": ft.step_count, "world": ft.world_size, "rank": ft.rank,
                                   "local": int(os.environ["LOCAL_RANK"]), "node": os.environ["NODE"],
                                   "pid": os.getpid(), "time": time.time(), "shards": shards,
                                   "seen": seen.item()}) + "\\n")
            rows.flush()
            time.sleep(float(os.environ.get("STEP_S", "0.05")) if ft.world_size == int(os.environ.get("WHOLE", "4"))
                       else 0.2)  # short, slower: outlast returns
            if os.path.exists(os.environ.get("HOLD", "/nonexistent")):
                time.sleep(1.0)  # the test waits for a node's return: a step a second meanwhile
    if "FINALS" in os.environ:  # this rank's shards of the trained model
        torch.save({n: p.to_local().detach().clone() for n, p in model.named_parameters()},
                   os.path.join(os.environ["FINALS"], f"{os.environ['NODE']}-{os.environ['LOCAL_RANK']}.pt"))
''')


@contextlib.contextmanager
def _held(run: Path) -> Iterator[None]:
    """The job steps once a second while the test waits for a node's return (the script's
    ``HOLD``): a return that takes long on a loaded machine costs few steps, so the job need
    not be long enough to outlast it, and few steps follow the last check's events."""
    (run / HOLD).touch()
    try:
        yield
    finally:
        (run / HOLD).unlink()


def _rows(path: Path) -> list[dict]:
    # (read while the ranks append: a line being written, or cut by a SIGKILL, is skipped)
    return read_rows(path)


def _node(nodes: Callable[..., Node], etcd: EmbeddedEtcd, run_id: str, tmp: Path, name: str, nnodes: str = "1:2",
          nproc: int = 2, dataset: int = DATASET, **extra: str) -> Node:
    """One node of the HSDP job: the script, its rows, the ledger and the snapshots in ``tmp``
    (or where ``ELASTIC_SNAPSHOT_DIR`` in ``extra`` says)."""
    script = tmp / "hsdp.py"
    if not script.exists():
        script.write_text(HSDP)
    env = {"OMP_NUM_THREADS": "1", "ROWS": str(tmp / "rows.jsonl"), "LEDGER": str(tmp / "ledger.jsonl"),
           "ELASTIC_SNAPSHOT_DIR": str(tmp / "snapshots"), "NODE": name, "HOLD": str(tmp / HOLD), **extra}
    return nodes(name=name, endpoint=etcd.endpoint, run_id=run_id, script=str(script), module_args=[str(dataset)],
                 nnodes=nnodes, nproc_per_node=nproc, metrics_port=AUTO_METRICS_PORT, env=env,
                 agent_args=["--lease-ttl", str(LEASE_TTL)])


# A kill of rank 0's node and a freeze of another: test_hsdp_over_3_nodes_... below, at 3 nodes.
@pytest.mark.parametrize(("victim", "fault"), [("rank0", "sigterm")], ids=["rank0-node-sigtermed"])
def test_an_hsdp_script_loses_a_node_in_place_and_heals_it_shard_by_shard_from_a_live_replica(
        etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path, victim: str,
        fault: str, s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its snapshots go to a real S3 server: every rank of each world uploads its own shards,
    in place too, and rank 0 of the round commits (checkpoints/s3parts.py)."""
    rows, ledger = tmp_path / "rows.jsonl", tmp_path / "ledger.jsonl"
    bucket = f"s3://{s3_server.bucket(f'hsdp-{os.getpid()}-{run_id}'.lower()[:60])}/job"
    dataset = 512  # 32 steps an epoch at 2 x 2 ranks; the lost node's return is held (_held)
    a, b = (_node(nodes, etcd_server, run_id, tmp_path, n, dataset=dataset, ELASTIC_SNAPSHOT_DIR=bucket,
                  **s3_server.env()) for n in ("a", "b"))
    both = lambda: "\n".join(n.log_tail(80) for n in (a, b))  # noqa: E731
    # a freeze after the stall rule has the job's pace (a few steady steps), as in a real job
    wait_until(lambda: any(r["world"] == 4 and r["step"] >= (6 if fault == "kill" else 14) for r in _rows(rows)),
               FORM_TIMEOUT, "HSDP over 2 nodes x 2 ranks to train", on_timeout=both)
    for op in ("allgather", "reducescatter", "allreduce"):  # FSDP2's own and the all-reduce across replicas
        wait_until(lambda: (a.metric("elastic_collective_duration_seconds_count", op=op) or 0) > 0, 30,
                   f"node a to export {op} timings", on_timeout=both)
    first = next(r["node"] for r in _rows(rows) if r["world"] == 4 and r["rank"] == 0)  # the round decides
    lost, kept = (a, b) if (first == "a") == (victim == "rank0") else (b, a)
    survivors = {r["pid"] for r in _rows(rows) if r["node"] == kept.name}
    assert len(survivors) == 2, survivors

    stale = {r["pid"] for r in _rows(rows) if r["node"] == lost.name}
    killed_at = time.time()
    if fault == "kill":
        lost.kill()
    elif fault == "freeze":
        lost.freeze()
    else:  # pre-empted: it leaves at a step boundary, the survivor goes on in place
        assert lost.process is not None
        lost.process.send_signal(signal.SIGTERM)
        wait_until(lambda: not lost.alive(), FORM_TIMEOUT, f"node {lost.name} to leave after SIGTERM", on_timeout=both)
        assert lost.process.returncode == 128 + signal.SIGTERM, both()
    wait_until(lambda: any(r["world"] == 2 and r["time"] > killed_at for r in _rows(rows)), FORM_TIMEOUT,
               f"node {kept.name} to train on alone, in place (1 replica x 2 shards)", on_timeout=both)
    alone_at = min(r["time"] for r in _rows(rows) if r["world"] == 2 and r["time"] > killed_at)
    if fault == "freeze":  # written off well within its lease: a frozen node stalls no one
        assert alone_at - killed_at < LEASE_TTL, f"first step without the frozen node {alone_at - killed_at:.1f} s on"
    with _held(tmp_path):
        if fault in ("kill", "sigterm"):
            lost.start()
        else:
            lost.thaw()  # its agent finds itself written off, stops its stale workers and rejoins
        back_at = time.time()
        wait_until(lambda: any(r["world"] == 4 and r["node"] == lost.name and r["time"] > back_at
                               for r in _rows(rows)),
                   FORM_TIMEOUT, f"node {lost.name} back and healed in a world of 2 replicas x 2 shards",
                   on_timeout=both)
    wait_until(lambda: not a.alive() and not b.alive(), FORM_TIMEOUT, "both nodes to finish", on_timeout=both)
    assert a.process is not None and a.process.returncode == 0, both()
    assert b.process is not None and b.process.returncode == 0, both()

    every = _rows(rows)
    assert {r["pid"] for r in every if r["node"] == kept.name} == survivors, "a survivor's worker was restarted"
    # a frozen node's workers, thawed, train nothing more (its agent stops them: they were written off)
    assert not [r for r in every if r["pid"] in stale and r["time"] > back_at], "a stale worker trained on"
    for pid in survivors:  # 0 steps rolled back: a survivor's committed step never goes down
        steps = [r["step"] for r in every if r["pid"] == pid]
        assert steps == sorted(steps), f"worker {pid} rolled back: {steps}"
    back = [r for r in every if r["node"] == lost.name and r["time"] > back_at]
    assert back, f"node {lost.name} never trained after its return"
    by_step = {(r["step"], r["local"], r["node"]): r["shards"] for r in every if r["world"] == 4}
    compared = 0
    for r in back:  # the healed node's shards equal its replica's, local rank by local rank, bit for bit
        twin = by_step.get((r["step"], r["local"], kept.name))
        if twin is not None:
            assert twin == r["shards"], f"step {r['step']} local rank {r['local']}: shards differ across replicas"
            compared += 1
    assert compared > 0, f"no step of node {lost.name}'s after its return to compare with the survivor's"

    # the script's own all-reduce spans the world it ran in, before the fault and after it
    assert any(r["seen"] == 4.0 for r in every if r["world"] == 4), "the metric all-reduce never spanned 4 ranks"
    assert any(r["seen"] == 2.0 for r in every if r["world"] == 2), "the metric all-reduce never spanned 2 ranks"
    log = a.log_tail(400) + b.log_tail(400)
    assert "in-place recovery off" not in log, log
    assert f"lost node {lost.name}" in log and "re-formed in place" in log, log
    assert "healed from" in log and "Traceback" not in log, log
    report = check_ledger(ledger, dataset_size=dataset, expect_epochs=2)
    assert report.ok, report.violations
    # in place too, every rank uploaded its own shards of each snapshot (no gather to rank 0):
    # the newest verifies (manifest, sizes, sha256) and holds one DCP file per rank that wrote
    for k, v in s3_server.env().items():  # this process reads the bucket too
        monkeypatch.setenv(k, v)
    store = S3SnapshotStore(bucket, create=False)
    newest = store.load_latest()
    assert newest is not None, "no snapshot verifies"
    where = str(newest[1][DCP_DIR_KEY])[len(bucket) + 1:]
    files = sorted(o["Key"].rsplit("/", 1)[-1] for o in store.objects.list(where + "/") if o["Key"].endswith(".distcp"))
    assert len(files) >= 2 and files == [f"__{r}_0.distcp" for r in range(len(files))], files


def test_a_worker_killed_alone_takes_its_nodes_other_rank_with_it_and_both_are_healed_in_place(
        etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path) -> None:
    """One worker process SIGKILLed, its node alive: a lone new rank could not build its
    node's shard group (it was refused as a node of the wrong shard size, and the job ended),
    so its agent starts the node's two ranks again together; they set up among themselves
    and are healed from the other node's replicas. The other node's workers keep their pids."""
    rows, ledger = tmp_path / "rows.jsonl", tmp_path / "ledger.jsonl"
    # the script's metric all-reduce unguarded, as many scripts have it: after the abandoned
    # step it is skipped (it used to meet the healed ranks' next step, and gloo aborted)
    dataset = 512  # 32 steps an epoch at 2 x 2 ranks; the restart is held (_held)
    a, b = (_node(nodes, etcd_server, run_id, tmp_path, n, nnodes="2:2", dataset=dataset, UNGUARDED="1")
            for n in ("a", "b"))
    both = lambda: "\n".join(n.log_tail(80) for n in (a, b))  # noqa: E731
    wait_until(lambda: any(r["world"] == 4 and r["step"] >= 6 for r in _rows(rows)), FORM_TIMEOUT,
               "HSDP over 2 nodes x 2 ranks to train", on_timeout=both)
    first = next(r["node"] for r in _rows(rows) if r["world"] == 4 and r["rank"] == 0)
    hit, other = (b, a) if first == "a" else (a, b)
    kept = {r["pid"] for r in _rows(rows) if r["node"] == other.name}
    old = {r["local"]: r["pid"] for r in _rows(rows) if r["node"] == hit.name}
    assert len(kept) == 2 and len(old) == 2, (kept, old)
    killed_at = time.time()
    with _held(tmp_path):
        os.kill(old[1], signal.SIGKILL)  # local rank 1 alone; its node and agent live on
        wait_until(lambda: {r["pid"] for r in _rows(rows) if r["node"] == hit.name and r["world"] == 4
                            and r["time"] > killed_at} - set(old.values()), FORM_TIMEOUT,
                   f"node {hit.name}'s ranks started again and training in the world of 4", on_timeout=both)
    wait_until(lambda: not a.alive() and not b.alive(), FORM_TIMEOUT, "both nodes to finish", on_timeout=both)
    assert a.process is not None and a.process.returncode == 0, both()
    assert b.process is not None and b.process.returncode == 0, both()

    every = _rows(rows)
    assert {r["pid"] for r in every if r["node"] == other.name} == kept, "the other node's workers were restarted"
    after = {r["local"]: r["pid"] for r in every if r["node"] == hit.name and r["time"] > killed_at}
    assert set(after) == {0, 1} and not set(after.values()) & set(old.values()), (old, after)
    log = hit.log_tail(400)
    assert "starting local rank(s) [0, 1] again" in log and "mesh shards over" not in log, both()
    assert "healed from" in other.log_tail(400), both()  # rank 0's line, on the node that kept its workers
    report = check_ledger(ledger, dataset_size=dataset, expect_epochs=2)
    assert report.ok, report.violations


def test_a_node_whose_local_rank_count_is_not_the_shard_size_is_refused_in_one_line(
        etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path) -> None:
    """Node b joins with 3 local ranks a job whose mesh shards over 2: its ranks say why in one
    line and exit 2 before training a step. The agent then ends the job, as it does for any
    usage error (agent/node/policy.py: a node leaving the job on a usage error while the others go
    on is not the agent's rule today), with node a's workers never restarted."""
    rows = tmp_path / "rows.jsonl"

    def node(name: str, count: int) -> Node:
        return _node(nodes, etcd_server, run_id, tmp_path, name, nproc=count)

    a = node("a", 2)
    wait_until(lambda: len({r["step"] for r in _rows(rows)}) >= 4, FORM_TIMEOUT, "node a to train alone",
               on_timeout=lambda: a.log_tail(80))
    survivors = {r["pid"] for r in _rows(rows)}
    b = node("b", 3)
    both = lambda: "\n".join(n.log_tail(80) for n in (a, b))  # noqa: E731
    wait_until(lambda: not b.alive(), FORM_TIMEOUT, "node b (3 local ranks) to be refused", on_timeout=both)
    assert b.process is not None and b.process.returncode != 0, both()
    refusal = [line for line in b.log_tail(200).splitlines() if line.startswith("error: ranks")]
    assert refusal == ["error: ranks [2, 3, 4] run 3 local ranks per node but the job's mesh shards over 2: a "
                       "node's local ranks must be exactly one shard group; start it with --nproc-per-node 2"], both()
    assert "exited with code 2" in b.log_tail(200), both()
    wait_until(lambda: not a.alive(), FORM_TIMEOUT, "node a's agent to end the job", on_timeout=both)
    assert {r["pid"] for r in _rows(rows)} == survivors, "node a's workers were restarted"
    assert not any(r["node"] == "b" or r["world"] != 2 for r in _rows(rows)), "node b trained a step"
    assert "refused a node" in a.log_tail(400), both()


def _finals(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each rank's shards of the trained model, by ``{node}-{local rank}``."""
    return {p.stem: torch.load(p) for p in sorted(folder.glob("*.pt"))}


def test_hsdp_over_3_nodes_loses_rank_0s_node_and_a_frozen_one_and_ends_where_an_undisturbed_run_does(
        etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path) -> None:
    """The issue's layout, 3 nodes x 2 local ranks, with the global batch held (12 samples a
    step at any world size): rank 0's node is SIGKILLed, then another is frozen (SIGSTOP), so
    the replicate dimension goes 3, 2, 1; both come back (a restart and a thaw) and are healed
    from the node that never left. That node's workers keep their pids, no survivor rolls a step
    back, every sample is trained once, the returned nodes' shards equal the keeper's bit for
    bit at every step, and the trained model equals an undisturbed run's within float tolerance
    (the global batch is the same at every size, the summation order is not). The undisturbed
    run is the same script on one node of 2 ranks: with the global batch held, its result does
    not depend on the world size, which is what a user of an elastic job counts on."""
    dataset, whole = 480, 6  # 40 steps an epoch; the nodes' return is held (_held), a step a second
    runs = {name: tmp_path / name for name in ("calm", "faulty")}
    for folder in runs.values():
        (folder / "finals").mkdir(parents=True)

    def node(name: str, run: str, nnodes: str, full: int) -> Node:
        return _node(nodes, etcd_server, f"{run_id}{run}", runs[run], name, nnodes=nnodes, dataset=dataset,
                     GLOBAL_BATCH="12", WHOLE=str(full), FINALS=str(runs[run] / "finals"))

    a, b, c = started = [node(n, "faulty", "1:3", whole) for n in ("a", "b", "c")]
    rows, ledger = runs["faulty"] / "rows.jsonl", runs["faulty"] / "ledger.jsonl"
    every_log = lambda: stacks_and_tails(started)  # noqa: E731  # each process's stacks first
    wait_until(lambda: any(r["world"] == whole and r["rank"] == 0 and r["step"] >= 14 for r in _rows(rows)),
               FORM_TIMEOUT, "HSDP over 3 nodes x 2 ranks to train", on_timeout=every_log)
    by_name = {n.name: n for n in (a, b, c)}

    def holder_of_rank0(world: int, after: float) -> str:
        return next(r["node"] for r in _rows(rows) if r["world"] == world and r["rank"] == 0 and r["time"] > after)

    killed = by_name[holder_of_rank0(whole, 0.0)]
    pids = {n: {r["pid"] for r in _rows(rows) if r["node"] == n} for n in by_name}
    assert all(len(p) == 2 for p in pids.values()), pids
    killed_at = time.time()
    killed.kill()
    wait_until(lambda: any(r["world"] == 4 and r["rank"] == 0 and r["time"] > killed_at for r in _rows(rows)),
               FORM_TIMEOUT,
               f"two nodes to train on without {killed.name}, in place", on_timeout=every_log)
    # freeze the node that does not hold rank 0 now: the other one keeps the job going alone
    host = holder_of_rank0(4, killed_at)
    frozen = next(by_name[n] for n in by_name if n not in (killed.name, host))
    kept = by_name[host]
    frozen_at = time.time()
    frozen.freeze()
    wait_until(lambda: any(r["world"] == 2 and r["time"] > frozen_at for r in _rows(rows)), FORM_TIMEOUT,
               f"node {kept.name} to train on alone (1 replica x 2 shards)", on_timeout=every_log)
    alone_at = min(r["time"] for r in _rows(rows) if r["world"] == 2 and r["time"] > frozen_at)
    assert alone_at - frozen_at < LEASE_TTL, f"first step without the frozen node {alone_at - frozen_at:.1f} s on"
    with _held(runs["faulty"]):
        killed.start()
        frozen.thaw()
        back_at = time.time()
        wait_until(lambda: {r["node"] for r in _rows(rows) if r["world"] == whole and r["time"] > back_at}
                   == set(by_name), FORM_TIMEOUT, "both nodes back and healed in a world of 3 replicas x 2 shards",
                   on_timeout=every_log)
    wait_until(lambda: not any(n.alive() for n in (a, b, c)), FORM_TIMEOUT, "the run to finish", on_timeout=every_log)
    # the undisturbed run after it, not beside it: 9 training processes at once on 2 cores
    # starved other tests' leases in a whole-suite run
    calm = node("r", "calm", "1:1", 2)
    started.append(calm)
    wait_until(lambda: not calm.alive(), FORM_TIMEOUT, "the undisturbed run to finish", on_timeout=every_log)
    for n in started:
        assert n.process is not None and n.process.returncode == 0, every_log()

    every = _rows(rows)
    assert {r["pid"] for r in every if r["node"] == kept.name} == pids[kept.name], "the keeper's workers restarted"
    assert {r["pid"] for r in every if r["node"] == frozen.name and r["time"] < frozen_at} == pids[frozen.name], \
        "the kill restarted a survivor's workers"
    # the frozen node's workers, thawed, train nothing more (its agent stops them: they were written off)
    assert not [r for r in every if r["pid"] in pids[frozen.name] and r["time"] > back_at], "a stale worker trained on"
    assert "Traceback" not in every_log(), every_log()
    for pid in {r["pid"] for r in every}:  # 0 steps rolled back: a worker's committed step never goes down
        steps = [r["step"] for r in every if r["pid"] == pid]
        assert steps == sorted(steps), f"worker {pid} rolled back: {steps}"
    by_step = {(r["step"], r["local"], r["node"]): r["shards"] for r in every if r["world"] == whole}
    for returned in (killed, frozen):  # its shards equal the keeper's, local rank by local rank, bit for bit
        back = [r for r in every if r["node"] == returned.name and r["time"] > back_at and r["world"] == whole]
        pairs = [(r["shards"], by_step.get((r["step"], r["local"], kept.name))) for r in back]
        assert pairs and all(mine == theirs for mine, theirs in pairs), f"node {returned.name}'s shards differ"
    report = check_ledger(ledger, dataset_size=dataset, expect_epochs=2)
    assert report.ok, report.violations

    faulty, reference = _finals(runs["faulty"] / "finals"), _finals(runs["calm"] / "finals")
    assert sorted(faulty) == [f"{n}-{i}" for n in "abc" for i in (0, 1)] and sorted(reference) == ["r-0", "r-1"]
    for local in (0, 1):
        mine = [faulty[f"{n}-{local}"] for n in "abc"]
        for name, tensor in mine[0].items():
            assert all(torch.equal(tensor, other[name]) for other in mine[1:]), f"{name}: the replicas differ"
            assert torch.allclose(tensor, reference[f"r-{local}"][name], rtol=0, atol=1e-6), \
                (name, (tensor - reference[f"r-{local}"][name]).abs().max().item())


def test_hsdp_spares_take_a_killed_nodes_and_a_stragglers_place_and_the_model_equals_an_undisturbed_run_bit_for_bit(
        etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path) -> None:
    """``--nnodes 2:2`` and a third agent, a warm spare. A member's whole tree is SIGKILLed: the
    spare's two ranks, started ahead, take its place, healed shard by shard from the survivor.
    The killed node comes back as the next spare. Then a member straggles (0.15 s more a step):
    its agent names it and evicts it, and the spare takes its place. The replica count never
    changes, so the trained model equals an undisturbed 2 x 2 run's bit for bit; the node that
    stayed keeps its workers' pids, none rolls a step back and every sample is trained once."""
    dataset = 960  # 60 steps an epoch: a straggler's eviction; the killed node's return is held (_held)
    runs = {name: tmp_path / name for name in ("calm", "faulty")}
    for folder in runs.values():
        (folder / "finals").mkdir(parents=True)
    flags = {name: tmp_path / f"{name}.slow" for name in ("a", "b", "c")}

    def node(name: str, run: str, **extra: str) -> Node:
        return _node(nodes, etcd_server, f"{run_id}{run}", runs[run], name, nnodes="2:2", dataset=dataset,
                     FINALS=str(runs[run] / "finals"), **extra)

    calm: list[Node] = []  # the undisturbed run, started once this one finished
    # Each step's own work is mostly a sleep (60 ms, as a GPU's would be): on a loaded 2-core
    # machine CPU-bound steps of 30-50 ms drifted 1.6x apart for seconds at a time, and with
    # the short look period below a healthy node was once named and evicted.
    group = {n: node(n, "faulty", SLOW_FLAG=str(flags[n]), ELASTIC_STRAGGLER_PERIOD_S="0.5", WORK_S="0.06")
             for n in ("a", "b", "c")}
    rows, ledger = runs["faulty"] / "rows.jsonl", runs["faulty"] / "ledger.jsonl"
    every_log = lambda: stacks_and_tails((*group.values(), *calm))  # noqa: E731  # each process's stacks first

    def trained_by(after: float) -> set[str]:
        return {r["node"] for r in _rows(rows) if r["time"] > after and r["world"] == 4}

    wait_until(lambda: len(trained_by(0.0)) == 2 and max(r["step"] for r in _rows(rows)) >= 8, FORM_TIMEOUT,
               "two of three nodes to train", on_timeout=every_log)
    spare = next(n for name, n in group.items() if name not in trained_by(0.0))
    victim, keeper = sorted((n for n in group.values() if n is not spare), key=lambda n: n.name)
    kept = {r["pid"] for r in _rows(rows) if r["node"] == keeper.name}
    killed_at = time.time()
    victim.kill()
    # (the victim may write a row in the milliseconds its tree takes to die)
    wait_until(lambda: spare.name in trained_by(killed_at), FORM_TIMEOUT,
               f"the spare {spare.name} to train in {victim.name}'s place", on_timeout=every_log)
    with _held(runs["faulty"]):
        victim.start()
        wait_until(lambda: victim.metric("elastic_agent_spare_workers_ready") == 2, FORM_TIMEOUT,
                   f"{victim.name} back as the next spare, its workers started ahead", on_timeout=every_log)

    # the member without rank 0 straggles (as in the DDP test): rank 0's node stays the round's host
    host = next(r["node"] for r in reversed(_rows(rows)) if r["world"] == 4 and r["rank"] == 0)
    slow, fast = (spare, keeper) if host == keeper.name else (keeper, spare)
    slowed_at = time.time()
    flags[slow.name].touch()
    wait_until(lambda: victim.name in trained_by(slowed_at), FORM_TIMEOUT,
               f"the straggler {slow.name} evicted and the spare {victim.name} in its place", on_timeout=every_log)
    admitted_at = min(r["time"] for r in _rows(rows) if r["node"] == victim.name and r["time"] > slowed_at)
    assert slow.metric("elastic_agent_straggler_evictions_total") == 1, every_log()
    wait_until(lambda: not any(n.alive() for n in (fast, victim)), FORM_TIMEOUT, "the run to finish",
               on_timeout=every_log)
    calm += [node(n, "calm", STEP_S="0") for n in ("p", "q")]  # after it: see the 3-node test
    wait_until(lambda: not any(n.alive() for n in calm), FORM_TIMEOUT, "the undisturbed run to finish",
               on_timeout=every_log)
    for n in (fast, victim, *calm):
        assert n.process is not None and n.process.returncode == 0, every_log()

    every = _rows(rows)
    assert {r["world"] for r in every} == {4}, "the world shrank: a spare did not take the place in place"
    assert not [r for r in every if r["node"] == slow.name and r["time"] > admitted_at], "the straggler trained on"
    if fast is keeper:
        assert {r["pid"] for r in every if r["node"] == keeper.name} == kept, "the survivor's workers restarted"
    for pid in {r["pid"] for r in every}:
        steps = [r["step"] for r in every if r["pid"] == pid]
        assert steps == sorted(steps), f"worker {pid} rolled back: {steps}"
    for admitted, lost in ((spare, victim), (victim, slow)):
        said = admitted.log_path.read_text()
        assert f"in the place of {lost.name}" in said and "the workers started while a spare take the place" in said, \
            said
    assert f"node {slow.name} is a straggler" in slow.log_path.read_text(), every_log()
    report = check_ledger(ledger, dataset_size=dataset, expect_epochs=2)
    assert report.ok, report.violations
    faulty, reference = _finals(runs["faulty"] / "finals"), _finals(runs["calm"] / "finals")
    assert sorted(faulty) == sorted(f"{n.name}-{i}" for n in (fast, victim) for i in (0, 1)), sorted(faulty)
    for name, shards in faulty.items():  # local rank i holds the same shards on every replica
        twin = reference["p" + name[-2:]]
        assert all(torch.equal(t, twin[k]) for k, t in shards.items()), f"{name} differs from the undisturbed run"
