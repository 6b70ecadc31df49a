"""The agent's decision function, one observation at a time (no processes, no etcd)."""

from __future__ import annotations

import signal

import pytest

from agent.node.policy import (
    CONTINUE,
    CRASH_LOOP_TRIES,
    CRASH_WINDOW_S,
    PEER_WORDS_GRACE_S,
    Action,
    AfterRound,
    Decision,
    Failure,
    JobEnd,
    Observation,
    PaceFacts,
    Reason,
    SdcFacts,
    Streak,
    after_round,
    before_joining,
    decide,
    formed_afresh,
    last_words,
    next_streak,
    refunded,
    sdc_keep_out,
    settled,
    stop_signal,
    streak_acted_on,
)
from agent.node.stragglers import Straggler
from elastic.contract import FailureKind

RUNNING = {0: None, 1: None}


def obs(**kw: object) -> Observation:
    kw.setdefault("exits", RUNNING)
    kw.setdefault("restarts_left", 3)
    return Observation(**kw)


@pytest.mark.parametrize("in_place", [False, True])
def test_healthy_workers_are_left_alone(in_place: bool) -> None:
    assert decide(obs(in_place=in_place)) == Decision(Action.CONTINUE)


@pytest.mark.parametrize("in_place", [False, True])
def test_peer_lost_restarts_a_plain_group_but_only_rejoins_in_place_and_is_never_counted(in_place: bool) -> None:
    decision = decide(obs(membership=Reason.PEER_LOST, in_place=in_place))
    assert decision.action is (Action.REJOIN if in_place else Action.RESTART)
    assert decision.reason is Reason.PEER_LOST and not decision.counted


@pytest.mark.parametrize("in_place", [False, True])
def test_own_lease_lost_always_kills_the_stale_workers(in_place: bool) -> None:
    decision = decide(obs(membership=Reason.LEASE_LOST, in_place=in_place, exits={0: 1, 1: None}))
    assert decision.action is Action.RESTART and decision.reason is Reason.LEASE_LOST
    assert not decision.counted  # being frozen is not the job's failure


@pytest.mark.parametrize("in_place", [False, True])
def test_a_new_node_waiting_is_a_scale_up_that_is_not_counted(in_place: bool) -> None:
    decision = decide(obs(membership=Reason.SCALE_UP, in_place=in_place))
    assert decision.action is (Action.REJOIN if in_place else Action.RESTART)
    assert decision.reason is Reason.SCALE_UP and not decision.counted


def test_a_worker_that_died_restarts_the_group_and_counts() -> None:
    decision = decide(obs(exits={0: None, 1: -9}))
    assert decision.action is Action.RESTART and decision.reason is Reason.WORKER_FAILED
    assert decision.counted and decision.failed == {1: -9}


def test_in_place_only_the_dead_worker_is_started_again() -> None:
    decision = decide(obs(exits={0: None, 1: 1, 2: None, 3: -11}, in_place=True))
    assert decision.action is Action.REPLACE and decision.ranks == (1, 3) and decision.counted


def test_under_hsdp_a_dead_worker_starts_its_whole_node_again() -> None:
    # a lone new rank cannot build the node's shard group, and its node's others lose their
    # peer in FSDP2's collectives anyway: the node's ranks go together, healed from a replica
    decision = decide(obs(exits={0: None, 1: -9}, in_place=True, whole_node=True))
    assert decision.action is Action.REPLACE and decision.ranks == (0, 1) and decision.counted
    assert decision.failed == {1: -9}
    hung = decide(obs(exits={0: None, 1: None}, stalled_for=75.0, in_place=True, whole_node=True))
    assert hung.action is Action.REPLACE and hung.ranks == (0, 1)


def test_a_failure_outranks_a_membership_change_seen_in_the_same_look() -> None:
    decision = decide(obs(exits={0: 1, 1: None}, membership=Reason.PEER_LOST))
    assert decision.action is Action.RESTART and decision.reason is Reason.WORKER_FAILED


@pytest.mark.parametrize("in_place", [False, True])
def test_a_hang_dumps_stacks_and_counts(in_place: bool) -> None:
    decision = decide(obs(stalled_for=75.0, in_place=in_place))
    assert decision.dump_stacks and decision.reason is Reason.HANG and decision.counted
    if in_place:
        assert decision.action is Action.REPLACE and decision.ranks == (0, 1)
    else:
        assert decision.action is Action.RESTART


