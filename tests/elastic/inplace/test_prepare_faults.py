"""A plain DDP loop changed only by the prepare API's lines, under real agents and faults.

The scripts are what a DDP tutorial writes (``init_process_group``, ``DDP(model)``, a
``DataLoader`` with a ``DistributedSampler`` and ``set_epoch``, a per-epoch loop, a rank-0
print and save) plus the lines marked ``# added`` and ``# was:``. Lines marked ``# eyes``
are the test's: each committed step's sample ids and a fingerprint of the parameters, one
JSON line per rank, from which the tests check what a user would.

* In place (``elastic agent``), 3 nodes: rank 0's node is SIGKILLed and another frozen
  (SIGSTOP past its lease, then SIGCONT) at once.
* AMP, a ``GradScaler``, accumulation over 4 micro-batches and an LR scheduler, with a spare
  (``--nnodes 2:2`` and a third agent) so the world stays 2 across a kill: the final
  parameters equal an undisturbed run's bit for bit.
* Plain ``torchrun --rdzv-backend etcd-v3`` (the restart path): a kill, a resume from the
  newest snapshot at the right epoch and sampler position.
"""

from __future__ import annotations

import re
import textwrap
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from agent.etcd import EmbeddedEtcd
from agent.local.local_node import AUTO_METRICS_PORT
from tests.agent.test_spares import is_spare
from tests.elastic.inplace.support import LEASE_TTL, at_world, logs, metric, read_rows, rows, start_script, \
    train_together
from tests.elastic.inplace.test_user_code import assert_trained_once, assert_went_on_from_where_it_stood, \
    no_tracebacks, write_script
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until

DATASET = 64  # samples; per rank 8 a batch: an epoch ends every 3 or 4 steps, so faults fall among epoch ends

_EYES = '''\
    class Numbered(SyntheticClassification):  # eyes: each sample carries its id
        def __getitem__(self, i):
            return self.x[i], self.y[i], i

        def __getitems__(self, ids):
            return [self[i] for i in ids]

    def note(out, ids, **row):  # eyes: one JSON line per committed step
        digest = hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        out.write(json.dumps({"node": os.environ["ELASTIC_NODE_NAME"], "pid": os.getpid(), "time": time.time(),
                              "step": ft.step_count, "rank": ft.rank, "world_size": ft.world_size,
                              "round": ft.run.round, "ids": ids, "params": digest[:16], **row}) + "\\n")
        out.flush()
'''

PLAIN_LOOP = textwrap.dedent('''\
    import hashlib, json, logging, os, time
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from elastic.jobs.mlp import SyntheticClassification
    import elastic                                                                    # added

''') + textwrap.dedent(_EYES) + textwrap.dedent('''\

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = Numbered(int(os.environ["DATASET"]), seed=1)
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    ft = elastic.Elastic(snapshot_dir=os.environ["SNAPSHOTS"], seed=3,  # added
                         snapshots=elastic.SnapshotConfig(every_steps=2, ledger=os.environ["LEDGER"]))
    model, optimizer, loader = ft.prepare(model, optimizer, loader)                   # added
    progress = open(os.environ["PROGRESS"], "a")  # eyes

    for epoch in ft.epochs(1000):                                                     # was: range(1000)
        sampler.set_epoch(epoch)
        for x, y, ids in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            if ft.last_step:  # eyes
                note(progress, ids.tolist(), epoch=epoch)
            time.sleep(float(os.environ.get("SLEEP", "0.03")))
        if dist.get_rank() == 0:
            print(f"epoch {epoch} done, loss {loss.item():.4f}", flush=True)
            torch.save(model.state_dict(), os.environ["SAVE"])
''')

