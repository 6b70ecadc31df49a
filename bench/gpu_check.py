"""What the NCCL path does on a real GPU: one short run for a lent one-GPU machine.

CI and the development machines have no GPU, so this is where the CUDA side is checked and
timed. Sections, each printed as it finishes (a section that fails prints why and the rest
go on):

* ``api``: torch, CUDA and NCCL versions; which backends can reconfigure a live group in
  place on this torch (:func:`elastic.inplace.reconfigure.unsupported_reason`), whether an
  ``nccl2`` backend is registered; a world of one NCCL rank reconfigured in place and
  all-reducing when the API exists; and whether NCCL lets two ranks share one GPU (it
  refuses, so shrink and heal need two GPUs).
* ``staging``: a snapshot's blocking part for a GPU state (ResNet-50 + Adam, and 2 GB of
  plain tensors): :class:`checkpoints.capture.Stager` (pinned buffers, non_blocking copies on
  a side stream) against its anchor, a synchronous ``.cpu()`` of the same state (pageable,
  freshly allocated), in the same run; medians.
* ``steps``: GPU step time with a snapshot every ``--every`` steps against none,
  interleaved block by block, medians (the writer's thread and process modes).
* ``overhead``: the prepare API's cost per step on a GPU (issue 27's goal: <= 2 %): one
  plain DDP loop (ResNet-50, bf16 autocast, AdamW, a DistributedSampler over a dataset
  held on the GPU) and the same loop with the prepare API's lines, both alive in one
  ``torchrun`` worker (NCCL, world of one, worker metrics on, a snapshot every
  ``--every`` steps), timed in alternating blocks; medians.
* ``resume``: a plain DDP loop on CUDA (NCCL, fp16 autocast with a ``GradScaler``, an LR
  scheduler) with the prepare API's lines, under ``torchrun``: 3 epochs, then 6 from the
  same snapshots, against 6 straight; the final parameters must be equal bit for bit.

    python bench/gpu_check.py                 # all sections
    python bench/gpu_check.py --sections api  # one

The NCCL collective timing with CUDA events is checked by
``tests/elastic/metrics/test_cuda_timing.py`` (run it in the same lease).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoints import AsyncSnapshotWriter, SnapshotStore  # noqa: E402
from checkpoints.capture import Stager  # noqa: E402
from checkpoints.tree import map_state  # noqa: E402
from elastic.inplace.reconfigure import unsupported_reason  # noqa: E402

GB = 1e9

_TWO_RANKS = """
import os, sys, torch, torch.distributed as dist
from datetime import timedelta
rank = int(sys.argv[1])
store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), 2, rank == 0, timeout=timedelta(seconds=30))
torch.cuda.set_device(0)
dist.init_process_group("nccl", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30),
                        device_id=torch.device("cuda", 0))
