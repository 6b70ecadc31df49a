"""FSDP across every node, in place (issue 52): an FSDP2 script on a 1-D mesh over 3 nodes x 2
local ranks, under ``elastic agent`` with peer copies after every step, loses a node and later
another without restarting the survivors.

The script is written as FSDP2's docs write it (``init_device_mesh`` over every rank,
``fully_shard`` per block and on the root, AdamW after sharding) plus the prepare lines, with
what real scripts have: its own process group, a set-up barrier, a metric all-reduce in the
loop body, rank 0 printing. The global batch is held (12 samples a step at any world size).

First one worker is SIGKILLed alone: its agent starts that node's two ranks again together
and they take their old positions with their own copies from their agent's shared memory
(world of 6 kept, no other worker restarted; elastic.inplace.memory_copies). Then a node's
whole process tree is SIGKILLed (rank 0's), then another: the world goes 6, 4, 2 ranks,
each time re-sharded over the survivors from memory (the lost node's shards from the
copies its buddy on the next node kept). Checked, as a user would: the survivors' workers
keep their pids, no worker's step ever goes down (0 steps rolled back: K = 1, so the last
committed step is in memory), the recovery line says ``from peer memory``, every sample of
each epoch is trained once (the ledger), and the trained model equals an undisturbed run's
on one node of 2 ranks within float tolerance (the global batch is the same at every size,
the summation order is not). That a re-shard from memory equals a snapshot reload at the new
size bit for bit is tested with real processes in tests/elastic/inplace/test_peer_reshard.py.

On the restart path (``--no-in-place``) the same script's crashed worker restarts its node
from the agent's memory instead of the snapshot (the last test)."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from agent.etcd import EmbeddedEtcd
from agent.local.local_node import AUTO_METRICS_PORT
from checkpoints import SnapshotStore
from checkpoints.reading import DCP_DIR_KEY
from elastic.ledger import check_ledger
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until
from tests.elastic.inplace.support import read_rows

FORM_TIMEOUT = 150
DATASET = 360  # 30 steps an epoch at 12 a step: every loss lands in the first (step 13 here, quiet), few steps follow
SPARE_DATASET = 360  # 30 an epoch: admission (step 11), 8 steps and a double loss (by 21, loaded) fit in the first
RESTART_DATASET = 240  # 20 steps an epoch: a kill between the first two snapshots (every 8) fits in the first
LEASE_TTL = 5  # a kill is seen at once (the connection resets): the lease only has to outlast a loaded machine

FSDP = textwrap.dedent('''\
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
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 30), nn.ReLU(), nn.Linear(30, 4))  # 30 rows: uneven cuts at 4
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Data(int(sys.argv[1])), batch_size=4)
    ft = elastic.Elastic(global_batch_size=12,
                         snapshots=elastic.SnapshotConfig(every_steps=8, ledger=os.environ["LEDGER"]))  # + the prepare lines
    model, optimizer, loader = ft.prepare(model, optimizer, loader)
    dist.barrier()  # the script's own set-up collective
    rows = open(os.environ["ROWS"], "a")
    for epoch in ft.epochs(2):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            trained = optimizer.step()
            seen = torch.ones(1)
            if trained and ft.step_count % 3 == 0:
                dist.all_reduce(seen)  # the script's own metric all-reduce, in the loop body
            if ft.rank == 0 and trained and ft.step_count % 20 == 0:
                print(f"step {ft.step_count} loss {loss.item():.4f} world {ft.world_size}", flush=True)
            shards = hashlib.sha1(b"".join(p.to_local().detach().numpy().tobytes()
                                           for p in model.parameters())).hexdigest()[:16]
            rows.write(json.dumps({"step": ft.step_count, "world": ft.world_size, "rank": ft.rank,
                                   "local": int(os.environ["LOCAL_RANK"]), "node": os.environ["NODE"],
                                   "pid": os.getpid(), "time": time.time(), "seen": seen.item(),
                                   "shards": shards}) + "\\n")
            rows.flush()
            time.sleep(float(os.environ.get("STEP_S", "0.05")))
    # this rank's shards of the trained model
    torch.save({n: p.to_local().detach().clone() for n, p in model.named_parameters()},
               os.path.join(os.environ["FINALS"], f"{os.environ['NODE']}-{os.environ['LOCAL_RANK']}.pt"))
''')


def _rows(path: Path) -> list[dict]:
    # (read while the ranks append: a line being written, or cut by a SIGKILL, is skipped)
    return read_rows(path)


def _finals(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.stem: torch.load(p) for p in sorted(folder.glob("*.pt"))}


def _runs(tmp_path: Path, nodes: Callable[..., Node], etcd: EmbeddedEtcd, run_id: str,
          dataset: int = DATASET) -> tuple[dict[str, Path], Callable[..., Node]]:
    """The faulty and the calm run's folders, and what starts a node of either."""
    runs = {name: tmp_path / name for name in ("calm", "faulty")}
    for folder in runs.values():
        (folder / "finals").mkdir(parents=True)
    script = tmp_path / "fsdp.py"
    script.write_text(FSDP)

    def node(name: str, run: str, nnodes: str, nproc: int = 2, agent_args: tuple[str, ...] = (), **extra: str) -> Node:
        env = {"OMP_NUM_THREADS": "1", "ROWS": str(runs[run] / "rows.jsonl"), "LEDGER": str(runs[run] / "ledger.jsonl"),
               "ELASTIC_SNAPSHOT_DIR": str(runs[run] / "snapshots"), "NODE": name,
               "FINALS": str(runs[run] / "finals"), "ELASTIC_PEER_COPY_EVERY": "1", **extra}
        return nodes(name=name, endpoint=etcd.endpoint, run_id=f"{run_id}{run}", script=str(script),
                     module_args=[str(dataset)], nnodes=nnodes, nproc_per_node=nproc, metrics_port=AUTO_METRICS_PORT,
                     env=env, agent_args=["--lease-ttl", str(LEASE_TTL), *agent_args])
    return runs, node


