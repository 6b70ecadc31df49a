"""A worker's marks, on a fake clock, through the real files its agent reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic import contract
from elastic.goodput.account import Account, Interval, extend
from elastic.atomic_file import write_atomically
from elastic.goodput.files import read_report, worker_file
from elastic.goodput.recorder import GoodputLog


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def tick(self, seconds: float) -> float:
        self.t += seconds
        return self.t


def log_at(tmp_path: Path, clock: Clock, started_at: float = 90.0) -> GoodputLog:
    return GoodputLog(tmp_path, 0, started_at=started_at, clock=clock)


def handed_in(tmp_path: Path) -> list[Interval]:
    report = read_report(worker_file(tmp_path, 0))
    assert report is not None
    return list(report.intervals)


def test_a_start_then_steps_with_a_snapshot_stall(tmp_path: Path) -> None:
    clock = Clock()
    log = log_at(tmp_path, clock)
    log.forming("start")  # 90 -> 100: imports, process group
    clock.tick(2)
    log.formed((), rank=0)  # 100 -> 102: restore
    for step in (1, 2, 3):
        clock.tick(1)
        log.stepped(step, stall=0.25 if step == 2 else 0.0)
    log.flush(force=True)
    rows = [(iv.start, iv.end, iv.cause, iv.step) for iv in handed_in(tmp_path)]
    assert rows == [(90, 100, "worker_start", None), (100, 102, "restore", None),
                    (102, 103.75, "productive", 2), (103.75, 104, "snapshot", None), (104, 105, "productive", 3)]
    account = extend(Account(), handed_in(tmp_path))
    assert (account.started_at, account.productive, account.lost["snapshot"]) == (102, 2.75, 0.25)


def test_steps_the_job_had_completed_before_are_recomputation(tmp_path: Path) -> None:
    clock = Clock()
    write_atomically(tmp_path / contract.GOODPUT_JOB_FILE, extend(Account(), [Interval(start=0, end=50, cause="productive",
                                                                      step=12)]).to_json())
    log = log_at(tmp_path, clock)
    log.forming("start")
    log.formed((), rank=0)  # the new worker restored step 10; the job had reached 12
    for step in (11, 12, 13):
        clock.tick(1)
        log.stepped(step)
    log.flush(force=True)
    assert [(iv.cause, iv.step) for iv in handed_in(tmp_path)] == [
        ("worker_start", None), ("restore", None), ("recompute", 12), ("productive", 13)]


def test_an_in_place_failure_is_detection_rendezvous_and_restore_named_after_the_lost_node(tmp_path: Path) -> None:
    clock = Clock()
    log = log_at(tmp_path, clock)
    log.forming("start")
    log.joined()
    log.formed(("a", "b", "c"), rank=0)
    clock.tick(1)
    log.stepped(1)
    clock.tick(0.5)
    log.failed()
    clock.tick(0.25)
    log.forming("failure")
    log.joined()
    clock.tick(0.125)
    log.formed(("a", "c"), rank=0)
    failure = [iv for iv in handed_in(tmp_path) if iv.reason]
    assert [(iv.cause, iv.end - iv.start) for iv in failure] == [("detection", 0.5), ("rendezvous", 0.25),
                                                                 ("restore", 0.125)]
    assert {(iv.reason, iv.nodes) for iv in failure} == {("peer_lost", ("b",))}


def test_a_join_is_one_stand_still_named_after_the_joiner(tmp_path: Path) -> None:
    clock = Clock()
    log = log_at(tmp_path, clock)
    log.forming("start")
    log.formed(("a",), rank=0)
    clock.tick(1)
    log.stepped(1)
    log.forming("join")
    clock.tick(0.5)
    log.joined()
    clock.tick(0.25)
    log.formed(("a", "b"), rank=0)
    joined = [iv for iv in handed_in(tmp_path) if iv.reason]
    assert [(iv.cause, iv.reason, iv.nodes) for iv in joined] == [("join", "scale_up", ("b",))] * 2


def test_only_rank_0_hands_in_its_marks_and_every_rank_forgets_what_is_counted(tmp_path: Path) -> None:
    clock = Clock()
    log = log_at(tmp_path, clock)
    log.forming("start")
    log.formed(("a", "b"), rank=1)
    for step in range(1, 5):
        clock.tick(1)
        log.stepped(step)
    report = read_report(worker_file(tmp_path, 0))
    assert report is not None and report.rank == 1 and report.intervals == ()  # an ElasticRun, not rank 0
    # rank 0's agent counted up to 103.5; then rank 0's node died and this worker became rank 0
    write_atomically(tmp_path / contract.GOODPUT_JOB_FILE, extend(Account(), [Interval(start=100, end=103.5, cause="productive",
                                                                      step=3)]).to_json())
    clock.tick(0.5)
    log.failed()
    log.forming("failure")
    log.joined()
    log.formed(("b",), rank=0)
    intervals = handed_in(tmp_path)
    assert intervals[0].end == 104 and intervals[0].cause == "productive"  # what its predecessor never reported
    assert [iv.cause for iv in intervals[1:]] == ["detection", "rendezvous", "restore"]


def test_outside_the_agent_nothing_is_recorded(tmp_path: Path) -> None:
    log = GoodputLog(None)
    log.forming("start")
    log.formed(("a",), rank=0)
    log.stepped(1)
    log.close()
    assert not log.enabled and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("env", [{}, {"ELASTIC_GOODPUT_DIR": ""}])
def test_from_env_without_the_agent_is_disabled(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    monkeypatch.delenv("ELASTIC_GOODPUT_DIR", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert not GoodputLog.from_env().enabled


def test_a_newcomer_healed_from_a_live_replica_hands_in_nothing_of_its_start(tmp_path: Path) -> None:
    """The job trained on while it started; once it is rank 0, its steps are the job's."""
    clock = Clock()
    log = log_at(tmp_path, clock)
    log.forming("start")
    clock.tick(1)
    log.joined()
    log.healed_from_replica()
    clock.tick(1)
    log.formed(("c", "a"), rank=0)
    clock.tick(1)
    log.stepped(7)
    log.flush(force=True)
    assert [(iv.start, iv.cause) for iv in handed_in(tmp_path)] == [(102, "productive")]


