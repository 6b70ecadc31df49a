"""Fork server for the crash test: imports torch once, then forks a saver per round.

Restarting a Python process that imports torch costs ~1.5 s; forking costs ~ms, so
50 kill/restart rounds stay within a few seconds each. The forked child saves
snapshot after snapshot forever (state is a function of step) until SIGKILLed.
"""

from __future__ import annotations

import os
import sys

import torch

torch.set_num_threads(1)  # no OpenMP pool to inherit across fork

from checkpoints import SnapshotStore  # noqa: E402
from ckpt_testutil import state_for  # noqa: E402

NUMEL = 1 << 18  # ~2 MB per snapshot (two 1 MB tensors + small ones), five files


def saver(root: str) -> None:
    store = SnapshotStore(root, keep=3)
    step = max((i.step for i in store.list()), default=0) + 1
    while True:
        store.save(step, state_for(step, NUMEL), world_size=1)
        os.write(1, f"durable {step}\n".encode())
        step += 1


def main() -> None:
    root = sys.argv[1]
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "fork":
            break
        pid = os.fork()
        if pid == 0:
            try:
                saver(root)
            finally:
                os._exit(1)
        print(f"child {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"reaped {pid} {status}", flush=True)


if __name__ == "__main__":
    main()
