"""Multiprocess mode as the agent runs it: real worker processes, one directory, dead pids.

What a user checks on the agent's endpoint after a restart: counters never go back (a dead
pid's counts stay in the sum), a dead worker's gauges vanish once the agent marks it dead,
and nothing from an earlier run leaks into a prepared directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from prometheus_client import generate_latest

from elastic.metrics import collector_registry, mark_dead, prepare_dir
from tests.elastic.metrics.scrape import Series, parse, value

ROOT = Path(__file__).resolve().parents[3]


class Workers:
    """Recording workers started here, each ended by closing its stdin; all reaped at the end."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, rank: int, world: int, steps: int, restart: int = 0) -> subprocess.Popen[str]:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.directory)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.elastic.metrics._recording_worker", str(rank), str(world), str(steps),
             str(restart)], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.procs.append(proc)
        line = proc.stdout.readline()  # EOF (not a hang) if it crashed
        assert line.strip() == "ready", f"worker rank {rank} did not start (exit {proc.poll()})"
        return proc

    @staticmethod
    def end(proc: subprocess.Popen[str]) -> None:
        proc.stdin.close()
        assert proc.wait(timeout=10) == 0

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    w = Workers(prepare_dir(tmp_path / "prom"))
    try:
        yield w
    finally:
        w.cleanup()


def scrape(directory: Path) -> Series:
    return parse(generate_latest(collector_registry(directory)).decode())


def test_prepare_dir_creates_it_and_drops_files_of_an_earlier_run(tmp_path: Path) -> None:
    d = tmp_path / "prom"
    d.mkdir()
    (d / "counter_12345.db").write_bytes(b"garbage from a previous run")
    (d / "notes.txt").write_text("not ours")
    assert prepare_dir(d) == d
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]
    assert not [k for k in scrape(d) if k[0].startswith("elastic_")]
    assert prepare_dir(tmp_path / "new" / "dir").is_dir()


@pytest.mark.slow  # starts processes
def test_two_workers_aggregate_and_a_restart_never_sends_counters_back(workers: Workers) -> None:
    d = workers.directory
    a = workers.start(rank=0, world=2, steps=5)
    b = workers.start(rank=1, world=2, steps=3)

    s = scrape(d)
    assert value(s, "elastic_steps_total", rank="0") == 5
    assert value(s, "elastic_steps_total", rank="1") == 3
    assert value(s, "elastic_samples_total", rank="0") == 40
    assert value(s, "elastic_rank", rank="1") == 1
    assert value(s, "elastic_loss", rank="1") == 2.0
    assert value(s, "elastic_world_size") == 2
    assert value(s, "elastic_step_duration_seconds_count", rank="0") == 5

    # Worker group fails: both exit. Until the agent marks them dead their gauges linger.
    workers.end(a)
    workers.end(b)
    assert value(scrape(d), "elastic_rank", rank="0") == 0
    mark_dead(a.pid, d)
    mark_dead(b.pid, d)
    s = scrape(d)
    for gauge in ("elastic_rank", "elastic_loss", "elastic_last_step_timestamp_seconds"):
        assert value(s, gauge, rank="0") is None and value(s, gauge, rank="1") is None, gauge
    assert value(s, "elastic_world_size") is None
    assert value(s, "elastic_steps_total", rank="0") == 5, "a dead worker's counts stay in the sum"

    # The restarted group is smaller: one rank, restart 1.
    workers.start(rank=0, world=1, steps=2, restart=1)
    s = scrape(d)
    assert value(s, "elastic_steps_total", rank="0") == 7, "counters continue from before the restart"
    assert value(s, "elastic_steps_total", rank="1") == 3, "a gone rank's counters stay, flat (documented)"
    assert value(s, "elastic_rank", rank="0") == 0
    assert value(s, "elastic_rank", rank="1") is None, "no live series for a gone rank"
    assert value(s, "elastic_world_size") == 1
    assert value(s, "elastic_worker_restarts") == 1
    assert value(s, "elastic_step_duration_seconds_count", rank="0") == 7
    build = [k for k in s if k[0] == "elastic_build_info"]
    assert len(build) == 1 and s[build[0]] == 1
    ttfs = value(s, "elastic_time_to_first_step_seconds")
    assert ttfs is not None and 0 < ttfs < 120
