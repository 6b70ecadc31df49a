"""The last-good rule for values that fail verification (pure; no etcd)."""

from __future__ import annotations

import pytest

from agent.rendezvous.last_good import LastGood


def test_a_verified_value_is_taken_as_it_is() -> None:
    memory: LastGood[str] = LastGood(grace=3.0)
    assert memory.resolve("k", "a", now=0.0) == "a"
    assert memory.resolve("k", "b", now=1.0) == "b"
    assert memory.forged_for("k", now=1.0) is None


def test_a_forgery_keeps_the_last_good_value_for_the_grace_then_counts_as_absent() -> None:
    memory: LastGood[str] = LastGood(grace=3.0)
    memory.resolve("k", "a", now=0.0)
    assert memory.resolve("k", None, now=10.0) == "a"  # the forgery's clock starts at first sight
    assert memory.resolve("k", None, now=12.9) == "a"
    assert memory.forged_for("k", now=12.9) == pytest.approx(2.9)
    assert memory.resolve("k", None, now=13.0) is None  # its owner did not repair it within the grace


def test_a_repair_ends_the_forgery_and_a_later_one_gets_a_fresh_grace() -> None:
    memory: LastGood[str] = LastGood(grace=3.0)
    memory.resolve("k", "a", now=0.0)
    memory.resolve("k", None, now=1.0)
    assert memory.resolve("k", "a", now=1.1) == "a"
    assert memory.resolve("k", None, now=20.0) == "a"
    assert memory.resolve("k", None, now=22.9) == "a"


def test_a_key_never_seen_good_is_absent_from_the_first_look() -> None:
    memory: LastGood[str] = LastGood(grace=float("inf"))
    assert memory.resolve("k", None, now=0.0) is None
    assert memory.forged_for("k", now=5.0) == 5.0
    assert memory.last("k") is None


def test_a_deleted_key_is_forgotten_at_once() -> None:
    memory: LastGood[str] = LastGood(grace=3.0)
    memory.resolve("k", "a", now=0.0)
    memory.resolve("k", None, now=1.0)
    memory.keep_only([])
    assert memory.last("k") is None and memory.forged_for("k", now=1.5) is None
    assert memory.resolve("k", None, now=1.5) is None
