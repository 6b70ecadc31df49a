"""A full or read-only snapshot directory at the final snapshot: one line, no restart, exit 74.

Before, after all its steps the final snapshot raised through the loop, the agent restarted
the worker three times (each failing at once: the directory is not writable) and exited 1
with "a crash loop". Two one-node jobs run side by side, each with its snapshot directory
on a small tmpfs: one fills it, one remounts it read-only, both just before the last step
(the periodic snapshots before that are written). What is checked is what the operator
sees: the agent exits 74 (the job trained to the end; its final snapshot is missing,
docs/agent.md), the worker started once, and one line names the directory and the newest
intact snapshot.
"""

from __future__ import annotations

import re
import subprocess
import textwrap
from pathlib import Path
from typing import Callable, Iterator

import pytest

from checkpoints import SnapshotStore
from elastic.contract import FINAL_SNAPSHOT_LOST_EXIT
from agent.etcd import EmbeddedEtcd
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until

STEPS, EVERY, INTACT = 40, 5, 10  # the directory breaks once snapshot 10 (or newer) is durable

SCRIPT = textwrap.dedent('''\
    import os, time
    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import TensorDataset
    import elastic

    steps, broken = int(os.environ["STEPS"]), os.environ["BROKEN"]

    def slow(info):  # until the test has broken the directory, which it does once snapshots are durable
        if not os.path.exists(broken):
            time.sleep(0.1 if info.step < steps - 1 else 0)
        while info.step == steps - 1 and not os.path.exists(broken):
            time.sleep(0.05)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = TensorDataset(torch.randn(1024, 8), torch.randint(0, 2, (1024,)))
    run = elastic.ElasticRun(model, optimizer, data, global_batch_size=16, steps=steps,
                             snapshot_dir=os.environ["SNAPSHOTS"],
                             snapshots=elastic.SnapshotConfig(every_steps=int(os.environ["EVERY"])),
                             on_step_end=slow)
    for x, y in run:
        run.step(F.cross_entropy(run.model(x), y))
''')


def fill(disk: Path) -> None:
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def newest(disk: Path) -> int:
    info = SnapshotStore(disk, create=False).newest_valid()
    return info.step if info is not None else -1


@pytest.fixture
def small_disks(tmp_path: Path) -> Iterator[dict[str, Path]]:
    disks: dict[str, Path] = {}
    try:
        for mode in ("full", "ro"):
            path = tmp_path / f"disk-{mode}"
            path.mkdir()
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
            disks[mode] = path
        yield disks
    finally:
        for path in disks.values():
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.mark.slow
def test_a_full_or_read_only_snapshot_dir_at_the_end_is_one_line_no_restart_and_exit_74(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path,
    small_disks: dict[str, Path]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    started = {}
    for mode, disk in small_disks.items():
        env = {"SNAPSHOTS": str(disk), "BROKEN": str(tmp_path / f"broken-{mode}"), "STEPS": str(STEPS),
               "EVERY": str(EVERY), "OMP_NUM_THREADS": "1"}
        started[mode] = nodes(name=f"n-{mode}", endpoint=etcd_server.endpoint, run_id=f"{run_id}{mode}",
                              script=str(script), nnodes="1", env=env, agent_args=["--lease-ttl", "2"])

    def logs() -> str:
        return "\n".join(n.log_tail(60) for n in started.values())

    intact = {}
    for mode, disk in small_disks.items():
        wait_until(lambda: newest(disk) >= INTACT, 150, f"snapshot {INTACT} in {mode}", on_timeout=logs)
        if mode == "ro":
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        else:
            fill(disk)
        intact[mode] = newest(disk)
        (tmp_path / f"broken-{mode}").touch()
    wait_until(lambda: not any(n.alive() for n in started.values()), 120, "both agents to exit", on_timeout=logs)
    for mode, node in started.items():
        log = node.log_path.read_text(errors="replace")
        assert node.process is not None and node.process.returncode == FINAL_SNAPSHOT_LOST_EXIT, log[-4000:]
        assert "restart (" not in log and "started again" not in log, log[-4000:]  # the worker started once
        assert "Traceback" not in log and "Root Cause" not in log, log[-4000:]
        lines = [line for line in log.splitlines() if "could not be written to" in line]
        assert len(lines) == 1, log[-4000:]
        assert re.search(rf"ERROR .*step {STEPS} is trained, but its snapshot", lines[0]), lines[0]
        assert str(small_disks[mode]) in lines[0], lines[0]
        assert f"the newest intact snapshot is step {intact[mode]} " in lines[0], (intact, lines[0])
