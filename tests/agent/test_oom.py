"""Telling an OOM kill from a SIGKILL from outside, by the kernel's count (no processes)."""

from __future__ import annotations

import signal

from agent.oom import _sources, killed_by, oom_kills, parse_count


def test_the_count_is_read_from_every_kind_of_file_the_kernel_writes_it_in() -> None:
    assert parse_count("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n") == 2  # v2 memory.events
    assert parse_count("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n") == 5  # v1 memory.oom_control
    assert parse_count("pgfault 10\noom_kill 7\n") == 7  # /proc/vmstat
    assert parse_count("oom_kill x\n") is None and parse_count("") is None


def test_the_cgroup_is_asked_before_the_machine() -> None:
    v2 = _sources("0::/system.slice/job.service\n")
    assert str(v2[0][1]) == "/sys/fs/cgroup/system.slice/job.service/memory.events" and v2[-1][0] == "machine"
    v1 = _sources("4:memory:/process_api/abc\n1:cpu:/\n0::/\n")
    assert str(v1[0][1]) == "/sys/fs/cgroup/memory/process_api/abc/memory.oom_control"
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