def test_a_usage_error_ends_the_job_whatever_restarts_are_left() -> None:
    decision = decide(obs(exits={0: 2, 1: 2}, restarts_left=100))
    assert decision.action is Action.FAIL and decision.failed == {0: 2, 1: 2}


def test_a_usage_error_beside_a_crash_is_a_crash() -> None:
    assert decide(obs(exits={0: 2, 1: -9})).action is Action.RESTART


def test_a_usage_error_beside_the_failures_it_caused_still_ends_the_job() -> None:
    """Rank 0 exits 2; rank 1's collective with it breaks and it exits 1: a restart would
    meet the same usage error, so the job ends, reported as the usage error alone."""
    decision = decide(obs(exits={0: 2, 1: 1, 2: None}, restarts_left=100))
    assert decision.action is Action.FAIL and decision.failed == {0: 2} and decision.usage_error
    assert not decision.counted


@pytest.mark.parametrize("in_place", [False, True])
def test_a_usage_error_while_the_others_still_run_is_not_restarted_in_place_either(in_place: bool) -> None:
    decision = decide(obs(exits={0: None, 1: 2}, in_place=in_place, reform_requested=in_place))
    assert decision.action is Action.FAIL and decision.failed == {1: 2} and decision.usage_error


def test_only_a_usage_error_makes_the_agent_exit_2() -> None:
    assert not decide(obs(exits={0: 1, 1: None}, restarts_left=0)).usage_error
    assert not decide(obs(stalled_for=60.0, restarts_left=0)).usage_error
    assert decide(obs(exits={0: 2, 1: 2})).usage_error


def test_all_workers_done_is_success() -> None:
    assert decide(obs(exits={0: 0, 1: 0})).action is Action.SUCCEED


def test_some_done_and_some_running_is_still_running() -> None:
    assert decide(obs(exits={0: 0, 1: None})).action is Action.CONTINUE


@pytest.mark.parametrize("in_place", [False, True])
def test_out_of_restarts_a_failure_or_hang_ends_the_job(in_place: bool) -> None:
    assert decide(obs(exits={0: 1, 1: None}, restarts_left=0, in_place=in_place)).action is Action.FAIL
    assert decide(obs(stalled_for=60.0, restarts_left=0, in_place=in_place)).action is Action.FAIL


def test_out_of_restarts_other_machines_dying_still_costs_nothing() -> None:
    assert decide(obs(membership=Reason.PEER_LOST, restarts_left=0)).action is Action.RESTART


def test_a_reform_request_rejoins_in_place_and_is_ignored_by_a_plain_group() -> None:
    decision = decide(obs(reform_requested=True, in_place=True))
    assert decision.action is Action.REJOIN and decision.reason is Reason.REFORM and not decision.counted
    assert decide(obs(reform_requested=True)).action is Action.CONTINUE


def test_stop_signal_is_graceful_only_for_a_healthy_world_that_made_progress() -> None:
    assert stop_signal(Reason.SCALE_UP, progressed=True) == signal.SIGTERM
    assert stop_signal(Reason.SCALE_UP, progressed=False) == signal.SIGKILL
    for reason in (Reason.PEER_LOST, Reason.LEASE_LOST, Reason.HANG, Reason.WORKER_FAILED):
        assert stop_signal(reason, progressed=True) == signal.SIGKILL


def test_a_failure_explained_by_a_missing_peer_is_refunded() -> None:
    assert refunded(Reason.WORKER_FAILED, ["a", "b"], ["a"])
    assert not refunded(Reason.WORKER_FAILED, ["a", "b"], ["a", "b"])
    assert not refunded(Reason.WORKER_FAILED, [], ["a"])
    assert not refunded(Reason.HANG, ["a", "b"], ["a"])


def test_the_round_after_a_restart_refunds_a_failure_a_lost_peer_explains() -> None:
    streak = Streak(current=3, before=2)  # the failure restarted for made it 3
    refund = after_round(Reason.WORKER_FAILED, ["a", "b"], ["a"], streak)
    assert refund == AfterRound(Reason.PEER_LOST, refund=True, streak=Streak(2, 2))  # restart and streak back
    assert after_round(Reason.WORKER_FAILED, ["a", "b"], ["a", "b"], streak) == AfterRound(Reason.WORKER_FAILED)
    assert after_round(Reason.HANG, ["a", "b"], ["a"], streak) == AfterRound(Reason.HANG)  # a hang is ours


