"""Which members a node with failing keep-alives asks: a bounded set at any round size."""

from agent.rendezvous.vouchers import DEFAULT_SPREAD, vouchers


def _round(n: int) -> list[str]:
    return [f"node-{i:05d}" for i in range(n)]


def test_a_small_round_asks_every_other_member_as_before() -> None:
    members = _round(11)
    assert vouchers(members, "node-00003", stewards=["node-00000", "node-00001", "node-00002"]) == \
        [m for m in members if m != "node-00003"]
    assert vouchers(["a", "b", "c"], "b") == ["a", "c"]
    assert vouchers(["a"], "a") == []


def test_a_large_round_asks_the_stewards_and_a_constant_number_spread_around_it() -> None:
    for n in (64, 1024, 16384):
        members = _round(n)
        stewards = [members[7], members[n // 2], members[n - 3]]
        node = members[n // 3]
        asked = vouchers(members, node, stewards)
        assert len(asked) == len(stewards) + DEFAULT_SPREAD  # O(1): the same at every size
        assert asked[:3] == stewards and node not in asked and len(set(asked)) == len(asked)
        # spread, not neighbours: the picks cover the whole ring, a rack of adjacent names holds few
        offsets = sorted((members.index(p) - members.index(node)) % n for p in asked[3:])
        assert offsets[0] == 1 and offsets[-1] >= n * 7 // 8 - 1
        assert all(b - a >= (n - 1) // DEFAULT_SPREAD - 1 for a, b in zip(offsets, offsets[1:]))


def test_the_choice_is_deterministic_and_spreads_the_questions() -> None:
    members = _round(1024)
    assert vouchers(members, "node-0100", ["node-00001"]) == vouchers(members, "node-0100", ["node-00001"])
    asked_by: dict[str, int] = {}
    for node in members:
        for peer in vouchers(members, node, []):
            asked_by[peer] = asked_by.get(peer, 0) + 1
    assert max(asked_by.values()) == DEFAULT_SPREAD  # each member is asked by a constant number


def test_stewards_outside_the_round_or_the_node_itself_are_not_asked() -> None:
    members = _round(100)
    asked = vouchers(members, "node-00010", ["node-00010", "spare-1", "node-00020", "node-00020"])
    assert asked[0] == "node-00020" and "node-00010" not in asked and "spare-1" not in asked
    assert len(asked) == 1 + DEFAULT_SPREAD


def test_picks_skip_a_steward_rather_than_asking_it_twice() -> None:
    members = _round(20)
    asked = vouchers(members, "node-00000", ["node-00001"], spread=4)
    assert asked[0] == "node-00001" and len(asked) == 5 and len(set(asked)) == 5
