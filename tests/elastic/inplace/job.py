"""The ElasticRun job the in-place tests run (written for them, in the tests' own tree).

Each completed step appends one JSON line to ``$PROGRESS`` (local rank 0 only): step,
rank, world, round, pid, time and a fingerprint of the parameters' exact bits, so a test
can tell from outside whether a process survived, which steps it trained in which world,
and whether every rank holds identical parameters.

``START_DELAY`` holds the worker back before it builds its model (a slow joiner).
``DIE_AT_STEP`` / ``DIE_ON_NODE``: that node's worker SIGKILLs itself inside the optimizer
step of that step, after every collective of the step completed: a real failure between
the gradient all-reduce and the optimizer step. ``DIE_MARKER`` makes it happen once.
``FAIL_AT_START_MARKER``: the first worker (the marker file does not exist yet) exits 1
before it builds anything: a joiner whose worker fails before it ever joined a round.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import time

import torch
from torch import nn
from torch.nn import functional as F

import elastic
from elastic.jobs.mlp import SyntheticClassification, as_batch

WIDTH = int(os.environ.get("WIDTH", "32"))


def fingerprint(model: nn.Module) -> str:
    digest = hashlib.sha1()
    for p in model.parameters():
        digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


class DyingAdam(torch.optim.Adam):
    def step(self, closure=None):
        die_at = int(os.environ.get("DIE_AT_STEP", "-1"))
        marker = os.environ.get("DIE_MARKER", "")
        if (run.step_count + 1 == die_at and os.environ.get("DIE_ON_NODE") == os.environ.get("ELASTIC_NODE_NAME")
                and marker and not os.path.exists(marker)):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(closure)


fail_marker = os.environ.get("FAIL_AT_START_MARKER", "")
if fail_marker and not os.path.exists(fail_marker):
    open(fail_marker, "w").close()
    raise SystemExit(1)
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
time.sleep(float(os.environ.get("START_DELAY", "0")))  # a joiner slow to build its model
torch.manual_seed(int(os.environ.get("INIT_SEED", "0")))
model = nn.Sequential(nn.Linear(16, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))
optimizer = DyingAdam(model.parameters(), lr=1e-3)
progress = open(os.environ["PROGRESS"], "a") if int(os.environ.get("LOCAL_RANK", "0")) == 0 else None


def report(info: elastic.StepInfo) -> None:
    if progress is not None:
        progress.write(json.dumps({
            "node": info.node, "rank": info.rank, "world_size": info.world_size, "step": info.step,
            "round": info.round, "pid": os.getpid(), "time": time.time(), "params": fingerprint(model),
            "loss": float(info.loss), "samples": info.samples,
        }) + "\n")
        progress.flush()


run = elastic.ElasticRun(
    model, optimizer, SyntheticClassification(int(os.environ.get("DATASET", "512")), seed=1),
    global_batch_size=16, steps=int(os.environ.get("STEPS", "100000")), snapshot_dir=os.environ["SNAPSHOTS"],
    snapshots=elastic.SnapshotConfig(every_steps=int(os.environ.get("SNAPSHOT_EVERY", "10")),
                                     ledger=os.environ.get("LEDGER")),
    on_step_end=report, data=elastic.DataConfig(collate_fn=as_batch), seed=3,
)
for x, y in run:
    run.step(F.cross_entropy(run.model(x), y))
    time.sleep(float(os.environ.get("STEP_SLEEP", "0.03")))
