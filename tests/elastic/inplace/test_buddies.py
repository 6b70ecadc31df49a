"""Who keeps whose copy (elastic/inplace/buddies.py): pure, milliseconds."""

from __future__ import annotations

import itertools

from elastic.inplace.buddies import every_k, held_by, memory_problem, ranks_by_node, ring


def _node(nodes: list[list[int]]) -> dict[int, int]:
    return {rank: k for k, ranks in enumerate(nodes) for rank in ranks}


def test_three_nodes_of_two_send_each_rank_to_the_same_local_rank_of_the_next_node() -> None:
    nodes = [[0, 1], [2, 3], [4, 5]]
    assert ring(nodes) == {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}
    assert held_by(ring(nodes)) == {2: [0], 3: [1], 4: [2], 5: [3], 0: [4], 1: [5]}


def test_no_buddy_is_ever_on_the_same_node_and_every_rank_has_one() -> None:
    for counts in itertools.product([1, 2, 3, 4], repeat=3):
        ranks = iter(range(sum(counts)))
        nodes = [[next(ranks) for _ in range(n)] for n in counts]
        buddies, node = ring(nodes), _node(nodes)
        assert set(buddies) == set(node), counts
        assert all(node[rank] != node[holder] for rank, holder in buddies.items()), counts


def test_one_node_has_no_buddy_anywhere_a_copy_on_it_would_die_with_it() -> None:
    assert ring([[0, 1, 2, 3]]) == {}
    assert ring([]) == {}
    assert ring([[0, 1], []]) == {}


def test_two_nodes_hold_each_others_copies() -> None:
    assert ring([[0, 1], [2, 3]]) == {0: 2, 1: 3, 2: 0, 3: 1}


def test_a_node_with_fewer_ranks_holds_more_than_one_copy_per_rank() -> None:
    buddies = ring([[0, 1, 2, 3], [4, 5]])
    assert buddies == {0: 4, 1: 5, 2: 4, 3: 5, 4: 0, 5: 1}
    assert held_by(buddies)[4] == [0, 2]


def test_the_assignment_follows_the_world_a_lost_node_closes_the_ring() -> None:
    before = ring([[0, 1], [2, 3], [4, 5]])
    after = ring([[0, 1], [2, 3]])  # the third node lost; ranks renumbered by the new world
    assert before[2] == 4 and after[2] == 0


def test_ranks_by_node_groups_in_the_order_of_the_lowest_rank() -> None:
    assert ranks_by_node([7, 7, 3, 3, 9, 9]) == [[0, 1], [2, 3], [4, 5]]
    assert ranks_by_node([5, 1, 5, 1]) == [[0, 2], [1, 3]]


def test_every_k_is_the_fewest_steps_that_keep_the_copies_within_the_goal() -> None:
    assert every_k(0.001, 0.1, 0.05) == 1  # 1 % of a step
    assert every_k(0.005, 0.1, 0.05) == 1  # exactly 5 %
    assert every_k(0.006, 0.1, 0.05) == 2
    assert every_k(0.05, 0.1, 0.05) == 10
    assert every_k(0.0, 0.1, 0.05) == 1 and every_k(0.1, 0.0, 0.05) == 1


def test_a_node_without_the_memory_says_how_much_it_needs() -> None:
    assert memory_problem(100 << 20, 2, None) is None
    assert memory_problem(100 << 20, 2, 800 << 20) is None
    why = memory_problem(100 << 20, 2, 799 << 20)
    assert why is not None and "800 MiB" in why and "799 MiB" in why
