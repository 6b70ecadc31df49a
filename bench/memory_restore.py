"""Restarts from memory (issue 52 item 3): a restarted node's workers loading their own copies
from the agent's shared memory, against reloading the newest snapshot from the snapshot
directory.

One node of 2 ranks under ``elastic agent --no-in-place`` (the restart path: every worker
restarts, as under plain torchrun), an FSDP2 script on a 1-D mesh over both ranks (written
here: FSDP2's docs plus the prepare lines; ``--width`` x ``--layers`` linear blocks, AdamW),
a snapshot every ``--snapshot-every`` steps. Configurations, interleaved trial by trial:

* ``memory``: peer copies after every step (``ELASTIC_PEER_COPY_EVERY=1``), so each rank's
  own copy is also in the agent's ``/dev/shm`` directory;
* ``snapshot``: no copies: the restart reloads the newest snapshot (verified, as always).

Each trial trains ``--before`` steps, SIGKILLs local rank 1 alone between two snapshots, and
reads: the restore time the workers report (``elastic_restore_seconds``: finding, loading and
agreeing on the state), the seconds from the kill to the first step after it, and the steps
rolled back (the last step trained before the kill, less the step the job went on from).

    .venv/bin/python bench/memory_restore.py --width 1024 --layers 4 --trials 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from agent.etcd import EmbeddedEtcd  # noqa: E402
from agent.local.local_node import AUTO_METRICS_PORT, LocalNode  # noqa: E402

SCRIPT = textwrap.dedent('''\
    import json, os, sys, time
    import torch, torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import elastic

    width, layers, every = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

    class Data(torch.utils.data.Dataset):
        def __len__(self): return 1 << 16
        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return torch.randn(width, generator=g), torch.randint(0, 4, (), generator=g)

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)],
                          nn.Linear(width, 4))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = torch.utils.data.DataLoader(Data(), batch_size=4)
    ft = elastic.Elastic(snapshots=elastic.SnapshotConfig(every_steps=every))  # + the prepare lines
    model, optimizer, loader = ft.prepare(model, optimizer, loader)
    rows = open(os.environ["ROWS"], "a")
    for epoch in ft.epochs(1000):  # runs until the bench ends it
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            rows.write(json.dumps({"step": ft.step_count, "local": int(os.environ["LOCAL_RANK"]),
                                   "pid": os.getpid(), "time": time.time()}) + "\\n")
            rows.flush()
''')


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def trial(config: str, work: Path, etcd: EmbeddedEtcd, args: argparse.Namespace) -> dict[str, float] | None:
    run = work / f"{config}-{time.time_ns()}"
    run.mkdir(parents=True)
    script, rows = run / "fsdp.py", run / "rows.jsonl"
    script.write_text(SCRIPT)
    env = {"OMP_NUM_THREADS": "1", "ROWS": str(rows), "ELASTIC_SNAPSHOT_DIR": str(run / "snapshots"),
           **({"ELASTIC_PEER_COPY_EVERY": "1"} if config == "memory" else {})}
    node = LocalNode(name="a", endpoint=etcd.endpoint, launcher="elastic", metrics_port=AUTO_METRICS_PORT,
                     run_id=run.name, workdir=run, script=str(script),
                     module_args=[str(args.width), str(args.layers), str(args.snapshot_every)], nnodes="1:1",
                     nproc_per_node=2, env=env, agent_args=["--no-in-place"])
    node.start()
    try:
        deadline = time.time() + 300
        # killed mid-way between snapshots: the snapshot path then rolls back about half an interval
        while not any(r["step"] >= args.before and r["step"] % args.snapshot_every == args.snapshot_every // 2
                      for r in _rows(rows)):
            if time.time() > deadline or not node.alive():
                print(node.log_tail(40), file=sys.stderr)
                return None
            time.sleep(0.01)
        old = {r["local"]: r["pid"] for r in _rows(rows)}
        steps = [r["step"] for r in _rows(rows) if r["local"] == 0]
        mine = [r["time"] for r in _rows(rows) if r["local"] == 0][-11:]
        step_s = statistics.median(b - a for a, b in zip(mine, mine[1:]))  # the steady pace before the kill
        killed_at = time.time()
        os.kill(old[1], signal.SIGKILL)
        while not any(r["pid"] not in old.values() for r in _rows(rows)):
            if time.time() > deadline or not node.alive():
                print(node.log_tail(40), file=sys.stderr)
                return None
            time.sleep(0.01)
        every = _rows(rows)
        first = min((r for r in every if r["pid"] not in old.values()), key=lambda r: r["time"])
        before = max(r["step"] for r in every if r["pid"] in old.values())
        restore = node.metric("elastic_restore_seconds")
        log = node.log_path.read_text()
        return {"restore_s": restore if restore is not None else float("nan"),
                "kill_to_step_s": first["time"] - killed_at, "rolled_back": before - (first["step"] - 1),
                "step_s": step_s, "from_memory": float("resumed from memory at step" in log),
                "steps_before": float(max(steps) if steps else 0)}
    finally:
        node.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--snapshot-every", type=int, default=20)
    parser.add_argument("--before", type=int, default=25)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--configs", default="memory,snapshot")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: the nodes and etcd are still cleaned up
    configs = args.configs.split(",")
    params = args.layers * (args.width * args.width + args.width) + 4 * args.width + 4
    print(f"FSDP2 over 2 ranks, {params / 1e6:.1f} M parameters ({params * 12 / 1e6:.0f} MB with AdamW's moments), "
          f"snapshot every {args.snapshot_every} steps; --no-in-place, local rank 1 SIGKILLed", flush=True)
    results: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="memory-restore-") as tmp, EmbeddedEtcd() as etcd:
        for t in range(args.trials):
            for config in configs:
                got = trial(config, Path(tmp), etcd, args)
                print(f"trial {t + 1} {config}: {got}", flush=True)
                if got is not None:
                    results[config].append(got)
    print()
    for config, got in results.items():
        if not got:
            print(f"{config}: no trial completed")
            continue
        med = {k: statistics.median(g[k] for g in got) for k in got[0]}
        print(f"{config}: restore {med['restore_s']:.3f} s, kill to first step {med['kill_to_step_s']:.2f} s, "
              f"{med['rolled_back']:.0f} step(s) rolled back ({med['rolled_back'] * med['step_s']:.2f} s of "
              f"training), step {med['step_s'] * 1e3:.0f} ms; from memory in {sum(g['from_memory'] for g in got):.0f} "
              f"of {len(got)} (medians of {len(got)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