t = torch.ones(4, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
print("rank", rank, "all_reduce ok", t.tolist(), flush=True)
dist.destroy_process_group()
"""

_ONE_RANK_IN_PLACE = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
from elastic.inplace.reconfigure import init_group, handle, reconfigure
torch.cuda.set_device(0)
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 1, True, timeout=timedelta(seconds=30))
init_group(sys.argv[2], store, 0, 1, timedelta(seconds=30), torch.device("cuda", 0))
reconfigure(1, [handle()], timedelta(seconds=30))
t = torch.ones(4, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
print("world", dist.get_world_size(), "rank", dist.get_rank(), "all_reduce", t.tolist(), flush=True)
"""


_PLAIN_LOOP = """\
import os, sys, torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
import elastic

snapshots, epochs, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
device = torch.device("cuda", 0) if cuda else torch.device("cpu")
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 10)).to(device))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
scaler = torch.amp.GradScaler("cuda", enabled=cuda)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(256, 32, generator=g), torch.randint(0, 10, (256,), generator=g))
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=32, sampler=sampler)
ft = elastic.Elastic(snapshot_dir=snapshots, snapshots=elastic.SnapshotConfig(every_steps=10), seed=0)
model, optimizer, loader, scheduler, scaler = ft.prepare(model, optimizer, loader, scheduler, scaler)
for epoch in ft.epochs(epochs):
    sampler.set_epoch(epoch)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16, enabled=cuda):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
if ft.is_main:
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, out)
    print("done", ft.step_count, "steps; device", next(model.parameters()).device, flush=True)
"""


_OVERHEAD_LOOP = """\
import itertools, os, statistics, sys, time, torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import elastic

snapshots, blocks, block, every, batch = sys.argv[1], *map(int, sys.argv[2:6])
cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
device = torch.device("cuda", 0) if cuda else torch.device("cpu")
side = 224 if cuda else 32


class Images(Dataset):
    def __init__(self, n):
        torch.manual_seed(1)
        self.x, self.y = torch.randn(n, 3, side, side, device=device), torch.randint(0, 1000, (n,), device=device)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __getitems__(self, indices):
        at = torch.as_tensor(indices, device=device)
        return self.x[at], self.y[at]


def as_batch(b):
    return b


data = Images(32 * batch)


def build():
    from torchvision.models import resnet50, resnet18
    torch.manual_seed(0)
    model = DDP((resnet50() if cuda else resnet18()).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sampler = DistributedSampler(data, seed=0)
    return model, optimizer, sampler, DataLoader(data, batch_size=batch, sampler=sampler, collate_fn=as_batch)


def loop(model, optimizer, sampler, loader, epochs):
    for epoch in epochs:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            yield


model, optimizer, sampler, loader = build()
loops = {"plain": loop(model, optimizer, sampler, loader, itertools.count())}
model, optimizer, sampler, loader = build()
ft = elastic.Elastic(snapshot_dir=snapshots, snapshots=elastic.SnapshotConfig(every_steps=every),  # added
                     handle_sigterm=False)  # added
model, optimizer, loader = ft.prepare(model, optimizer, loader)                                  # added
loops["prepared"] = loop(model, optimizer, sampler, loader, ft.epochs(10**6))                   # changed


def timed(steps, n):
    if cuda:
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        next(steps)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


timed(loops["plain"], 20)
timed(loops["prepared"], every + 1)  # its first snapshot (which allocates the staging buffers) off the clock
times = {name: [] for name in loops}
for b in range(blocks):
    for name in (list(loops) if b % 2 == 0 else list(loops)[::-1]):
        times[name].append(timed(loops[name], block))
plain = statistics.median(t for t, _ in times["plain"])
prepared = statistics.median(t for t, _ in times["prepared"])
pairs = [p[0] / q[0] for p, q in zip(times["plain"], times["prepared"])]
print(f"overhead: plain {plain * 1e3:.2f} ms/step, prepared {prepared * 1e3:.2f} ms/step; "
      f"prepared/plain per block pair: median {1 / statistics.median(pairs):.4f}x "
      f"({', '.join(f'{1 / r:.3f}' for r in pairs)}); host CPU per step: plain "
      f"{statistics.median(c for _, c in times['plain']) * 1e3:.2f} ms, prepared "
      f"{statistics.median(c for _, c in times['prepared']) * 1e3:.2f} ms", flush=True)
"""


def free_port() -> int:
    """A port for rank 0's TCPStore, handed to every rank on its command line before any
    starts (so it is picked ahead; the device machine runs nothing else). Not
    agent.etcd.server.free_port: the lent machine's Python has torch but no etcd3."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env() -> dict[str, str]:
    """This environment, with the project importable from a child's script."""
    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run_python(code: str, *args: str, procs: int = 1, timeout: float = 90) -> list[str]:
    """Run ``code`` in ``procs`` processes (argv[1] = its index when procs > 1); their output."""
    children = [subprocess.Popen([sys.executable, "-c", code, *([str(i)] if procs > 1 else []), *args],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env())
                for i in range(procs)]
    out = []
    for i, child in enumerate(children):
        try:
            text, _ = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            text, _ = child.communicate()
            text += f"\n(timed out after {timeout:.0f} s)"
        lines = [ln for ln in text.splitlines() if ln.strip() and "Warning" not in ln]
        out.append(f"proc {i} exit {child.returncode}: " + " | ".join(lines[-4:])[:600])
    return out


def section_api() -> None:
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU {torch.cuda.get_device_name(0)}, "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    backends = list(getattr(dist.Backend, "backend_list", []))
    print(f"registered backends: {backends}; nccl2 registered: {'nccl2' in backends}")
    for backend in ("gloo", "nccl", "nccl2"):
        print(f"in place with {backend}: {unsupported_reason(backend) or 'supported'}")
    if unsupported_reason("nccl") is None:
        for backend in ("nccl", "nccl2"):
            if backend == "nccl" or "nccl2" in backends:
                print(f"a world of one {backend} rank, reconfigured in place:")
                for line in run_python(_ONE_RANK_IN_PLACE, str(free_port()), backend):
                    print("   ", line)
    print("two NCCL ranks on one GPU:")
    # ports picked ahead (free_port): each rank needs rank 0's TCPStore port on its command line first
    for line in run_python(_TWO_RANKS, str(free_port()), procs=2, timeout=60):
        print("   ", line)


def resnet_state() -> dict[str, Any]:
    from torchvision.models import resnet50

    torch.manual_seed(0)
    model = resnet50(weights=None).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3, 64, 64, device="cuda")).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def plain_state(nbytes: int) -> dict[str, Any]:
    n = 64
    return {"model": {f"w{i}": torch.randn(nbytes // 4 // n, device="cuda") for i in range(n)}}


def section_staging(repeats: int) -> None:
    for name, state in (("ResNet-50 + Adam", resnet_state()), ("2 GB of tensors", plain_state(2 * 10**9))):
        stager = Stager()
        nbytes = 0

        # stager and state bound now (not looked up when called): the loop rebinds them and
        # deletes state at the end of the iteration
        def staged(stager: Stager = stager, state: Any = state) -> tuple[float, float]:
            nonlocal nbytes
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            capture = stager.stage(state)
            t1 = time.perf_counter()
            capture.finish_copies()
            nbytes = capture.nbytes
            return t1 - t0, time.perf_counter() - t0

        staged()  # allocates the pinned buffers once, as a job's first snapshot does
        runs = [staged() for _ in range(repeats)]
        blocking = statistics.median(r[0] for r in runs)
        landed = statistics.median(r[1] for r in runs)

        def to_cpu(state: Any = state) -> None:
            torch.cuda.synchronize()
            map_state(state, lambda t, _where: t.cpu())

        anchor = statistics.median(timeit.repeat(to_cpu, repeat=repeats, number=1))
        print(f"{name}, {nbytes / GB:.2f} GB: stage() blocks {blocking * 1e3:.1f} ms, copies landed after "
              f"{landed * 1e3:.0f} ms ({nbytes / landed / GB:.1f} GB/s); a synchronous .cpu() of the same state "
              f"{anchor * 1e3:.0f} ms ({nbytes / anchor / GB:.1f} GB/s): blocking {blocking / anchor:.3f}x the anchor")
        stager.release()
        del state, staged, to_cpu  # the closures hold the state too
        torch.cuda.empty_cache()


def section_steps(blocks: int, every: int, batch: int) -> None:
    from torchvision.models import resnet50

    torch.manual_seed(0)
    model = resnet50(weights=None).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device="cuda")
    step = 0
    with tempfile.TemporaryDirectory() as d:
        writers = {m: AsyncSnapshotWriter(SnapshotStore(Path(d) / m, keep=2), mode=m) for m in ("thread", "process")}
        for w in writers.values():
            w.attach_optimizer(opt)
            w.wait_writer_process()

        def train(n: int, writer: AsyncSnapshotWriter | None) -> float:
            nonlocal step
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(n):
                if writer is not None and i % every == 0:
                    writer.submit(step, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                                  world_size=1)
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                step += 1
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            if writer is not None:
                writer.flush()  # between blocks, off the clock: the write overlaps the next block in a job
            return elapsed / n

        for w in writers.values():
            train(2 * every, w)
        train(every, None)
        plain: list[float] = []
        snap: dict[str, list[float]] = {m: [] for m in writers}
        for b in range(blocks):
            plain.append(train(2 * every, None))
            for m in (list(writers) if b % 2 == 0 else list(writers)[::-1]):
                snap[m].append(train(2 * every, writers[m]))
        base = statistics.median(plain)
        print(f"ResNet-50 + Adam, batch {batch} of 224x224, bf16 autocast: {base * 1e3:.1f} ms/step without "
              f"snapshots ({blocks} blocks of {2 * every} steps)")
        for m, times in snap.items():
            ratios = [s / p for s, p in zip(times, plain)]
            print(f"  a snapshot every {every} steps, {m} writer: {statistics.median(times) * 1e3:.1f} ms/step, "
                  f"{statistics.median(ratios):.3f}x (blocks: {', '.join(f'{r:.3f}' for r in ratios)})")
            writers[m].close()


def section_overhead(blocks: int, every: int, batch: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        loop = Path(d) / "loop.py"
        loop.write_text(_OVERHEAD_LOOP)
        prom = Path(d) / "prom"
        prom.mkdir()  # worker metrics on, as under the agent (multiprocess mode, the timing comm hook)
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                               str(loop), f"{d}/snapshots", str(blocks), str(2 * every), str(every), str(batch)],
                              capture_output=True, text=True, env={**child_env(), "PROMETHEUS_MULTIPROC_DIR": str(prom)},
                              timeout=400)
        said = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.startswith("overhead") or "Error" in ln]
        print(f"ResNet-50, batch {batch}, bf16 autocast, AdamW, NCCL world of one, a snapshot every {every} steps, "
              f"{blocks} blocks of {2 * every} steps per loop: exit {done.returncode}")
        for line in said or (done.stdout + done.stderr).splitlines()[-8:]:
            print("   ", line)