def test_a_failure_acted_on_counts_towards_the_streak_and_nothing_else_does() -> None:
    streak = Streak(current=1, before=0)
    for decision in (Decision(Action.RESTART, Reason.WORKER_FAILED, failed={0: 1}),
                     Decision(Action.KEEP_OUT, Reason.CRASH_LOOP, failed={0: 1})):
        assert streak_acted_on(streak, decision, observed=2) == Streak(2, 1)
    for decision in (CONTINUE, Decision(Action.REJOIN, Reason.PEER_LOST), Decision(Action.RESTART, Reason.HANG),
                     Decision(Action.FAIL, Reason.SCRIPT_ERROR, failed={0: 1})):
        assert streak_acted_on(streak, decision, observed=2) is streak


def test_a_round_formed_afresh_restarts_in_place_workers_uncounted() -> None:
    assert formed_afresh(Reason.PEER_LOST, fresh_world=False) is None
    assert formed_afresh(Reason.SCALE_UP, True) == Decision(Action.RESTART, Reason.SCALE_UP)
    for reason in (Reason.WORKER_FAILED, Reason.HANG, Reason.REFORM, Reason.FROZEN, None):
        restart = formed_afresh(reason, True)
        assert restart == Decision(Action.RESTART, Reason.PEER_LOST) and not restart.counted


# ---------------------------------------------------------------------- crash loops

BOOM = Failure(code=1, ran_for=3.0, message="ValueError: boom on c")
LOST_PEER = Failure(code=1, ran_for=3.0, message="CollectiveFailure: lost a peer in step 4 (its connection closed); "
                                                 "the agent restarts this worker", kind=FailureKind.PEER_LOST)
GLOO = Failure(code=1, ran_for=2.0, message="RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:545] "
                                            "Read error [127.0.0.1]:33680: Connection reset by peer",
                kind=FailureKind.PEER_LOST)


def looping(streak: int, failure: Failure = BOOM, **kw: object) -> Observation:
    kw.setdefault("nodes_without_us", 2)
    kw.setdefault("min_nodes", 2)
    return obs(exits={0: failure.code, 1: None}, failures={0: failure}, crash_streak=streak, **kw)


@pytest.mark.parametrize("in_place", [False, True])
def test_the_third_failure_right_after_a_start_keeps_the_node_out_naming_the_cause(in_place: bool) -> None:
    for streak in (1, 2):
        assert decide(looping(streak, in_place=in_place)).action is (Action.REPLACE if in_place else Action.RESTART)
    decision = decide(looping(3, in_place=in_place))
    assert decision.action is Action.KEEP_OUT and decision.reason is Reason.CRASH_LOOP
    assert decision.failed == {0: 1} and not decision.counted and not decision.usage_error
    assert decision.detail.endswith(": ValueError: boom on c") and "3 starts" in decision.detail


def test_a_node_on_probation_is_not_kept_out_for_a_failure_a_peer_caused() -> None:
    """Back from a keep-out (its streak still 3), its worker fails because another node died."""
    assert decide(looping(3, failure=GLOO)).action is Action.RESTART
    assert decide(looping(3, failure=GLOO, in_place=True)).action is Action.REPLACE


def test_a_crash_loop_is_kept_out_even_with_no_restarts_left() -> None:
    assert decide(looping(3, restarts_left=0)).action is Action.KEEP_OUT


def test_a_crash_loop_fails_the_job_only_when_the_others_cannot_go_on_and_says_why_last() -> None:
    decision = decide(looping(3, nodes_without_us=1, min_nodes=2, restarts_left=17))
    assert decision.action is Action.FAIL and decision.reason is Reason.CRASH_LOOP
    assert "1 node(s) would remain, fewer than the 2" in decision.detail
    assert decision.detail.endswith("the cause: ValueError: boom on c")


def test_without_a_rendezvous_that_can_keep_a_node_out_a_crash_loop_restarts_as_before() -> None:
    assert decide(looping(5, nodes_without_us=None)).action is Action.RESTART
    assert decide(looping(5, nodes_without_us=None, restarts_left=0)).action is Action.FAIL


