"""The own-clock lease rule: when a node cut from etcd stops its workers, and when an etcd
outage for everyone lets it train on. Pure: times are plain numbers (seconds)."""

from __future__ import annotations

from agent.rendezvous.lease_clock import (
    LeaseClock, PeerWord, Verdict, deadline, judge, margin, outage_proven_at, should_ask, still_reaches_etcd,
    telling_after,
)

TTL = 2.0  # keep-alive every 0.5 s; deadline 1.5 s after the last confirmed one was sent
HEALTHY = LeaseClock(TTL, confirmed_at=10.0)
FAILING = LeaseClock(TTL, confirmed_at=10.0, failing_since=10.5)  # the next keep-alive failed


def outage_word(asked: float, age_at_answer: float | None) -> PeerWord:
    """A peer whose keep-alives fail too; ``age_at_answer`` since its last confirmed one."""
    return PeerWord(asked_at=asked, answered_at=asked + 0.01, age=age_at_answer, failing=True)


def test_the_deadline_comes_before_etcd_could_expire_the_lease() -> None:
    assert margin(2.0) == 0.5 and margin(10.0) == 1.0
    assert deadline(HEALTHY) == 11.5
    assert deadline(LeaseClock(TTL, confirmed_at=None)) is None  # never confirmed: nothing to count from


def test_before_the_deadline_nothing_is_decided_even_while_failing() -> None:
    assert judge(FAILING, 11.45, peers=["b"], words={}) is Verdict.HELD
    assert judge(HEALTHY, 11.45, peers=[], words={}) is Verdict.HELD


def test_cut_off_alone_a_node_stops_by_its_own_clock_when_no_peer_can_be_asked() -> None:
    # a full partition: the peers do not answer either
    assert judge(FAILING, 11.5, peers=["b", "c"], words={}) is Verdict.CUT_OFF


def test_a_round_of_one_cannot_prove_an_outage() -> None:
    assert judge(FAILING, 11.5, peers=[], words={}) is Verdict.CUT_OFF


def test_a_peer_that_still_reaches_etcd_means_this_node_is_cut_off() -> None:
    words = {"b": PeerWord(asked_at=11.2, answered_at=11.21, age=0.2, failing=False),
             "c": outage_word(11.2, 1.0)}
    assert judge(FAILING, 11.55, peers=["b", "c"], words=words) is Verdict.CUT_OFF


def test_every_peer_failing_since_before_our_failure_is_an_etcd_outage() -> None:
    # etcd died at 10.4: b last confirmed at 10.3, c at 10.45; asked at 11.2 (telling after 11.125)
    words = {"b": outage_word(11.2, 11.21 - 10.3), "c": outage_word(11.2, 11.21 - 10.45)}
    assert telling_after(FAILING) == 11.125
    assert judge(FAILING, 11.55, peers=["b", "c"], words=words) is Verdict.OUTAGE
    assert judge(FAILING, 30.0, peers=["b", "c"], words=words) is Verdict.OUTAGE  # the outage goes on


def test_one_peer_missing_from_the_answers_is_not_proof() -> None:
    words = {"b": outage_word(11.2, 0.9)}
    assert judge(FAILING, 11.55, peers=["b", "c"], words=words) is Verdict.CUT_OFF


def test_an_answer_asked_too_soon_after_our_failure_cannot_tell() -> None:
    # 0.1 s after our first failure a healthy peer may simply not have refreshed yet
    words = {"b": outage_word(10.6, 0.4)}
    assert judge(FAILING, 11.55, peers=["b"], words=words) is Verdict.CUT_OFF


def test_a_peer_that_confirmed_a_keep_alive_after_ours_failed_saw_etcd_alive() -> None:
    # b is failing now (a blip), but it confirmed one at 11.0, after we began to fail at 10.5
    words = {"b": PeerWord(asked_at=11.2, answered_at=11.21, age=0.21, failing=True)}
    assert judge(FAILING, 11.55, peers=["b"], words=words) is Verdict.CUT_OFF


def test_a_peer_that_never_had_a_confirmed_keep_alive_lost_etcd_too() -> None:
    assert judge(FAILING, 11.55, peers=["b"], words={"b": outage_word(11.2, None)}) is Verdict.OUTAGE


def test_a_starved_keep_alive_thread_that_saw_no_failure_is_cut_off_past_the_deadline() -> None:
    assert judge(HEALTHY, 11.55, peers=["b"], words={"b": outage_word(11.2, 0.9)}) is Verdict.CUT_OFF


def test_peers_are_asked_only_while_failing_and_four_times_per_interval() -> None:
    assert not should_ask(HEALTHY, 11.0, None)
    assert should_ask(FAILING, 10.6, None)
    assert not should_ask(FAILING, 10.7, last_asked=10.6)
    assert should_ask(FAILING, 10.73, last_asked=10.6)


def test_a_peer_reaches_etcd_if_its_keep_alives_succeed_or_failed_only_briefly() -> None:
    """What a round that follows a failure waits for: a late member still able to join."""
    assert still_reaches_etcd(PeerWord(asked_at=1.0, answered_at=1.01, age=0.2, failing=False), TTL)
    assert still_reaches_etcd(outage_word(1.0, 0.9), TTL)  # failing for under half a TTL: an election
    assert not still_reaches_etcd(outage_word(1.0, 1.2), TTL)  # cut off from etcd this long: it cannot join
    assert not still_reaches_etcd(outage_word(1.0, None), TTL)


def test_after_an_accepted_outage_a_peer_back_on_etcd_first_does_not_cut_this_node_off() -> None:
    """etcd returns at 30.0: b's keep-alive gets through first; ours is due a moment later.
    The outage was last proven at 29.8, so etcd's renewed lease outlives 31.8 at least."""
    back = {"b": PeerWord(asked_at=30.1, answered_at=30.11, age=0.05, failing=False)}
    assert outage_proven_at(FAILING, ["b"], {"b": outage_word(29.8, 19.5)}) == 29.8
    assert judge(FAILING, 30.15, peers=["b"], words=back) is Verdict.CUT_OFF  # from the old clock: no slack
    assert judge(FAILING, 30.15, peers=["b"], words=back, outage_proven=29.8) is Verdict.HELD
    assert deadline(FAILING, outage_proven=29.8) == 29.8 + TTL - margin(TTL)
    assert judge(FAILING, 31.3, peers=["b"], words=back, outage_proven=29.8) is Verdict.CUT_OFF  # still no keep-alive


def test_the_outage_proof_is_the_earliest_question_every_peer_answered_and_none_without_proof() -> None:
    words = {"b": outage_word(29.8, 19.5), "c": outage_word(29.6, 19.3)}
    assert outage_proven_at(FAILING, ["b", "c"], words) == 29.6
    assert outage_proven_at(FAILING, ["b", "c"], {"b": words["b"]}) is None  # c did not answer
    assert outage_proven_at(HEALTHY, ["b"], words) is None  # our keep-alives do not fail


def test_an_old_outage_proof_does_not_outlive_a_keep_alive_that_got_through() -> None:
    assert deadline(HEALTHY, outage_proven=29.8) == deadline(HEALTHY)
