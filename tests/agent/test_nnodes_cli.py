"""The --nnodes rule through a real `elastic agent`, as Kubeflow Trainer v2 starts it.

Trainer v2's torch runtime injects a fixed PET_NNODES (the TrainJob's numNodes); our
runtime sets ELASTIC_NNODES=MIN:MAX. A lone agent under PET_NNODES=2 and
ELASTIC_NNODES=1:2 must train on its own (MIN is 1) instead of waiting for a second node,
and say once that it ignored PET_NNODES.
"""

from __future__ import annotations

import pytest

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from agent.node.proctree import kill_tree, process_tree
from agent.etcd import EmbeddedEtcd

AGENT = [sys.executable, "-m", "agent.cli", "agent"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_", "PET_", "TORCHELASTIC_"))}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def test_a_fixed_pet_nnodes_does_not_pin_an_elastic_job(
    etcd_server: EmbeddedEtcd, run_id: str, tmp_path: Path
) -> None:
    progress = tmp_path / "progress.jsonl"
    log = tmp_path / "agent.log"
    cmd = [*AGENT, "--node-name", "solo", "--metrics-port", "0", "--no-warm-start",
           "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run_id, "--monitor-interval", "0.1",
           "-m", "elastic.examples.tiny_ddp", "--steps", "3", "--step-time", "0.01", "--progress", str(progress)]
    env = clean_env(PET_NNODES="2", PET_NODE_RANK="0", ELASTIC_NNODES="1:2", ELASTIC_NODE_NAME="solo")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=tmp_path, start_new_session=True)
    try:
        try:
            code = proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            raise AssertionError("the lone agent never finished: it waited for the PET_NNODES=2 it should "
                                 "have ignored?\n" + log.read_text()[-3000:]) from None
        text = log.read_text()
        assert code == 0, text[-3000:]
        steps = [json.loads(line) for line in progress.read_text().splitlines()]
        assert [s["step"] for s in steps] == [0, 1, 2]
        assert {s["world_size"] for s in steps} == {1}, "trained alone, as ELASTIC_NNODES=1:2 allows"
        named = [line for line in text.splitlines() if "PET_NNODES" in line]
        assert len(named) == 1, text[-3000:]
        assert "WARNING" in named[0] and "PET_NNODES=2" in named[0] and "ELASTIC_NNODES=1:2" in named[0]
    finally:
        if process_tree(proc.pid):
            kill_tree(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.mark.slow  # starts processes
def test_a_bad_elastic_nnodes_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = subprocess.run([*AGENT, "--rdzv-id", "x", "-m", "elastic.examples.tiny_ddp"],
                          env=clean_env(ELASTIC_NNODES="4:1", PET_NNODES="2"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert errors == ["error: ELASTIC_NNODES '4:1': need 1 <= MIN <= MAX; give N or MIN:MAX with 1 <= MIN <= MAX, e.g. 1:4"]