def test_a_usage_error_still_ends_the_job_first() -> None:
    usage = Failure(code=2, ran_for=1.0, message="error: snapshot from another model")
    assert decide(looping(3, failure=usage)).usage_error


def test_the_streak_counts_own_failures_right_after_a_start_and_nothing_a_peer_caused() -> None:
    assert next_streak(0, [BOOM]) == 1 and next_streak(2, [BOOM]) == 3
    assert next_streak(2, [LOST_PEER]) == 2 and next_streak(2, [GLOO]) == 2  # a survivor of someone else's crash
    assert next_streak(2, [LOST_PEER, BOOM]) == 3  # the rank that raised, beside the sibling it broke
    assert next_streak(2, []) == 2
    late = Failure(code=1, ran_for=CRASH_WINDOW_S + 1, message="ValueError: boom", progressed=True)
    assert next_streak(2, [late]) == 0  # it trained a while first: no crash loop
    stuck = Failure(code=1, ran_for=CRASH_WINDOW_S + 1, message="OSError: data gone", progressed=False)
    assert next_streak(2, [stuck]) == 3  # it never made a step since its start, however long that took


def test_a_group_that_outlives_the_window_ends_the_streak() -> None:
    assert settled(2, CRASH_WINDOW_S - 1) == 2
    assert settled(2, CRASH_WINDOW_S) == 0


def test_what_counts_as_a_peer_s_doing() -> None:
    assert LOST_PEER.peer_caused and GLOO.peer_caused
    assert Failure(code=1, ran_for=1.0, kind=FailureKind.TIMEOUT).peer_caused
    assert not BOOM.peer_caused and not Failure(code=-9, ran_for=1.0, message="killed by SIGKILL").peer_caused


def test_a_scripts_own_error_is_its_own_whatever_it_says() -> None:
    """The kind decides, never the words: a script's RuntimeError that says "timeout" (or, from
    an older worker that wrote no kind, gloo's very words) extends the crash streak."""
    own = Failure(code=1, ran_for=2.0, message="RuntimeError: timeout", kind=FailureKind.USER)
    unknown = Failure(code=1, ran_for=2.0, message=GLOO.message)
    for failure in (own, unknown):
        assert not failure.peer_caused and next_streak(2, [failure]) == 3
        assert decide(looping(3, failure=failure)).reason is Reason.CRASH_LOOP
    abandoned = Failure(code=1, ran_for=2.0, message="StaleGroupError: a newer round", kind=FailureKind.ABANDONED)
    assert not abandoned.peer_caused and abandoned.abandoned  # this node's own doing, but nothing to tell


def test_the_cause_printed_is_the_worker_s_own_traceback_line_first() -> None:
    assert last_words({0: LOST_PEER, 1: BOOM}) == "ValueError: boom on c"
    assert last_words({0: LOST_PEER}) == LOST_PEER.message
    assert last_words({0: Failure(code=1, ran_for=1.0), 1: Failure(code=-9, ran_for=1.0)}) == "exit 1, exit -9"


# ------------------------------------------------------------------ the same error on every node: the script's


NAME_ERROR = "NameError: name 'undefined_thing' is not defined"


def quick(message: str = NAME_ERROR) -> Failure:
    return Failure(code=1, ran_for=3.0, message=message, progressed=True)


def test_the_same_error_right_after_start_on_every_node_fails_the_job_at_once_without_a_keep_out() -> None:
    decision = decide(obs(exits={0: 1, 1: None}, failures={0: quick()}, crash_streak=1, nodes_without_us=2,
                          peer_crashes={"b": NAME_ERROR, "c": NAME_ERROR}))
    assert decision.action is Action.FAIL and decision.reason is Reason.SCRIPT_ERROR
    assert NAME_ERROR in decision.detail and "every node (3)" in decision.detail
    assert not decision.usage_error and not decision.counted


