"""A misspelt ``s3://`` is refused wherever a snapshot location is read, never taken for a directory.

``--snapshot-dir s3:/ckpt/x`` trained and snapshotted into ``./s3:/ckpt/x/`` and exited 0,
the bucket never written. Every entry point (``elastic agent`` and its
``ELASTIC_SNAPSHOT_DIR``, ``elastic local``, ``python -m elastic.train``, ``ElasticRun``,
``Elastic``, ``python -m checkpoints``, ``open_store``), alone or as the second tier of
``DIR,s3://...``, now says in one line which ``s3://`` URL was likely meant, exits 2 and
creates nothing. Each runs its real entry point in this process: they end before anything
starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

from checkpoints import SnapshotDirError
from checkpoints.location import LocationError, MisspeltLocationError, is_remote, split_tiers
from checkpoints.stores import location_of, open_store

TYPOS = [  # (what was typed, the URL it likely meant)
    ("s3:/ckpt/x", "s3://ckpt/x"),
    ("S3://ckpt/x", "s3://ckpt/x"),
    ("s3:ckpt/x", "s3://ckpt/x"),
    ("s3//ckpt/x", "s3://ckpt/x"),
    ("s3:///ckpt/x", "s3://ckpt/x"),
    ("snaps,s3:/ckpt/x", "snaps,s3://ckpt/x"),  # the second tier of two
    ("snaps,S3://ckpt/x", "snaps,s3://ckpt/x"),
]


@pytest.fixture(autouse=True)
def in_empty_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each case runs in an empty directory, which must stay empty; no ELASTIC_* of the shell."""
    for name in list(os.environ):
        if name.startswith(("ELASTIC_", "PET_")):
            monkeypatch.delenv(name)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def _one_error_line(run: Callable[[], object], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        code = run()
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(("typed", "meant"), TYPOS)
def test_every_entry_point_refuses_a_misspelt_s3_url_naming_the_one_meant(
        typed: str, meant: str, in_empty_dir: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from agent import cli
    from checkpoints.cli import main as checkpoints_cli
    from elastic.train import parse_args as train_args

    runs: dict[str, Callable[[], object]] = {
        "elastic agent": lambda: cli.main(["agent", "--snapshot-dir", typed, "--nnodes", "1", "train.py"]),
        "elastic local": lambda: cli.main(["local", "--snapshot-dir", typed, "--run-dir", "run"]),
        "python -m elastic.train": lambda: train_args(["--job", "mlp", "--snapshot-dir", typed]),
        "python -m checkpoints": lambda: checkpoints_cli(["ls", typed]),
    }
    for name, run in runs.items():
        line = _one_error_line(run, capsys)
        assert f"did you mean {meant}?" in line and typed in line, (name, line)
    monkeypatch.setenv("ELASTIC_SNAPSHOT_DIR", typed)  # the agent's flag, from its variable
    line = _one_error_line(lambda: cli.main(["agent", "--nnodes", "1", "train.py"]), capsys)
    assert line.startswith(f"error: ELASTIC_SNAPSHOT_DIR={typed}: ") and f"did you mean {meant}?" in line, line
    line = _one_error_line(lambda: train_args(["--job", "mlp"]), capsys)  # a worker's, from the same variable
    assert f"did you mean {meant}?" in line, line
    assert os.listdir(in_empty_dir) == []  # no ./s3:/..., no run directory: nothing started


@pytest.mark.parametrize(("typed", "meant"), TYPOS)
def test_the_library_refuses_it_too(typed: str, meant: str, in_empty_dir: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    import elastic

    with pytest.raises(MisspeltLocationError) as err:
        location_of(typed)
    assert err.value.meant == meant and "\n" not in str(err.value)
    for check in (is_remote, split_tiers):
        with pytest.raises(LocationError):
            check(typed)
    with pytest.raises(SnapshotDirError, match=f"did you mean {meant}"):
        open_store(typed, key=None)
    model = nn.Linear(2, 2)
    line = _one_error_line(lambda: elastic.ElasticRun(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.zeros(4, 2), global_batch_size=2, steps=1,
        snapshot_dir=typed, metrics=False, handle_sigterm=False), capsys)
    assert f"did you mean {meant}?" in line, line
    line = _one_error_line(lambda: elastic.Elastic(snapshot_dir=typed), capsys)
    assert f"did you mean {meant}?" in line, line
    assert os.listdir(in_empty_dir) == []


def test_what_is_not_a_typo_still_parses(in_empty_dir: Path) -> None:
    assert is_remote("s3://ckpt/x") and split_tiers("snaps,s3://ckpt/x") == ("snaps", "s3://ckpt/x")
    for directory in ("s3/x", "./s3:/x", "/data/s3:/x", "my-s3:x", "snaps,./s3:x"):
        assert not is_remote(directory) and split_tiers(directory) is None, directory
        assert location_of(directory) == Path(directory)
