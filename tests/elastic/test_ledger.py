"""check_ledger: redone steps count once; gaps, repeats, losses and split brains are reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.ledger import Ledger, check_ledger, read_ledger
from elastic.sampler import ElasticSampler


def _write(path: Path, sampler: ElasticSampler, first: int, last: int, world: int, resumed_from: int) -> None:
    ledger = Ledger(path)
    for step in range(first, last + 1):
        ids = sampler.global_batch(4)
        ledger.record(epoch=sampler.epoch, step=step, world_size=world, samples=ids, resumed_from=resumed_from)
        sampler.advance(len(ids))
    ledger.close()


def test_rolled_back_steps_are_superseded_by_the_redo(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    sampler = ElasticSampler(10, seed=3)  # 3 steps per epoch: 4, 4, 2
    _write(path, sampler, 1, 5, world=3, resumed_from=0)
    snap = ElasticSampler(10, seed=3)
    for _ in range(3):
        snap.advance(len(snap.global_batch(4)))  # the snapshot was taken after step 3
    with open(path, "a") as f:
        f.write('{"incarnation": "x", "step": 6, "sam')  # a line cut short by SIGKILL
    _write(path, snap, 4, 9, world=2, resumed_from=3)
    report = check_ledger(path, 10, expect_epochs=3)
    assert report.ok, report.violations
    assert report.steps == 9 and report.completed_epochs == [0, 1, 2] and len(report.incarnations) == 2


def test_repeats_losses_and_gaps_are_violations(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    ledger.record(epoch=0, step=1, world_size=2, samples=[0, 1, 2], resumed_from=0)
    ledger.record(epoch=0, step=2, world_size=2, samples=[2, 3], resumed_from=0)
    ledger.record(epoch=1, step=4, world_size=2, samples=[0], resumed_from=0)
    ledger.close()
    text = "\n".join(check_ledger(path, 5).violations)
    assert "missing 3" in text
    assert "epoch 0: samples seen more than once: 2" in text
    assert "epoch 0: 1 sample(s) never seen: 4" in text


def test_a_line_of_an_older_round_after_a_newer_rounds_line_is_a_split_brain(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    sampler = ElasticSampler(10, seed=3)
    old, new = Ledger(path, incarnation="old"), Ledger(path, incarnation="new")
    for step, (writer, round_number) in enumerate([(old, 4), (old, 4), (new, 6), (old, 4), (new, 6)], start=1):
        ids = sampler.global_batch(2)
        writer.record(epoch=0, step=step, world_size=2, samples=ids, resumed_from=0, round_number=round_number)
        sampler.advance(len(ids))
    old.close()
    new.close()
    report = check_ledger(path, 10)
    assert [v for v in report.violations if v.startswith("split brain")] == [
        "split brain: step 4 committed by round 4 (incarnation old) after round 6 had committed step 3: "
        "two groups committed steps at once"]


def test_rounds_that_only_rise_are_no_split_brain(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    sampler = ElasticSampler(10, seed=3)
    _write(path, sampler, 1, 2, world=2, resumed_from=0)  # lines without a round are not judged
    ledger = Ledger(path)
    for step, round_number in ((3, 1), (4, 1), (5, 3)):
        ids = sampler.global_batch(2)
        ledger.record(epoch=0, step=step, world_size=2, samples=ids, resumed_from=0, round_number=round_number)
        sampler.advance(len(ids))
    ledger.close()
    assert not [v for v in check_ledger(path, 10).violations if v.startswith("split brain")]


def _rounds(path: Path, lines: list[tuple[str, int, int]], *, other_samples: int | None = None) -> None:
    """``lines``: (incarnation, round, step) in file order; every step's samples are the
    sampler's for that step (``other_samples``: that step's line of the older round differs)."""
    batches = {}
    sampler = ElasticSampler(12, seed=5)
    for step in range(1, 7):
        batches[step] = sampler.global_batch(2)
        sampler.advance(2)
    writers: dict[str, Ledger] = {}
    for incarnation, round_number, step in lines:
        ids = batches[step]
        if step == other_samples and round_number == min(r for _, r, _ in lines):
            ids = [(i + 1) % 12 for i in ids]
        writer = writers.setdefault(incarnation, Ledger(path, incarnation=incarnation))
        writer.record(epoch=0, step=step, world_size=2, samples=ids, resumed_from=0, round_number=round_number)
    for writer in writers.values():
        writer.close()


def _split(path: Path) -> list[str]:
    return [v for v in check_ledger(path, 12).violations if v.startswith("split brain")]


def test_the_one_commit_admitted_before_a_raise_may_land_late_and_is_superseded(tmp_path: Path) -> None:
    """A rank 0 frozen inside its commit of step 3 completes that one line after the new
    round's rank 0 recorded steps 3 and 4 itself (before it, or when it trains step 3 again)."""
    path = tmp_path / "ledger.jsonl"
    _rounds(path, [("old", 5, 1), ("old", 5, 2), ("new", 6, 3), ("new", 6, 4), ("old", 5, 3), ("new", 6, 5),
                   ("new", 6, 6)])
    report = check_ledger(path, 12, expect_epochs=1)
    assert report.ok, report.violations
    assert report.steps == 6
    again = tmp_path / "again.jsonl"  # the new round rolled back to step 2 and trains step 3 after the late line
    _rounds(again, [("old", 5, 1), ("old", 5, 2), ("new", 6, 2), ("old", 5, 3), ("new", 6, 3), ("new", 6, 4),
                    ("new", 6, 5), ("new", 6, 6)])
    assert check_ledger(again, 12, expect_epochs=1).ok


@pytest.mark.parametrize("lines, other", [
    pytest.param([("old", 5, 1), ("old", 5, 2), ("new", 6, 3), ("old", 5, 3), ("old", 5, 4), ("new", 6, 4)], None,
                 id="a second line after the raise"),
    pytest.param([("old", 5, 1), ("old", 5, 2), ("new", 6, 3), ("old", 5, 4), ("new", 6, 5), ("new", 6, 6)], None,
                 id="a step the newer round never records"),
    pytest.param([("old", 5, 1), ("old", 5, 2), ("new", 6, 3), ("old", 5, 3), ("new", 6, 4)], 3,
                 id="other samples than the newer round's line"),
])
def test_anything_more_than_that_one_late_line_is_a_split_brain(tmp_path: Path, lines: list[tuple[str, int, int]],
                                                                 other: int | None) -> None:
    path = tmp_path / "ledger.jsonl"
    _rounds(path, lines, other_samples=other)
    assert _split(path), read_ledger(path)
