"""What each test costs: ``make test-profile`` loads this plugin (``-p tests.support.profile_plugin``).

Per test it records the wall time, the CPU time of everything the test started (the pytest
worker's own and every descendant's, whether reaped, orphaned or killed), the processes
started and how many of them imported torch (tests/support/proc_probe.py), the fixtures it
used and the asserts it makes. ``python -m tests.support.suite_profile report`` sums them up.

CPU comes from a cgroup-v1 ``cpuacct`` group per test: the worker moves itself into a fresh
group for the test's set-up, call and tear-down, so every process started in between is
charged there, and moves back after. A process still in the group after the tear-down outlived
its test: it is counted (``leftover``) and moved out, so the next test is not charged for it.
Where cgroups cannot be written (not root), CPU falls back to this process and its reaped
children, and says so in the record.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.proc_probe import LOG_ENV, TEST_ENV

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
OUT_ENV = "ELASTIC_PROFILE_OUT"


def _own_cgroup() -> Path | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "cpuacct" in controllers.split(","):
                return CPUACCT / path.lstrip("/")
    except OSError:
        return None
    return None


class _Group:
    """A cpuacct group for one test; ``None`` CPU where cgroups cannot be written."""

    def __init__(self, name: str) -> None:
        self.home = _own_cgroup()
        self.path: Path | None = None
        if self.home is None:
            return
        path = CPUACCT / "elastic-test-profile" / name
        try:
            path.mkdir(parents=True, exist_ok=True)
            (path / "cgroup.procs").write_text(str(os.getpid()))
            self.path = path
        except OSError:
            self.path = None

    def close(self) -> tuple[float | None, list[str]]:
        """The group's CPU seconds and how many processes outlived the test in it."""
        if self.path is None or self.home is None:
            return None, []
        (self.home / "cgroup.procs").write_text(str(os.getpid()))
        cpu = int((self.path / "cpuacct.usage").read_text()) / 1e9
        leftover = [p for p in (self.path / "cgroup.procs").read_text().split() if p]
        for pid in leftover:
            try:
                (self.home / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        try:
            self.path.rmdir()
        except OSError:
            pass
        return cpu, [_command(pid) for pid in leftover]


def _command(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return f"pid {pid} (gone)"


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


_counter = iter(range(1 << 30))
_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        previous = _outcomes.get(report.nodeid)
        if previous in (None, "passed"):
            _outcomes[report.nodeid] = report.outcome


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    out = os.environ.get(OUT_ENV)
    if not out:
        yield
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    os.environ[LOG_ENV] = str(Path(out) / f"procs-{worker}.log")
    os.environ[TEST_ENV] = item.nodeid
    group = _Group(f"{worker}-{os.getpid()}-{next(_counter)}")
    start, cpu0 = time.monotonic(), _self_cpu()
    try:
        yield
    finally:
        wall = time.monotonic() - start
        cpu, leftover = group.close()
        record = {
            "test": item.nodeid,
            "wall_s": round(wall, 3),
            "cpu_s": round(cpu, 3) if cpu is not None else round(_self_cpu() - cpu0, 3),
            "cpu_source": "cgroup" if cpu is not None else "rusage",
            "leftover_processes": leftover,
            "fixtures": sorted(getattr(item, "fixturenames", ())),
            "outcome": _outcomes.pop(item.nodeid, "unknown"),
        }
        os.environ.pop(TEST_ENV, None)
        with open(Path(out) / f"tests-{worker}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
