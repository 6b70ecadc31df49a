"""Rank info and in-place rank changes, as the agent's endpoint shows them: real processes.

Real worker processes write multiprocess files into one directory; the agent's collector
(``collector_registry``) merges them. What a user checks on the endpoint: one
``elastic_rank_info`` per live rank, naming the process that holds it now; after a rank
changes in place no gauge of the old rank remains, and counters count on under the new
one; the agent's account of a worker that exports nothing itself fills the gap.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Mapping

import pytest
from prometheus_client import generate_latest, values

from elastic.metrics import RankInfo, WorkerMetrics, collector_registry, mark_dead, prepare_dir
from elastic.metrics.catalogue import families
from tests.elastic.metrics.scrape import Series, parse, value

ROOT = Path(__file__).resolve().parents[3]
GUESS = "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"


class Proc:
    """One process started here, answering ``ok`` to each command line on its stdin."""

    def __init__(self, args: list[str], directory: Path) -> None:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
        self.p = subprocess.Popen(args, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        self.expect_ok()

    @property
    def pid(self) -> int:
        return self.p.pid

    def expect_ok(self) -> None:
        line = self.p.stdout.readline()  # EOF (not a hang) if it crashed
        assert line.strip() == "ok", f"pid {self.p.pid} did not answer (exit {self.p.poll()})"

    def do(self, command: str) -> None:
        self.p.stdin.write(command + "\n")
        self.p.stdin.flush()
        self.expect_ok()

    def end(self) -> str:
        """Close its stdin, wait for it to exit; its stderr."""
        _, err = self.p.communicate(timeout=10)
        assert self.p.returncode == 0, err
        return err


class Procs:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[Proc] = []

    def worker(self, rank: int, world: int, local_rank: int) -> Proc:
        args = [sys.executable, "-m", "tests.elastic.metrics._rank_worker", str(rank), str(world), str(local_rank)]
        self.started.append(Proc(args, self.directory))
        return self.started[-1]

    def silent(self) -> Proc:
        """A plain script: never imports elastic, so it exports nothing itself."""
        self.started.append(Proc([sys.executable, "-c", "import sys; print('ok', flush=True); sys.stdin.read()"],
                                 self.directory))
        return self.started[-1]

    def cleanup(self) -> None:
        for proc in self.started:
            if proc.p.poll() is None:
                proc.p.kill()
                proc.p.wait(timeout=10)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(prepare_dir(tmp_path / "prom"))
    try:
        yield p
    finally:
        p.cleanup()


def scrape(directory: Path, stand_in: Mapping[int, RankInfo] | None = None) -> Series:
    return parse(generate_latest(collector_registry(directory, (lambda: stand_in) if stand_in else None)).decode())


def info_by_rank(series: Series) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for (name, labels), v in series.items():
        if name == "elastic_rank_info":
            row = dict(labels)
            assert v == 1 and "pid" not in row, row
            assert row["rank"] not in out, f"rank {row['rank']} shown twice: {out[row['rank']]} and {row}"
            out[row["rank"]] = row
    return out


def ranks_of(series: Series, name: str) -> set[str]:
    return {dict(labels)["rank"] for n, labels in series if n == name}


@pytest.mark.slow  # starts processes
def test_ranks_swapped_in_place_move_every_per_rank_series(procs: Procs) -> None:
    d = procs.directory
    a, b = procs.worker(0, 2, local_rank=0), procs.worker(1, 2, local_rank=1)
    for _ in range(3):
        a.do("step")
        b.do("step")
    before = info_by_rank(scrape(d))
    assert {r: row["local_rank"] for r, row in before.items()} == {"0": "0", "1": "1"}
    assert before["0"] == {"rank": "0", "local_rank": "0", "node": "node-a", "hostname": "host-a", "gpu_uuid": ""}

    a.do("rank 1 2")
    b.do("rank 0 2")
    a.do("step")
    b.do("step")
    s = scrape(d)
    assert {r: row["local_rank"] for r, row in info_by_rank(s).items()} == {"0": "1", "1": "0"}
    assert {dict(k)["rank"]: v for (n, k), v in s.items() if n == "elastic_rank"} == {"0": 0, "1": 1}
    assert value(s, "elastic_loss", rank="0") == 1.0 and value(s, "elastic_loss", rank="1") == 2.0
    assert ranks_of(s, "elastic_last_step_timestamp_seconds") == {"0", "1"}
    assert value(s, "elastic_steps_total", rank="0") == 4 and value(s, "elastic_steps_total", rank="1") == 4
    for proc in (a, b):
        assert "not been implemented" not in proc.end()  # no remove() in multiprocess mode


@pytest.mark.slow  # starts processes
def test_a_rank_gone_in_place_leaves_only_its_counters(procs: Procs) -> None:
    d = procs.directory
    workers = [procs.worker(r, 3, local_rank=r) for r in range(3)]
    for w in workers:
        w.do("step")
    # rank 1's process dies; the survivors re-form a world of 2 in place: rank 2 becomes 1
    workers[1].end()
    mark_dead(workers[1].pid, d)
    workers[0].do("rank 0 2")
    workers[2].do("rank 1 2")
    workers[2].do("step")
    s = scrape(d)
    assert {r: row["local_rank"] for r, row in info_by_rank(s).items()} == {"0": "0", "1": "2"}
    for gauge in ("elastic_rank", "elastic_loss", "elastic_last_step_timestamp_seconds"):
        assert ranks_of(s, gauge) == {"0", "1"}, gauge
    assert value(s, "elastic_world_size") == 2
    assert value(s, "elastic_steps_total", rank="2") == 1, "the gone rank's counter stays, flat"
    assert value(s, "elastic_steps_total", rank="1") == 2  # the dead process's step and the new holder's


@pytest.mark.slow  # starts processes
def test_the_agent_stands_in_for_workers_that_export_no_rank_info(procs: Procs) -> None:
    d = procs.directory
    plain = procs.silent()
    own = procs.worker(0, 2, local_rank=0)
    # the agent's account: what it knows from the worker group (and nvidia-smi); it guessed a GPU for both
    account = {own.pid: RankInfo(0, 0, "node-a", "host-a", GUESS), plain.pid: RankInfo(1, 1, "node-a", "host-a", GUESS)}
    got = info_by_rank(scrape(d, account))
    assert got["0"]["gpu_uuid"] == "", "the worker's own word wins over the agent's guess"
    assert got["1"] == {"rank": "1", "local_rank": "1", "node": "node-a", "hostname": "host-a", "gpu_uuid": GUESS}

    own.do("rank 1 2")  # in place; the agent does not know, and must not bring back its stale rank 0
    got = info_by_rank(scrape(d, account))
    assert list(got) == ["1"] and got["1"]["local_rank"] == "0"

    own.end()
    plain.end()
    for proc in (own, plain):
        mark_dead(proc.pid, d)
    assert info_by_rank(scrape(d, {})) == {}, "a stopped group leaves no rank info"


@pytest.mark.skipif(values.ValueClass is not values.MutexValue, reason="needs single-process prometheus_client")
def test_served_by_the_worker_itself_rank_changed_removes_the_old_samples() -> None:
    """ELASTIC_METRICS_PORT mode: the worker's own registry, where remove() works."""
    fam = families.__wrapped__()  # a private set of families, not this process's shared one
    metrics = WorkerMetrics(2, 3, backend="gloo", device="cpu", torch_version="test", fam=fam,
                            identity=RankInfo(2, 0, "n", "h"))
    metrics.step_done(local_samples=8, step_seconds=0.01, data_wait_seconds=0.001, loss=0.5)
    metrics.rank_changed(1, 2)
    metrics.step_done(local_samples=8, step_seconds=0.01, data_wait_seconds=0.001, loss=0.25)
    s = parse(generate_latest(fam.registry).decode())
    assert list(info_by_rank(s)) == ["1"]
    for gauge in ("elastic_rank", "elastic_loss", "elastic_last_step_timestamp_seconds"):
        assert ranks_of(s, gauge) == {"1"}, gauge
    assert value(s, "elastic_steps_total", rank="2") == 1 and value(s, "elastic_steps_total", rank="1") == 1
    assert value(s, "elastic_world_size") == 2