@pytest.mark.parametrize("peers", [
    {"b": NAME_ERROR, "c": ""},  # c trains: the error is this node's, or b's and ours
    {"b": "ValueError: boom on b"},  # another error
    {},  # a node alone: nothing to compare with
    None,  # cannot hear the others (not the etcd-v3 handler)
])
def test_an_error_not_shared_by_every_node_is_a_nodes_own_and_restarts_or_keeps_it_out(
        peers: dict[str, str] | None) -> None:
    first = decide(obs(exits={0: 1, 1: None}, failures={0: quick()}, crash_streak=1, nodes_without_us=2,
                       peer_crashes=peers))
    assert first.action is Action.RESTART and first.reason is Reason.WORKER_FAILED
    third = decide(obs(exits={0: 1, 1: None}, failures={0: quick()}, crash_streak=3, nodes_without_us=2,
                       peer_crashes=peers, failed_for=PEER_WORDS_GRACE_S))  # (a silent peer is waited for a moment)
    assert third.action is Action.KEEP_OUT and third.reason is Reason.CRASH_LOOP


def test_a_shared_error_after_a_good_run_or_caused_by_a_peer_is_no_script_verdict() -> None:
    late = Failure(code=1, ran_for=CRASH_WINDOW_S + 1, message=NAME_ERROR, progressed=True)
    peer = Failure(code=1, ran_for=3.0, message="RuntimeError: Connection closed by peer", progressed=True,
                   kind=FailureKind.PEER_LOST)
    for failure in (late, peer):
        decision = decide(obs(exits={0: 1, 1: None}, failures={0: failure}, crash_streak=1, nodes_without_us=1,
                              peer_crashes={"b": failure.message}))
        assert decision.reason is not Reason.SCRIPT_ERROR, failure


def test_what_a_node_tells_the_others_is_its_own_quick_failure_only() -> None:
    from agent.node.policy import crash_report, script_error

    peer = Failure(code=1, ran_for=3.0, message="RuntimeError: Connection closed by peer",
                   kind=FailureKind.PEER_LOST)
    assert crash_report({0: peer, 1: quick()}) == NAME_ERROR
    assert crash_report({0: peer}) == ""
    assert crash_report({0: Failure(code=-9, ran_for=200.0, message="killed by SIGKILL")}) == ""
    assert script_error(NAME_ERROR, {"b": NAME_ERROR}) == NAME_ERROR
    assert script_error("", {"b": ""}) is None


def test_a_final_snapshot_that_could_not_be_written_ends_the_job_without_a_restart() -> None:
    from agent.node.policy import FINAL_SNAPSHOT_LOST_EXIT

    decision = decide(obs(exits={0: FINAL_SNAPSHOT_LOST_EXIT, 1: 0}, restarts_left=5))
    assert decision.action is Action.FAIL and decision.final_snapshot_lost and not decision.usage_error
    assert decision.failed == {0: FINAL_SNAPSHOT_LOST_EXIT}
    beside_a_crash = decide(obs(exits={0: FINAL_SNAPSHOT_LOST_EXIT, 1: -9}, restarts_left=5))
    assert beside_a_crash.action is Action.RESTART  # a death by a signal beside it is a crash


# ------------------------------------------------------------------ etcd lost the job's state


def test_a_fence_above_every_round_etcd_holds_ends_the_job_with_the_fix() -> None:
    from agent.node.policy import etcd_lost

    fence = {"run": "job", "round": 7, "snapshot_dir": "/data/snaps"}
    line = etcd_lost(fence, "job", 0)
    assert "--snapshot-dir /data/snaps" in line and "round 7" in line
    stale = Failure(code=1, ran_for=2.0, message="StaleGroupError: round 7 of this job now commits ...",
                    kind=FailureKind.ABANDONED)
    decision = decide(obs(exits={0: 1, 1: 1}, failures={0: stale, 1: stale}, crash_streak=1, nodes_without_us=1,
                          etcd_lost=line, peer_crashes={"b": stale.message}))
    assert decision.action is Action.FAIL and decision.reason is Reason.ETCD_LOST and decision.detail == line


@pytest.mark.parametrize(("fence", "now"), [
    ({"run": "job", "round": 7, "snapshot_dir": "/d"}, 7),  # a newer group's fence: etcd holds its round too
    ({"run": "job", "round": 7, "snapshot_dir": "/d"}, 9),
    ({"run": "other", "round": 7, "snapshot_dir": "/d"}, 0),  # another job's directory: not ours to judge
    ({"run": "job", "round": "7", "snapshot_dir": "/d"}, 0),  # not a round number: never acted on
    ({"run": "job", "round": True, "snapshot_dir": "/d"}, 0),
    (None, 0),
])
def test_a_stale_group_of_a_live_job_is_no_lost_etcd(fence: dict[str, object] | None, now: int) -> None:
    from agent.node.policy import etcd_lost

    assert etcd_lost(fence, "job", now) == ""


