"""A member frozen while a gloo reconfigure's pairs connect, then thawed (issue 51, item 12).

Three processes reconfigure one gloo group into round 1; rank 2 SIGSTOPs itself right after
posting its address, as a node frozen mid-join would. The survivors wait in gloo's
``connectFullMesh`` (5 x the 1 s reconfigure timeout: nothing interrupts it; the round store
is abandoned at 0.8 s, as the watcher does once the agents' next round leaves rank 2 out),
form round 2 without it, and rank 0 then thaws rank 2: its round-1 connect goes on against
the survivors, which train on in round 2. Measured (torch 2.14.1, 2 cores): the survivors'
round 1 fails after 5.0 s; in about 1 try in 5 a survivor that waited for rank 2 to connect
in (the passive side of the pair) is then aborted by gloo (``pair.cc:684 state_ <= CONNECTED.
5 vs 4``, SIGABRT): the late connection reaches the pair the survivor's connect gave up on.
In other tries one survivor formed round 1 (its active connect to the frozen peer's
listener completed in the kernel) and the job went on, or a survivor hung in round 2.

``python bench/gloo_freeze_mid_connect.py --tries 10``: one line per try, a count at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """\
import os, signal, sys, threading, time
from datetime import timedelta
import torch, torch.distributed as dist
from elastic.inplace import reconfigure as rc
from elastic.inplace.round_store import RoundStore

rank, port, pid_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
collective = timedelta(seconds=30)
if rank == 0:
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=collective)


class FreezesOnceItsAddressIsPosted(RoundStore):
    def set(self, key, value):
        super().set(key, value)
        if rank == 2 and "reconfigure/" in key:  # frozen between posting its address and its pairs connecting
            os.kill(os.getpid(), signal.SIGSTOP)


store = FreezesOnceItsAddressIsPosted(collective)
rc.init_group("gloo", store, stable_rank=rank, stable_ranks=3, timeout=collective)


def handles(round_number, size):
    store.point_at(f"127.0.0.1:{port}", f"round/{round_number}/")
    store.set(f"h{rank}", rc.handle())
    return [store.get(f"h{r}").decode() for r in range(size)]


if rank == 2:
    open(pid_file, "w").write(str(os.getpid()))
members = handles(1, 3)
newer_round = threading.Timer(0.8, store.abandon)
if rank < 2:
    newer_round.start()
started = time.monotonic()
try:
    rc.reconfigure(1, members, rc.reconfigure_timeout("gloo", collective))
    print("round 1 formed", flush=True)
except rc.ReconfigureError as exc:
    print(f"round 1 failed after {time.monotonic() - started:.2f} s", flush=True)
newer_round.cancel()
rc.reconfigure(2, handles(2, 2), rc.reconfigure_timeout("gloo", collective))
if rank == 0:
    os.kill(int(open(pid_file).read()), signal.SIGCONT)  # thawed: its round-1 connect goes on
for _ in range(300):
    x = torch.ones(1)
    dist.all_reduce(x)
    time.sleep(0.01)
print("round 2 trained on", flush=True)
if rank == 0:
    time.sleep(1)
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_try(work: Path, timeout: float) -> tuple[list[int | None], list[str]]:
    script = work / "script.py"
    script.write_text(SCRIPT)
    port, pid_file = str(free_port()), str(work / "rank2.pid")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    logs = [open(work / f"rank{r}.log", "w") for r in range(3)]
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, pid_file], stdout=logs[r],
                              stderr=subprocess.STDOUT, env=env) for r in range(3)]
    deadline = time.monotonic() + timeout
    try:
        for p in procs[:2]:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()
        for f in logs:
            f.close()
    codes = [p.returncode for p in procs]
    outs = [(work / f"rank{r}.log").read_text(errors="replace") for r in range(3)]
    return codes, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=40.0, help="seconds per try")
    args = parser.parse_args()
    aborted = hung = 0
    for i in range(args.tries):
        with tempfile.TemporaryDirectory(prefix="gloo-freeze-") as tmp:
            codes, outs = one_try(Path(tmp), args.timeout)
        survivors = [line for out in outs[:2] for line in out.splitlines() if line.startswith("round 1 ")]
        abort = any(c in (-signal.SIGABRT, 134) for c in codes[:2]) or any("EnforceNotMet" in o for o in outs[:2])
        hang = any(c == -signal.SIGKILL for c in codes[:2])
        aborted, hung = aborted + abort, hung + hang
        print(f"try {i + 1}: survivors {codes[:2]}, {'; '.join(survivors) or '?'}"
              f"{', a survivor ABORTED by gloo' if abort else ''}{', a survivor hung' if hang else ''}", flush=True)
    print(f"{aborted} of {args.tries} tries aborted a survivor, {hung} hung one")


if __name__ == "__main__":
    main()
