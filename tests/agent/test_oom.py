"""Telling an OOM kill from a SIGKILL from outside, by the kernel's count (no processes)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Callable

import pytest

from agent.node.oom import _sources, killed_by, oom_kills, parse_count
from agent.etcd import EmbeddedEtcd
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until


def test_the_count_is_read_from_every_kind_of_file_the_kernel_writes_it_in() -> None:
    assert parse_count("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n") == 2  # v2 memory.events
    assert parse_count("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n") == 5  # v1 memory.oom_control
    assert parse_count("pgfault 10\noom_kill 7\n") == 7  # /proc/vmstat
    assert parse_count("oom_kill x\n") is None and parse_count("") is None


def test_the_cgroup_is_asked_before_the_machine() -> None:
    v2 = _sources("0::/system.slice/job.service\n")
    assert str(v2[0][1]) == "/sys/fs/cgroup/system.slice/job.service/memory.events" and v2[-1][0] == "machine"
    v1 = _sources("4:memory:/process_api/abc\n1:cpu:/\n")  # v1 counts its own cgroup only: the machine's
    assert [scope for scope, _ in v1] == ["machine"]
    found = oom_kills()
    assert found is None or (found[0] in ("cgroup", "machine") and found[1] >= 0)


def test_a_sigkill_is_the_oom_killers_only_when_the_count_rose() -> None:
    line = killed_by(signal.SIGKILL, ("cgroup", 2), ("cgroup", 3))
    assert line.startswith("killed by the OOM killer (SIGKILL; the cgroup's OOM kill count went from 2 to 3)")
    assert killed_by(signal.SIGKILL, ("cgroup", 2), ("cgroup", 2)) == "killed by SIGKILL"
    assert killed_by(signal.SIGKILL, None, ("machine", 9)) == "killed by SIGKILL"
    assert killed_by(signal.SIGKILL, ("cgroup", 2), ("machine", 9)) == "killed by SIGKILL"  # not comparable
    assert killed_by(signal.SIGSEGV, ("cgroup", 2), ("cgroup", 3)) == "killed by SIGSEGV"
    assert killed_by(99, None, None) == "killed by signal 99"


SCRIPT = """\
import os, sys
cgroup = sys.argv[1]
with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:  # into a cgroup with a 64 MB limit
    f.write(str(os.getpid()))
hoard = []
while True:
    hoard.append(bytearray(8 * 1024 * 1024))
"""


@pytest.mark.slow
def test_a_worker_the_oom_killer_ended_is_named_so_in_the_agents_line(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    mine = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                 if "memory" in line.split(":")[1].split(",")), None)
    if mine is None:
        pytest.skip("no cgroup v1 memory controller here")  # v2: the agent's own memory.events counts it
    cgroup = Path("/sys/fs/cgroup/memory") / mine.lstrip("/") / f"oom-test-{os.getpid()}"
    try:
        cgroup.mkdir()
        (cgroup / "memory.limit_in_bytes").write_text(str(64 * 1024 * 1024))
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    try:
        script = tmp_path / "hoard.py"
        script.write_text(SCRIPT)
        node = nodes(name="a", endpoint=etcd_server.endpoint, run_id=run_id, script=str(script), nnodes="1",
                     max_restarts=1, module_args=[str(cgroup)], agent_args=["--lease-ttl", "2", "--no-warm-start"])
        wait_until(lambda: not node.alive(), 120, "the agent to end", on_timeout=node.log_tail)
        log = node.log_path.read_text(errors="replace")
        assert 'failed (exit -9) with "killed by the OOM killer (SIGKILL; the machine' in log, log[-3000:]
    finally:
        cgroup.rmdir()
