"""A node applies each HSDP step on all of its ranks or on none (:mod:`elastic.inplace.node_verdict`):
the rule for a peer's outcome, pure, then the ranks' side over real files, in threads."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from elastic.inplace.node_verdict import NodeVerdict, Outcome, decode, encode, outcome

A, X = Outcome.APPLIES, Outcome.ABANDONS


def test_a_peers_post_of_the_step_is_its_outcome() -> None:
    assert outcome([(3, 7, A)], 3, 7, alive=True) is A
    assert outcome([(3, 6, A), (3, 7, X)], 3, 7, alive=True) is X


def test_a_peer_past_the_step_in_the_round_applied_it() -> None:
    assert outcome([(3, 8, X)], 3, 7, alive=True) is A  # it got to 8 only by applying 7


def test_a_peer_in_a_later_round_without_the_step_or_gone_abandoned_it() -> None:
    assert outcome([(3, 6, A), (4, 7, A)], 3, 7, alive=True) is X
    assert outcome([(3, 6, A)], 3, 7, alive=False) is X


def test_a_live_peer_that_has_not_posted_the_step_has_not_decided() -> None:
    assert outcome([(3, 6, A)], 3, 7, alive=True) is None
    assert outcome([], 3, 7, alive=True) is None
    assert outcome([(2, 9, A)], 3, 7, alive=True) is None  # an older round's posts say nothing


def test_posts_travel_through_the_file_and_back() -> None:
    assert decode(encode(42, [(1, 2, A), (1, 3, X)])) == (42, [(1, 2, A), (1, 3, X)])


def test_ranks_that_all_would_apply_agree_and_one_that_abandons_stops_the_others(tmp_path: Path) -> None:
    ranks = [NodeVerdict(tmp_path, r, 3) for r in range(3)]
    said: dict[int, str | None] = {}

    def agree(r: int) -> None:
        said[r] = ranks[r].agree(5, 10)

    threads = [threading.Thread(target=agree, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert said == {0: None, 1: None, 2: None}

    # step 11: local rank 2 abandons (a collective cut on it); the two that would apply do not
    ranks[2].abandon(5, 11)
    assert ranks[0].agree(5, 11) == "local rank 2 of this node abandoned step 11"
    assert ranks[1].agree(5, 11) is not None
    # ... and a rank that reads them later sees the node's outcome as abandoned too
    assert outcome(decode((tmp_path / "verdict-0").read_bytes())[1], 5, 11, alive=True) is X


def test_a_rank_waits_for_a_peer_that_has_not_decided(tmp_path: Path) -> None:
    first, second = NodeVerdict(tmp_path, 0, 2), NodeVerdict(tmp_path, 1, 2)
    result: list[str | None] = []
    waiter = threading.Thread(target=lambda: result.append(first.agree(1, 1)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not result, "it applied before its peer decided"
    second.abandon(1, 1)
    waiter.join(10)
    assert result == ["local rank 1 of this node abandoned step 1"]


def test_a_new_process_in_a_local_ranks_place_starts_with_no_posts(tmp_path: Path) -> None:
    old = NodeVerdict(tmp_path, 1, 2)
    old.abandon(1, 4)  # the replaced process's last word
    NodeVerdict(tmp_path, 1, 2)  # its replacement
    assert decode((tmp_path / "verdict-1").read_bytes())[1] == []


def test_a_torn_record_is_not_a_decision() -> None:
    whole = encode(7, [(1, 2, A)])
    with pytest.raises(ValueError):
        decode(whole[:100] + b"x" * (len(whole) - 100))  # a read that met a write half-way
    with pytest.raises(ValueError):
        decode(whole[:-1])