def test_a_stale_group_on_every_node_is_no_script_error() -> None:
    from agent.node.policy import crash_report

    stale = Failure(code=1, ran_for=2.0, message="StaleGroupError: round 7 of this job now commits ...",
                    kind=FailureKind.ABANDONED)
    assert crash_report({0: stale}) == ""


# ---------------------------------------------------------------- the watches that feed the decision

SLOW = Straggler("b", compute=0.3, others=0.1, windows=3)  # 3.0x the others


def pace(mine: bool = True, world: int = 3, spares: int = 0, evict: bool = True) -> PaceFacts:
    return PaceFacts(SLOW, mine=mine, world=world, spares=spares, evict=evict)


def outliers(*at: float, now: float = 1000.0) -> SdcFacts:
    return SdcFacts(at, now=now, window_s=500.0)


SUSPECT = outliers(900.0, 950.0)
SUSPECT_LINE = sdc_keep_out(SUSPECT.outlier_at, SUSPECT.now, SUSPECT.window_s)


def test_a_straggler_that_may_go_is_kept_out() -> None:
    decision = decide(obs(pace=pace(spares=1)))
    assert decision == Decision(Action.KEEP_OUT, Reason.STRAGGLER, detail=f"{SLOW.describe()}; evicted: a spare waits "
                                                                          "to take its place")
    assert decide(obs(pace=pace(world=3), min_nodes=2)).reason is Reason.STRAGGLER  # 2 at their pace train faster


def test_only_the_stragglers_own_agent_evicts_it_and_only_where_the_job_gains() -> None:
    assert decide(obs(pace=pace(mine=False, spares=1))) == CONTINUE  # another node's agent names it too
    assert decide(obs(pace=pace(evict=False, spares=1))) == CONTINUE  # ELASTIC_STRAGGLER_EVICT=0: named only
    assert decide(obs(pace=pace(world=2), min_nodes=2)) == CONTINUE  # without it, fewer than the job needs
    assert decide(obs(pace=PaceFacts(Straggler("b", 0.14, 0.1, 3), mine=True, world=3), min_nodes=1)) == CONTINUE
    # (1.4x: two nodes at their pace would not train faster than three at its)


def test_a_straggler_yields_to_anything_the_workers_or_the_round_say() -> None:
    assert decide(obs(pace=pace(spares=1), membership=Reason.PEER_LOST)).reason is Reason.PEER_LOST
    assert decide(obs(pace=pace(spares=1), exits={0: 1, 1: None})).reason is Reason.WORKER_FAILED


def test_an_sdc_suspect_is_kept_out_when_the_others_can_train_on() -> None:
    decision = decide(obs(sdc=SUSPECT, nodes_without_us=2, min_nodes=2))
    assert SUSPECT_LINE and decision == Decision(Action.KEEP_OUT, Reason.SDC, detail=SUSPECT_LINE)


def test_one_vote_or_votes_outside_the_window_are_no_suspect() -> None:
    for facts in (outliers(950.0), outliers(100.0, 950.0), outliers()):
        assert facts.suspect == "" and decide(obs(sdc=facts, nodes_without_us=2, min_nodes=2)) == CONTINUE


def test_an_sdc_suspect_the_job_cannot_spare_trains_on_and_is_said_once() -> None:
    decision = decide(obs(sdc=SUSPECT, nodes_without_us=1, min_nodes=2))
    assert decision.action is Action.CONTINUE and decision.reason is None
    assert decision.unheeded.startswith(f"{SUSPECT_LINE}; not kept out: without it 1 node(s)")


def test_an_sdc_suspect_at_the_jobs_minimum_is_kept_out_when_a_warm_spare_waits() -> None:
    decision = decide(obs(sdc=SUSPECT, nodes_without_us=1, min_nodes=2, spares_waiting=1))
    assert decision == Decision(Action.KEEP_OUT, Reason.SDC, detail=SUSPECT_LINE)


