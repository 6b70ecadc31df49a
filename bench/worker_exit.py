"""How long a worker takes to exit once its script has returned, with the preloaded imports
frozen out of collections (agent.worker.gc_frozen) against the same process without.

The agent declares a node's workers finished (and the job ended) only when they exit; the
interpreter's shutdown runs several full collections, each walking every object torch's
import made unless they are frozen. Each trial starts a process that imports what a warm
worker preloads (agent.worker.warm_worker.DEFAULT_IMPORTS), freezes or not, trains a small
model a few steps, stamps the time its script ends and exits; the figure is stamp to exit as
the parent sees it. Alternating trials, the median of each::

    .venv/bin/python bench/worker_exit.py --trials 7
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """\
import sys, time
sys.path.insert(0, {root!r})
from agent.worker.warm_worker import DEFAULT_IMPORTS, preload
preload(list(DEFAULT_IMPORTS))
if sys.argv[1] == "frozen":
    from agent.worker.gc_frozen import freeze_preloaded
    freeze_preloaded()
import torch
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
opt = torch.optim.AdamW(model.parameters())
for _ in range(20):
    model(torch.randn(16, 256)).sum().backward()
    opt.step()
    opt.zero_grad()
open(sys.argv[2], "w").write(repr(time.time()))
"""


def trial(mode: str, stamp: Path) -> float:
    code = SCRIPT.format(root=str(ROOT))
    subprocess.run([sys.executable, "-c", code, mode, str(stamp)], check=True)
    ended = time.time()
    return ended - float(stamp.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=7)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"plain": [], "frozen": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.trials):
            for mode in times:
                times[mode].append(trial(mode, Path(tmp) / "stamp"))
    plain, frozen = (statistics.median(times[m]) for m in ("plain", "frozen"))
    print(f"script end to process exit, median of {args.trials}: frozen {frozen:.3f} s, "
          f"plain {plain:.3f} s (anchor): ratio {frozen / plain:.2f}")


if __name__ == "__main__":
    main()
