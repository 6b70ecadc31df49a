"""Node health checks against real faults, with real agents and a real etcd.

What is real: the snapshot directories are small tmpfs mounts (we are root), filled with a
file until the kernel says ENOSPC, or remounted read-only; the wrong clock is libfaketime
(``LD_PRELOAD``, Debian's ``libfaketime``) in the agent's process, one hour ahead, measured
against the ``Date`` header etcd's own HTTP server sends. What each test checks is what an
operator sees: the one line naming the check and the fix, the metric, the node not joining
(or going out while it trains) and joining again once the fault is gone.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import pytest

from agent.local.local_node import AUTO_METRICS_PORT
from agent.etcd import EmbeddedEtcd
from tests.support.stacks import stacks_and_tails
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until

FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
FAST = {"ELASTIC_HEALTH_INTERVAL_S": "0.5", "OMP_NUM_THREADS": "1"}


def fill(disk: Path) -> None:
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    mounted: list[Path] = []

    def mount(name: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(path)
        return path

    try:
        yield mount
    finally:
        for path in mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _log(node: Node) -> str:
    return node.log_path.read_text(errors="replace") if node.log_path.exists() else ""


def _stacks(node: Node) -> str:
    """The agent's log tail with every one of its threads' stacks (SIGUSR1), for an agent that
    did not end: what it waits on."""
    return stacks_and_tails([node], lines=150)


@pytest.mark.slow
def test_a_node_with_a_full_snapshot_disk_does_not_join_until_space_is_freed(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], small_disk: Callable[[str], Path]
) -> None:
    disk = small_disk("snapshots")
    fill(disk)
    node = nodes(name="a", endpoint=etcd_server.endpoint, run_id=run_id, nnodes="1", env=FAST,
                 metrics_port=AUTO_METRICS_PORT,
                 module_args=["--steps", "20", "--step-time", "0.01", "--progress", "{progress}"],
                 agent_args=["--lease-ttl", "2", "--snapshot-dir", str(disk)])
    wait_until(lambda: "not joining the job: health check snapshot_dir" in _log(node), 60, "the health line",
               on_timeout=node.log_tail)
    line = next(ln for ln in _log(node).splitlines() if "not joining the job" in ln)
    assert "ERROR" in line and str(disk) in line and ("free space" in line), line
    wait_until(lambda: node.metric("elastic_agent_health_check_failing", check="snapshot_dir_writable") == 1, 30,
               "the metric", on_timeout=node.log_tail)
    # set a moment after the check's own gauge (the keep-out is the agent's act on it): polled
    wait_until(lambda: node.metric("elastic_agent_kept_out") == 1, 30, "the kept-out gauge", on_timeout=node.log_tail)
    assert not node.progress() and "closed in" not in _log(node)  # it joined no round, trained nothing
    (disk / "filler").unlink()
    wait_until(lambda: not node.alive(), 90, "the job to train to its end", on_timeout=node.log_tail)
    assert node.process is not None and node.process.returncode == 0, node.log_tail()
    assert "health checks pass again" in _log(node) and node.progress()[-1]["step"] == 19


@pytest.mark.slow
def test_a_snapshot_dir_gone_read_only_while_training_puts_its_node_out_and_back(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], small_disk: Callable[[str], Path]
) -> None:
    disks = {name: small_disk(f"snap-{name}") for name in ("a", "b")}  # each node's own local directory
    started = {name: nodes(name=name, endpoint=etcd_server.endpoint, run_id=run_id, nnodes="1:2", env=FAST,
                           metrics_port=AUTO_METRICS_PORT,
                           module_args=["--step-time", "0.05", "--progress", "{progress}"],
                           agent_args=["--lease-ttl", "2", "--snapshot-dir", str(disks[name])])
               for name in ("a", "b")}

    def logs() -> str:
        return "\n".join(n.log_tail(40) for n in started.values())

    a, b = started["a"], started["b"]
    wait_until(lambda: a.steps_at(2) and b.steps_at(2), 120, "a world of 2", on_timeout=logs)
    subprocess.run(["mount", "-o", "remount,ro", str(disks["b"])], check=True)
    wait_until(lambda: "health check snapshot_dir_writable failed" in _log(b) and "kept out of the job" in _log(b),
               60, "b kept out", on_timeout=logs)
    line = next(ln for ln in _log(b).splitlines() if "kept out of the job for" in ln)
    assert "read-only (EROFS)" in line and "remount it read-write" in line, line
    assert "crash loop" not in line
    out_at = max(r["time"] for r in b.progress())
    wait_until(lambda: a.steps_at(1, after=out_at + 1), 60, "a training on alone", on_timeout=logs)
    subprocess.run(["mount", "-o", "remount,rw", str(disks["b"])], check=True)
    back = a.progress()[-1]["time"]
    wait_until(lambda: b.steps_at(2, after=back), 120, "b back in a world of 2", on_timeout=logs)
    assert b.metric("elastic_agent_health_check_failing", check="snapshot_dir_writable") == 0


@pytest.mark.slow
@pytest.mark.skipif(not FAKETIME.exists(),
                    reason="libfaketime is not installed (make test installs it: tests/support/ensure-libfaketime.sh)")
def test_a_node_whose_clock_is_an_hour_off_does_not_join(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node]
) -> None:
    # monotonic clocks move by the same hour (FAKETIME_DONT_FAKE_MONOTONIC=1 makes Python's
    # time.sleep fail with EINVAL under libfaketime 0.9.10); only differences of them are used
    env = {**FAST, "LD_PRELOAD": str(FAKETIME), "FAKETIME": "+1h", "FAKETIME_DONT_RESET": "1"}
    node = nodes(name="a", endpoint=etcd_server.endpoint, run_id=run_id, nnodes="1", env=env,
                 metrics_port=AUTO_METRICS_PORT,
                 module_args=["--steps", "20", "--progress", "{progress}"],
                 agent_args=["--lease-ttl", "2", "--no-warm-start"])
    wait_until(lambda: "not joining the job: health check clock failed" in _log(node), 60, "the clock line",
               on_timeout=node.log_tail)
    line = next(ln for ln in _log(node).splitlines() if "not joining the job" in ln)
    assert " s ahead of etcd's" in line and "chronyc makestep" in line, line
    skew = float(line.split("clock is ")[1].split(" s ahead")[0])
    assert 3590 < skew < 3610, line  # the hour libfaketime added, measured against etcd's Date
    wait_until(lambda: node.metric("elastic_agent_health_check_failing", check="clock") == 1, 30, "the metric",
               on_timeout=node.log_tail)
    assert not node.progress() and "closed in" not in _log(node) and node.alive()
    os.kill(node.pid, 15)
    wait_until(lambda: not node.alive(), 30, "the agent to stop", on_timeout=lambda: _stacks(node))
