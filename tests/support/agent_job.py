"""The training script the agent's tests run on their nodes (spares, stragglers, freezes,
replica checks): one file, each test's twist set by its node's environment.

Every rank appends one JSON line to ``$PROGRESS`` per committed step (step, rank, world
size, round, pid, time and a fingerprint of the parameters' exact bits), and one line to
``$PROGRESS.setup`` once its start-up (model, data, run) is done. ``$DATASET`` samples,
snapshots in ``$SNAPSHOTS``, the ledger at ``$LEDGER`` (as
:func:`tests.elastic.inplace.support.start_script` sets them).

Knobs, all optional:

- ``JOB_GLOBAL_BATCH`` (16), ``JOB_CHECK_EVERY`` (the run's default replica checks).
- ``JOB_STEP_SLEEP`` (0.03 s after each batch), ``JOB_FIRST_STEPS_SLEEP`` (before each of
  the first 3 steps: no history yet, nobody may be written off).
- ``SLOW_FLAG``: while that file exists, each step's own work takes ``JOB_SLOW_S`` (0.15 s)
  longer (a throttled GPU).
- ``SLOW_SETUP``: while that file exists, start-up takes 2 s longer (a joiner loading data).
- ``PAUSE_MARKER``: node ``b`` pauses 0.3 s once, after step 40 (a GC pause), and makes
  the file so that it happens once.
- ``HOLD_MARKER``: once the file ``$HOLD_MARKER.arm`` exists, node ``b`` holds ``JOB_HOLD_S``
  (6 s) once, alive (a long validation on one rank), and makes ``$HOLD_MARKER`` as it starts.
- ``WEDGE_MARKER``: once the file ``$WEDGE_MARKER.arm`` exists, node ``b`` waits for ever,
  idle, on a FIFO of its own that nobody writes (a wait no fence covers: a pipe, a socket of
  the script's own), once, and makes ``$WEDGE_MARKER`` as it starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path


def write_to(path: Path) -> Path:
    """This script, copied to ``path`` (a test's own directory, where a user's script would be)."""
    shutil.copyfile(__file__, path)
    return path


def main() -> None:
    import torch
    from torch import nn
    from torch.nn import functional as F

    import elastic
    from elastic.jobs.mlp import SyntheticClassification, as_batch

    env = os.environ
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    check = {"check_every_steps": int(env["JOB_CHECK_EVERY"])} if env.get("JOB_CHECK_EVERY") else {}
    run = elastic.ElasticRun(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                             SyntheticClassification(int(env["DATASET"]), seed=1),
                             global_batch_size=int(env.get("JOB_GLOBAL_BATCH", "16")), steps=100000,
                             snapshot_dir=env["SNAPSHOTS"],
                             snapshots=elastic.SnapshotConfig(every_steps=10, ledger=env["LEDGER"]),
                             data=elastic.DataConfig(collate_fn=as_batch), seed=3, **check)
    with open(env["PROGRESS"] + ".setup", "a") as f:  # the script's start-up is done: model, data, run
        f.write(json.dumps({"pid": os.getpid(), "time": time.time()}) + "\n")
    rows = open(env["PROGRESS"], "a")
    step_sleep = float(env.get("JOB_STEP_SLEEP", "0.03"))
    first_steps_sleep = float(env.get("JOB_FIRST_STEPS_SLEEP", "0"))
    slow_flag, slow_s = env.get("SLOW_FLAG", ""), float(env.get("JOB_SLOW_S", "0.15"))
    pause = env.get("PAUSE_MARKER", "")
    hold, hold_s = env.get("HOLD_MARKER", ""), float(env.get("JOB_HOLD_S", "6"))
    wedge = env.get("WEDGE_MARKER", "")
    if os.path.exists(env.get("SLOW_SETUP", "/nonexistent")):
        time.sleep(2)  # a joiner's slow set-up (loading its data): the survivors train on meanwhile
    for x, y in run:
        if first_steps_sleep and run.step_count < 3:
            time.sleep(first_steps_sleep)
        loss = F.cross_entropy(run.model(x), y)
        if slow_flag and os.path.exists(slow_flag):
            time.sleep(slow_s)  # a throttled GPU: this rank's own work takes longer
        if run.step(loss):
            digest = hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
            rows.write(json.dumps({"step": run.step_count, "rank": run.rank, "world_size": run.world_size,
                                   "round": run.round, "pid": os.getpid(), "time": time.time(),
                                   "params": digest[:16]}) + "\n")
            rows.flush()
            if (pause and run.step_count >= 40 and env.get("ELASTIC_NODE_NAME") == "b"
                    and not os.path.exists(pause)):
                open(pause, "w").close()
                time.sleep(0.3)  # a GC pause: the others wait 0.3 s in the next step's all-reduce
            if (hold and env.get("ELASTIC_NODE_NAME") == "b" and os.path.exists(hold + ".arm")
                    and not os.path.exists(hold)):
                open(hold, "w").close()
                time.sleep(hold_s)  # alive and slow: the others' next step is stuck, b's agent answers
            if (wedge and env.get("ELASTIC_NODE_NAME") == "b" and os.path.exists(wedge + ".arm")
                    and not os.path.exists(wedge)):
                open(wedge, "w").close()
                os.mkfifo(wedge + ".fifo")
                with open(wedge + ".fifo") as fifo:  # blocks in open() until a writer comes: none does
                    fifo.read()
        time.sleep(step_sleep)


if __name__ == "__main__":
    main()
