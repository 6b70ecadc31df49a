"""What a step does with non-finite gradients: the pure decision, the flag, the setting (milliseconds)."""

from __future__ import annotations

import pytest
import torch

from elastic.consistency.nonfinite import (FAILED, FINITE, NONFINITE, Do, decide, decide_unreplicated, flag, grads_finite,
                                          heals_in_place, skip_setting, state_finite)
from elastic.consistency.vote import vote

A, B = [1, 10, 20, 30], [1, 11, 20, 30]  # [method, digest per group]: two replica states


def test_finite_gradients_are_applied_whatever_else() -> None:
    assert decide(True, None, False, False) is Do.APPLY
    assert decide(True, vote([A, B]), True, True) is Do.APPLY


def test_non_finite_gradients_are_never_decided_without_a_vote() -> None:
    with pytest.raises(ValueError, match="vote"):
        decide(False, None, False, False)


def test_a_nan_replica_beside_a_finite_majority_is_healed_where_it_stands() -> None:
    two = vote([A, B], [True, False])  # two replicas: the finite one is right
    three = vote([A, A, B], [False, False, True])
    for v in (two, three):
        assert heals_in_place(v) and decide(False, v, False, False) is Do.HEAL
        assert decide(False, v, True, True) is Do.HEAL  # a recompute before it changes nothing
    assert two.majority == (1,) and two.suspects == (0,) and three.suspects == (2,)


def test_every_replica_finite_and_agreeing_is_recomputed_once_then_stops_or_skips() -> None:
    agreed = vote([A, A, A])
    assert decide(False, agreed, False, False) is Do.RECOMPUTE
    assert decide(False, agreed, False, True) is Do.RECOMPUTE  # a skip only after the recompute
    assert decide(False, agreed, True, False) is Do.STOP
    assert decide(False, agreed, True, True) is Do.SKIP


def test_every_replica_non_finite_is_a_divergence_even_when_skipping() -> None:
    v = vote([A, B], [True, True])
    assert v.diverged and not heals_in_place(v)
    assert decide(False, v, False, True) is Do.STOP


def test_replicas_that_differ_otherwise_go_back_to_the_last_agreed_state() -> None:
    flipped = vote([A, A, B])  # a finite outlier: a flipped bit may have spread through gradients
    no_majority = vote([A, B])
    both = vote([A, B, B, A], [True, False, False, False])  # a NaN, and a finite disagreement besides
    for v in (flipped, no_majority, both):
        assert not heals_in_place(v) and decide(False, v, False, False) is Do.ROLLBACK


def _grads(*first: float) -> list[torch.nn.Parameter]:
    """Three parameters: float32 gradient ``first``, a bfloat16 one, and one with no gradient."""
    params = [torch.nn.Parameter(torch.zeros(len(first))), torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.zeros(1))]
    params[0].grad = torch.tensor(first)
    params[1].grad = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    return params


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_gradient_flag_sees_nan_and_either_infinity(bad: float) -> None:
    assert grads_finite(_grads(1.0, 3e38, -3e38))
    assert grads_finite(_grads(3e38, 3e38))  # their float32 sum overflows: the exact look says finite
    assert not grads_finite(_grads(1.0, bad))
    p = _grads(1.0)
    p[1].grad[1] = bad
    assert not grads_finite(p)
    assert grads_finite([torch.nn.Parameter(torch.zeros(2))])  # no gradients at all


def test_a_state_is_finite_only_if_every_floating_tensor_is() -> None:
    state = [torch.zeros(3), torch.arange(4), torch.empty(0), torch.ones(2, dtype=torch.float16)]
    assert state_finite(state) and state_finite([])
    state[3][1] = float("inf")
    assert not state_finite(state)


def test_the_skip_setting() -> None:
    assert skip_setting("") is False and skip_setting("0") is False and skip_setting(" 1 ") is True
    assert skip_setting("yes") is True
    with pytest.raises(ValueError, match="ELASTIC_SKIP_NONFINITE='sometimes': use 1"):
        skip_setting("sometimes")


def test_without_a_replica_a_transient_fault_is_recomputed_once_then_stops_or_skips() -> None:
    assert decide_unreplicated(True, recomputed=False, skip=False) is Do.RECOMPUTE
    assert decide_unreplicated(True, recomputed=False, skip=True) is Do.RECOMPUTE
    assert decide_unreplicated(True, recomputed=True, skip=False) is Do.STOP
    assert decide_unreplicated(True, recomputed=True, skip=True) is Do.SKIP


def test_without_a_replica_a_non_finite_shard_stops_at_once_even_when_skipping() -> None:
    for recomputed in (False, True):
        for skip in (False, True):
            assert decide_unreplicated(False, recomputed, skip) is Do.STOP


def test_the_sharded_flag_in_a_max_all_reduce_lets_a_failure_outrank_a_nan() -> None:
    assert (flag(False, True), flag(False, False), flag(True, True), flag(True, False)) == (
        FINITE, NONFINITE, FAILED, FAILED)
    assert max(flag(False, False), flag(True, True)) == FAILED  # a failed step is abandoned, whatever its gradients
    assert max(flag(False, True), flag(False, False)) == NONFINITE  # one rank's NaN shard is every rank's news