def test_an_sdc_suspect_without_a_rendezvous_that_keeps_out_changes_nothing() -> None:
    assert decide(obs(sdc=SUSPECT)) == Decision(Action.CONTINUE)


def test_a_straggler_goes_before_an_sdc_suspect_is_looked_at() -> None:
    decision = decide(obs(pace=pace(spares=1), sdc=SUSPECT, nodes_without_us=2, min_nodes=1))
    assert decision.reason is Reason.STRAGGLER


def test_a_node_written_off_as_frozen_stops_its_stale_workers_whatever_else_was_decided() -> None:
    for seen in (obs(), obs(membership=Reason.PEER_LOST, in_place=True), obs(exits={0: 1, 1: None})):
        decision = decide(Observation(**{**seen.__dict__, "written_off": "its peers wrote it off"}))
        assert decision == Decision(Action.RESTART, Reason.LEASE_LOST, detail="its peers wrote it off")


def test_the_end_of_the_job_and_a_lost_lease_outrank_a_write_off() -> None:
    assert decide(obs(exits={0: 0, 1: 0}, written_off="w")).action is Action.SUCCEED
    assert decide(obs(exits={0: 2, 1: None}, written_off="w")).action is Action.FAIL
    assert decide(obs(membership=Reason.LEASE_LOST, written_off="w")).detail == "this node's etcd lease was lost"


def test_frozen_peers_are_written_off_and_the_round_formed_again_only_when_all_else_is_well() -> None:
    decision = decide(obs(frozen=("b",), frozen_detail="b frozen"))
    assert decision == Decision(Action.REJOIN, Reason.FROZEN, detail="b frozen", nodes=("b",))
    assert decide(obs(frozen=("b",), frozen_detail="b frozen", membership=Reason.PEER_LOST)).reason is Reason.PEER_LOST
    assert decide(obs(frozen=("b",), pace=pace(spares=1))).reason is Reason.STRAGGLER


def test_an_unheeded_sdc_suspect_is_still_said_when_a_freeze_decides() -> None:
    decision = decide(obs(sdc=SUSPECT, nodes_without_us=0, min_nodes=1, frozen=("b",), frozen_detail="b"))
    assert decision.reason is Reason.FROZEN and decision.unheeded.startswith(f"{SUSPECT_LINE}; not kept out")


def test_a_round_in_place_workers_cannot_take_restarts_them_counted_as_the_act_that_found_it() -> None:
    decision = decide(obs(unusable_round=Reason.PEER_LOST, in_place=True))
    assert decision.action is Action.RESTART and decision.reason is Reason.PEER_LOST and not decision.counted
    assert decide(obs(unusable_round=Reason.WORKER_FAILED, in_place=True)).counted
    assert decide(obs(unusable_round=Reason.PEER_LOST, membership=Reason.LEASE_LOST)).reason is Reason.LEASE_LOST


FINISHED = JobEnd(failed=False, line="the job finished (node a: workers succeeded)")
FAILED = JobEnd(failed=True, line="the job failed (node b): a local worker failed")


def test_a_job_another_node_failed_ends_this_nodes_workers_now_while_they_join_a_round() -> None:
    """A round with a member that failed the job never completes: its joiners stop now. Workers
    in a formed world end by themselves (a diverged run's rank 0 says why, then exits 2)."""
    for kw in ({"in_place": True}, {"in_place": True, "membership": Reason.SCALE_UP},
               {"in_place": True, "frozen": ("b",)}, {"in_place": True, "exits": {0: 1, 1: None}}):
        decision = decide(obs(job_ended=FAILED, **kw))
        assert decision == Decision(Action.END, Reason.JOB_ENDED, detail=FAILED.line), kw
    assert decide(obs(job_ended=FAILED, in_place=True, in_world=True)).action is Action.CONTINUE
    assert decide(obs(job_ended=FAILED, in_place=False)).action is Action.CONTINUE


def test_a_job_that_finished_stops_only_workers_still_joining_a_round() -> None:
    """A node back just after the last step joined a round no one will complete: it stops now
    (it waited for the round's 30 s timeout before). Workers in the world that trained the last
    step, or whose scripts returned, are left to end as they will."""
    assert decide(obs(job_ended=FINISHED, in_place=True)) == Decision(Action.END, Reason.JOB_ENDED,
                                                                         detail=FINISHED.line)
    assert decide(obs(job_ended=FINISHED, in_place=True, in_world=True)).action is Action.CONTINUE
    assert decide(obs(job_ended=FINISHED, in_place=False)).action is Action.CONTINUE  # restart mode: in that world
    assert decide(obs(job_ended=FINISHED, in_place=True, scripts_returned=True)).action is Action.CONTINUE


