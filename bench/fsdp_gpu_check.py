"""Sharded snapshots on a GPU with NCCL: FSDP2 under ``ElasticRun``, one lent GPU.

CI and the development machines have no GPU; this is the short check for a lent one. One
GPU means a world of one NCCL rank (a 1-D mesh of one: FSDP2's code path, no peer), so what
it checks is the CUDA side of the per-rank snapshot (``checkpoints/sharded.py``): the copy
off the device at the step, the background write, the seal, and a resume through
``dcp.load`` onto the GPU. Phases, each a fresh process:

* ``train``: an FSDP2 MLP (``--width``, 8 layers, AdamW) trained ``--steps`` steps with a
  snapshot every ``--every``; the run logs each snapshot's stall. Anchor, in the same
  process and on the same model afterwards: the plain FSDP2 loop with
  ``torch.distributed.checkpoint.async_save`` every ``--every`` steps (the blocking part of
  each call timed), and the plain loop alone (median step time).
* ``resume``: a new process resumes the same directory and trains to ``2 * --steps``;
  a third trains ``2 * --steps`` straight in another directory; final parameters must be
  equal bit for bit (same GPU, same kernels).
* ``dcp``: the newest snapshot verified by the store, then loaded with ``dcp.load`` into a
  plain CPU model outside any process group; it must equal the run's own final state.

    python bench/fsdp_gpu_check.py              # ~2 min on an H100/H200
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

JOB = textwrap.dedent('''\
    import json, logging, os, statistics, sys, time
    import torch, torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from elastic import ElasticRun, SnapshotConfig

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    width, steps, every = int(os.environ["WIDTH"]), int(os.environ["STEPS"]), int(os.environ["EVERY"])
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")

    def build():
        torch.manual_seed(0)
        layers = []
        for _ in range(8):
            layers += [nn.Linear(width, width), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(width, 16)).cuda()
        mesh = init_device_mesh("cuda", (1,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    class Data(torch.utils.data.Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(1)
            self.x, self.y = torch.randn(n, width, generator=g), torch.randint(0, 16, (n,), generator=g)
        def __len__(self): return len(self.x)
        def __getitem__(self, i): return self.x[i], self.y[i]

    model = build()
    run = ElasticRun(model, torch.optim.AdamW(model.parameters(), lr=1e-4), Data(int(os.environ["DATA"])), global_batch_size=64,
                     steps=steps, snapshot_dir=os.environ["SNAPSHOTS"], seed=3,
                     snapshots=SnapshotConfig(every_steps=every))
    times = []
    for x, y in run:
        t0 = time.perf_counter()
        run.step(F.cross_entropy(run.model(x), y))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    full = get_model_state_dict(run.state.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    torch.save(full, os.environ["OUT"])
    result = {"resumed_from": run.resumed_from, "median_step_s": statistics.median(times[5:]) if len(times) > 8 else None}
    run.close()
    if os.environ.get("ANCHOR"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        data = Data(int(os.environ["DATA"]))
        plain, calls, future = [], [], None
        group = dist.new_group(backend="gloo")
        for i in range(steps):
            t0 = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(data.x[i*64:(i+1)*64].cuda()), data.y[i*64:(i+1)*64].cuda()).backward()
            opt.step()
            torch.cuda.synchronize()
            plain.append(time.perf_counter() - t0)
            if (i + 1) % every == 0:
                if future is not None:
                    future.result()
                msd, osd = get_state_dict(model, opt)
                t1 = time.perf_counter()
                future = dcp.async_save({"model": msd, "optimizer": osd},
                                        checkpoint_id=os.environ["SNAPSHOTS"] + f"-dcp/{i + 1}", process_group=group)
                calls.append(time.perf_counter() - t1)
        if future is not None:
            future.result()
        result["plain_median_step_s"] = statistics.median(plain[5:])
        result["dcp_async_save_call_s"] = statistics.median(calls)
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()
''')


def _phase(tmp: Path, name: str, snapshots: Path, steps: int, args: argparse.Namespace, anchor: bool = False) -> tuple[dict, str]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "WIDTH": str(args.width), "STEPS": str(steps), "DATA": str(64 * 2 * args.steps), "EVERY": str(args.every),
           "SNAPSHOTS": str(snapshots),
           "OUT": str(tmp / f"{name}.pt"), "PYTHONPATH": str(ROOT), "ANCHOR": "1" if anchor else ""}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(tmp / "job.py")], env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    out = proc.stdout + proc.stderr
    found = re.findall(r"^RESULT (.*)$", out, re.M)
    if proc.returncode != 0 or not found:
        print(f"[{name}] exit {proc.returncode} after {time.perf_counter() - t0:.1f} s\n{out[-4000:]}", flush=True)
        raise SystemExit(1)
    return json.loads(found[-1]), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=240)
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}", flush=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "job.py").write_text(JOB)
        first, out = _phase(tmp, "first", tmp / "snap", args.steps, args, anchor=True)
        stalls = [float(x) for x in re.findall(r"training stalled ([0-9.]+) ms", out)]
        sizes = re.findall(r"durable: ([0-9.]+) MB of shards", out)
        params = 8 * (args.width * args.width + args.width) + args.width * 16 + 16
        print(f"[train] FSDP2 MLP {params / 1e6:.1f} M params (+ AdamW: {params * 12 / 1e9:.2f} GB of state), "
              f"{args.steps} steps, a snapshot every {args.every}", flush=True)
        print(f"[train] per-rank snapshot: {len(stalls)} written ({sizes[-1] if sizes else '?'} MB each), "
              f"stall median {statistics.median(stalls) if stalls else float('nan'):.1f} ms", flush=True)
        print(f"[train] anchor dcp.async_save: blocking part median {first['dcp_async_save_call_s'] * 1e3:.1f} ms; "
              f"ratio ours/dcp {statistics.median(stalls) / 1e3 / first['dcp_async_save_call_s']:.2f}", flush=True)
        print(f"[train] median step: ElasticRun {first['median_step_s'] * 1e3:.2f} ms (snapshot steps included), "
              f"plain loop {first['plain_median_step_s'] * 1e3:.2f} ms", flush=True)

        resumed, _ = _phase(tmp, "resumed", tmp / "snap", 2 * args.steps, args)
        straight, _ = _phase(tmp, "straight", tmp / "snap2", 2 * args.steps, args)
        a, b = torch.load(tmp / "resumed.pt", weights_only=True), torch.load(tmp / "straight.pt", weights_only=True)
        same = all(torch.equal(a[k], b[k]) for k in b)
        print(f"[resume] resumed from step {resumed['resumed_from']} onto the GPU; final parameters bitwise equal to "
              f"a straight run: {same}", flush=True)

        from checkpoints import SnapshotStore
        from checkpoints.reading import DCP_DIR_KEY
        import torch.distributed.checkpoint as dcp
        from torch import nn

        found = SnapshotStore(tmp / "snap", create=False).load_latest()
        assert found is not None
        layers: list[nn.Module] = []
        for _ in range(8):
            layers += [nn.Linear(args.width, args.width), nn.ReLU()]
        plain = nn.Sequential(*layers, nn.Linear(args.width, 16))
        target = {"model": plain.state_dict()}
        dcp.load(target, checkpoint_id=str(found[1][DCP_DIR_KEY]), no_dist=True)
        equal = all(torch.equal(target["model"][k], v) for k, v in a.items())
        print(f"[dcp] step {found[0].step} verified and loaded with dcp.load into a CPU model: equal to the run's "
              f"own state {equal}", flush=True)
        if not (same and equal):
            raise SystemExit(1)


if __name__ == "__main__":
    main()
