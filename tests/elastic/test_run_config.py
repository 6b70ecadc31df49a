"""ElasticRun's snapshot and data settings as two small objects, and the flat keywords folded in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from elastic.distributed import ElasticRunError
from elastic.jobs.mlp import SyntheticClassification, as_batch
from elastic.run_config import FLAT_KEYWORDS, DataConfig, SnapshotConfig, from_flat_keywords


def test_every_flat_keyword_lands_in_its_objects_field() -> None:
    def pad(batch: list[Any]) -> Any:
        return batch

    flat = dict(snapshot_every_steps=7, snapshot_every_seconds=60.0, keep_snapshots=5, snapshot_writer="thread",
                ledger="l.jsonl", snapshot_meta={"job": "x"}, batch_policy="fixed-per-rank", per_rank_batch_size=4,
                num_workers=2, collate_fn=pad, pin_memory=False)
    assert set(flat) == set(FLAT_KEYWORDS)
    snapshots, data = from_flat_keywords(None, None, flat)
    assert snapshots == SnapshotConfig(every_steps=7, every_seconds=60.0, keep=5, writer="thread", ledger="l.jsonl",
                                       meta={"job": "x"})
    assert data == DataConfig(batch_policy="fixed-per-rank", per_rank_batch_size=4, num_workers=2, collate_fn=pad,
                              pin_memory=False)


def test_nothing_given_is_the_documented_defaults_and_objects_pass_through() -> None:
    assert from_flat_keywords(None, None, {}) == (SnapshotConfig(), DataConfig())
    assert SnapshotConfig() == SnapshotConfig(every_steps=100, every_seconds=None, keep=3, writer="process")
    mine = SnapshotConfig(every_steps=10, keep=1)
    assert from_flat_keywords(mine, None, {"num_workers": 3}) == (mine, DataConfig(num_workers=3))
    assert from_flat_keywords(None, None, {"snapshot_meta": None})[0].meta == {}


def test_a_setting_given_both_ways_is_refused_naming_both() -> None:
    with pytest.raises(ElasticRunError, match=r"give keep_snapshots= or snapshots=SnapshotConfig\(keep=...\)"):
        from_flat_keywords(SnapshotConfig(), None, {"keep_snapshots": 4})
    with pytest.raises(ElasticRunError, match=r"give num_workers= or data=DataConfig\(num_workers=...\)"):
        from_flat_keywords(None, DataConfig(), {"num_workers": 4})


def test_an_unknown_keyword_is_pythons_own_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_snapshot'"):
        from_flat_keywords(None, None, {"keep_snapshot": 4})


@pytest.mark.parametrize("config, words", [
    (SnapshotConfig(keep=0), "keep must be >= 1"),
    (SnapshotConfig(every_steps=-1), "every_steps must be >= 1"),
    (SnapshotConfig(every_seconds=-5.0), "every_seconds must be >= 0"),
    (SnapshotConfig(writer="disk"), "unknown snapshot writer 'disk'"),  # type: ignore[arg-type]
    (DataConfig(batch_policy="dynamic"), "unknown batch policy 'dynamic'"),  # type: ignore[arg-type]
    (DataConfig(batch_policy="fixed-per-rank"), "fixed-per-rank needs a per-rank batch size"),
    (DataConfig(num_workers=-1), "num_workers must be >= 0"),
])
def test_a_bad_value_is_one_line_saying_what_is_allowed(config: Any, words: str) -> None:
    with pytest.raises(ElasticRunError, match=words):
        config.check()


# ---------------------------------------------------------------------- a real run, world of one, in this process


def _train(snapshot_dir: Path, **settings: Any) -> list[torch.Tensor]:
    from elastic.trainer import ElasticRun

    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    run = ElasticRun(model, torch.optim.SGD(model.parameters(), lr=0.1), SyntheticClassification(40, seed=1),
                     global_batch_size=8, steps=6, snapshot_dir=snapshot_dir, metrics=False, handle_sigterm=False,
                     **settings)
    for x, y in run:
        run.step(F.cross_entropy(run.model(x), y))
    return [p.detach().clone() for p in model.parameters()]


def test_the_objects_and_the_flat_keywords_train_the_same_run(world_of_one: None, tmp_path: Path) -> None:
    grouped = _train(tmp_path / "grouped", snapshots=SnapshotConfig(every_steps=2, keep=2, writer="thread",
                                                                    ledger=tmp_path / "grouped.jsonl"),
                     data=DataConfig(collate_fn=as_batch))
    flat = _train(tmp_path / "flat", snapshot_every_steps=2, keep_snapshots=2, snapshot_writer="thread",
                  ledger=tmp_path / "flat.jsonl", collate_fn=as_batch)
    assert all(torch.equal(a, b) for a, b in zip(grouped, flat))
    assert len((tmp_path / "grouped.jsonl").read_text().splitlines()) == 6
    for run in ("grouped", "flat"):  # keep=2 of the snapshots due at steps 2, 4 and 6, the last one always
        kept = sorted(p.name for p in (tmp_path / run).iterdir() if p.name.startswith("step-"))
        # Step 4's is skipped when step 2's is still being written (the writer's 'skip' policy:
        # these steps take a millisecond), so the older one kept is step 2's or step 4's.
        assert len(kept) == 2 and kept[-1] == "step-000000000006", (run, kept)
        assert kept[0] in ("step-000000000002", "step-000000000004"), (run, kept)


def test_a_bad_setting_ends_the_run_with_one_error_line_and_exit_2_before_touching_the_snapshot_dir(
        world_of_one: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _train(tmp_path / "snap", snapshots=SnapshotConfig(keep=0))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "keep must be >= 1 snapshot, got 0" in err and "Traceback" not in err
    assert not (tmp_path / "snap").exists()
