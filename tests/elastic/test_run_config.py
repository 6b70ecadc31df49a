"""ElasticRun's snapshot and data settings as two small objects, the one way to give them (0.1.0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from elastic.distributed import ElasticRunError
from elastic.jobs.mlp import SyntheticClassification, as_batch
from elastic.run_config import FLAT_KEYWORDS, DataConfig, SnapshotConfig, checked, grouped_form, refuse_flat_keywords


def test_every_flat_keyword_of_earlier_releases_is_a_type_error_naming_its_grouped_form() -> None:
    for name, (which, attribute) in FLAT_KEYWORDS.items():
        cls = "SnapshotConfig" if which == "snapshots" else "DataConfig"
        with pytest.raises(TypeError) as error:
            refuse_flat_keywords({name: 1})
        line = str(error.value)
        assert line == f"ElasticRun({name}=) is gone since 0.1.0: give {which}={cls}({attribute}=...) " \
                       f"(from elastic import {cls})", line
        assert grouped_form(name) == f"{which}={cls}({attribute}=...)"
    refuse_flat_keywords({})  # nothing flat: nothing to say


def test_nothing_given_is_the_documented_defaults_and_objects_pass_through() -> None:
    assert checked(None, None) == (SnapshotConfig(), DataConfig())
    assert SnapshotConfig() == SnapshotConfig(every_steps=100, every_seconds=None, keep=3, writer="process")
    mine = SnapshotConfig(every_steps=10, keep=1)
    assert checked(mine, DataConfig(num_workers=3)) == (mine, DataConfig(num_workers=3))
    with pytest.raises(ElasticRunError, match="keep must be >= 1"):
        checked(SnapshotConfig(keep=0), None)


def test_an_unknown_keyword_is_pythons_own_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_snapshot'"):
        refuse_flat_keywords({"keep_snapshot": 4})


@pytest.mark.parametrize("config, words", [
    (SnapshotConfig(keep=0), "keep must be >= 1"),
    (SnapshotConfig(every_steps=-1), "every_steps must be >= 1"),
    (SnapshotConfig(every_seconds=-5.0), "every_seconds must be >= 0"),
    (SnapshotConfig(writer="disk"), "unknown snapshot writer 'disk'"),
    (DataConfig(batch_policy="dynamic"), "unknown batch policy 'dynamic'"),
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


def test_the_objects_train_the_run_they_say_and_a_flat_keyword_is_refused_before_anything_starts(
        world_of_one: None, tmp_path: Path) -> None:
    _train(tmp_path / "grouped", snapshots=SnapshotConfig(every_steps=2, keep=2, writer="thread",
                                                         ledger=tmp_path / "grouped.jsonl"),
           data=DataConfig(collate_fn=as_batch))
    assert len((tmp_path / "grouped.jsonl").read_text().splitlines()) == 6
    # keep=2 of the snapshots due at steps 2, 4 and 6, the last one always. Step 4's is
    # skipped when step 2's is still being written (the writer's 'skip' policy: these steps
    # take a millisecond), so the older one kept is step 2's or step 4's.
    kept = sorted(p.name for p in (tmp_path / "grouped").iterdir() if p.name.startswith("step-"))
    assert len(kept) == 2 and kept[-1] == "step-000000000006", kept
    assert kept[0] in ("step-000000000002", "step-000000000004"), kept
    with pytest.raises(TypeError, match=r"ElasticRun\(keep_snapshots=\) is gone since 0.1.0: give "
                                        r"snapshots=SnapshotConfig\(keep=...\)"):
        _train(tmp_path / "flat", keep_snapshots=2)
    assert not (tmp_path / "flat").exists()


def test_a_bad_setting_ends_the_run_with_one_error_line_and_exit_2_before_touching_the_snapshot_dir(
        world_of_one: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _train(tmp_path / "snap", snapshots=SnapshotConfig(keep=0))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "keep must be >= 1 snapshot, got 0" in err and "Traceback" not in err
    assert not (tmp_path / "snap").exists()


def test_the_prepare_api_refuses_a_flat_keyword_the_same_way_and_keeps_the_loaders_own_settings(
        tmp_path: Path) -> None:
    import elastic

    with pytest.raises(TypeError, match=r"Elastic\(ledger=\) is gone since 0.1.0: give snapshots=SnapshotConfig"):
        elastic.Elastic(snapshot_dir=tmp_path, ledger=tmp_path / "l.jsonl")
    with pytest.raises(TypeError, match=r"Elastic\(num_workers=\) is gone since 0.1.0: the DataLoader's is kept"):
        elastic.Elastic(snapshot_dir=tmp_path, num_workers=2)
    elastic.Elastic(snapshot_dir=tmp_path, snapshots=SnapshotConfig(every_steps=5))  # the grouped form is taken
