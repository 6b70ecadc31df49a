"""The one line of a world that cannot stand on a step from memory (pure, milliseconds); the
recovery itself runs under real agents in tests/agent/test_fsdp_in_place.py."""

from __future__ import annotations

from elastic.inplace.fsdp_in_place import lost_line


def test_a_node_lost_with_the_node_that_kept_its_copies_is_named_with_its_keeper_in_one_line() -> None:
    # three nodes in rank order a, b, c: a's copies at b, b's at c, c's at a
    nodes = {"b": [2, 3], "a": [0, 1], "c": [4, 5]}
    line = lost_line([2, 3], nodes)  # b and c lost together: b's copies were at c
    assert line == ("rank(s) [2, 3] (node b) exist in no live memory: lost together with node c, which kept their "
                    "copies; resuming from the newest snapshot")
    assert "lost together with node a" in lost_line([4, 5], nodes)  # c's copies were at a
    assert "\n" not in line


def test_a_node_with_fewer_ranks_names_the_node_that_kept_each_of_its_copies() -> None:
    line = lost_line([0, 1, 2], {"a": [0, 1, 2], "b": [3, 4]})  # a's third rank's copy wraps to b's first
    assert "(node a)" in line and "lost together with node b" in line