def test_fsdp_over_3_nodes_loses_two_in_turn_re_shards_from_peer_memory_and_ends_where_an_undisturbed_run_does(
        etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path) -> None:
    runs, node = _runs(tmp_path, nodes, etcd_server, run_id)

    started = [node(n, "faulty", "1:3") for n in ("a", "b", "c")]
    by_name = {n.name: n for n in started}
    rows, ledger = runs["faulty"] / "rows.jsonl", runs["faulty"] / "ledger.jsonl"
    every_log = lambda: "\n".join(n.log_tail(60) for n in started)  # noqa: E731
    wait_until(lambda: any(r["world"] == 6 and r["rank"] == 0 and r["step"] >= 10 for r in _rows(rows)),
               FORM_TIMEOUT, "FSDP over 3 nodes x 2 ranks to train", on_timeout=every_log)

    def holder_of_rank0(world: int, after: float) -> str:
        return next(r["node"] for r in _rows(rows) if r["world"] == world and r["rank"] == 0 and r["time"] > after)

    # a worker SIGKILLed alone: its agent starts the node's two ranks again together (they hold one
    # node's positions), and they are filled from the copies their buddy kept; no other worker restarts
    hit = next(n for n in sorted(by_name) if n != holder_of_rank0(6, 0.0))
    old = {r["local"]: r["pid"] for r in _rows(rows) if r["node"] == hit}
    others = {r["pid"] for r in _rows(rows) if r["node"] != hit}
    assert len(old) == 2 and len(others) == 4, (old, others)
    crashed_at = time.time()
    os.kill(old[1], signal.SIGKILL)
    wait_until(lambda: len({r["pid"] for r in _rows(rows) if r["node"] == hit and r["pid"] not in old.values()
                            and r["world"] == 6 and r["time"] > crashed_at}) == 2,
               FORM_TIMEOUT, f"node {hit}'s ranks started again and training in the world of 6", on_timeout=every_log)
    pids = {n: {r["pid"] for r in _rows(rows) if r["node"] == n and r["pid"] not in old.values()} for n in by_name}
    assert all(len(p) == 2 for p in pids.values()), pids
    assert pids[hit].isdisjoint(old.values()) and set().union(*(pids[n] for n in by_name if n != hit)) == others

    first = by_name[holder_of_rank0(6, 0.0)]
    first_at = time.time()
    first.kill()  # rank 0's node, its whole process tree
    wait_until(lambda: any(r["world"] == 4 and r["rank"] == 0 and r["time"] > first_at for r in _rows(rows)),
               FORM_TIMEOUT, f"two nodes to train on without {first.name}, in place", on_timeout=every_log)
    # (a row at a multiple of 3 is not enough: a step that was not applied writes its row with the count unmoved)
    wait_until(lambda: any(r["world"] == 4 and r["rank"] == 0 and r["seen"] == 4.0 and r["time"] > first_at
                           for r in _rows(rows)), FORM_TIMEOUT, "a step in the world of 4 with the metric all-reduce",
               on_timeout=every_log)
    second = by_name[holder_of_rank0(4, first_at)]  # rank 0's node again: the keeper is the other one
    kept = next(n for n in started if n not in (first, second))
    second_at = time.time()
    second.kill()
    wait_until(lambda: not kept.alive(), FORM_TIMEOUT, f"node {kept.name} to finish alone", on_timeout=every_log)
    calm = node("r", "calm", "1:1", STEP_S="0")  # the undisturbed run after it: 9 training processes at once starve 2 cores
    started.append(calm)
    wait_until(lambda: not calm.alive(), FORM_TIMEOUT, "the undisturbed run to finish", on_timeout=every_log)
    for n in (kept, calm):
        assert n.process is not None and n.process.returncode == 0, every_log()

    every = _rows(rows)
    later = [r for r in every if r["time"] > crashed_at + 0.05]  # (rows the killed worker's peer wrote as it died)
    assert {r["pid"] for r in later if r["node"] == kept.name} == pids[kept.name], "the keeper's workers restarted"
    assert {r["pid"] for r in later if r["node"] == second.name} == pids[second.name], \
        "the first kill restarted a survivor's workers"
    assert [w for w in (6, 4, 2) if any(r["world"] == w for r in every)] == [6, 4, 2], sorted({r["world"] for r in every})
    for pid in {r["pid"] for r in every}:  # 0 steps rolled back: a worker's committed step never goes down
        steps = [r["step"] for r in every if r["pid"] == pid]
        assert steps == sorted(steps), f"worker {pid} rolled back: {steps}"
    for killed_at, world in ((crashed_at, 6), (first_at, 4), (second_at, 2)):  # and the first step after a loss follows the last before
        # the last step trained before the new world's first: the old world may train on between the test's
        # clock reading and the kill landing (a loaded machine), so the kill's time is not the boundary
        went_on = [r for r in every if r["world"] == world and r["time"] > killed_at + 0.05]
        after, resumed_at = min(r["step"] for r in went_on), min(r["time"] for r in went_on)
        before = max(r["step"] for r in every if r["time"] < resumed_at)
        assert after <= before + 1, f"world {world} went on from step {after}, the last trained before was {before}"
    assert any(r["seen"] == 6.0 for r in every if r["world"] == 6), "the metric all-reduce never spanned 6 ranks"
    assert any(r["seen"] == 4.0 for r in every if r["world"] == 4), "the metric all-reduce never spanned 4 ranks"
    log = "\n".join(n.log_path.read_text() for n in (first, second, kept))
    assert "in-place recovery off" not in log and "Traceback" not in log, every_log()
    assert log.count("from peer memory at step") == 3, every_log()
    # the crashed node's ranks took their own copies from their agent's shared memory, not their buddy's
    assert "world of 6 kept, the restarted ranks filled from their own copies in their node agent's memory" in log, \
        every_log()
    assert "starting local rank(s) [0, 1] again" in by_name[hit].log_path.read_text(), every_log()
    assert "resumed from snapshot step" not in log, every_log()
    report = check_ledger(ledger, dataset_size=DATASET, expect_epochs=2)
    assert report.ok, report.violations

    faulty, reference = _finals(runs["faulty"] / "finals"), _finals(runs["calm"] / "finals")
    assert sorted(faulty) == [f"{kept.name}-0", f"{kept.name}-1"] and sorted(reference) == ["r-0", "r-1"], faulty
    for local in (0, 1):
        for name, tensor in faulty[f"{kept.name}-{local}"].items():
            twin = reference[f"r-{local}"][name]
            assert torch.allclose(tensor, twin, rtol=0, atol=1e-6), (name, (tensor - twin).abs().max().item())


