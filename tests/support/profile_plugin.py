"""What each test costs: ``make test-profile`` loads this plugin (``-p tests.support.profile_plugin``).

Per test it records the wall time, the CPU time of everything the test started (the pytest
worker's own and every descendant's, whether reaped, orphaned or killed), the processes
started and how many of them imported torch (tests/support/proc_probe.py), the fixtures it
used and the asserts it makes. ``python -m tests.support.suite_profile report`` sums them up.

CPU comes from a cgroup-v1 ``cpuacct`` group per test: the worker moves itself into a fresh
group for the test's set-up, call and tear-down, so every process started in between is
charged there, and moves back after. A process still in the group after the tear-down outlived
its test (a module's or the session's shared etcd, S3 server or zygote): it is named
(``leftover``) and moved to the worker's ``outlived`` group, so the next test is not charged
for it and its later CPU is still counted (``outlived-<worker>.json``, written at the session's
end). The controller also reads the machine's busy CPU over the whole run from ``/proc/stat``
(``machine.json``): the cross-check that the groups add up to what the run cost, and the
figure that shows what else ran beside it. Where cgroups cannot be written (not root), CPU
falls back to this process and its reaped children, and says so in the record.
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


def _make_group(name: str) -> Path | None:
    path = CPUACCT / "elastic-test-profile" / name
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return path


def _move(pids: list[str], to: Path) -> None:
    for pid in pids:
        try:
            (to / "cgroup.procs").write_text(pid)
        except OSError:
            pass  # it exited meanwhile


def _usage(group: Path) -> float:
    return int((group / "cpuacct.usage").read_text()) / 1e9


_outlived: Path | None = None


def _outlived_group() -> Path | None:
    """The worker's group for processes that outlive their test, made on first use."""
    global _outlived
    if _outlived is None:
        _outlived = _make_group(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}-outlived")
    return _outlived


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
        leftover = [p for p in (self.path / "cgroup.procs").read_text().split() if p]
        _move(leftover, _outlived_group() or self.home)
        cpu = _usage(self.path)
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


def _machine_busy_s() -> float:
    """Every core's non-idle time since boot (``/proc/stat``), seconds."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


_run_start: tuple[float, float] | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _run_start
    if os.environ.get(OUT_ENV) and "PYTEST_XDIST_WORKER" not in os.environ:
        _run_start = (time.monotonic(), _machine_busy_s())


def pytest_unconfigure(config: pytest.Config) -> None:
    out = os.environ.get(OUT_ENV)
    if not out:
        return
    if _run_start is not None:  # the controller: the whole run
        record = {"wall_s": round(time.monotonic() - _run_start[0], 1),
                  "busy_cpu_s": round(_machine_busy_s() - _run_start[1], 1), "cores": os.cpu_count()}
        (Path(out) / "machine.json").write_text(json.dumps(record) + "\n")
    if _outlived is not None:  # a worker: what its shared servers used outside any test
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        (Path(out) / f"outlived-{worker}.json").write_text(json.dumps({"cpu_s": round(_usage(_outlived), 1)}) + "\n")
        home = _own_cgroup()
        if home is not None:
            _move([p for p in (_outlived / "cgroup.procs").read_text().split() if p], home)
        try:
            _outlived.rmdir()
        except OSError:
            pass


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