def test_workers_whose_scripts_returned_are_left_to_exit_and_their_own_end_decides() -> None:
    assert decide(obs(job_ended=FAILED, scripts_returned=True)).action is Action.CONTINUE
    assert decide(obs(job_ended=FAILED, exits={0: 0, 1: 0})) == Decision(Action.SUCCEED)
    usage = decide(obs(job_ended=FAILED, exits={0: 2, 1: None}))
    assert usage.action is Action.FAIL and usage.usage_error  # its own usage error says more


def test_out_of_restarts_a_node_waits_a_moment_for_its_peers_words_before_it_fails_alone() -> None:
    """The same bug hit both nodes a few ms apart: the node out of restarts waits (at most
    PEER_WORDS_GRACE_S) for the other's crash report, so the job ends as the script's error on
    every node, not "no restarts left" here (a whole suite under load saw that race)."""
    from agent.node.policy import PEER_WORDS_GRACE_S

    base = dict(exits={0: 1}, failures={0: quick()}, restarts_left=0, nodes_without_us=1)
    assert decide(obs(**base, peer_crashes={"b": ""}, failed_for=0.1)) == Decision(Action.CONTINUE)
    said = decide(obs(**base, peer_crashes={"b": NAME_ERROR}, failed_for=0.3))
    assert said.action is Action.FAIL and said.reason is Reason.SCRIPT_ERROR
    for late in (dict(peer_crashes={"b": ""}, failed_for=PEER_WORDS_GRACE_S),  # it never came: this node's own
                 dict(peer_crashes={}, failed_for=0.0),  # alone: nothing to wait for
                 dict(peer_crashes=None, failed_for=0.0)):  # cannot hear the others
        decision = decide(obs(**base, **late))
        assert decision.action is Action.FAIL and decision.detail == "no restarts left", late
    slow = Failure(code=1, ran_for=CRASH_WINDOW_S + 1, message=NAME_ERROR, progressed=True)  # not a start-up bug
    assert decide(obs(**{**base, "failures": {0: slow}}, peer_crashes={"b": ""}, failed_for=0.1)).action is Action.FAIL


def test_a_crash_loop_waits_a_moment_for_its_peers_words_before_the_node_is_kept_out() -> None:
    """The third quick crash on this node and the same crash on its peer a few ms later: the
    node waits (at most PEER_WORDS_GRACE_S) for the peer's report, so the job ends as the
    script's error on every node, not this node kept out as a crash loop (a whole suite under
    load saw that race in test_script_error)."""
    base = dict(exits={0: 1}, failures={0: quick()}, crash_streak=CRASH_LOOP_TRIES, nodes_without_us=1)
    assert decide(obs(**base, peer_crashes={"b": ""}, failed_for=0.1)) == Decision(Action.CONTINUE)
    said = decide(obs(**base, peer_crashes={"b": NAME_ERROR}, failed_for=0.3))
    assert said.action is Action.FAIL and said.reason is Reason.SCRIPT_ERROR
    for late in (dict(peer_crashes={"b": ""}, failed_for=PEER_WORDS_GRACE_S),  # it never came: a loop of its own
                 dict(peer_crashes={}, failed_for=0.0),  # alone: nothing to wait for
                 dict(peer_crashes=None, failed_for=0.0)):  # cannot hear the others
        decision = decide(obs(**base, **late))
        assert decision.action is Action.KEEP_OUT and decision.reason is Reason.CRASH_LOOP, late


def test_a_node_failing_a_health_check_stays_out_of_the_round_it_would_join_whoever_could_train() -> None:
    """Before joining there is no min-nodes test (3b's, while training): a node not yet in a
    round holds nobody up, so a failed check keeps it out, kept out as for any cause."""
    line = "disk /snap: 99% full: free space or give the job another directory"
    assert before_joining(line) == Decision(Action.KEEP_OUT, Reason.HEALTH, detail=line)
    assert before_joining("") is None
