"""Writing off a frozen peer (agent.node.freeze): the verdict, and the question over real sockets.

A frozen agent's kernel still completes a TCP connect to its listening socket; a socket that
listens and never accepts is exactly that, with no process to stop.
"""

from __future__ import annotations

import socket
import time

from agent.node.freeze import (ANSWER_TIMEOUT_S, Questions, frozen_verdict, probe_enabled, waiting_level, written_off_by,
                          written_off_later)
from elastic.inplace.channel import WorkerStatus
from elastic.inplace.stall import SLOW, STUCK, StallRule, join_level
from agent.rendezvous.keepout import ReachReport, choose_kept_out
from agent.rendezvous.lease_clock import LeaseClock
from agent.rendezvous.signing import StateSigner
from agent.rendezvous.witness import WitnessServer

KEY = b"k" * 32


def test_the_silent_peers_are_written_off() -> None:
    assert frozen_verdict({"b": True, "c": False}) == ["c"]
    assert frozen_verdict({"b": True, "c": True}) == []
    assert frozen_verdict({"b": False}) == ["b"], "in a round of two, the lone peer's silence is enough"


def test_a_node_that_hears_nobody_evicts_nobody() -> None:
    """It is the likelier one cut off: its own-clock fence deals with it, not an eviction."""
    assert frozen_verdict({"b": False, "c": False}) == []
    assert frozen_verdict({}) == []


def test_the_switch_turns_it_off() -> None:
    assert probe_enabled({}) and probe_enabled({"ELASTIC_FREEZE_PROBE": "1"})
    assert not probe_enabled({"ELASTIC_FREEZE_PROBE": "0"}) and not probe_enabled({"ELASTIC_FREEZE_PROBE": "off"})


def test_a_live_witness_answers_and_a_frozen_one_times_out_concurrently() -> None:
    signer = StateSigner(KEY)
    live = WitnessServer("b", signer, lambda: LeaseClock(3.0, time.monotonic())).start()
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)  # connects complete in the kernel; nobody ever answers
    try:
        started = time.monotonic()
        answered = Questions({"b": f"127.0.0.1:{live.port}", "c": f"127.0.0.1:{frozen.getsockname()[1]}",
                              "d": f"127.0.0.1:{frozen.getsockname()[1]}", "e": None}, signer, ANSWER_TIMEOUT_S).answers()
        took = time.monotonic() - started
    finally:
        live.close()
        frozen.close()
    assert answered == {"b": True, "c": False, "d": False, "e": True}, "no address is no reason to evict"
    assert took < ANSWER_TIMEOUT_S + 0.5, f"asked one after another ({took:.2f} s)"
    assert frozen_verdict(answered) == ["c", "d"]


def test_a_witness_sealed_with_another_key_counts_as_silent() -> None:
    other = WitnessServer("b", StateSigner(b"x" * 32), lambda: LeaseClock(3.0, time.monotonic())).start()
    try:
        assert Questions({"b": f"127.0.0.1:{other.port}"}, StateSigner(KEY), 0.5).answers() == {"b": False}
    finally:
        other.close()


def test_a_frozen_report_round_trips_and_keeps_the_frozen_node_out_whoever_closes() -> None:
    report = ReachReport("a", 7, ("c",), ("c",))
    assert ReachReport.from_json(report.to_json()) == report
    assert ReachReport.from_json(b'{"node": "a", "round": 7, "unreachable": ["c"]}').frozen == ()
    assert choose_kept_out(("a", "b", "c"), [report]) == {"c"}
    assert choose_kept_out(("a", "b", "c"), [report, ReachReport("b", 7, ("c",), ("c",))]) == {"c"}
    assert choose_kept_out(("c", "a"), [report]) == {"c"}, "rank 0's node frozen in a round of two"


def test_asked_early_the_verdict_waits_for_nothing() -> None:
    """Asked when the step was only slow, the answers are in by the time it is stuck."""
    signer = StateSigner(KEY)
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)
    try:
        questions = Questions({"c": f"127.0.0.1:{frozen.getsockname()[1]}"}, signer, 0.2)
        time.sleep(0.25)  # the step goes from slow to stuck meanwhile
        started = time.monotonic()
        assert questions.answers() == {"c": False}
        assert time.monotonic() - started < 0.1
    finally:
        frozen.close()


def test_the_worker_asks_early_and_is_stuck_at_its_limit() -> None:
    rule = StallRule()
    for _ in range(20):
        rule.record(0.03)
    assert [rule.level(w) for w in (0.19, 0.21, 0.51)] == [0, SLOW, STUCK]


