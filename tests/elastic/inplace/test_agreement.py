"""The re-formation's agreement (:mod:`elastic.inplace.agreement`), pure: which step the new
world goes on from, and who heals whom (under HSDP: the same local rank of another node)."""

from __future__ import annotations

from elastic.inplace.agreement import HealPlan, Holding, decode, encode, pair_shards, plan


def reports(*rows: tuple[bool, int]) -> list[Holding]:
    return [Holding(rank, *row) for rank, row in enumerate(rows)]


def test_the_newest_step_any_holder_completed_is_the_step_and_the_others_are_healed_from_its_holders() -> None:
    got = plan(reports((True, 7), (True, 6), (False, 0), (True, 7)))
    assert got == HealPlan(step=7, sources={1: 0, 2: 3})
    assert plan(reports((False, 0), (False, 0))) == HealPlan(step=-1, from_disk=True)


def test_a_report_travels_as_ints_and_back() -> None:
    mine = Holding(3, True, 12)
    assert decode([encode(mine)]) == [mine]


def test_hsdp_heals_each_rank_from_the_same_local_rank_of_another_node() -> None:
    # 2 nodes x 2 local ranks; node 1 came back holding nothing
    rows = reports((True, 9), (True, 9), (False, 0), (False, 0))
    assert pair_shards(plan(rows), rows, 2) == HealPlan(step=9, sources={2: 0, 3: 1})


def test_hsdp_without_a_holder_of_some_local_rank_goes_to_disk() -> None:
    # node 0's local rank 1 stands a step behind (what the node's verdict prevents); node 1 is new
    rows = reports((True, 9), (True, 8), (False, 0), (False, 0))
    assert pair_shards(plan(rows), rows, 2) == HealPlan(step=-1, from_disk=True)


def test_the_heals_of_one_local_rank_are_spread_over_its_holders() -> None:
    # 4 nodes x 2: nodes 0 and 1 hold step 5, nodes 2 and 3 are new
    rows = reports((True, 5), (True, 5), (True, 5), (True, 5), (False, 0), (False, 0), (False, 0), (False, 0))
    assert pair_shards(plan(rows), rows, 2).sources == {4: 0, 5: 1, 6: 2, 7: 3}
