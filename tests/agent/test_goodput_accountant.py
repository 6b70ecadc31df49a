"""The agent's goodput accountant against a real etcd: one record, each second exported once.

Real: etcd, the watch-fed mirror, the signed record, the files workers write, the
heartbeat files, prometheus_client registries. STAND-IN: the rendezvous handler is a
small object holding exactly what the accountant uses of one (client, signer, mirror and
the run's key prefix), because a real one would need agents and workers to be of use.
Worker reports are written by hand, with made-up times, so the expected seconds are exact.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from prometheus_client import CollectorRegistry

from agent.node.goodput import GoodputAccountant, NoGoodput, beat_cause, fault_nodes, read_account
from elastic import contract
from agent.etcd import EtcdClient
from agent.etcd.mirror import PrefixMirror
from elastic.goodput.account import Interval
from elastic.atomic_file import write_atomically
from elastic.goodput.files import WorkerReport, read_job_file, worker_file
from elastic.heartbeat import JOB_STEP, LOCAL_COUNT, Beat, Heartbeat
from agent.rendezvous.session import EtcdSession
from agent.rendezvous.signing import StateSigner
from tests.support.waiting import wait_until

KEY = b"0123456789abcdef0123456789abcdef"


@dataclass
class Options:
    key_prefix: str = "/elastic"


@dataclass
class Handler:
    """What the accountant reads of an ``EtcdV3RendezvousHandler``."""

    run_id: str
    client: EtcdClient
    signer: StateSigner
    mirror: PrefixMirror
    options: Options


@pytest.fixture
def handler(etcd_client: EtcdClient, run_id: str) -> Iterator[Handler]:
    mirror = PrefixMirror(etcd_client, f"/elastic/{run_id}/").start()
    try:
        yield Handler(run_id, etcd_client, StateSigner(KEY), mirror, Options())
    finally:
        mirror.close()


def accountant(handler: Handler, tmp_path: Path, node: str, **kw: Any) -> GoodputAccountant:
    (tmp_path / node / "heartbeat").mkdir(parents=True)
    kw.setdefault("push_every", 0.0)
    return GoodputAccountant(node, tmp_path / node / "goodput", tmp_path / node / "heartbeat", CollectorRegistry(),
                             EtcdSession(handler), **kw)


def report(acc: GoodputAccountant, rows: list[tuple[float | None, float, str, int | None]], rank: int = 0,
           pid: int = 4242, **tag: Any) -> dict[int, int]:
    intervals = tuple(Interval(start=s, end=e, cause=c, step=step, **tag) for s, e, c, step in rows)
    write_atomically(worker_file(acc.directory, 0), WorkerReport(pid, rank, intervals).to_json())
    return {0: pid}


def exported(*accs: GoodputAccountant) -> tuple[float, dict[str, float]]:
    productive, lost = 0.0, dict[str, float]()
    for acc in accs:
        productive += acc.metrics.productive._value.get()
        for (cause,), child in acc.metrics.lost._metrics.items():
            lost[cause] = lost.get(cause, 0.0) + child._value.get()
    return productive, lost


def record_of(handler: Handler) -> Any:
    return read_account(handler.client, handler.signer, "/elastic", handler.run_id)


def test_rank_0s_report_becomes_the_signed_record_and_the_counters(handler: Handler, tmp_path: Path) -> None:
    acc = accountant(handler, tmp_path, "a")
    workers = report(acc, [(90, 100, "worker_start", None), (100, 110, "productive", 40), (110, 111, "snapshot", None)])
    acc.tick(workers, rank_base=0)
    record = record_of(handler)
    assert (record.started_at, record.to, record.productive, record.lost["snapshot"]) == (100, 111, 10, 1)
    assert record.high_water == 40
    assert exported(acc) == (10, {**{c: 0.0 for c in record.lost}, "snapshot": 1.0})
    job = read_job_file(acc.directory / contract.GOODPUT_JOB_FILE)  # what the workers and `elastic local` read
    assert job == record
    other_key = StateSigner(b"another-key-of-32-bytes-long!!!!")  # signed: a reader with another key refuses it
    assert read_account(handler.client, other_key, "/elastic", handler.run_id) is None


def test_two_agents_reporting_the_same_seconds_export_each_second_once(handler: Handler, tmp_path: Path) -> None:
    """Rank 0 moved from a to b: both hand in what they saw, and their times overlap."""
    a, b = accountant(handler, tmp_path, "a"), accountant(handler, tmp_path, "b")
    a.tick(report(a, [(100, 110, "productive", 10)]), rank_base=0)
    wait_until(lambda: b.tick({}, rank_base=1) or b.record.to == 110, 10, "b's mirror to see a's record")
    workers_a = report(a, [(100, 112, "productive", 12)])  # a's last, never pushed before its node died...
    workers_b = report(b, [(105, 111.5, "productive", 11), (111.5, 112.5, "detection", None),
                           (112.5, 113, "rendezvous", None), (113, 114, "restore", None),
                           (114, 120, "productive", 17)], reason="peer_lost", nodes=("a",))
    b.tick(workers_b, rank_base=0)  # ...b, rank 0 now, was first
    a.tick(workers_a, rank_base=0)  # a's write loses the race, and folds again from b's record
    # a takes the record from its mirror only when it ticks, as its agent does every monitor interval
    wait_until(lambda: a.tick(workers_a, rank_base=0) or a.record.to == 120, 10, "a's mirror to see b's record")
    a.tick(workers_a, rank_base=0)
    record = record_of(handler)
    assert record.to == 120 and record.productive + sum(record.lost.values()) == pytest.approx(record.wall)
    productive, lost = exported(a, b)
    assert productive == pytest.approx(record.productive) and lost == pytest.approx(dict(record.lost))
    (fault,) = record.faults
    assert (fault.reason, fault.nodes, fault.phases) == ("peer_lost", ("a",), {"detection": 1.0, "rendezvous": 0.5,
                                                                                  "restore": 1.0})


def test_a_restart_is_recorded_by_the_agent_that_acted_and_named_by_the_one_whose_node_failed(
    handler: Handler, tmp_path: Path
) -> None:
    a = accountant(handler, tmp_path, "a")
    b = accountant(handler, tmp_path, "b", clock=lambda: 150.0)  # a note from long after the first fault
    c = accountant(handler, tmp_path, "c", clock=lambda: 115.3)  # one from within the second
    a.tick(report(a, [(100, 110, "productive", 10)]), rank_base=0)
    b.acted("worker_failed")
    wait_until(lambda: any(k.endswith("/goodput/acts/b") for k in handler.mirror.entries()[0]), 10, "b's note")
    a.workers_stopped()
    a.restarted("reform", (), acted_at=110.5, rendezvous_done=111.0)  # a saw only a collective fail
    a.tick({}, rank_base=0)
    (fault,) = record_of(handler).faults
    assert (fault.reason, fault.phases) == ("reform", {"detection": 0.5, "rendezvous": 0.5})
    c.acted("hang")
    c.acted("peer_lost")  # not a node's own trouble: no note
    wait_until(lambda: any(k.endswith("/goodput/acts/c") for k in handler.mirror.entries()[0]), 10, "c's note")
    a.tick(report(a, [(111, 115, "productive", 11)], pid=4343), rank_base=0)
    a.restarted("reform", (), acted_at=115.5, rendezvous_done=116)
    a.tick({}, rank_base=0)
    assert [(f.reason, f.nodes) for f in record_of(handler).faults] == [("reform", ()), ("hang", ("c",))]


def test_a_node_whose_own_lease_was_lost_records_nothing(handler: Handler, tmp_path: Path) -> None:
    a, b = accountant(handler, tmp_path, "a"), accountant(handler, tmp_path, "b")
    a.tick(report(a, [(100, 110, "productive", 10)]), rank_base=0)
    b.restarted("lease_lost", ("b",), acted_at=115, rendezvous_done=116)  # the job trained on without b
    b.tick({}, rank_base=1)
    assert record_of(handler).to == 110 and exported(b)[0] == 0


@pytest.mark.parametrize("kind", [JOB_STEP, LOCAL_COUNT])
def test_a_plain_scripts_heartbeats_are_its_steps(handler: Handler, tmp_path: Path, kind: int) -> None:
    acc = accountant(handler, tmp_path, "a")
    beat = Heartbeat(acc.heartbeat_dir / "rank-0")
    pid = os.getpid()
    acc.workers_started(time.time())
    beat.beat(1, kind)
    acc.tick({0: pid}, rank_base=0)  # start to the first beat: the worker's start-up, before the clock starts
    time.sleep(0.05)
    beat.beat(5, kind)
    acc.tick({0: pid}, rank_base=0)
    record = record_of(handler)
    assert record.productive > 0 and record.lost["worker_start"] == 0 and record.faults == ()
    assert record.high_water == (5 if kind == JOB_STEP else -1)


def test_a_plain_scripts_steps_after_a_fast_restart_are_not_start_up_while_the_push_waits(
        handler: Handler, tmp_path: Path) -> None:
    """A worker forked from the template beats within a second of its restart, before the
    accountant may push again: its start-up ends at its first beat all the same, and what
    follows is ``unknown`` (a plain script's redone steps cannot be told from new ones)."""
    now = [1000.0]
    acc = accountant(handler, tmp_path, "a", push_every=60.0, clock=lambda: now[0])
    beat = Heartbeat(acc.heartbeat_dir / "rank-0")
    pid = os.getpid()
    acc.workers_started(time.time())
    for step in (1, 2):  # the job's first steps: its clock starts
        time.sleep(0.05)
        beat.beat(step, LOCAL_COUNT)
        acc.tick({0: pid}, rank_base=0, force=True)
    productive = record_of(handler).productive
    assert productive > 0
    time.sleep(0.05)  # b is lost; a acts, then the rendezvous
    acted = time.time()
    time.sleep(0.05)
    started = time.time()
    acc.restarted("peer_lost", ("b",), acted_at=acted, rendezvous_done=started)
    acc.workers_started(started)
    acc.tick({0: pid}, rank_base=0)  # the fault is news: pushed at once
    wait_until(lambda: acc.tick({}, rank_base=0) or acc.record.faults, 10, "the fault back through the mirror")
    time.sleep(0.05)
    before = time.time()  # the beat stamps its own time in between: a loaded machine took 24 ms over the write
    beat.beat(1, LOCAL_COUNT)
    first = time.time()
    acc.tick({0: pid}, rank_base=0)  # within push_every of the last push: held
    for step in range(2, 6):
        time.sleep(0.05)
        beat.beat(step, LOCAL_COUNT)
        acc.tick({0: pid}, rank_base=0)
    acc.tick({0: pid}, rank_base=0, force=True)  # as at the agent's stop
    record = record_of(handler)
    (fault,) = record.faults
    assert before - started - 0.02 <= fault.phases["worker_start"] <= first - started + 0.02, \
        (fault.phases["worker_start"], before - started, first - started)
    assert record.lost["unknown"] >= 0.15 and record.productive == productive


def test_what_a_plain_scripts_step_was() -> None:
    job, count = Beat(7, 0.0, 1, JOB_STEP), Beat(7, 0.0, 1, LOCAL_COUNT)
    assert beat_cause(job, high_water=6, had_fault=True) == "productive"
    assert beat_cause(job, high_water=7, had_fault=True) == "recompute"
    assert beat_cause(count, high_water=100, had_fault=False) == "productive"
    assert beat_cause(count, high_water=-1, had_fault=True) == "unknown"  # redone or new: nobody can tell


def test_which_nodes_a_restart_was_about() -> None:
    assert fault_nodes("peer_lost", "a", ("a", "b", "c"), ("a", "c")) == ("b",)
    assert fault_nodes("scale_up", "a", ("a",), ("a", "d")) == ("d",)
    assert fault_nodes("worker_failed", "a", ("a", "b"), ("a", "b")) == ("a",)


def test_without_etcd_v3_the_accountant_does_nothing(tmp_path: Path) -> None:
    acc = NoGoodput(CollectorRegistry())  # what AgentRendezvous.goodput gives without a session
    acc.restarted("peer_lost", ("b",), 1.0, 2.0)
    acc.tick({0: 1}, rank_base=0, force=True)
    assert not acc.enabled and not (tmp_path / "g" / contract.GOODPUT_JOB_FILE).exists()