def test_a_thawed_node_knows_it_was_written_off_and_a_partitioned_pair_agrees_on_one() -> None:
    assert written_off_by("c", ("a", "b", "c"), [ReachReport("a", 3, ("c",), ("c",))]) == ["a"]
    assert written_off_by("a", ("a", "b", "c"), [ReachReport("a", 3, ("c",), ("c",))]) == []
    assert written_off_by("c", ("a", "b", "c"), [ReachReport("a", 3, ("c",))]) == [], "unreachable, not frozen"
    # a and b cut apart, both alive: each names the other; the later in round order is out, on both
    both = [ReachReport("a", 3, ("b",), ("b",)), ReachReport("b", 3, ("a",), ("a",))]
    assert written_off_by("b", ("a", "b"), both) == ["a"] and written_off_by("a", ("a", "b"), both) == []


WORLDS = {4: ("a", "b"), 5: ("a", "b", "c"), 6: ("a", "c")}


def test_a_worker_in_the_agents_round_waits_as_far_as_its_step_is_stalled() -> None:
    assert [waiting_level(WorkerStatus(1, round=5, stalled=s), 5, WORLDS[5], WORLDS) for s in (0, SLOW, STUCK)] == \
        [0, SLOW, STUCK]


def test_a_world_that_fails_while_a_join_is_pending_lost_a_member() -> None:
    """Round 5 only adds c to the worker's world of round 4: that world's failure is not the
    round's doing, so a member is dead or frozen, and the join of round 5 waits for it."""
    failed = WorkerStatus(1, round=4, state="joining", want_round_after=4)
    assert waiting_level(failed, 5, WORLDS[5], WORLDS) == STUCK, "judged at once: a failure is evidence"
    assert waiting_level(WorkerStatus(1, round=4, stalled=SLOW), 5, WORLDS[5], WORLDS) == SLOW, "slow: ask early"
    assert waiting_level(WorkerStatus(1, round=4), 5, WORLDS[5], WORLDS) == 0, "training on until the joiner is up"


def test_a_round_that_leaves_members_out_explains_the_failure() -> None:
    """Round 6 removes b from the worker's world of round 5: that is why it failed, nobody is asked."""
    assert waiting_level(WorkerStatus(1, round=5, want_round_after=5), 6, WORLDS[6], WORLDS) == 0
    assert waiting_level(WorkerStatus(1, round=3, want_round_after=3), 5, WORLDS[5], WORLDS) == 0, \
        "a world the agent never saw: unknown is no reason to evict"
    assert waiting_level(WorkerStatus(1, round=-1, want_round_after=-1), 5, WORLDS[5], WORLDS) == 0


def test_a_join_is_held_to_the_floor_whatever_the_pace() -> None:
    """Between live members a join takes milliseconds; one waiting on a frozen member (the
    round's store host among them) is asked about at 0.2 s and judged at 0.5 s."""
    assert [join_level(w) for w in (0.05, 0.25, 0.55)] == [0, SLOW, STUCK]


def test_a_worker_whose_join_of_the_agents_round_stalls_waits_on_its_members() -> None:
    """Round 6 leaves b out of the worker's world of round 5 (a failure): no step runs, so only
    the join's own stall says that a member of round 6 (its store host, say) froze."""
    joining = WorkerStatus(1, round=5, state="joining", want_round_after=5, stalled=STUCK, extra={"joining": 6})
    assert waiting_level(joining, 6, WORLDS[6], WORLDS) == STUCK
    assert waiting_level(WorkerStatus(1, round=5, state="joining", want_round_after=5), 6, WORLDS[6], WORLDS) == 0
    assert waiting_level(joining, 7, WORLDS[6], WORLDS) == 0, "a stall of another round's join says nothing of this one"
    fresh = WorkerStatus(1, round=-1, state="joining", stalled=SLOW, extra={"joining": 6})
    assert waiting_level(fresh, 6, WORLDS[6], WORLDS) == SLOW, "a joiner's first join too"


def test_a_node_written_off_in_a_round_its_agent_never_saw_has_stale_workers() -> None:
    """Frozen as round 5 closed (its agent still in round 4), written off in round 5 by b."""
    later = {5: [ReachReport("b", 5, ("a",), ("a",))], 6: []}
    assert written_off_later("a", 4, later) == (5, ["b"])
    assert written_off_later("a", 5, later) is None, "its own round is written_off_by's"
    assert written_off_later("b", 4, later) is None
    assert written_off_later("a", 4, {5: [ReachReport("a", 5, ("b",), ("b",))]}) is None, "its own report"