# The same loop with AMP (bfloat16 autocast on the CPU, and a GradScaler: torch 2.14 has a
# CPU GradScaler, which bfloat16 does not need but a script written for GPUs keeps), an LR
# scheduler and accumulation over 4 micro-batches as Accelerate writes it: step, update and
# zero_grad after every backward (no-ops within a step), clipping on the step's last.
AMP_LOOP = textwrap.dedent('''\
    import hashlib, json, logging, os, time
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from elastic.jobs.mlp import SyntheticClassification
    import elastic                                                                    # added

''') + textwrap.dedent(_EYES) + textwrap.dedent('''\

    ACCUMULATE = 4
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.Tanh(), nn.Linear(32, 4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.8)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    data = Numbered(int(os.environ["DATASET"]), seed=1)
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    ft = elastic.Elastic(snapshot_dir=os.environ["SNAPSHOTS"], seed=3, gradient_accumulation_steps=ACCUMULATE,  # added
                         snapshots=elastic.SnapshotConfig(every_steps=4, ledger=os.environ["LEDGER"]))
    model, optimizer, loader, scheduler, scaler = ft.prepare(model, optimizer, loader, scheduler, scaler)  # added
    progress, in_step = open(os.environ["PROGRESS"], "a"), []  # eyes

    for epoch in ft.epochs(int(os.environ["EPOCHS"])):                                # was: range(EPOCHS)
        sampler.set_epoch(epoch)
        for x, y, ids in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y) / ACCUMULATE
            scaler.scale(loss).backward()
            if ft.sync_gradients:                                                     # added
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()
            in_step += ids.tolist()  # eyes
            if ft.last_step:  # eyes
                note(progress, in_step, epoch=epoch, lr=scheduler.get_last_lr()[0])
            if ft.sync_gradients:  # eyes: committed or abandoned, the step's micro-batches are done
                in_step = []
            time.sleep(float(os.environ.get("SLEEP", "0.02")))
        if dist.get_rank() == 0:
            print(f"epoch {epoch} done, lr {scheduler.get_last_lr()[0]:.5f}", flush=True)
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), os.environ["SAVE"])
''')


