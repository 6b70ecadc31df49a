"""check_ledger: redone steps count once; gaps, repeats and losses are reported."""

from __future__ import annotations

from pathlib import Path

from elastic.ledger import Ledger, check_ledger
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
