"""After a lost node, which step a world sharded across every node stands on from memory, and
where each rank's state comes from (elastic/inplace/copy_plan.py): pure, milliseconds."""

from __future__ import annotations

from elastic.inplace.buddies import held_by, ring
from elastic.inplace.copy_plan import HELD, LIVE, OWN, CopyPlan, Holding, Source, lost_together_line, plan, seats

NODES = [[0, 1], [2, 3], [4, 5]]  # a, b, c: 3 nodes x 2 ranks; rank r's copy is at ring(NODES)[r]
NAMES = {r: "abc"[r // 2] for r in range(6)}


def _survivor(rank: int, position: int, step: int, own: tuple[int, ...] = (), held_step: int | None = None) -> Holding:
    """A survivor at ``step`` keeping the copies the ring gives it, at ``held_step`` (default: ``step``)."""
    keeps = held_by(ring(NODES)).get(position, [])
    return Holding(rank, position, step, own or (step,),
                   tuple((p, held_step if held_step is not None else step) for p in keeps))


def _spare(rank: int) -> Holding:
    return Holding(rank)


def test_a_spare_takes_the_lost_nodes_positions_and_survivors_keep_theirs() -> None:
    # node b (positions 2, 3) lost; the round orders a, c, then the spare d
    assert seats([0, 1, 4, 5, None, None], 6) == [0, 1, 4, 5, 2, 3]
    assert seats([None, None, 2, 3, 4, 5], 6) == [0, 1, 2, 3, 4, 5]  # rank 0's node lost: the spare at 0, 1


def test_a_world_of_another_size_is_cut_anew_every_rank_at_its_own_rank() -> None:
    assert seats([0, 1, 4, 5], 4) == [0, 1, 2, 3]
    assert seats([0, 0, None], 3) == [0, 1, 2]  # duplicates: never trusted


def test_killed_mid_step_the_world_stands_on_the_last_step_and_the_spare_gets_the_lost_shards_from_their_buddy() -> None:
    # b lost while step 8 was in flight: every survivor at 7, b's copies (of 7) at c (positions 4, 5)
    holdings = [_survivor(0, 0, 7), _survivor(1, 1, 7), _survivor(2, 4, 7), _survivor(3, 5, 7), _spare(4), _spare(5)]
    seated = dict(enumerate(seats([h.position for h in holdings], 6)))
    got = plan(holdings, 6, seated)
    assert got.step == 7 and got.from_memory
    assert got.sources == {0: Source(LIVE, 0), 1: Source(LIVE, 1), 2: Source(LIVE, 2), 3: Source(LIVE, 3),
                           4: Source(HELD, 2), 5: Source(HELD, 3)}
    assert got.moves() == {4: 2, 5: 3}  # nothing moves but the lost node's shards


def test_lost_during_an_exchange_the_world_stands_on_the_step_every_position_has() -> None:
    # b died after applying 8 and before its copy of 8 reached c: c holds b's 7 (the previous kept);
    # a and c applied 8 and their exchange with each other completed (own 8, own 7 kept)
    holdings = [_survivor(0, 0, 8, own=(8, 7)), _survivor(1, 1, 8, own=(8, 7)),
                Holding(2, 4, 8, (8, 7), ((2, 7),)), Holding(3, 5, 8, (8, 7), ((3, 7),)), _spare(4), _spare(5)]
    seated = dict(enumerate(seats([h.position for h in holdings], 6)))
    got = plan(holdings, 6, seated)
    assert got.step == 7
    assert got.sources[0] == Source(OWN, 0) and got.sources[2] == Source(OWN, 2)  # survivors go to their own 7
    assert got.sources[4] == Source(HELD, 2)


def test_a_copy_that_reached_its_buddy_lets_the_world_go_on_from_the_newer_step() -> None:
    holdings = [_survivor(0, 0, 8, own=(8, 7)), _survivor(1, 1, 8, own=(8, 7)),
                Holding(2, 4, 8, (8, 7), ((2, 8),)), Holding(3, 5, 8, (8, 7), ((3, 8),)), _spare(4), _spare(5)]
    got = plan(holdings, 6, dict(enumerate(seats([h.position for h in holdings], 6))))
    assert got.step == 8 and got.sources[0] == Source(LIVE, 0)


def test_a_node_lost_with_the_node_that_kept_its_copies_goes_to_the_snapshot_with_one_line() -> None:
    # b and c lost at once: b's copies were at c; c's are at a (alive), b's nowhere
    holdings = [_survivor(0, 0, 7), _survivor(1, 1, 7)] + [_spare(r) for r in range(2, 6)]
    got = plan(holdings, 6, dict(enumerate(range(6))))
    assert got == CopyPlan(-1, missing=(2, 3))  # c's positions are at a; b's are nowhere
    keeper_of = {p: ring(NODES)[p] for p in range(6)}
    line = lost_together_line((2, 3), NAMES, keeper_of)
    assert line == ("rank(s) [2, 3] (node b) exist in no live memory: lost together with node c, which kept their "
                    "copies; resuming from the newest snapshot")


def test_no_common_step_is_never_a_partial_state() -> None:
    # position 1 only at 5, position 0 only at 7: no step has both
    holdings = [Holding(0, 0, 7, (7,)), Holding(1, None, None, (), ((1, 5),))]
    got = plan(holdings, 2, {0: 0, 1: 1})
    assert not got.from_memory and got.missing == (1,)


def test_a_report_travels_as_a_row_of_integers_and_comes_back_the_same() -> None:
    from elastic.inplace.peer_restore import MAX_HELD, decode, encode

    for h in (Holding(3), Holding(0, 0, 7, (7, 6), ((4, 7), (4, 6))), Holding(5, 2, None, (), ((1, 3),))):
        row = encode(h)
        assert len(row) == 5 + 2 * MAX_HELD and decode(row) == h


def test_a_rank_reports_its_copies_and_a_newcomer_nothing_of_its_own() -> None:
    from elastic.inplace.peer_copies import Copy, PeerCopies
    from elastic.inplace.peer_restore import holding

    copies = PeerCopies(1)
    copies.own, copies.own_prev = Copy(8, 2, 0, {}, 0), Copy(7, 2, 0, {}, 0)
    copies.held, copies.held_prev = {0: Copy(8, 0, 0, {}, 0)}, {0: Copy(7, 0, 0, {}, 0)}
    assert holding(copies, 2, 2, 8) == Holding(2, 2, 8, (8, 7), ((0, 8), (0, 7)))
    assert holding(PeerCopies(1), 4, None, 8) == Holding(4)


def test_rows_are_cut_as_fsdp2_cuts_them() -> None:
    import torch

    from elastic.inplace.copy_plan import rows

    for n in (0, 1, 5, 30, 32):
        for world in (1, 2, 3, 4, 6):
            got = [hi - lo for lo, hi in rows(n, world)]
            assert got == [c.shape[0] for c in torch.arange(n).chunk(world)] + [0] * (world - len(torch.arange(n).chunk(world)))


def test_a_smaller_world_gathers_each_ranks_new_rows_from_the_positions_that_hold_them() -> None:
    from elastic.inplace.copy_plan import by_position, pieces

    # 30 rows over 6 (5 each) re-cut over 4 (8, 8, 8, 6)
    assert pieces(30, 6, 4, 0) == [(0, 0, 5), (1, 5, 8)]
    assert pieces(30, 6, 4, 1) == [(1, 8, 10), (2, 10, 15), (3, 15, 16)]
    assert pieces(30, 6, 4, 3) == [(4, 24, 25), (5, 25, 30)]
    # node b (positions 2, 3) lost, no spare: its positions come from c's copies; a's and c's from themselves
    holdings = [_survivor(0, 0, 7), _survivor(1, 1, 7), _survivor(2, 4, 7), _survivor(3, 5, 7)]
    got = by_position(holdings, 6)
    assert got.step == 7
    assert got.sources == {0: Source(LIVE, 0), 1: Source(LIVE, 1), 2: Source(HELD, 2), 3: Source(HELD, 3),
                           4: Source(LIVE, 2), 5: Source(LIVE, 3)}


def test_buffers_stay_with_a_survivor_and_a_rank_new_to_its_position_takes_a_lost_ranks() -> None:
    """BatchNorm's running stats are each rank's own, whole (FSDP2 does not shard buffers)."""
    from elastic.inplace.copy_plan import buffers_of, by_position

    # node b lost, no spare: the survivors, re-numbered 0..3, keep the buffers of where they trained
    holdings = [_survivor(0, 0, 7), _survivor(1, 1, 7), _survivor(2, 4, 7), _survivor(3, 5, 7)]
    got = by_position(holdings, 6)
    assert got.trained == {0: 0, 1: 1, 2: 4, 3: 5}
    assert buffers_of(got, 6, 4) == [0, 1, 4, 5]
    # a spare (holding nothing of its own) takes the lost ranks' (2, 3), wherever the world seats it
    holdings = [_survivor(0, 0, 7), _survivor(1, 1, 7), _spare(2), _spare(3), _survivor(4, 4, 7), _survivor(5, 5, 7)]
    assert buffers_of(by_position(holdings, 6), 6, 6) == [0, 1, 2, 3, 4, 5]
    holdings = [_survivor(0, 0, 7), _survivor(1, 1, 7), _survivor(2, 4, 7), _survivor(3, 5, 7), _spare(4), _spare(5)]
    assert buffers_of(by_position(holdings, 6), 6, 6) == [0, 1, 4, 5, 2, 3]
    # a world that grew: a newcomer past the lost ranks takes position 0's
    holdings = [_survivor(0, 0, 7), _survivor(1, 1, 7), _spare(2)]
    assert buffers_of(by_position(holdings, 2), 2, 3) == [0, 1, 0]