def committed(tmp: Path, names: list[str]) -> dict[int, list[dict[str, Any]]]:
    """Each committed step's rows, as the job's history has it: a step trained again after a
    fault (by a new world) replaces what a broken world wrote for it."""
    by_step: dict[int, dict[tuple[int, int], list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for name in names:
        for r in read_rows(tmp / f"{name}.rows.jsonl"):
            by_step[r["step"]][(r["world_size"], r["round"])].append(r)
    # the newest round that trained it (rounds only grow; a thawed stale worker writes late)
    return {step: worlds[max(worlds, key=lambda key: key[1])] for step, worlds in by_step.items()}


def assert_each_sample_once_per_epoch(tmp: Path, names: list[str], incomplete_allowed: int = 0,
                                      upto: int | None = None) -> int:
    """From the ids the script logged: no sample twice in an epoch, and every sample of every
    finished epoch once. A step whose row a fault cut off (its rank was killed or frozen right
    after the step; a frozen rank's stale worker is replaced, not resumed) leaves its epoch
    unchecked for skips; at most ``incomplete_allowed`` such epochs.
    ``upto``: the last step every rank has written its row for (the job may still run).
    Returns the number of finished epochs checked (at least 2)."""
    steps = {s: g for s, g in committed(tmp, names).items() if upto is None or s <= upto}
    assert steps and sorted(steps) == list(range(min(steps), max(steps) + 1)), "a gap in the committed steps"
    by_epoch: dict[int, list[int]] = defaultdict(list)
    incomplete: set[int] = set()  # epochs with a step whose row a SIGKILL cut off
    for _step, group in sorted(steps.items()):
        if len({r["rank"] for r in group}) != group[0]["world_size"]:
            incomplete.add(group[0]["epoch"])
        for r in group:
            by_epoch[r["epoch"]].extend(r["ids"])
    assert len(incomplete) <= incomplete_allowed, f"steps miss a rank's row in epochs {sorted(incomplete)}"
    finished = 0
    for epoch, ids in sorted(by_epoch.items()):
        twice = sorted(i for i, n in Counter(ids).items() if n > 1)
        assert not twice, f"epoch {epoch}: samples trained twice: {twice}"
        if epoch < max(by_epoch) and epoch not in incomplete:  # the last one is not finished
            assert sorted(ids) == list(range(DATASET)), f"epoch {epoch}: samples skipped"
            finished += 1
    assert finished >= 2, "too few finished epochs to check"
    return finished


def same_params_from(tmp: Path, group: list[Node], after: float, steps: int = 3) -> None:
    """Every node holds the same parameters, bit for bit, at each of the last ``steps`` steps all trained."""
    prints = {n.name: {r["step"]: r["params"] for r in rows(n, tmp) if r["time"] > after} for n in group}
    common = sorted(set.intersection(*(set(p) for p in prints.values())))
    assert len(common) >= steps, f"only {len(common)} steps trained by all of {list(prints)}"
    for step in common[-steps:]:
        assert len({p[step] for p in prints.values()}) == 1, f"replicas differ at step {step}"


@pytest.mark.slow
def test_a_plain_loop_survives_a_kill_of_rank_0s_node_and_a_freeze_in_place(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script = write_script(tmp_path, "plain_ddp.py", PLAIN_LOOP)
    env = {"DATASET": str(DATASET), "SAVE": str(tmp_path / "model.pt")}
    group = [start_script(nodes, name, etcd_server, run_id, tmp_path, script, nnodes="1:3", env=env)
             for name in ("a", "b", "c")]
    train_together(group, tmp_path, 3, steps=4)
    victim = next(n for n in group if rows(n, tmp_path)[-1]["rank"] == 0)
    frozen = next(n for n in group if rows(n, tmp_path)[-1]["rank"] == 1)
    survivor = next(n for n in group if n is not victim and n is not frozen)
    pid = rows(survivor, tmp_path)[-1]["pid"]

    killed_at = time.time()
    victim.kill()  # the whole tree, SIGKILL
    train_together([survivor, frozen], tmp_path, 2, steps=3, after=killed_at, timeout=60)
    assert_went_on_from_where_it_stood(survivor, tmp_path, killed_at, 2)
    frozen.freeze()  # SIGSTOP of the whole tree, past its lease
    frozen_at = time.time()
    train_together([survivor], tmp_path, 1, steps=3, after=frozen_at, timeout=LEASE_TTL + 40)
    assert_went_on_from_where_it_stood(survivor, tmp_path, frozen_at, 1)
    time.sleep(max(0.0, frozen_at + 5 - time.time()))
    back_at = time.time()
    frozen.thaw()
    victim.start()
    train_together(group, tmp_path, 3, steps=4, after=back_at, timeout=90)

    assert {r["pid"] for r in rows(survivor, tmp_path)} == {pid}, "the survivor's worker was restarted"
    assert metric(survivor, "elastic_agent_restarts_total") == 0
    assert metric(victim, "elastic_restores_total", source="replica") >= 1, "the node back was not healed"
    assert metric(frozen, "elastic_restores_total", source="replica") >= 1, "the thawed node was not healed"
    same_params_from(tmp_path, group, back_at)
    upto = min(rows(n, tmp_path)[-1]["step"] for n in group)  # the job runs on: its newest rows may be partial
    assert_each_sample_once_per_epoch(tmp_path, [n.name for n in group], incomplete_allowed=2, upto=upto)
    assert_trained_once(tmp_path)
    # Rank 0's print and save moved with rank 0: the survivor said it while alone, and the file loads.
    said = survivor.log_path.read_text()
    assert re.search(r"epoch \d+ done", said), survivor.log_tail(30)
    saved = wait_until(lambda: _loaded(tmp_path / "model.pt"), 30, "rank 0's save to load (it saves every epoch)")
    assert sorted(saved) == ["module.0.bias", "module.0.weight", "module.2.bias", "module.2.weight"]
    no_tracebacks(survivor)


def _loaded(path: Path) -> dict[str, torch.Tensor] | None:
    """The script's ``torch.save`` file, or None while it is missing or half written."""
    try:
        return torch.load(path, weights_only=True) if path.exists() else None
    except (EOFError, RuntimeError):
        return None


def _final(tmp: Path) -> dict[str, torch.Tensor] | None:
    return _loaded(tmp / "final.pt")


@pytest.mark.slow
def test_amp_accumulation_and_a_scheduler_after_a_kill_with_a_spare_equal_an_undisturbed_run_bit_for_bit(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    """World 2 throughout: ``--nnodes 2:2`` and a spare, which takes the killed node's place."""
    script = write_script(tmp_path, "amp_ddp.py", AMP_LOOP)
    runs = {"calm": tmp_path / "calm", "faulty": tmp_path / "faulty"}
    for d in runs.values():
        d.mkdir()
    # 64 samples, 4 per micro-batch, 4 micro-batches, 2 ranks: 2 steps an epoch, 40 steps in all
    env = {"DATASET": str(DATASET), "EPOCHS": "20"}
    calm = [start_script(nodes, name, etcd_server, f"{run_id}calm", runs["calm"], script, nnodes="2:2",
                         env={**env, "SAVE": str(runs["calm"] / "final.pt"), "SLEEP": "0"}) for name in ("r1", "r2")]
    faulty = [start_script(nodes, name, etcd_server, run_id, runs["faulty"], script, nnodes="2:2",
                           env={**env, "SAVE": str(runs["faulty"] / "final.pt")}) for name in ("a", "b", "c")]
    wait_until(lambda: sum(bool(rows(n, runs["faulty"])) for n in faulty) == 2 and any(is_spare(n) for n in faulty),
               150, "two nodes to train and the third to wait as a spare", on_timeout=logs(*faulty))
    spare = next(n for n in faulty if is_spare(n))
    members = [n for n in faulty if n is not spare]
    train_together(members, runs["faulty"], 2, steps=3)
    victim = next(n for n in members if rows(n, runs["faulty"])[-1]["rank"] == 0)
    survivor = next(n for n in members if n is not victim)
    pid = rows(survivor, runs["faulty"])[-1]["pid"]
    killed_at = time.time()
    victim.kill()
    killed_step = max(r["step"] for r in rows(survivor, runs["faulty"]))
    assert killed_step < 30, "the kill came too late to test anything"

    wait_until(lambda: _final(runs["faulty"]) is not None and _final(runs["calm"]) is not None, 150,
               "both runs to finish", on_timeout=logs(survivor, spare, *calm))
    assert len(at_world(spare, runs["faulty"], 2, killed_at)) >= 3, "the spare did not take the lost node's place"
    assert all(r["world_size"] == 2 for n in faulty for r in rows(n, runs["faulty"])), "the world changed size"
    assert {r["pid"] for r in rows(survivor, runs["faulty"])} == {pid}, "the survivor's worker was restarted"
    assert_went_on_from_where_it_stood(survivor, runs["faulty"], killed_at, 2)
    mine, theirs = _final(runs["faulty"]), _final(runs["calm"])
    assert mine is not None and theirs is not None and sorted(mine) == sorted(theirs)
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), f"{key} differs from the undisturbed run's"
    # Every step's gradient came from the same micro-batches and the same schedule as in the calm run.
    calm_steps, faulty_steps = committed(runs["calm"], ["r1", "r2"]), committed(runs["faulty"], ["a", "b", "c"])
    assert sorted(calm_steps) == sorted(faulty_steps) == list(range(1, 41))
    for step in (killed_step, killed_step + 1, 40):
        assert {r["lr"] for r in faulty_steps[step]} == {r["lr"] for r in calm_steps[step]}
    assert_each_sample_once_per_epoch(runs["faulty"], ["a", "b", "c"], incomplete_allowed=1)


def _resumed_from(node: Node) -> tuple[int, int, int]:
    """(step, epoch, samples into it) of the resume rank 0's worker announced after the kill."""
    found = re.findall(r"resumed from snapshot step (\d+) \(epoch (\d+), (\d+) samples into it\)",
                       node.log_path.read_text())
    assert found, node.log_tail(40)
    step, epoch, cursor = found[-1]
    return int(step), int(epoch), int(cursor)


@pytest.mark.slow
def test_under_plain_torchrun_a_kill_resumes_from_the_newest_snapshot_at_the_right_epoch_and_position(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script = write_script(tmp_path, "plain_ddp.py", PLAIN_LOOP)
    env = {"DATASET": str(DATASET), "SAVE": str(tmp_path / "model.pt"), "PROGRESS_DIR": str(tmp_path),
           "SNAPSHOTS": str(tmp_path / "snapshots"), "LEDGER": str(tmp_path / "ledger.jsonl"),
           "OMP_NUM_THREADS": "1", "SLEEP": "0.05"}
    group = [nodes(name=name, endpoint=etcd_server.endpoint, run_id=run_id, script=str(script), nnodes="1:2",
                   launcher="torchrun", metrics_port=AUTO_METRICS_PORT,
                   env={**env, "PROGRESS": str(tmp_path / f"{name}.rows.jsonl")}) for name in ("a", "b")]
    train_together(group, tmp_path, 2, steps=7)
    victim, survivor = group
    old_pid = rows(survivor, tmp_path)[-1]["pid"]
    killed_at = time.time()
    victim.kill()
    train_together([survivor], tmp_path, 1, steps=1, after=killed_at, timeout=90)
    step, epoch, cursor = _resumed_from(survivor)
    wait_until(lambda: rows(survivor, tmp_path)[-1]["epoch"] > epoch, 60, f"the resumed epoch {epoch} to end",
               on_timeout=logs(survivor))

    after = [r for r in rows(survivor, tmp_path) if r["pid"] != old_pid]
    assert after[0]["step"] == step + 1, "the first step after the restart does not follow the snapshot's"
    assert after[0]["epoch"] == epoch
    # Before the resume point: the epoch's first `cursor` samples; after it, exactly the rest.
    before = [r for name in ("a", "b") for r in read_rows(tmp_path / f"{name}.rows.jsonl")
              if r["pid"] != after[0]["pid"] and r["step"] <= step]
    assert len({(r["step"], r["rank"]) for r in before if r["step"] > step - 1}) == 2, "the snapshot step's rows"
    trained = [i for r in before if r["epoch"] == epoch for i in r["ids"]]
    rest = [i for r in after if r["epoch"] == epoch for i in r["ids"]]
    assert len(trained) == cursor, (len(trained), cursor)
    assert sorted(trained + rest) == list(range(DATASET)), "a sample repeated or skipped across the resume"
    assert after[-1]["epoch"] > epoch, "the resumed epoch did not end"
    assert [r["step"] for r in after] == list(range(step + 1, after[-1]["step"] + 1)), "steps skipped or repeated"
