"""`elastic check` under real agents: the job checks its replicas when asked, and says what it found.

Two nodes train in place (real etcd, real agents, a plain script whose periodic check is
too rare to run during the test). ``elastic check`` asks the job, through one node's
agent, to check at its next step: it prints that the replicas agree, exit 0. After
``elastic inject-sdc`` flips a bit in one node's worker, ``elastic check`` prints the
mismatch line (with two replicas both nodes are named) and exits 1; the job has gone back
to its last agreed state and trains on. A node that is not live is one line, exit 2.
``elastic inject-sdc`` prints the worker's answer: the tensor it changed by its own name,
or (exit 2) the tensors the model has when the one named does not exist.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable

import pytest

from agent.node.goodput import read_account
from agent.etcd import EmbeddedEtcd, EtcdClient
from agent.rendezvous.signing import StateSigner
from tests.agent.test_spares import DATASET
from tests.elastic.inplace.support import start_script, train_together
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until

SCRIPT = textwrap.dedent('''\
    import json, logging, os, time
    import torch
    from torch import nn
    from torch.nn import functional as F
    import elastic
    from elastic.jobs.mlp import SyntheticClassification, as_batch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    run = elastic.ElasticRun(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                             SyntheticClassification(int(os.environ["DATASET"]), seed=1), global_batch_size=18,
                             steps=100000, snapshot_dir=os.environ["SNAPSHOTS"],
                             snapshots=elastic.SnapshotConfig(every_steps=0, ledger=os.environ["LEDGER"]),
                             data=elastic.DataConfig(collate_fn=as_batch), seed=3, check_every_steps=100000)
    rows = open(os.environ["PROGRESS"], "a")
    for x, y in run:
        if run.step(F.cross_entropy(run.model(x), y)):
            rows.write(json.dumps({"step": run.step_count, "rank": run.rank, "world_size": run.world_size,
                                   "pid": os.getpid(), "time": time.time()}) + "\\n")
            rows.flush()
        time.sleep(0.02)
''')


def _elastic(etcd: EmbeddedEtcd, run_id: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args, "--rdzv-endpoint", etcd.endpoint,
                           "--rdzv-id", run_id], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_elastic_check_prints_agreement_then_the_mismatch_it_found(
    etcd_server: EmbeddedEtcd, etcd_client: EtcdClient, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script = tmp_path / "check.py"
    script.write_text(SCRIPT)
    group = [start_script(nodes, name, etcd_server, run_id, tmp_path, script, nnodes="2:2",
                          env={"DATASET": str(DATASET)}) for name in ("a", "b")]
    train_together(group, tmp_path, 2, steps=5)

    agreed = _elastic(etcd_server, run_id, "check", "--timeout", "60")
    assert agreed.returncode == 0, agreed.stdout + agreed.stderr
    assert "asked the job through node a" in agreed.stdout and "the 2 replicas agree at step" in agreed.stdout, \
        agreed.stdout

    # a tensor the model does not have: one line naming those it has, exit 2 (it exited 0 and said nothing)
    typo = _elastic(etcd_server, run_id, "inject-sdc", "b", "--tensor", "0.wieght")
    assert typo.returncode == 2, typo.stdout + typo.stderr
    errors = [line for line in typo.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: [b rank ") and "Traceback" not in typo.stderr, typo.stderr
    assert "no parameter or optimizer state named '0.wieght'; parameters: 0.weight, 0.bias, 2.weight, 2.bias" \
        in errors[0], errors
    # the default tensor, named by its own name (it was 'first' in every line)
    flip = _elastic(etcd_server, run_id, "inject-sdc", "b")
    assert flip.returncode == 0, flip.stdout + flip.stderr
    asked, done = flip.stdout.splitlines()
    assert asked == "asked node b through etcd to flip a bit of its first parameter in its local rank 0", asked
    assert done.startswith("[b rank ") and "flipped bit 22 of element 0 of 0.weight after step" in done, done
    b = group[1]
    assert "fault injection: flipped bit 22 of element 0 of 0.weight" in b.log_path.read_text()
    found = _elastic(etcd_server, run_id, "check", "b", "--timeout", "60")
    assert found.returncode == 1, found.stdout + found.stderr
    line = found.stdout.splitlines()[-1]
    assert line.startswith("silent data corruption at step") and "node a (rank" in line and "node b (rank" in line \
        and "every replica returns to step" in line, found.stdout
    train_together(group, tmp_path, 2, steps=15)  # trains on from the agreed state

    def sdc_fault() -> object:  # the job's fault timeline (elastic top, elastic local): the event, named
        account = read_account(etcd_client, StateSigner(None), "/elastic", run_id)
        return next((f for f in account.faults if f.reason == "sdc"), None) if account is not None else None

    wait_until(lambda: sdc_fault() is not None, 30, "the fault timeline to record the SDC event",
               on_timeout=lambda: "".join(n.log_tail(30) for n in group))
    fault = sdc_fault()
    assert set(fault.nodes) == {"a", "b"} and "differs: 0.weight" in fault.detail, fault
    assert "step(s) retrained" in fault.detail and "detection" in fault.phases, fault

    missing = _elastic(etcd_server, run_id, "check", "ghost")
    assert missing.returncode == 2 and "no live node 'ghost'" in missing.stderr, missing.stdout + missing.stderr