def _full(snapshots: Path) -> dict[str, torch.Tensor]:
    """The newest verified snapshot's model, unsharded (DCP reads any shard count)."""
    found = SnapshotStore(snapshots, create=False).load_latest()
    assert found is not None, f"no snapshot verifies in {snapshots}"
    plain = nn.Sequential(nn.Linear(16, 30), nn.ReLU(), nn.Linear(30, 4))
    target = {"model": plain.state_dict()}
    dcp.load(target, checkpoint_id=str(found[1][DCP_DIR_KEY]), no_dist=True)  # this process has no group
    return target["model"]


def test_a_spare_takes_a_lost_fsdp_nodes_place_from_its_buddys_memory_bit_for_bit_and_two_nodes_lost_together_resume_from_the_snapshot(
        etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path) -> None:
    """``--nnodes 1:3`` and a fourth agent, a warm spare. A member's whole tree is SIGKILLed:
    the spare's ranks, started ahead, take its place in the world of 6, filled from the copies
    the lost node's buddy kept; the world keeps its size, so every rank's shards equal an
    undisturbed run's at every step after, bit for bit (the undisturbed run: one node of 6
    ranks, the same world). Then two members are killed at once: in a ring of three, one of
    them kept the other's copies, so that node's shards exist in no live memory; the one left
    resumes from the newest snapshot, with one line naming why, and every sample is still
    trained once and the trained model equals the undisturbed run's within float tolerance."""
    runs, node = _runs(tmp_path, nodes, etcd_server, run_id, dataset=SPARE_DATASET)
    started = [node(n, "faulty", "1:3", STEP_S="0.03") for n in ("a", "b", "c", "d")]
    by_name = {n.name: n for n in started}
    rows, ledger = runs["faulty"] / "rows.jsonl", runs["faulty"] / "ledger.jsonl"
    every_log = lambda: "\n".join(n.log_tail(60) for n in started)  # noqa: E731

    def trained_by(after: float, world: int = 6) -> set[str]:
        return {r["node"] for r in _rows(rows) if r["time"] > after and r["world"] == world}

    wait_until(lambda: len(trained_by(0.0)) == 3 and max(r["step"] for r in _rows(rows)) >= 10, FORM_TIMEOUT,
               "three of four nodes to train", on_timeout=every_log)
    spare = next(n for name, n in by_name.items() if name not in trained_by(0.0))
    wait_until(lambda: spare.metric("elastic_agent_spare_workers_ready") == 2, FORM_TIMEOUT,
               f"the spare {spare.name}'s workers started ahead", on_timeout=every_log)
    victim = by_name[next(r["node"] for r in reversed(_rows(rows)) if r["world"] == 6 and r["rank"] == 0)]
    kept = {n.name: {r["pid"] for r in _rows(rows) if r["node"] == n.name} for n in started
            if n not in (spare, victim)}
    killed_at = time.time()
    victim.kill()
    wait_until(lambda: spare.name in trained_by(killed_at), FORM_TIMEOUT,
               f"the spare {spare.name} to train in {victim.name}'s place", on_timeout=every_log)
    admitted_at = min(r["time"] for r in _rows(rows) if r["node"] == spare.name)
    admitted_step = min(r["step"] for r in _rows(rows) if r["node"] == spare.name)
    wait_until(lambda: max(r["step"] for r in _rows(rows)) >= admitted_step + 8, FORM_TIMEOUT,
               "eight steps with the spare", on_timeout=every_log)
    members = [spare, *(by_name[n] for n in kept)]
    keeper = next(n for n in members if n is not spare)
    together_at = time.time()
    for n in members:
        if n is not keeper:
            n.kill()  # two at once
    wait_until(lambda: not keeper.alive(), FORM_TIMEOUT, f"node {keeper.name} to finish alone", on_timeout=every_log)
    calm = node("r", "calm", "1:1", nproc=6, STEP_S="0")  # the same world of 6 on one node (no copies: no buddy)
    started.append(calm)
    wait_until(lambda: not calm.alive(), FORM_TIMEOUT, "the undisturbed run to finish", on_timeout=every_log)
    for n in (keeper, calm):
        assert n.process is not None and n.process.returncode == 0, every_log()

    every, reference = _rows(rows), _rows(runs["calm"] / "rows.jsonl")
    for name, pids in kept.items():
        assert {r["pid"] for r in every if r["node"] == name} == pids, f"node {name}'s workers restarted"
    assert not [r for r in every if r["world"] != 6 and r["time"] < together_at], "the world shrank: no spare took the place"
    calm_by = {(r["step"], r["rank"]): r["shards"] for r in reference}
    with_spare = [r for r in every if admitted_at <= r["time"] < together_at and r["world"] == 6]
    assert len({r["step"] for r in with_spare}) >= 6, with_spare
    differ = [(r["step"], r["rank"], r["node"]) for r in with_spare if calm_by.get((r["step"], r["rank"])) != r["shards"]]
    assert not differ, f"shards differ from the undisturbed run's at (step, rank, node) {differ[:6]}"
    log = "\n".join(n.log_path.read_text() for n in started)
    assert "Traceback" not in log, every_log()
    assert f"in the place of {victim.name}" in spare.log_path.read_text(), every_log()
    said = [line for line in keeper.log_path.read_text().splitlines() if "exist in no live memory" in line]
    assert len(said) == 1 and "lost together with node" in said[0] and "resuming from the newest snapshot" in said[0], \
        every_log()
    assert "resumed from snapshot step" in keeper.log_path.read_text(), every_log()
    report = check_ledger(ledger, dataset_size=SPARE_DATASET, expect_epochs=2)
    assert report.ok, report.violations
    mine, theirs = _full(runs["faulty"] / "snapshots"), _full(runs["calm"] / "snapshots")
    for name, tensor in mine.items():
        assert torch.allclose(tensor, theirs[name], rtol=0, atol=1e-6), (name, (tensor - theirs[name]).abs().max().item())


