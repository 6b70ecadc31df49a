"""The elastic sampler's promise: within an epoch, every sample exactly once, any world sizes."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from elastic.sampler import ElasticSampler, split_sizes


def _run_step(sampler: ElasticSampler, batch_size: int, world: int) -> list[int]:
    """One committed step: the union of what every rank trained on, then advance."""
    shares = [sampler.local_batch(batch_size, r, world) for r in range(world)]
    taken = [i for share in shares for i in share]
    assert taken == sampler.global_batch(batch_size), "ranks' shares must tile the global batch in rank order"
    sampler.advance(len(taken))
    return taken


def test_split_is_contiguous_and_uneven_splits_favour_first_ranks() -> None:
    assert split_sizes(10, 3) == [4, 3, 3]
    assert split_sizes(2, 3) == [1, 1, 0]
    assert split_sizes(0, 2) == [0, 0]
    s = ElasticSampler(10, seed=1, shuffle=False)
    assert [s.local_batch(10, r, 3) for r in range(3)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_order_is_a_permutation_fixed_by_seed_and_epoch() -> None:
    a, b = ElasticSampler(50, seed=7), ElasticSampler(50, seed=7)
    assert a.order(0).tolist() == b.order(0).tolist()
    assert sorted(a.order(0).tolist()) == list(range(50))
    assert a.order(0).tolist() != a.order(1).tolist()
    assert a.order(0).tolist() != ElasticSampler(50, seed=8).order(0).tolist()


@pytest.mark.parametrize("trial", range(40))
def test_exactly_once_across_random_world_sizes_and_restores(trial: int) -> None:
    rng = random.Random(trial)
    size, batch_size = rng.randint(1, 60), rng.randint(1, 16)
    sampler = ElasticSampler(size, seed=trial)
    seen: dict[int, Counter[int]] = {}
    world = rng.randint(1, 5)
    while sampler.epoch < 3:
        if rng.random() < 0.3:  # a restart: new world size, state restored from plain numbers
            state = dict(sampler.state_dict())
            assert all(isinstance(v, int) for v in state.values())
            sampler = ElasticSampler(size, seed=12345)  # the seed comes back from the state
            sampler.load_state_dict(state)
            world = rng.randint(1, 5)
        epoch = sampler.epoch
        seen.setdefault(epoch, Counter()).update(_run_step(sampler, batch_size, world))
    for epoch, counts in seen.items():
        assert counts == Counter(range(size)), f"epoch {epoch}: not every sample exactly once"


def test_tail_batch_is_short_and_gives_empty_shares_when_fewer_samples_than_ranks() -> None:
    sampler = ElasticSampler(11, seed=0)
    _run_step(sampler, 10, 3)
    assert sampler.cursor == 10
    shares = [sampler.local_batch(10, r, 3) for r in range(3)]
    assert [len(s) for s in shares] == [1, 0, 0]
    _run_step(sampler, 10, 3)
    assert (sampler.epoch, sampler.cursor) == (1, 0), "the short tail step closes the epoch"


def test_load_rejects_state_from_another_dataset() -> None:
    state = ElasticSampler(10).state_dict()
    with pytest.raises(ValueError, match="dataset of 10 samples"):
        ElasticSampler(12).load_state_dict(state)
