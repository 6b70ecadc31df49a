"""What a step's pace leaves out (:class:`elastic.metrics.training.TrainingMetrics`): the work
only rank 0 does, so that its figure compares with its peers' (agent/node/stragglers.py)."""

from __future__ import annotations

import pytest
import torch

from elastic.distributed import DistInfo
from elastic.metrics.catalogue import families
from elastic.metrics.training import TrainingMetrics
from elastic.metrics.worker import WorkerMetrics


@pytest.fixture
def metrics(monkeypatch: pytest.MonkeyPatch) -> tuple[TrainingMetrics, object]:
    for name in ("PROMETHEUS_MULTIPROC_DIR", "ELASTIC_METRICS_PORT"):
        monkeypatch.delenv(name, raising=False)  # in-process metrics, no port
    out = TrainingMetrics(DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo",
                                   node="n"))
    fam = families.__wrapped__()  # a private set: this test's values only
    out.worker = WorkerMetrics(0, 2, backend="gloo", device="cpu", torch_version="x", restart_count=0, fam=fam)
    return out, fam


def compute(fam: object) -> float | None:
    return fam.registry.get_sample_value("elastic_step_compute_seconds", {"rank": "0"})


def test_rank_0s_ledger_line_is_not_its_pace(metrics: tuple[TrainingMetrics, object]) -> None:
    m, fam = metrics
    for _ in range(10):
        m.commit_took(0.012)  # the previous step's ledger line, slow on a busy disk
        m.step_done(16, 0.020, 0.0, None, None)
    assert compute(fam) == pytest.approx(0.008)


def test_a_snapshot_submitted_in_the_commit_is_left_out_once(metrics: tuple[TrainingMetrics, object]) -> None:
    m, fam = metrics
    for _ in range(10):
        m.snapshot_submitted(0.04)  # inside the commit, which took 0.05 in all
        m.commit_took(0.05)
        m.capture_waited(0.01)  # before the optimizer step, after the commit
        m.step_done(16, 0.100, 0.0, None, None)
    assert compute(fam) == pytest.approx(0.04)