def test_a_replacement_started_to_repair_a_broken_world_hands_in_its_start(tmp_path: Path) -> None:
    clock = Clock()
    log = GoodputLog(tmp_path, 0, started_at=99, recovery=True, clock=clock)
    log.forming("start")
    clock.tick(1)
    log.joined()
    log.healed_from_replica()
    clock.tick(1)
    log.formed(("a", "b"), rank=0)
    assert [iv.cause for iv in handed_in(tmp_path)] == ["worker_start", "rendezvous", "restore"]


def test_rank_0_demoted_by_a_join_hands_in_the_stand_still_and_then_nothing(tmp_path: Path) -> None:
    clock = Clock()
    log = log_at(tmp_path, clock)
    log.forming("start")
    log.formed(("b",), rank=0)
    clock.tick(1)
    log.stepped(1)
    log.forming("join")
    clock.tick(0.5)
    log.joined()
    log.formed(("a", "b"), rank=1)  # the newcomer on node a is rank 0 now
    clock.tick(1)
    log.stepped(2)
    log.flush(force=True)
    intervals = handed_in(tmp_path)
    assert [iv.cause for iv in intervals] == ["worker_start", "restore", "productive", "join", "join"]
    assert intervals[-1].end == 101.5 and intervals[-1].nodes == ("a",)


def test_a_newcomer_that_later_takes_rank_0_over_never_hands_in_its_own_start(tmp_path: Path) -> None:
    """It joined as the job trained on; when rank 0's node dies it hands in the job's time it saw."""
    clock = Clock()
    log = log_at(tmp_path, clock)
    log.forming("start")
    log.joined()
    log.healed_from_replica()
    clock.tick(1)
    log.formed(("b", "a"), rank=1)
    clock.tick(1)
    log.stepped(5)
    clock.tick(1)
    log.failed()
    log.forming("failure")
    log.joined()
    log.formed(("a",), rank=0)
    assert [(iv.cause, iv.start) for iv in handed_in(tmp_path)] == [
        ("productive", 101), ("detection", 102), ("rendezvous", 103), ("restore", 103)]


def test_a_replica_mismatch_is_an_sdc_fault_with_its_detail_then_recompute(tmp_path: Path) -> None:
    from elastic.goodput.report import describe_fault

    clock = Clock()
    log = log_at(tmp_path, clock)
    log.forming("start")
    log.formed((), rank=0)
    for step in range(1, 13):
        clock.tick(1)
        log.stepped(step)
    clock.tick(0.5)  # the check at step 12 finds b's replica differing; every replica goes back to step 8
    log.corrupted(["b"], "step 12, differs: 0.weight; back to step 8, 4 step(s) retrained")
    for step in range(9, 15):
        clock.tick(1)
        log.stepped(step)
    log.flush(force=True)
    account = extend(Account(), handed_in(tmp_path))
    (fault,) = account.faults
    assert (fault.reason, fault.nodes, fault.detail) == ("sdc", ("b",), "step 12, differs: 0.weight; back to "
                                                         "step 8, 4 step(s) retrained")
    assert fault.phases == {"detection": 0.5, "recompute": 4.0}
    assert describe_fault(fault) == ("sdc b (step 12, differs: 0.weight; back to step 8, 4 step(s) retrained): "
                                     "detection 0.50 s, recompute 4.0 s (4.5 s)")
    assert Account.from_json(account.to_json()) == account  # the detail survives etcd and job.json
    plain = Interval(end=1.0, cause="productive", start=0.0, step=1)
    assert len(plain.to_row()) == 6 and Interval.from_row(plain.to_row()) == plain  # rows without one: as before