def test_on_the_restart_path_a_worker_sigkilled_alone_restarts_its_node_from_the_agents_memory_not_the_snapshot(
        etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path) -> None:
    """The restart path (``--no-in-place``: every worker restarts, as under plain torchrun):
    one worker of a node of 2 ranks is SIGKILLed alone between snapshots (every 8 steps). The
    agent starts both again; each rank loads its own copy from the agent's shared memory, so
    0 steps are rolled back (the snapshot would have cost up to 7), every sample is trained
    once, and the agent's memory directory is gone once the job ends."""
    runs, node = _runs(tmp_path, nodes, etcd_server, run_id, dataset=RESTART_DATASET)
    rows, ledger = runs["faulty"] / "rows.jsonl", runs["faulty"] / "ledger.jsonl"
    a = node("a", "faulty", "1:1", agent_args=("--no-in-place",))
    log = lambda: a.log_tail(80)  # noqa: E731
    wait_until(lambda: any(r["step"] >= 11 and r["step"] % 8 not in (0, 7) for r in _rows(rows)), FORM_TIMEOUT,
               "FSDP over 2 ranks to train past its first snapshot", on_timeout=log)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None  # else under the agent's own directory
    made = list(shm.glob(f"elastic-copies-{a.pid}-*")) if shm is not None else []
    if shm is not None:  # the agent's directory in shared memory, each local rank's copies in it
        assert len(made) == 1 and {p.name.split(".")[0] for p in made[0].glob("rank-*.copy")} == {"rank-0", "rank-1"}
    old = {r["local"]: r["pid"] for r in _rows(rows)}
    os.kill(old[1], signal.SIGKILL)
    wait_until(lambda: any(r["pid"] not in old.values() for r in _rows(rows)), FORM_TIMEOUT,
               "node a's ranks restarted and training", on_timeout=log)
    wait_until(lambda: not a.alive(), FORM_TIMEOUT, "the job to finish", on_timeout=log)
    assert a.process is not None and a.process.returncode == 0, log()

    every = _rows(rows)
    before = max(r["step"] for r in every if r["pid"] in old.values())  # the last step an old worker wrote a row for
    after = min(r["step"] for r in every if r["pid"] not in old.values())
    text = a.log_path.read_text()
    resumed = [line for line in text.splitlines() if "resumed from memory at step" in line]
    assert len(resumed) == 1, log()
    at = int(resumed[0].split("resumed from memory at step ")[1].split()[0])
    # 0 steps rolled back: a step is reported trained only once every rank's copy of it is in
    # memory. The step the kill came after may have no row: its copies were complete, but the
    # kill failed the script's metric all-reduce (every third step) before the surviving rank
    # wrote one. So the resumed step is the last row's or the one after it, never earlier.
    assert before <= at <= before + 1, f"resumed from memory at step {at}: the last row before the kill was {before}"
    assert after == at + 1, f"restarted at step {after} after resuming from step {at}"
    assert "resumed from snapshot step" not in text and "Traceback" not in text, log()
    report = check_ledger(ledger, dataset_size=RESTART_DATASET, expect_epochs=2)
    assert report.ok, report.violations
    assert not [p for p in made if p.exists()], "the agent left its copies in shared memory"