def section_resume() -> None:
    with tempfile.TemporaryDirectory() as d:
        loop = Path(d) / "loop.py"
        loop.write_text(_PLAIN_LOOP)
        lines = []
        for snapshots, epochs, out in (("s1", 3, "a3"), ("s1", 6, "a6"), ("s2", 6, "b6")):
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                                   str(loop), f"{d}/{snapshots}", str(epochs), f"{d}/{out}.pt"],
                                  capture_output=True, text=True, env=child_env(), timeout=300)
            said = [ln for ln in (done.stdout + done.stderr).splitlines()
                    if "resumed" in ln or "done" in ln or "Error" in ln or "starting from scratch" in ln]
            lines.append(f"{epochs} epochs into {snapshots}: exit {done.returncode}; " + " | ".join(s[-140:] for s in said))
        for line in lines:
            print("   ", line)
        a, b = torch.load(f"{d}/a6.pt"), torch.load(f"{d}/b6.pt")
        print(f"resumed run equals the straight run bit for bit: {all(torch.equal(a[k], b[k]) for k in a)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="api,staging,steps,overhead,resume")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device here; run this on a machine with a GPU")
    sections: dict[str, Callable[[], None]] = {
        "api": section_api,
        "staging": lambda: section_staging(args.repeats),
        "steps": lambda: section_steps(args.blocks, args.every, args.batch),
        "overhead": lambda: section_overhead(args.blocks, args.every, args.batch),
        "resume": section_resume,
    }
    for name in args.sections.split(","):
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            sections[name]()
        except Exception as exc:  # noqa: BLE001 - report it, run the next section
            print(f"section {name} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        print(f"({time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
