"""The replica vote under HSDP: one vote per shard class (ranks with the same ``r % L``)."""

from __future__ import annotations

from elastic.consistency.check import Mismatch, describe
from elastic.consistency.vote import vote, vote_by_class

M = 1  # a fingerprint method


def rows(*ds: int) -> list[list[int]]:
    return [[M, d, 0, 0] for d in ds]


def test_shards_differ_between_classes_yet_every_class_agrees() -> None:
    # 3 nodes x 2 local ranks: classes 0,1,0,1,0,1; the two shards hold other bits
    v = vote_by_class(rows(10, 20, 10, 20, 10, 20), [], [0, 1, 0, 1, 0, 1])
    assert v.agreed and v.suspects == () and v.majority == tuple(range(6))
    assert not vote(rows(10, 20, 10, 20, 10, 20)).agreed  # a whole-world vote would always split


def test_an_outlier_is_named_by_its_own_shards_replicas() -> None:
    v = vote_by_class(rows(10, 20, 10, 21, 10, 20), [], [0, 1, 0, 1, 0, 1])
    assert not v.agreed and v.suspects == (3,) and v.has_majority
    assert v.majority == (0, 1, 2, 4, 5)


def test_two_replicas_of_a_shard_make_both_suspects() -> None:
    v = vote_by_class(rows(10, 20, 11, 20), [], [0, 1, 0, 1])  # 2 nodes x 2
    assert not v.agreed and v.suspects == (0, 2) and not v.has_majority


def test_a_non_finite_shard_is_the_outlier_and_a_whole_class_non_finite_diverged() -> None:
    v = vote_by_class(rows(10, 20, 99, 20), [False, False, True, False], [0, 1, 0, 1])
    assert not v.agreed and v.suspects == (2,) and v.majority == (0, 1, 3) and v.nonfinite == (2,)
    v = vote_by_class(rows(10, 20, 11, 20), [True, False, True, False], [0, 1, 0, 1])
    assert v.diverged and v.nonfinite == (0, 2)


def test_methods_that_differ_are_told_apart() -> None:
    v = vote_by_class([[1, 10, 0, 0], [1, 20, 0, 0], [2, 10, 0, 0], [2, 20, 0, 0]], [], [0, 1, 0, 1])
    assert v.methods_differ


def test_one_class_is_the_ddp_vote() -> None:
    for ds in ((5, 5, 5), (5, 6, 5), (5, 6)):
        assert vote_by_class(rows(*ds), [], [0] * len(ds)) == vote(rows(*ds))


def test_the_line_counts_the_replicas_of_the_outliers_shard() -> None:
    v = vote_by_class(rows(10, 20, 10, 21, 10, 20), [], [0, 1, 0, 1, 0, 1])
    line = describe(Mismatch(12, 8, v, ["n0", "n0", "n1", "n1", "n2", "n2"], {3: ["0.weight"]}, shard_ranks=2))
    assert "node n1 (rank 3; differs in 0.weight) disagrees with the majority of 2 of 3 replicas of its shard " \
        "(local rank 1)" in line, line
    assert "returns to step 8" in line
